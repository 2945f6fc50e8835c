//! Speculative decoding by prompt lookup (n-gram): the proposals, and how many a sequence may make.
//!
//! A decoding sequence's last few tokens are looked up among its earlier tokens (prompt and output); the
//! tokens that followed their latest earlier occurrence are proposed as its next ones. The shards verify
//! every proposal in the step's one forward pass (a chunk of the last token plus the proposals, sampled at
//! each position); the engine keeps the longest prefix of proposals equal to what was sampled at their
//! positions, plus the token sampled after it. Since a token's draw depends only on the request's seed and
//! its position, and the float32 forward on nothing but the sequence, the output is the same token for
//! token as without speculation: only sooner, when the text repeats its context (edits, quotes, code).

/// `--speculative`, `--num-speculative-tokens`, `--speculative-ngram-min/max`,
/// `--speculative-max-step-tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpeculativeConfig {
    /// The most tokens proposed for one sequence in one step.
    pub max_proposed_tokens: usize,
    /// The shortest and longest suffix of a sequence looked up among its earlier tokens.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// Proposals join a step only while its decodes and proposals stay within this many tokens: up to
    /// about there a decode step reads its weights once whatever the count, so a proposal costs little;
    /// beyond it the step is compute-bound and a rejected proposal costs as much as a generated token.
    pub max_step_tokens: usize,
}

/// The tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (from
/// `ngram_max` down to `ngram_min` tokens) that occurs earlier; at most `max_tokens` of them. Empty when
/// no suffix recurs.
pub fn ngram_proposal(tokens: &[u32], ngram_min: usize, ngram_max: usize, max_tokens: usize) -> Vec<u32> {
    if max_tokens == 0 {
        return Vec::new();
    }
    let len = tokens.len();
    for n in (ngram_min.max(1)..=ngram_max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // The latest occurrence that ends before the suffix itself starts to overlap its own end.
        let found = (0..len - n).rev().find(|&start| &tokens[start..start + n] == suffix);
        if let Some(start) = found {
            let from = start + n;
            return tokens[from..(from + max_tokens).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// How many tokens a sequence proposes next, learned from its latest verification: after every proposal
/// was accepted, one more (up to the maximum); after a rejection, one more than were accepted, so a
/// sequence whose text stops repeating soon proposes a single token per step.
pub fn next_proposal_len(num_proposed: usize, num_accepted: usize, max_proposed_tokens: usize) -> usize {
    if num_accepted == num_proposed {
        (num_proposed + 1).min(max_proposed_tokens)
    } else {
        (num_accepted + 1).min(max_proposed_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proposes_what_followed_the_latest_occurrence_of_the_longest_suffix() {
        //            0  1  2  3  4  5  6  7  8  9
        let tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 2, 3];
        // Suffix [2, 3] last occurred at 5..7 (followed by 4, 5, 2, 3); [5, 2, 3] never earlier.
        assert_eq!(ngram_proposal(&tokens, 1, 3, 4), [4, 5, 2, 3]);
        assert_eq!(ngram_proposal(&tokens, 1, 3, 2), [4, 5]);
        // The longest suffix wins over a later match of a shorter one.
        let tokens = [7, 8, 1, 5, 8, 2, 7, 8];
        assert_eq!(ngram_proposal(&tokens, 1, 2, 3), [1, 5, 8]);
        assert_eq!(ngram_proposal(&tokens, 1, 1, 3), [2, 7, 8]);
    }

    #[test]
    fn proposes_nothing_without_a_recurring_suffix_or_room() {
        assert!(ngram_proposal(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(ngram_proposal(&[1, 2, 1, 2], 3, 3, 4).is_empty());
        assert!(ngram_proposal(&[1, 2, 1, 2], 1, 2, 0).is_empty());
        assert!(ngram_proposal(&[5], 1, 2, 4).is_empty());
        assert!(ngram_proposal(&[], 1, 2, 4).is_empty());
    }

    #[test]
    fn a_proposal_stops_at_the_end_of_the_known_tokens() {
        // [1, 2] occurs at 2..4, followed only by the suffix itself.
        assert_eq!(ngram_proposal(&[0, 0, 1, 2, 1, 2], 2, 2, 4), [1, 2]);
        // A run of one token proposes more of it.
        assert_eq!(ngram_proposal(&[3, 3, 3, 3], 1, 2, 4), [3]);
    }

    #[test]
    fn the_proposal_length_follows_the_acceptance() {
        assert_eq!(next_proposal_len(4, 4, 4), 4);
        assert_eq!(next_proposal_len(2, 2, 4), 3);
        assert_eq!(next_proposal_len(4, 1, 4), 2);
        assert_eq!(next_proposal_len(4, 0, 4), 1);
        assert_eq!(next_proposal_len(1, 0, 1), 1);
    }
}
