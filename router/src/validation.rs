//! The one place client input is checked: `GenerateRequest -> ValidRequest`. Downstream code takes only
//! `ValidRequest`, so nothing unchecked reaches the engine. Messages name the field and the bound.

use std::sync::Arc;

use thiserror::Error;
use tokenizers::Tokenizer;

use crate::{api::GenerateRequest, config::LimitsConfig};

#[derive(Debug, Error)]
pub enum ValidationError {
    #[error("`inputs` must not be empty")]
    EmptyInput,
    #[error("`inputs` has {0} tokens; the limit is --max-input-tokens = {1}")]
    InputTooLong(usize, u32),
    #[error("`max_new_tokens` must be at least 1")]
    MaxNewTokensZero,
    #[error("`inputs` tokens + `max_new_tokens` = {0} + {1} exceeds --max-total-tokens = {2}")]
    TotalTooLong(usize, u32, u32),
    #[error("`inputs` tokens + `max_new_tokens` = {0} tokens needs more KV memory than the whole pool holds ({1} tokens)")]
    ExceedsKvPool(usize, usize),
    #[error("`temperature` must be a number > 0, got {0}")]
    Temperature(f32),
    #[error("`top_p` must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("`top_k` must be > 0, got 0")]
    TopK,
    #[error("`stop` has {0} sequences; the limit is {1}")]
    TooManyStops(usize, u32),
    #[error("`stop` sequences must not be empty strings")]
    EmptyStop,
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
}

/// Sampling settings after validation; `seed` is always set (random when the client gave none).
#[derive(Debug, Clone, PartialEq)]
pub struct ValidSampling {
    pub do_sample: bool,
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub seed: u64,
}

/// A request that passed every check, tokenized, with defaults filled.
#[derive(Debug, Clone)]
pub struct ValidRequest {
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: u32,
    pub sampling: ValidSampling,
    pub stop_sequences: Vec<String>,
    pub details: bool,
}

/// Checks requests against the limits and the KV pool size; tokenizes off the async runtime.
#[derive(Clone)]
pub struct Validator {
    tokenizer: Arc<Tokenizer>,
    limits: LimitsConfig,
    /// Tokens a single sequence can hold in the KV pool.
    max_kv_tokens: usize,
}

impl Validator {
    pub fn new(tokenizer: Arc<Tokenizer>, limits: LimitsConfig, max_kv_tokens: usize) -> Self {
        Self {
            tokenizer,
            limits,
            max_kv_tokens,
        }
    }

    pub async fn validate(
        &self,
        request: GenerateRequest,
    ) -> Result<ValidRequest, ValidationError> {
        if request.inputs.is_empty() {
            return Err(ValidationError::EmptyInput);
        }
        let tokenizer = self.tokenizer.clone();
        let inputs = request.inputs;
        let encoding = tokio::task::spawn_blocking(move || tokenizer.encode(inputs, true))
            .await
            .map_err(|e| ValidationError::Tokenizer(e.to_string()))?
            .map_err(|e| ValidationError::Tokenizer(e.to_string()))?;
        self.validate_tokens(encoding.get_ids().to_vec(), request.parameters)
    }

    fn validate_tokens(
        &self,
        prompt_ids: Vec<u32>,
        parameters: crate::api::GenerateParameters,
    ) -> Result<ValidRequest, ValidationError> {
        let limits = &self.limits;
        let num_prompt_tokens = prompt_ids.len();
        if num_prompt_tokens == 0 {
            return Err(ValidationError::EmptyInput);
        }
        if num_prompt_tokens > limits.max_input_tokens as usize {
            return Err(ValidationError::InputTooLong(
                num_prompt_tokens,
                limits.max_input_tokens,
            ));
        }
        let room = limits.max_total_tokens - num_prompt_tokens as u32;
        let kv_room = self.max_kv_tokens.saturating_sub(num_prompt_tokens) as u32;
        let max_new_tokens = parameters.max_new_tokens.unwrap_or(room.min(kv_room));
        if max_new_tokens == 0 {
            return Err(ValidationError::MaxNewTokensZero);
        }
        if max_new_tokens > room {
            return Err(ValidationError::TotalTooLong(
                num_prompt_tokens,
                max_new_tokens,
                limits.max_total_tokens,
            ));
        }
        if num_prompt_tokens + max_new_tokens as usize > self.max_kv_tokens {
            return Err(ValidationError::ExceedsKvPool(
                num_prompt_tokens + max_new_tokens as usize,
                self.max_kv_tokens,
            ));
        }
        if let Some(t) = parameters.temperature {
            if !(t > 0.0 && t.is_finite()) {
                return Err(ValidationError::Temperature(t));
            }
        }
        if let Some(p) = parameters.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ValidationError::TopP(p));
            }
        }
        if parameters.top_k == Some(0) {
            return Err(ValidationError::TopK);
        }
        if parameters.stop.len() > limits.max_stop_sequences as usize {
            return Err(ValidationError::TooManyStops(
                parameters.stop.len(),
                limits.max_stop_sequences,
            ));
        }
        if parameters.stop.iter().any(String::is_empty) {
            return Err(ValidationError::EmptyStop);
        }
        // As in TGI, any sampling setting implies sampling.
        let do_sample = parameters.do_sample
            || parameters.temperature.is_some_and(|t| t != 1.0)
            || parameters.top_k.is_some()
            || parameters.top_p.is_some_and(|p| p < 1.0);
        Ok(ValidRequest {
            prompt_ids,
            max_new_tokens,
            sampling: ValidSampling {
                do_sample,
                temperature: parameters.temperature.unwrap_or(1.0),
                top_k: parameters.top_k.unwrap_or(0),
                top_p: parameters.top_p.unwrap_or(1.0),
                seed: parameters.seed.unwrap_or_else(rand::random),
            },
            stop_sequences: parameters.stop,
            details: parameters.details,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::GenerateParameters;

    fn validator() -> Validator {
        let tokenizer = Tokenizer::new(tokenizers::models::bpe::BPE::default());
        let limits = LimitsConfig {
            max_input_tokens: 10,
            max_total_tokens: 20,
            max_stop_sequences: 2,
            max_concurrent_requests: 4,
        };
        Validator::new(Arc::new(tokenizer), limits, 16)
    }

    fn check(
        num_prompt_tokens: usize,
        parameters: GenerateParameters,
    ) -> Result<ValidRequest, ValidationError> {
        validator().validate_tokens(vec![1; num_prompt_tokens], parameters)
    }

    #[test]
    fn defaults_fill_the_room_left_by_the_prompt() {
        let valid = check(3, GenerateParameters::default()).expect("valid");
        // The smaller of what --max-total-tokens leaves (17) and what the KV pool leaves (13).
        assert_eq!(valid.max_new_tokens, 13);
        assert!(!valid.sampling.do_sample);
    }

    #[test]
    fn limits_name_their_bounds() {
        let too_long = check(11, GenerateParameters::default()).unwrap_err();
        assert!(too_long.to_string().contains("--max-input-tokens = 10"));
        let params = GenerateParameters {
            max_new_tokens: Some(12),
            ..Default::default()
        };
        assert!(matches!(
            check(9, params).unwrap_err(),
            ValidationError::TotalTooLong(9, 12, 20)
        ));
        let params = GenerateParameters {
            max_new_tokens: Some(8),
            ..Default::default()
        };
        assert!(matches!(
            check(9, params).unwrap_err(),
            ValidationError::ExceedsKvPool(17, 16)
        ));
    }

    #[test]
    fn sampling_values_are_range_checked() {
        for params in [
            GenerateParameters {
                temperature: Some(0.0),
                ..Default::default()
            },
            GenerateParameters {
                temperature: Some(f32::NAN),
                ..Default::default()
            },
            GenerateParameters {
                top_p: Some(1.5),
                ..Default::default()
            },
            GenerateParameters {
                top_k: Some(0),
                ..Default::default()
            },
            GenerateParameters {
                stop: vec!["a".into(), "b".into(), "c".into()],
                ..Default::default()
            },
            GenerateParameters {
                stop: vec![String::new()],
                ..Default::default()
            },
            GenerateParameters {
                max_new_tokens: Some(0),
                ..Default::default()
            },
        ] {
            assert!(check(2, params).is_err());
        }
        let sampled = check(
            2,
            GenerateParameters {
                top_k: Some(5),
                ..Default::default()
            },
        )
        .expect("valid");
        assert!(sampled.sampling.do_sample);
    }
}
