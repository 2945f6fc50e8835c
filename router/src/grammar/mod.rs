//! Constrained decoding: a request's grammar (JSON Schema, any JSON object, regex, Lark, a list of
//! choices) compiled with `llguidance` against the model's tokenizer, and the per-sequence matcher that
//! says which tokens may come next.
//!
//! Ownership: `GrammarCompiler` is shared by the HTTP handlers; it compiles on the blocking pool (never
//! on the engine loop) and caches compiled grammars by their text, since one router serves one
//! tokenizer. Compilation is bounded: llguidance's `ParserLimits` (grammar size, lexer work) refuse an
//! oversized grammar, and a wall-clock bound (`--grammar-compile-timeout`) answers the request
//! once it is spent (the compile, bounded by the limits, finishes on its blocking thread unseen). Each sequence gets its own `GrammarMatcher` (a cheap clone of the compiled grammar),
//! owned by the engine: the engine asks it for the allowed-token bitmask before a sampled step and
//! feeds it the sampled token after. EOS is allowed exactly when the grammar is complete, so a
//! sequence that runs out of `max_new_tokens` first ends with `length`, never with invalid output
//! reported as complete.

mod spec;

use std::{
    collections::HashMap,
    path::Path,
    sync::{Arc, Mutex},
    time::Duration,
};

use llguidance::{api::TopLevelGrammar, Matcher, ParserFactory};
use thiserror::Error;

pub use spec::GrammarSpec;

/// Compiled grammars kept at once; the cache is emptied when it fills (grammars are cheap to
/// recompile, and clients reuse few of them).
const MAX_CACHED_GRAMMARS: usize = 256;

#[derive(Debug, Error)]
pub enum GrammarError {
    /// The grammar (schema, regex, Lark) is malformed or unsupported; the message says where.
    #[error("{0}")]
    Invalid(String),
    #[error("grammar compilation failed: {0}")]
    Internal(String),
}

/// Compiles grammars for the served tokenizer; cheap to clone.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    cache: Arc<Mutex<HashMap<String, CompiledGrammar>>>,
    /// Where each `compile` reports its time, labelled `hit` or `miss` (`rill_grammar_compile_seconds`).
    compile_seconds: Option<prometheus::HistogramVec>,
    /// The longest a compile may take before the request is refused.
    timeout: Duration,
}

/// `--grammar-compile-timeout`'s default.
const DEFAULT_COMPILE_TIMEOUT: Duration = Duration::from_secs(5);

impl GrammarCompiler {
    /// Builds the token trie of `tokenizer.json` for a model whose logits have `vocab_size` entries;
    /// `eos_token_ids` are the tokens that end a sequence (allowed once the grammar is complete).
    pub fn new(tokenizer_json: &Path, eos_token_ids: &[u32], vocab_size: u32) -> anyhow::Result<Self> {
        let mut tokenizer = toktrie_hf_tokenizers::ByteTokenizer::from_file(tokenizer_json)?;
        if !eos_token_ids.is_empty() {
            tokenizer.set_eos_tokens(eos_token_ids);
        }
        let env = tokenizer.into_tok_env(Some(vocab_size as usize))?;
        let mut factory = ParserFactory::new_simple(&env)?;
        // Grammar errors reach the client in the response; nothing to print.
        factory.set_stderr_log_level(0);
        Ok(Self {
            factory: Arc::new(factory),
            cache: Arc::default(),
            compile_seconds: None,
            timeout: DEFAULT_COMPILE_TIMEOUT,
        })
    }

    /// Refuses grammars that take longer than `timeout` to compile.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Reports the time of every `compile` into `histogram` (labelled by `cache`: `hit` or `miss`).
    pub fn with_metrics(mut self, histogram: prometheus::HistogramVec) -> Self {
        self.compile_seconds = Some(histogram);
        self
    }

    fn observe(&self, cache: &str, started: std::time::Instant) {
        if let Some(histogram) = &self.compile_seconds {
            histogram
                .with_label_values(&[cache])
                .observe(started.elapsed().as_secs_f64());
        }
    }

    /// The compiled grammar for `spec`: from the cache, or compiled on the blocking pool.
    pub async fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let started = std::time::Instant::now();
        let key = spec.cache_key();
        if let Some(hit) = self.cache.lock().expect("never poisoned").get(&key).cloned() {
            self.observe("hit", started);
            return Ok(hit);
        }
        let grammar = spec.to_llguidance()?;
        let compiler = self.clone();
        let compiling = tokio::task::spawn_blocking(move || compiler.compile_now(grammar));
        let compiled = tokio::time::timeout(self.timeout, compiling)
            .await
            .map_err(|_| {
                GrammarError::Invalid(format!(
                    "the grammar took longer than {:?} to compile (--grammar-compile-timeout): simplify the schema",
                    self.timeout
                ))
            })?
            .map_err(|e| GrammarError::Internal(e.to_string()))??;
        let mut cache = self.cache.lock().expect("never poisoned");
        if cache.len() >= MAX_CACHED_GRAMMARS {
            cache.clear();
        }
        cache.insert(key, compiled.clone());
        drop(cache);
        self.observe("miss", started);
        Ok(compiled)
    }

    /// The id of `text` where the tokenizer has it as a special token (llguidance counts every added
    /// `<...>` token as one): a grammar must name such a token, not spell its text.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.factory.tok_env().tok_trie().get_special_token(text)
    }

    /// Compiles on the calling thread (milliseconds to seconds for a large schema).
    pub fn compile_now(&self, grammar: TopLevelGrammar) -> Result<CompiledGrammar, GrammarError> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GrammarError::Invalid(error));
        }
        Ok(CompiledGrammar(Arc::new(matcher)))
    }
}

/// A grammar compiled for the served tokenizer, in its start state.
#[derive(Clone)]
pub struct CompiledGrammar(Arc<Matcher>);

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CompiledGrammar")
    }
}

impl CompiledGrammar {
    /// A fresh matcher for one sequence.
    pub fn matcher(&self) -> GrammarMatcher {
        GrammarMatcher(self.0.deep_clone())
    }
}

/// One sequence's position in its grammar.
pub struct GrammarMatcher(Matcher);

impl GrammarMatcher {
    /// The tokens allowed next, as a bitmask packed in 32-bit words (bit `t % 32` of word `t / 32` set
    /// when token `t` is allowed): EOS only, once the grammar is complete and nothing may follow.
    pub fn allowed_tokens(&mut self) -> Result<Vec<u32>, GrammarError> {
        let mask = self
            .0
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::Internal(e.to_string()))?;
        Ok(mask.as_slice().to_vec())
    }

    /// Advances past a sampled token (one the last mask allowed).
    pub fn accept(&mut self, token_id: u32) -> Result<(), GrammarError> {
        if self.0.is_stopped() {
            return Ok(());
        }
        self.0
            .consume_token(token_id)
            .map_err(|e| GrammarError::Internal(e.to_string()))
    }

    /// Whether the text so far is a complete sentence of the grammar.
    pub fn is_complete(&mut self) -> bool {
        self.0.is_stopped() || self.0.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
pub(crate) mod tests;
