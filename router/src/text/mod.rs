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
//! It does not tokenize prompts, apply chat templates, or decide when generation ends: the caller
//! feeds tokens in, and finishes the request when [`StopOutcome::stopped`] says so (or on EOS or
//! length, which it checks itself).

mod detokenize;
mod stop;

pub use detokenize::{DetokenizeError, IncrementalDetokenizer};
pub use stop::StopMatcher;
