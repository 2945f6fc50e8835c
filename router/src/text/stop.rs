//! Stop sequences with a hold-back buffer, so no fragment of a stop string reaches a client.
//!
//! Text arrives in pieces (from the detokenizer). Whatever might still be the start of a stop
//! string is held back until the next piece settles it; everything before is released at once.
//!
//! Which match counts: generation stops as soon as any stop string is complete, so the match that
//! *ends* first wins, and among matches ending at the same place the longest (then the first in
//! the list). This makes the outcome independent of how the text was split into pieces: it is what
//! feeding the text one character at a time would give. (With stops `["abcd", "bc"]`, the text
//! `"abcd"` stops at `"bc"` and emits `"a"`; a model streaming it would never have produced the
//! `"d"`.) The emitted text is everything before the winning match.

/// What [`StopMatcher::push`] lets through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StopOutcome {
    /// Text that is safe to send now: no stop string can start inside it any more.
    pub text: String,
    /// Index into the matcher's stop sequences of the stop string this push completed. `Some` on
    /// exactly one push at most; the caller then finishes the request with reason "stop".
    pub stopped: Option<usize>,
}

/// Stop-sequence matcher for one request's generated text.
///
/// Invariant between pushes: `pending` is the longest suffix of the text seen so far that is a
/// proper prefix of some stop string; everything before it has been emitted, and no stop string
/// occurs in text seen so far (else the matcher has stopped and `pending` is empty). So a new piece
/// can only complete a match that starts inside `pending + piece`, and each push costs
/// O(number of stop strings x (piece length + longest stop string ^ 2)), never a rescan of the
/// whole generation.
///
/// Works on `&str`, so held and emitted text always split on char boundaries. Empty stop strings
/// (rejected earlier by validation) never match.
#[derive(Debug, Clone)]
pub struct StopMatcher {
    /// The request's stop strings, in the order the client gave them.
    stop_sequences: Vec<String>,
    /// Length in bytes of the longest stop string; 0 when there is none to match.
    max_stop_len: usize,
    /// Held-back text, not emitted yet. Empty once stopped.
    pending: String,
    /// Index of the matched stop string, once one has matched; nothing is emitted after that.
    stopped: Option<usize>,
}

impl StopMatcher {
    /// A matcher for `stop_sequences`; with none (or only empty ones) it passes text through.
    pub fn new(stop_sequences: Vec<String>) -> Self {
        let max_stop_len = stop_sequences.iter().map(String::len).max().unwrap_or(0);
        Self {
            stop_sequences,
            max_stop_len,
            pending: String::new(),
            stopped: None,
        }
    }

    /// Feeds the next piece of generated text; returns what may be emitted now and whether a stop
    /// string was completed. After a stop, every push returns an empty outcome.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.stopped.is_some() {
            return StopOutcome::default();
        }
        if self.max_stop_len == 0 {
            return StopOutcome {
                text: text.to_owned(),
                stopped: None,
            };
        }
        self.pending.push_str(text);
        if let Some((start, index)) = self.first_match() {
            self.pending.truncate(start);
            self.stopped = Some(index);
            return StopOutcome {
                text: std::mem::take(&mut self.pending),
                stopped: Some(index),
            };
        }
        let held = self.pending.split_off(self.hold_start());
        StopOutcome {
            text: std::mem::replace(&mut self.pending, held),
            stopped: None,
        }
    }

    /// Releases the held-back text at the end of generation (when no stop string matched; after
    /// a stop there is nothing left to release).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// The match in `pending` that ends first (then the longest, then the first listed), as
    /// `(start byte, stop index)`.
    fn first_match(&self) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize, usize)> = None; // (end, len, index)
        for (index, stop) in self.stop_sequences.iter().enumerate() {
            if stop.is_empty() {
                continue;
            }
            // The first occurrence of a given stop string is also the first to end.
            let Some(start) = self.pending.find(stop.as_str()) else {
                continue;
            };
            let end = start + stop.len();
            let is_better =
                best.is_none_or(|(best_end, best_len, _)| end < best_end || (end == best_end && stop.len() > best_len));
            if is_better {
                best = Some((end, stop.len(), index));
            }
        }
        best.map(|(end, len, index)| (end - len, index))
    }

    /// Start of the longest suffix of `pending` that is a proper prefix of some stop string
    /// (`pending.len()` if none). Only the last `max_stop_len - 1` bytes can qualify.
    fn hold_start(&self) -> usize {
        let earliest = self.pending.len().saturating_sub(self.max_stop_len - 1);
        (earliest..self.pending.len())
            .filter(|&start| self.pending.is_char_boundary(start))
            .find(|&start| {
                let tail = &self.pending[start..];
                self.stop_sequences.iter().any(|stop| stop.starts_with(tail))
            })
            .unwrap_or(self.pending.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn matcher(stops: &[&str]) -> StopMatcher {
        StopMatcher::new(stops.iter().map(|stop| stop.to_string()).collect())
    }

    /// Pushes `pieces` in order, checking after each that the emitted text stays a prefix of
    /// `expected` and that a stop is reported at most once; returns (emitted incl. flush, stop).
    fn run(stops: &[&str], pieces: &[&str], expected: &str) -> (String, Option<usize>) {
        let mut matcher = matcher(stops);
        let mut emitted = String::new();
        let mut stopped = None;
        for piece in pieces {
            let outcome = matcher.push(piece);
            emitted.push_str(&outcome.text);
            assert!(
                expected.starts_with(&emitted),
                "stops {stops:?}, pieces {pieces:?}: emitted {emitted:?} beyond {expected:?}"
            );
            if outcome.stopped.is_some() {
                assert_eq!(stopped, None, "stop reported twice");
                stopped = outcome.stopped;
            }
        }
        emitted.push_str(&matcher.flush());
        (emitted, stopped)
    }

    /// Every way to cut `text` into up to three pieces at char boundaries.
    fn all_splits(text: &str) -> Vec<Vec<&str>> {
        let mut boundaries: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        boundaries.push(text.len());
        let mut splits = Vec::new();
        for (n, &first) in boundaries.iter().enumerate() {
            for &second in &boundaries[n..] {
                splits.push(vec![&text[..first], &text[first..second], &text[second..]]);
            }
        }
        splits
    }

    #[test]
    fn without_stop_sequences_text_passes_through() {
        let mut matcher = matcher(&[]);
        assert_eq!(matcher.push("hello").text, "hello");
        assert_eq!(matcher.flush(), "");
    }

    #[test]
    fn stop_split_across_pushes_never_leaks_a_fragment() {
        let text = "Hello, world! The end.";
        for pieces in all_splits(text) {
            assert_eq!(run(&["world!"], &pieces, "Hello, "), ("Hello, ".into(), Some(0)));
        }
    }

    #[test]
    fn stop_one_character_per_push() {
        let text = "say STOP now";
        let pieces: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
        assert_eq!(run(&["STOP"], &pieces, "say "), ("say ".into(), Some(0)));
    }

    #[test]
    fn multi_byte_stop_at_every_split() {
        let text = "これで終わりです🦀";
        for pieces in all_splits(text) {
            assert_eq!(run(&["終わり"], &pieces, "これで"), ("これで".into(), Some(0)));
            assert_eq!(
                run(&["す🦀"], &pieces, "これで終わりで"),
                ("これで終わりで".into(), Some(0))
            );
        }
    }

    #[test]
    fn stop_at_the_very_start() {
        let mut matcher = matcher(&["###"]);
        let outcome = matcher.push("###rest");
        assert_eq!(
            outcome,
            StopOutcome {
                text: String::new(),
                stopped: Some(0)
            }
        );
        assert_eq!(matcher.flush(), "");
    }

    #[test]
    fn the_match_that_ends_first_wins() {
        // "bc" completes before "abcd" could, whether the text comes at once or char by char.
        assert_eq!(run(&["abcd", "bc"], &["abcd"], "a"), ("a".into(), Some(1)));
        assert_eq!(run(&["abcd", "bc"], &["a", "b", "c", "d"], "a"), ("a".into(), Some(1)));
        // Same start: the shorter one completes first.
        assert_eq!(run(&["abc", "ab"], &["abc"], ""), ("".into(), Some(1)));
        // Same end: the longest wins.
        assert_eq!(run(&["bc", "abc"], &["xabc"], "x"), ("x".into(), Some(1)));
        // Same string twice: the first listed wins.
        assert_eq!(run(&["bc", "bc"], &["abc"], "a"), ("a".into(), Some(0)));
    }

    #[test]
    fn self_overlapping_stop_is_found_after_a_false_start() {
        let pieces = ["a", "a", "a", "b", "c"];
        assert_eq!(run(&["aab"], &pieces, "a"), ("a".into(), Some(0)));
        let pieces = ["ab", "ab", "ac"];
        assert_eq!(run(&["abac"], &pieces, "ab"), ("ab".into(), Some(0)));
    }

    #[test]
    fn held_text_is_released_once_it_cannot_match() {
        let mut matcher = matcher(&["END"]);
        assert_eq!(matcher.push("the E").text, "the ");
        assert_eq!(matcher.push("N").text, "");
        assert_eq!(matcher.push("o E").text, "ENo ");
        assert_eq!(matcher.flush(), "E");
    }

    #[test]
    fn flush_returns_held_text_when_no_stop_matched() {
        let mut matcher = matcher(&["END"]);
        assert_eq!(matcher.push("the EN").text, "the ");
        assert_eq!(matcher.flush(), "EN");
        assert_eq!(matcher.flush(), "");
    }

    #[test]
    fn nothing_is_emitted_after_a_stop() {
        let mut matcher = matcher(&["x"]);
        assert_eq!(matcher.push("abx").stopped, Some(0));
        assert_eq!(matcher.push("more"), StopOutcome::default());
        assert_eq!(matcher.flush(), "");
    }

    #[test]
    fn empty_stop_strings_never_match() {
        assert_eq!(run(&[""], &["ab", "c"], "abc"), ("abc".into(), None));
        assert_eq!(run(&["", "x"], &["ab", "xy"], "ab"), ("ab".into(), Some(1)));
    }

    /// The obvious definition: the first prefix of `text` that ends with a stop string decides.
    fn reference(text: &str, stops: &[String]) -> (String, Option<usize>) {
        for end in text.char_indices().map(|(i, c)| i + c.len_utf8()) {
            let seen = &text[..end];
            let mut best: Option<(usize, usize)> = None; // (len, index)
            for (index, stop) in stops.iter().enumerate() {
                let is_better = best.is_none_or(|(len, _)| stop.len() > len);
                if !stop.is_empty() && seen.ends_with(stop.as_str()) && is_better {
                    best = Some((stop.len(), index));
                }
            }
            if let Some((len, index)) = best {
                return (seen[..end - len].to_owned(), Some(index));
            }
        }
        (text.to_owned(), None)
    }

    #[test]
    fn randomized_against_reference() {
        const ALPHABET: [char; 4] = ['a', 'b', 'é', '中'];
        let random_string = |rng: &mut StdRng, max_chars: usize| -> String {
            let num_chars = rng.random_range(0..=max_chars);
            (0..num_chars)
                .map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())])
                .collect()
        };
        let mut rng = StdRng::seed_from_u64(0x5709);
        let mut num_stopped = 0;
        for _ in 0..5000 {
            let num_stops = rng.random_range(1..=3);
            let stops: Vec<String> = (0..num_stops)
                .map(|_| random_string(&mut rng, 4))
                .filter(|stop| !stop.is_empty())
                .collect();
            let text = random_string(&mut rng, 30);
            let mut pieces = Vec::new();
            let mut rest = text.as_str();
            while !rest.is_empty() {
                let num_chars = rng.random_range(0..=4);
                let cut = rest.char_indices().nth(num_chars).map_or(rest.len(), |(i, _)| i);
                pieces.push(&rest[..cut]);
                rest = &rest[cut..];
            }
            let (expected, expected_stop) = reference(&text, &stops);
            let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (emitted, stopped) = run(&stop_refs, &pieces, &expected);
            assert_eq!(emitted, expected, "stops {stops:?}, pieces {pieces:?}");
            assert_eq!(stopped, expected_stop, "stops {stops:?}, pieces {pieces:?}");
            num_stopped += usize::from(stopped.is_some());
        }
        assert!(num_stopped > 1000, "only {num_stopped} cases stopped");
    }
}
