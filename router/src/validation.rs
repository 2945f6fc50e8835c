//! The one place client input is checked. Both APIs turn their bodies into a `GenerateInput`;
//! `Validator::validate` turns that into a `ValidRequest` (tokenized, every limit checked, defaults
//! filled). Downstream code takes only `ValidRequest`, so nothing unchecked reaches the engine.
//! Messages name the field and the bound.

use std::{collections::HashMap, sync::Arc, time::Duration};

use thiserror::Error;
use tokenizers::Tokenizer;

use crate::{
    config::{LimitsConfig, MAX_TIMEOUT_S},
    grammar::{CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec},
    lora::AdapterRef,
};

/// The shortest `timeout` a request may give, in seconds (shorter ones could not even be measured).
const MIN_TIMEOUT_S: f64 = 1e-3;

/// Most alternatives per position a request may ask logprobs for.
pub const MAX_TOP_N_TOKENS: u32 = 20;

/// Longest session key of a cache pin, in bytes.
pub const MAX_CACHE_PIN_KEY_BYTES: usize = 1024;

#[derive(Debug, Error)]
pub enum ValidationError {
    #[error("`{0}` must not be empty")]
    EmptyInput(&'static str),
    #[error("the prompt has {0} tokens; the limit is --max-input-tokens = {1}")]
    InputTooLong(usize, u32),
    #[error("`{0}` must be at least 1")]
    MaxNewTokensZero(&'static str),
    #[error("prompt tokens + `{field}` = {0} + {1} exceeds --max-total-tokens = {2}", field = .3)]
    TotalTooLong(usize, u32, u32, &'static str),
    #[error("prompt tokens + `{field}` = {0} tokens needs more KV memory than the whole pool holds ({1} tokens)", field = .2)]
    ExceedsKvPool(usize, usize, &'static str),
    #[error("`{0}` must be {1}, got {2}")]
    OutOfRange(&'static str, &'static str, String),
    #[error("`stop` has {0} sequences; the limit is --max-stop-sequences = {1}")]
    TooManyStops(usize, u32),
    #[error("`stop` sequences must not be empty strings")]
    EmptyStop,
    #[error("token id {0} in `{1}` is outside the vocabulary (size {2})")]
    TokenOutOfVocab(u32, &'static str, u32),
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// A malformed or unsupported grammar (answered with 400).
    #[error("`{0}` is not a valid grammar: {1}")]
    InvalidGrammar(&'static str, String),
    #[error("constrained decoding is not available on this server")]
    NoGrammarSupport,
    #[error("grammar compilation failed: {0}")]
    GrammarCompile(String),
    #[error("`{0}` must be a non-empty session key of at most {MAX_CACHE_PIN_KEY_BYTES} bytes, got {1} bytes")]
    CachePinKey(&'static str, usize),
}

impl ValidationError {
    /// The request field the error is about, for APIs that report it separately (OpenAI's `param`).
    pub fn param(&self) -> Option<&str> {
        match self {
            ValidationError::EmptyInput(f)
            | ValidationError::MaxNewTokensZero(f)
            | ValidationError::OutOfRange(f, _, _)
            | ValidationError::TokenOutOfVocab(_, f, _)
            | ValidationError::InvalidGrammar(f, _)
            | ValidationError::CachePinKey(f, _) => Some(f),
            ValidationError::TotalTooLong(.., f) | ValidationError::ExceedsKvPool(.., f) => Some(f),
            ValidationError::TooManyStops(..) | ValidationError::EmptyStop => Some("stop"),
            _ => None,
        }
    }
}

/// The prompt as the client gave it.
#[derive(Debug, Clone)]
pub enum Prompt {
    /// Tokenized with the tokenizer's special tokens (BOS, ...) when `add_special_tokens`.
    Text {
        text: String,
        add_special_tokens: bool,
    },
    Tokens(Vec<u32>),
}

/// A request's ask to keep the KV of its prefix cached after it finishes normally, for an agent session's
/// next turn: the sequence's cached blocks (prompt and output) are pinned under `key`, within the
/// request's `cache_salt` namespace, for `ttl`, so eviction passes them by until then (see `KvPool::pin`).
/// The next pin of the same key replaces it. Every API maps its session hint onto one of these:
/// `CachePin::new("prompt_cache_key", key)` for the server's default TTL, `.with_ttl(ttl)` for another
/// (clamped to `--max-cache-pin-ttl`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CachePin {
    /// The API field that gave the key, for error messages.
    pub field: &'static str,
    /// The session key: non-empty, at most `MAX_CACHE_PIN_KEY_BYTES`.
    pub key: String,
    /// How long the pin lasts from the request's end; None = `--cache-pin-ttl`.
    pub ttl: Option<Duration>,
}

impl CachePin {
    /// A pin of `key` (from the API field `field`) for the server's default TTL.
    pub fn new(field: &'static str, key: impl Into<String>) -> Self {
        Self {
            field,
            key: key.into(),
            ttl: None,
        }
    }

    /// The same pin for `ttl` (clamped to `--max-cache-pin-ttl`).
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }
}

/// A checked `CachePin`: its TTL resolved within the server's bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidCachePin {
    pub key: String,
    pub ttl: Duration,
}

/// A generation request in the terms shared by every API, before checking.
#[derive(Debug, Clone)]
pub struct GenerateInput {
    pub prompt: Prompt,
    /// Name of the API field that holds the prompt, for error messages.
    pub prompt_field: &'static str,
    /// Name of the API field that sets `max_new_tokens`, for error messages.
    pub max_new_tokens_field: &'static str,
    pub max_new_tokens: Option<u32>,
    pub do_sample: bool,
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub typical_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub repetition_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: HashMap<u32, f32>,
    pub top_n_tokens: u32,
    pub min_new_tokens: u32,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// Special tokens kept in the text even when the rest are skipped: the tool-call format's
    /// markers, which its parser reads.
    pub kept_special_tokens: Vec<u32>,
    /// Keep only the last `truncate` prompt tokens.
    pub truncate: Option<u32>,
    /// Lower runs first; 0 is the default.
    pub priority: i32,
    /// Prefix-cache namespace: requests with different salts never share cached blocks.
    pub cache_salt: Option<String>,
    /// The language the output must belong to, and the API field that gave it (for errors).
    pub grammar: Option<(GrammarSpec, &'static str)>,
    /// Seconds the request may take from arrival to its last token (`timeout`).
    pub timeout: Option<f64>,
    /// Keep the finished sequence's prefix cached for the session's next turn.
    pub cache_pin: Option<CachePin>,
    /// The LoRA adapter the request named (`model`, `adapter_id`); None = the base model.
    pub adapter: Option<AdapterRef>,
}

impl GenerateInput {
    /// Greedy decoding of `prompt` with every option at its default; the field names are the API's.
    pub fn new(prompt: Prompt, prompt_field: &'static str, max_new_tokens_field: &'static str) -> Self {
        Self {
            prompt,
            prompt_field,
            max_new_tokens_field,
            max_new_tokens: None,
            do_sample: false,
            temperature: None,
            top_k: None,
            top_p: None,
            min_p: None,
            typical_p: None,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            repetition_penalty: None,
            frequency_penalty: None,
            presence_penalty: None,
            logit_bias: HashMap::new(),
            top_n_tokens: 0,
            min_new_tokens: 0,
            ignore_eos: false,
            skip_special_tokens: true,
            kept_special_tokens: Vec::new(),
            truncate: None,
            priority: 0,
            cache_salt: None,
            grammar: None,
            timeout: None,
            cache_pin: None,
            adapter: None,
        }
    }
}

/// Sampling settings after validation; `seed` is always set (random when the client gave none).
/// Neutral values mean off: penalties 1.0 / 0.0, min_p 0.0, typical_p 1.0.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSampling {
    pub do_sample: bool,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub typical_p: f32,
    pub seed: u64,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub logit_bias: HashMap<u32, f32>,
}

impl ValidSampling {
    /// Whether the shard needs the sequence's token history (for a penalty).
    pub fn has_penalty(&self) -> bool {
        self.repetition_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0
    }
}

/// A request that passed every check, tokenized, with defaults filled.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: u32,
    pub sampling: ValidSampling,
    pub stop_sequences: Vec<String>,
    /// Token ids that end generation besides EOS.
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub min_new_tokens: u32,
    pub skip_special_tokens: bool,
    /// See [`GenerateInput::kept_special_tokens`].
    pub kept_special_tokens: Vec<u32>,
    pub top_n_tokens: u32,
    /// Lower runs first.
    pub priority: i32,
    /// Prefix-cache namespace (a hash of the request's `cache_salt`; 0 = the shared namespace).
    pub cache_salt: u64,
    /// The grammar the output must follow (constrained decoding), compiled.
    pub grammar: Option<CompiledGrammar>,
    /// How long the request may take from arrival to its last token: the shorter of its own `timeout`
    /// and `--request-timeout`; None = no limit.
    pub timeout: Option<Duration>,
    /// Pin the finished sequence's cached prefix under this key for this long.
    pub cache_pin: Option<ValidCachePin>,
    /// The LoRA adapter it runs with, held until the request is dropped everywhere; None = the base model.
    pub adapter: Option<AdapterRef>,
}

/// Checks requests against the limits, the vocabulary and the KV pool size; tokenizes off the runtime.
#[derive(Clone)]
pub struct Validator {
    tokenizer: Arc<Tokenizer>,
    limits: LimitsConfig,
    vocab_size: u32,
    /// Tokens a single sequence can hold in the KV pool.
    max_kv_tokens: usize,
    /// Compiles request grammars; `None` where constrained decoding is unavailable.
    grammar: Option<GrammarCompiler>,
}

fn check(
    is_valid: bool,
    field: &'static str,
    bound: &'static str,
    value: impl ToString,
) -> Result<(), ValidationError> {
    if is_valid {
        Ok(())
    } else {
        Err(ValidationError::OutOfRange(field, bound, value.to_string()))
    }
}

impl Validator {
    pub fn new(tokenizer: Arc<Tokenizer>, limits: LimitsConfig, vocab_size: u32, max_kv_tokens: usize) -> Self {
        Self {
            tokenizer,
            limits,
            vocab_size,
            max_kv_tokens,
            grammar: None,
        }
    }

    /// Enables constrained decoding with this compiler.
    pub fn with_grammar(mut self, compiler: GrammarCompiler) -> Self {
        self.grammar = Some(compiler);
        self
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Tokenizes text off the async runtime (long prompts take milliseconds).
    pub async fn tokenize(
        &self,
        text: String,
        add_special_tokens: bool,
    ) -> Result<tokenizers::Encoding, ValidationError> {
        let tokenizer = self.tokenizer.clone();
        tokio::task::spawn_blocking(move || tokenizer.encode(text, add_special_tokens))
            .await
            .map_err(|e| ValidationError::Tokenizer(e.to_string()))?
            .map_err(|e| ValidationError::Tokenizer(e.to_string()))
    }

    pub async fn validate(&self, input: GenerateInput) -> Result<ValidRequest, ValidationError> {
        let prompt_ids = match &input.prompt {
            Prompt::Text { text, .. } if text.is_empty() => {
                return Err(ValidationError::EmptyInput(input.prompt_field))
            }
            Prompt::Text {
                text,
                add_special_tokens,
            } => self
                .tokenize(text.clone(), *add_special_tokens)
                .await?
                .get_ids()
                .to_vec(),
            Prompt::Tokens(ids) => ids.clone(),
        };
        let grammar = input.grammar.clone();
        let mut valid = self.validate_tokens(prompt_ids, input)?;
        if let Some((spec, field)) = grammar {
            valid.grammar = Some(self.compile_grammar(&spec, field).await?);
        }
        Ok(valid)
    }

    /// The id of `text` as a special token of the grammar compiler's tokenizer, if it is one.
    pub fn special_token(&self, text: &str) -> Option<u32> {
        self.grammar.as_ref()?.special_token(text)
    }

    /// Compiles (or finds in the cache) the grammar `field` gave; errors name the field.
    pub async fn compile_grammar(
        &self,
        spec: &GrammarSpec,
        field: &'static str,
    ) -> Result<CompiledGrammar, ValidationError> {
        let compiler = self.grammar.as_ref().ok_or(ValidationError::NoGrammarSupport)?;
        compiler.compile(spec).await.map_err(|e| match e {
            GrammarError::Invalid(message) => ValidationError::InvalidGrammar(field, message),
            GrammarError::Internal(message) => ValidationError::GrammarCompile(message),
        })
    }

    fn validate_tokens(&self, mut prompt_ids: Vec<u32>, input: GenerateInput) -> Result<ValidRequest, ValidationError> {
        let limits = &self.limits;
        if let Some(truncate) = input.truncate {
            check(truncate > 0, "truncate", "> 0", truncate)?;
            let excess = prompt_ids.len().saturating_sub(truncate as usize);
            prompt_ids.drain(..excess);
        }
        let num_prompt_tokens = prompt_ids.len();
        if num_prompt_tokens == 0 {
            return Err(ValidationError::EmptyInput(input.prompt_field));
        }
        if let Some(&id) = prompt_ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(ValidationError::TokenOutOfVocab(
                id,
                input.prompt_field,
                self.vocab_size,
            ));
        }
        if num_prompt_tokens > limits.max_input_tokens as usize {
            return Err(ValidationError::InputTooLong(
                num_prompt_tokens,
                limits.max_input_tokens,
            ));
        }
        let field = input.max_new_tokens_field;
        let room = limits.max_total_tokens - num_prompt_tokens as u32;
        let kv_room = self.max_kv_tokens.saturating_sub(num_prompt_tokens) as u32;
        let max_new_tokens = input.max_new_tokens.unwrap_or(room.min(kv_room));
        if max_new_tokens == 0 {
            return Err(ValidationError::MaxNewTokensZero(field));
        }
        if max_new_tokens > room {
            return Err(ValidationError::TotalTooLong(
                num_prompt_tokens,
                max_new_tokens,
                limits.max_total_tokens,
                field,
            ));
        }
        if num_prompt_tokens + max_new_tokens as usize > self.max_kv_tokens {
            return Err(ValidationError::ExceedsKvPool(
                num_prompt_tokens + max_new_tokens as usize,
                self.max_kv_tokens,
                field,
            ));
        }
        if let Some(t) = input.temperature {
            // 0 means greedy, as in the OpenAI API.
            check(t >= 0.0 && t.is_finite(), "temperature", ">= 0", t)?;
        }
        if let Some(p) = input.top_p {
            check(p > 0.0 && p <= 1.0, "top_p", "in (0, 1]", p)?;
        }
        if let Some(p) = input.min_p {
            check((0.0..=1.0).contains(&p), "min_p", "in [0, 1]", p)?;
        }
        if let Some(p) = input.typical_p {
            check(p > 0.0 && p <= 1.0, "typical_p", "in (0, 1]", p)?;
        }
        if let Some(k) = input.top_k {
            check(k > 0, "top_k", "> 0", k)?;
        }
        if let Some(r) = input.repetition_penalty {
            check(r > 0.0 && r.is_finite(), "repetition_penalty", "> 0", r)?;
        }
        for (name, value) in [
            ("frequency_penalty", input.frequency_penalty),
            ("presence_penalty", input.presence_penalty),
        ] {
            if let Some(v) = value {
                check((-2.0..=2.0).contains(&v), name, "in [-2, 2]", v)?;
            }
        }
        for (&id, &bias) in &input.logit_bias {
            if id >= self.vocab_size {
                return Err(ValidationError::TokenOutOfVocab(id, "logit_bias", self.vocab_size));
            }
            check((-100.0..=100.0).contains(&bias), "logit_bias", "in [-100, 100]", bias)?;
        }
        if let Some(&id) = input.stop_token_ids.iter().find(|&&id| id >= self.vocab_size) {
            return Err(ValidationError::TokenOutOfVocab(id, "stop_token_ids", self.vocab_size));
        }
        check(
            input.top_n_tokens <= MAX_TOP_N_TOKENS,
            "top_n_tokens",
            "at most 20",
            input.top_n_tokens,
        )?;
        check(
            input.min_new_tokens <= max_new_tokens,
            "min_tokens",
            "at most the maximum new tokens",
            input.min_new_tokens,
        )?;
        if input.stop.len() > limits.max_stop_sequences as usize {
            return Err(ValidationError::TooManyStops(
                input.stop.len(),
                limits.max_stop_sequences,
            ));
        }
        if input.stop.iter().any(String::is_empty) {
            return Err(ValidationError::EmptyStop);
        }
        if let Some(t) = input.timeout {
            check(
                (MIN_TIMEOUT_S..=MAX_TIMEOUT_S).contains(&t),
                "timeout",
                "in [0.001, 1000000] seconds",
                t,
            )?;
        }
        let cache_pin = match input.cache_pin {
            Some(pin) if pin.key.is_empty() || pin.key.len() > MAX_CACHE_PIN_KEY_BYTES => {
                return Err(ValidationError::CachePinKey(pin.field, pin.key.len()));
            }
            Some(pin) => Some(ValidCachePin {
                key: pin.key,
                ttl: pin.ttl.unwrap_or(limits.cache_pin_ttl).min(limits.max_cache_pin_ttl),
            }),
            None => None,
        };
        // The request's own timeout may shorten --request-timeout, never lengthen it.
        let timeout = input
            .timeout
            .map(Duration::from_secs_f64)
            .into_iter()
            .chain(limits.request_timeout)
            .min();
        // As in TGI, any sampling setting implies sampling; temperature 0 means greedy, as in OpenAI's API.
        let temperature = input.temperature.unwrap_or(1.0);
        let do_sample = temperature > 0.0
            && (input.do_sample
                || temperature != 1.0
                || input.top_k.is_some()
                || input.top_p.is_some_and(|p| p < 1.0)
                || input.min_p.is_some_and(|p| p > 0.0)
                || input.typical_p.is_some_and(|p| p < 1.0));
        Ok(ValidRequest {
            prompt_ids,
            max_new_tokens,
            sampling: ValidSampling {
                do_sample,
                temperature: if do_sample { temperature } else { 1.0 },
                top_k: input.top_k.unwrap_or(0),
                top_p: input.top_p.unwrap_or(1.0),
                min_p: input.min_p.unwrap_or(0.0),
                typical_p: input.typical_p.unwrap_or(1.0),
                seed: input.seed.unwrap_or_else(rand::random),
                repetition_penalty: input.repetition_penalty.unwrap_or(1.0),
                frequency_penalty: input.frequency_penalty.unwrap_or(0.0),
                presence_penalty: input.presence_penalty.unwrap_or(0.0),
                logit_bias: input.logit_bias,
            },
            stop_sequences: input.stop,
            stop_token_ids: input.stop_token_ids,
            ignore_eos: input.ignore_eos,
            min_new_tokens: input.min_new_tokens,
            skip_special_tokens: input.skip_special_tokens,
            kept_special_tokens: input.kept_special_tokens,
            top_n_tokens: input.top_n_tokens,
            priority: input.priority,
            cache_salt: input.cache_salt.as_deref().map_or(0, salt_namespace),
            grammar: None,
            timeout,
            cache_pin,
            adapter: input.adapter,
        })
    }
}

/// A salt's cache namespace: a fixed-key hash, never 0 (the namespace of unsalted requests).
fn salt_namespace(salt: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    salt.hash(&mut hasher);
    hasher.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn validator() -> Validator {
        let tokenizer = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let limits = LimitsConfig {
            max_input_tokens: 10,
            max_total_tokens: 20,
            max_stop_sequences: 2,
            max_concurrent_requests: 4,
            max_waiting_requests: 4,
            request_timeout: Some(Duration::from_secs(60)),
            max_unread_tokens: 8,
            cache_pin_ttl: Duration::from_secs(300),
            max_cache_pin_ttl: Duration::from_secs(3600),
        };
        Validator::new(Arc::new(tokenizer), limits, 100, 16)
    }

    fn input(edit: impl FnOnce(&mut GenerateInput)) -> GenerateInput {
        let mut input = GenerateInput::new(Prompt::Tokens(Vec::new()), "inputs", "max_new_tokens");
        edit(&mut input);
        input
    }

    fn check_input(num_prompt_tokens: usize, input: GenerateInput) -> Result<ValidRequest, ValidationError> {
        validator().validate_tokens(vec![1; num_prompt_tokens], input)
    }

    #[test]
    fn defaults_fill_the_room_left_by_the_prompt() {
        let valid = check_input(3, input(|_| {})).expect("valid");
        // The smaller of what --max-total-tokens leaves (17) and what the KV pool leaves (13).
        assert_eq!(valid.max_new_tokens, 13);
        assert!(!valid.sampling.do_sample);
        assert!(!valid.sampling.has_penalty());
    }

    #[test]
    fn cache_pins_get_the_default_ttl_within_the_bound_and_a_checked_key() {
        let pin = |edit: fn(CachePin) -> CachePin| {
            check_input(
                2,
                input(|i| i.cache_pin = Some(edit(CachePin::new("prompt_cache_key", "s")))),
            )
            .map(|valid| valid.cache_pin.expect("pinned"))
        };
        let ttl = |pin: Result<ValidCachePin, _>| pin.expect("valid").ttl;
        assert_eq!(ttl(pin(|p| p)), Duration::from_secs(300));
        assert_eq!(
            ttl(pin(|p| p.with_ttl(Duration::from_secs(60)))),
            Duration::from_secs(60)
        );
        assert_eq!(
            ttl(pin(|p| p.with_ttl(Duration::from_secs(86_400)))),
            Duration::from_secs(3600),
            "clamped to --max-cache-pin-ttl"
        );
        assert_eq!(pin(|p| p).expect("valid").key, "s");
        for key in [String::new(), "k".repeat(MAX_CACHE_PIN_KEY_BYTES + 1)] {
            let error = check_input(2, input(|i| i.cache_pin = Some(CachePin::new("prompt_cache_key", key))))
                .expect_err("a bad key");
            assert_eq!(error.param(), Some("prompt_cache_key"));
        }
        assert_eq!(check_input(2, input(|_| {})).expect("valid").cache_pin, None);
    }

    #[test]
    fn limits_name_their_bounds() {
        let too_long = check_input(11, input(|_| {})).unwrap_err();
        assert!(too_long.to_string().contains("--max-input-tokens = 10"));
        let error = check_input(9, input(|i| i.max_new_tokens = Some(12))).unwrap_err();
        assert!(matches!(
            error,
            ValidationError::TotalTooLong(9, 12, 20, "max_new_tokens")
        ));
        let error = check_input(9, input(|i| i.max_new_tokens = Some(8))).unwrap_err();
        assert!(matches!(error, ValidationError::ExceedsKvPool(17, 16, _)));
        let error = validator().validate_tokens(vec![1, 500], input(|_| {})).unwrap_err();
        assert!(error.to_string().contains("token id 500"));
    }

    #[test]
    fn salts_get_their_own_namespaces() {
        let salted = |salt: Option<&str>| {
            check_input(2, input(|i| i.cache_salt = salt.map(str::to_owned)))
                .expect("valid")
                .cache_salt
        };
        assert_eq!(salted(None), 0);
        assert_ne!(salted(Some("tenant-a")), 0);
        assert_ne!(salted(Some("tenant-a")), salted(Some("tenant-b")));
        assert_eq!(salted(Some("tenant-a")), salted(Some("tenant-a")));
    }

    #[test]
    fn truncate_keeps_the_last_tokens() {
        let valid = validator()
            .validate_tokens(vec![1, 2, 3, 4], input(|i| i.truncate = Some(2)))
            .expect("valid");
        assert_eq!(valid.prompt_ids, vec![3, 4]);
    }

    #[test]
    fn sampling_values_are_range_checked() {
        type Edit = Box<dyn Fn(&mut GenerateInput)>;
        let bad: Vec<Edit> = vec![
            Box::new(|i| i.temperature = Some(-0.5)),
            Box::new(|i| i.temperature = Some(f32::NAN)),
            Box::new(|i| i.top_p = Some(1.5)),
            Box::new(|i| i.top_k = Some(0)),
            Box::new(|i| i.min_p = Some(2.0)),
            Box::new(|i| i.typical_p = Some(0.0)),
            Box::new(|i| i.repetition_penalty = Some(0.0)),
            Box::new(|i| i.frequency_penalty = Some(3.0)),
            Box::new(|i| i.presence_penalty = Some(-2.5)),
            Box::new(|i| i.logit_bias = [(5, 200.0)].into()),
            Box::new(|i| i.logit_bias = [(100, 1.0)].into()),
            Box::new(|i| i.stop_token_ids = vec![100]),
            Box::new(|i| i.top_n_tokens = 21),
            Box::new(|i| i.stop = vec!["a".into(), "b".into(), "c".into()]),
            Box::new(|i| i.stop = vec![String::new()]),
            Box::new(|i| i.max_new_tokens = Some(0)),
            Box::new(|i| {
                i.max_new_tokens = Some(2);
                i.min_new_tokens = 3;
            }),
            Box::new(|i| i.timeout = Some(0.0)),
            Box::new(|i| i.timeout = Some(5e-324)),
            Box::new(|i| i.timeout = Some(-1.0)),
            Box::new(|i| i.timeout = Some(f64::NAN)),
            Box::new(|i| i.timeout = Some(1e300)),
        ];
        for (k, edit) in bad.iter().enumerate() {
            let mut one = input(|_| {});
            edit(&mut one);
            assert!(check_input(2, one).is_err(), "case {k} passed");
        }
        let sampled = check_input(2, input(|i| i.top_k = Some(5))).expect("valid");
        assert!(sampled.sampling.do_sample);
        let greedy = check_input(2, input(|i| i.temperature = Some(0.0))).expect("valid");
        assert!(!greedy.sampling.do_sample);
    }

    #[test]
    fn the_shorter_timeout_wins() {
        let timeout = |own: Option<f64>| check_input(2, input(|i| i.timeout = own)).expect("valid").timeout;
        // The validator's --request-timeout is 60 s.
        assert_eq!(timeout(None), Some(Duration::from_secs(60)));
        assert_eq!(timeout(Some(1.5)), Some(Duration::from_millis(1500)));
        assert_eq!(timeout(Some(600.0)), Some(Duration::from_secs(60)));
    }
}
