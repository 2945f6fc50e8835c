//! Text handling on the per-token path: the one place that turns generated token ids into
//! client-visible text.
//!
//! This module owns incremental detokenization ([`IncrementalDetokenizer`]: never emits half a
//! UTF-8 character, never loses text, gets SentencePiece leading spaces right) and stop sequences
//! ([`StopMatcher`]: holds back any tail that could still become a stop string, so no fragment of
//! one ever reaches a client). The native API and the OpenAI API, streaming and non-streaming,
//! all go through these two types: a request's text is `detokenizer → stop matcher → client`, and
//! a non-streaming response is the concatenation of what a streaming one would have sent.
//!
//! For chat answers, two splitters read the text the stop matcher lets through: [`reasoning`] takes
//! a reasoning model's thinking apart from the answer, and [`tool_calls`] takes the model's tool calls
//! out of the answer, one parser per template family.
//!
//! [`pyjson`] writes JSON as chat templates' `tojson` does, for the prompts of tool chats.
//!
//! It does not tokenize prompts, apply chat templates, or decide when generation ends: the caller
//! feeds tokens in, and finishes the request when [`StopOutcome::stopped`] says so (or on EOS or
//! length, which it checks itself).

mod detokenize;
pub mod pyjson;
pub mod reasoning;
mod stop;
pub mod tool_calls;

pub use detokenize::{DetokenizeError, IncrementalDetokenizer};
pub use stop::StopMatcher;

/// The length of the longest end of `text` that is the start of `marker` (and not all of it): what
/// must be held back because the next piece may complete the marker.
pub(crate) fn held_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && marker.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

/// `text` as a regex that matches exactly it.
pub(crate) fn escape_regex(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for ch in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(ch) {
            escaped.push('\\');
        }
        escaped.push(ch);
    }
    escaped
}

#[cfg(test)]
mod tests {
    #[test]
    fn held_back_text_is_a_marker_start() {
        assert_eq!(super::held_len("abc<tool", "<tool_call>"), 5);
        assert_eq!(super::held_len("abc", "<tool_call>"), 0);
        assert_eq!(super::held_len("é<", "<tool_call>"), 1);
    }
}
