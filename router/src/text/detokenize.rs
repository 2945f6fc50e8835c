//! Incremental detokenization: generated token ids in, text pieces out.
//!
//! Decoding one token at a time is wrong in two ways: a byte-level BPE token may hold only part of
//! a UTF-8 character (a CJK character or an emoji can span 2-4 tokens), and SentencePiece-style
//! decoders drop the leading space of whatever token comes first. So we decode a small window of
//! ids twice and emit the difference, the prefix-offset/read-offset technique of TGI's
//! `decode_token` and vLLM's `detokenize_incrementally`.

use tokenizers::Tokenizer;

/// How many prompt tokens the decode window reaches back before the first generated token, so
/// that the first generated token is decoded with context (its leading space survives) and the
/// first decode stays cheap. Matches vLLM's `INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET`.
const NUM_PROMPT_CONTEXT_TOKENS: usize = 5;

/// What a lossy UTF-8 decode puts where bytes do not (yet) form a whole character.
const REPLACEMENT_CHARACTER: char = '\u{FFFD}';

/// Errors from [`IncrementalDetokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum DetokenizeError {
    /// The tokenizer's decoder failed on the current window of ids.
    #[error("tokenizer failed to decode generated token ids: {0}")]
    Decode(tokenizers::Error),
}

/// Turns a stream of generated token ids into text pieces, one request at a time.
///
/// Callers may assume:
/// - no piece ends in the middle of a UTF-8 character: a piece is only emitted once the decoded
///   window no longer ends in U+FFFD, so U+FFFD appears only where the model really generated an
///   invalid byte sequence (and, at the very end, in what [`flush`](Self::flush) returns);
/// - no text is lost: for tokenizers whose decoding is concatenative (byte-level BPE, the GPT-2 /
///   Llama-3 / SmolLM2 family) the pieces from every [`push`](Self::push) plus the final
///   [`flush`](Self::flush) concatenate to exactly `tokenizer.decode(generated_ids,
///   skip_special_tokens)`;
/// - for SentencePiece-style tokenizers the first generated token keeps its leading space (which
///   a decode of the generated ids alone would strip), because the window starts a few prompt
///   tokens back.
///
/// The same `tokenizer` must be passed to every call.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    /// The last few prompt ids, then every generated id. Index ranges:
    ///
    /// ```text
    /// [0, prefix_offset)            already emitted; no longer decoded
    /// [prefix_offset, read_offset)  already emitted; decoded again only as context
    /// [read_offset, ids.len())      pending: not emitted yet (e.g. half a character)
    /// ```
    ///
    /// `read_offset` only moves to a point where the decoded text is complete, so a window never
    /// starts inside a character of valid text.
    ids: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// End of the text already emitted (or of the prompt context, before the first piece).
    read_offset: usize,
    /// Whether special tokens (EOS, chat markers, ...) are left out of the text.
    skip_special_tokens: bool,
    /// Special tokens kept in the text all the same (a tool-call format's markers).
    kept_special_tokens: Vec<u32>,
}

impl IncrementalDetokenizer {
    /// Starts detokenizing the continuation of `prompt_ids`. Only the last few prompt ids are
    /// kept, as decoding context; none of the prompt's text is ever emitted. With
    /// `skip_special_tokens`, special tokens other than `kept_special_tokens` are left out.
    pub fn new(prompt_ids: &[u32], skip_special_tokens: bool, kept_special_tokens: Vec<u32>) -> Self {
        let context = &prompt_ids[prompt_ids.len().saturating_sub(NUM_PROMPT_CONTEXT_TOKENS)..];
        Self {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special_tokens,
            kept_special_tokens,
        }
    }

    /// Appends one generated token and returns the text it completes: possibly empty (half a
    /// character, or a skipped special token), possibly more than this token's own text (when it
    /// completes a character begun by earlier tokens).
    pub fn push(&mut self, tokenizer: &Tokenizer, token_id: u32) -> Result<String, DetokenizeError> {
        self.ids.push(token_id);
        self.emit(tokenizer, false)
    }

    /// Returns the text still pending at the end of generation. It is empty unless the last
    /// tokens did not form whole characters, in which case it carries their U+FFFD as a full
    /// decode would.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String, DetokenizeError> {
        self.emit(tokenizer, true)
    }

    /// Decodes the window with and without the pending ids and emits what the pending ids add,
    /// unless that ends in an incomplete character and `is_final` is false.
    fn emit(&mut self, tokenizer: &Tokenizer, is_final: bool) -> Result<String, DetokenizeError> {
        if self.read_offset == self.ids.len() {
            return Ok(String::new());
        }
        let prefix_text = self.decode(tokenizer, &self.ids[self.prefix_offset..self.read_offset])?;
        let new_text = self.decode(tokenizer, &self.ids[self.prefix_offset..])?;
        // Compare in characters, not bytes, as TGI and vLLM do: if the window's prefix decodes
        // differently inside the longer window, a byte offset might not be a char boundary.
        let num_prefix_chars = prefix_text.chars().count();
        let Some((start, _)) = new_text.char_indices().nth(num_prefix_chars) else {
            return Ok(String::new());
        };
        if !is_final && new_text.ends_with(REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(new_text[start..].to_owned())
    }

    fn decode(&self, tokenizer: &Tokenizer, ids: &[u32]) -> Result<String, DetokenizeError> {
        if !self.skip_special_tokens || self.kept_special_tokens.is_empty() {
            return tokenizer
                .decode(ids, self.skip_special_tokens)
                .map_err(DetokenizeError::Decode);
        }
        let vocabulary = tokenizer.get_added_vocabulary();
        let is_skipped = |id: u32| {
            !self.kept_special_tokens.contains(&id)
                && vocabulary
                    .simple_id_to_token(id)
                    .is_some_and(|token| vocabulary.is_special_token(&token))
        };
        let ids: Vec<u32> = ids.iter().copied().filter(|&id| !is_skipped(id)).collect();
        tokenizer.decode(&ids, false).map_err(DetokenizeError::Decode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::decoders::byte_level::ByteLevel;
    use tokenizers::decoders::metaspace::{Metaspace, PrependScheme};
    use tokenizers::models::bpe::{Vocab, BPE};
    use tokenizers::AddedToken;

    const EOS: &str = "<|endoftext|>";
    const TOOL_CALLS: &str = "[TOOL_CALLS]";
    const VIETNAMESE: &str = "Tiếng Việt rất đẹp";
    const CHINESE: &str = "你好，世界";
    const EMOJI: &str = "🦀 👍🏽 ok";

    /// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to U+0100 onwards.
    fn byte_chars() -> Vec<char> {
        let is_printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let mut next_unprintable = 256u32;
        (0..=255u8)
            .map(|b| {
                if is_printable(b) {
                    char::from(b)
                } else {
                    next_unprintable += 1;
                    char::from_u32(next_unprintable - 1).unwrap()
                }
            })
            .collect()
    }

    /// A byte-level BPE tokenizer over the 256 byte tokens, with merges chosen so that tokens
    /// both split characters and straddle character boundaries, plus an `<|endoftext|>` special.
    fn byte_level_tokenizer() -> Tokenizer {
        let chars = byte_chars();
        let to_token = |bytes: &[u8]| bytes.iter().map(|&b| chars[b as usize]).collect::<String>();
        let mut vocab: Vocab = chars
            .iter()
            .enumerate()
            .map(|(id, c)| (c.to_string(), id as u32))
            .collect();
        let merge_pairs: &[(&[u8], &[u8])] = &[
            (&[0xE1], &[0xBB]), // first two bytes of "ệ"
            (&[0x87], b"t"),    // last byte of "ệ" + "t": straddles a boundary
            (b"i", &[0xE1]),    // "i" + first byte of "ế"
            (&[0xBF], b"n"),    // last byte of "ế" + "n"
            (&[0xE4], &[0xBD]), // first two bytes of "你"
            (&[0xA0], &[0xE5]), // last byte of "你" + first byte of "好"
            (&[0x9F], &[0xA6]), // middle bytes of "🦀"
            (b"o", b"k"),
        ];
        let mut merges = Vec::new();
        for (left, right) in merge_pairs {
            let merged = to_token(&[*left, *right].concat());
            let id = vocab.len() as u32;
            vocab.insert(merged, id);
            merges.push((to_token(left), to_token(right)));
        }
        let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().unwrap();
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        tokenizer.add_special_tokens(&[AddedToken::from(EOS, true), AddedToken::from(TOOL_CALLS, true)]);
        tokenizer
    }

    fn encode(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
        tokenizer.encode(text, false).unwrap().get_ids().to_vec()
    }

    /// Streams `generated` after `prompt`; returns every piece, the flush last.
    fn stream(tokenizer: &Tokenizer, prompt: &[u32], generated: &[u32], skip_special_tokens: bool) -> Vec<String> {
        stream_keeping(tokenizer, prompt, generated, skip_special_tokens, &[])
    }

    /// [`stream`] keeping `kept` special tokens.
    fn stream_keeping(
        tokenizer: &Tokenizer,
        prompt: &[u32],
        generated: &[u32],
        skip_special_tokens: bool,
        kept: &[u32],
    ) -> Vec<String> {
        let mut detokenizer = IncrementalDetokenizer::new(prompt, skip_special_tokens, kept.to_vec());
        let mut pieces: Vec<String> = generated
            .iter()
            .map(|&id| detokenizer.push(tokenizer, id).unwrap())
            .collect();
        pieces.push(detokenizer.flush(tokenizer).unwrap());
        pieces
    }

    #[test]
    fn byte_level_pieces_are_whole_characters_and_lossless() {
        let tokenizer = byte_level_tokenizer();
        for text in [VIETNAMESE, CHINESE, EMOJI] {
            let ids = encode(&tokenizer, text);
            // The test is only meaningful if some tokens hold partial characters.
            assert!(
                ids.iter()
                    .any(|&id| tokenizer.decode(&[id], false).unwrap().contains('\u{FFFD}')),
                "{text:?} has no partial-character token"
            );
            assert_eq!(tokenizer.decode(&ids, true).unwrap(), text);
            let pieces = stream(&tokenizer, &[], &ids, true);
            for piece in &pieces {
                assert!(!piece.contains('\u{FFFD}'), "{text:?}: piece {piece:?}");
            }
            assert_eq!(pieces.concat(), text);
            assert_eq!(pieces.last().unwrap(), "", "nothing left for flush");
        }
    }

    #[test]
    fn byte_level_streaming_after_any_prompt_split_matches_full_decode() {
        let tokenizer = byte_level_tokenizer();
        let text = format!("{VIETNAMESE} {CHINESE} {EMOJI}");
        let ids = encode(&tokenizer, &text);
        let mut num_checked_splits = 0;
        for split in 0..=ids.len() {
            let (prompt, generated) = ids.split_at(split);
            if tokenizer.decode(prompt, true).unwrap().ends_with('\u{FFFD}') {
                continue; // the prompt itself ends mid-character
            }
            num_checked_splits += 1;
            let pieces = stream(&tokenizer, prompt, generated, true);
            assert!(pieces.iter().all(|piece| !piece.contains('\u{FFFD}')));
            assert_eq!(pieces.concat(), tokenizer.decode(generated, true).unwrap());
        }
        assert!(num_checked_splits > 10);
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tokenizer = byte_level_tokenizer();
        let eos_id = tokenizer.token_to_id(EOS).unwrap();
        let ids = [encode(&tokenizer, CHINESE), vec![eos_id], encode(&tokenizer, "🦀")].concat();

        let skipped = stream(&tokenizer, &[], &ids, true);
        assert_eq!(skipped.concat(), format!("{CHINESE}🦀"));
        assert_eq!(skipped.concat(), tokenizer.decode(&ids, true).unwrap());

        let kept = stream(&tokenizer, &[], &ids, false);
        assert_eq!(kept.concat(), format!("{CHINESE}{EOS}🦀"));
        assert_eq!(kept.concat(), tokenizer.decode(&ids, false).unwrap());
        assert!(kept.iter().any(|piece| piece == EOS));
    }

    /// A tool-call marker that is a special token stays in text whose other special tokens are skipped.
    #[test]
    fn kept_special_tokens_stay_when_the_rest_are_skipped() {
        let tokenizer = byte_level_tokenizer();
        let (eos_id, marker_id) = (
            tokenizer.token_to_id(EOS).unwrap(),
            tokenizer.token_to_id(TOOL_CALLS).unwrap(),
        );
        let ids = [
            encode(&tokenizer, CHINESE),
            vec![marker_id, eos_id],
            encode(&tokenizer, "🦀"),
        ]
        .concat();
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), format!("{CHINESE}🦀"));
        let pieces = stream_keeping(&tokenizer, &[eos_id], &ids, true, &[marker_id]);
        assert_eq!(pieces.concat(), format!("{CHINESE}{TOOL_CALLS}🦀"));
        // Without skipping, everything is shown, kept or not.
        let pieces = stream_keeping(&tokenizer, &[], &ids, false, &[marker_id]);
        assert_eq!(pieces.concat(), format!("{CHINESE}{TOOL_CALLS}{EOS}🦀"));
    }

    #[test]
    fn flush_releases_a_truly_invalid_tail() {
        let tokenizer = byte_level_tokenizer();
        // "ok" then only the first two bytes of "你": the model never finished the character.
        let ids = [encode(&tokenizer, "ok"), vec![tokenizer.token_to_id("ä½").unwrap()]].concat();
        let mut detokenizer = IncrementalDetokenizer::new(&[], true, Vec::new());
        assert_eq!(detokenizer.push(&tokenizer, ids[0]).unwrap(), "ok");
        assert_eq!(detokenizer.push(&tokenizer, ids[1]).unwrap(), "");
        let tail = detokenizer.flush(&tokenizer).unwrap();
        assert_eq!(format!("ok{tail}"), tokenizer.decode(&ids, true).unwrap());
        assert!(tail.contains('\u{FFFD}'));
        assert_eq!(detokenizer.flush(&tokenizer).unwrap(), "", "flush is idempotent");
    }

    #[test]
    fn invalid_bytes_followed_by_text_are_emitted_once_text_follows() {
        let tokenizer = byte_level_tokenizer();
        let ids = [vec![tokenizer.token_to_id("ä½").unwrap()], encode(&tokenizer, "ok")].concat();
        let pieces = stream(&tokenizer, &[], &ids, true);
        assert_eq!(pieces.concat(), tokenizer.decode(&ids, true).unwrap());
        assert_eq!(pieces.last().unwrap(), "");
    }

    /// A SentencePiece-like tokenizer: word tokens carry a leading `▁` that the decoder turns
    /// into a space, except on the first token of a decode.
    fn metaspace_tokenizer() -> Tokenizer {
        let vocab: Vocab = ["<unk>", "▁Hello", "▁world", "!", "▁"]
            .iter()
            .enumerate()
            .map(|(id, token)| (token.to_string(), id as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, Vec::new())
            .unk_token("<unk>".to_owned())
            .build()
            .unwrap();
        let mut tokenizer = Tokenizer::new(bpe);
        let metaspace = Metaspace::new('▁', PrependScheme::Always, true);
        tokenizer.with_pre_tokenizer(Some(metaspace.clone()));
        tokenizer.with_decoder(Some(metaspace));
        tokenizer
    }

    #[test]
    fn metaspace_first_generated_token_keeps_its_leading_space() {
        let tokenizer = metaspace_tokenizer();
        let id = |token: &str| tokenizer.token_to_id(token).unwrap();
        let prompt = [id("▁Hello")];
        let generated = [id("▁world"), id("!"), id("▁world")];
        // Decoding the generated ids alone strips the first space: why the window needs context.
        assert_eq!(tokenizer.decode(&generated, true).unwrap(), "world! world");

        let pieces = stream(&tokenizer, &prompt, &generated, true);
        assert_eq!(pieces, [" world", "!", " world", ""]);

        // With no prompt there is nothing to follow, so the first space goes, as in a decode.
        let pieces = stream(&tokenizer, &[], &generated, true);
        assert_eq!(pieces.concat(), "world! world");
    }

    #[test]
    fn only_the_last_prompt_tokens_are_kept() {
        let prompt: Vec<u32> = (0..100).collect();
        let detokenizer = IncrementalDetokenizer::new(&prompt, true, Vec::new());
        assert_eq!(detokenizer.ids, &prompt[100 - NUM_PROMPT_CONTEXT_TOKENS..]);
        assert_eq!(detokenizer.read_offset, NUM_PROMPT_CONTEXT_TOKENS);
    }
}
