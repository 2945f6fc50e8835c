//! The step token budget that keeps inter-token latency under a target (`--target-itl-ms`).
//!
//! Every running stream waits one step per token, so a step's wall time is the streams' inter-token
//! latency. Step time grows with the tokens computed in the step (prompt chunks dominate), so this learns
//! that function from real steps — synthetic ones at warmup, then every step served — and gives the
//! largest token count predicted to finish within the target. The scheduler then sizes prompt chunks to
//! fit. (vLLM, SGLang and TGI use a fixed token budget.)

/// Step time as a function of tokens per step, learned per power-of-two bucket of token counts.
#[derive(Debug, Clone)]
pub struct ItlBudget {
    target_s: f64,
    /// Per bucket k (tokens in [2^k, 2^(k+1))): exponentially weighted means of tokens and seconds.
    buckets: Vec<Option<(f64, f64)>>,
}

/// Weight of a new observation in its bucket's running mean.
const NEW_WEIGHT: f64 = 0.2;

impl ItlBudget {
    pub fn new(target_ms: f64) -> Self {
        Self {
            target_s: target_ms / 1e3,
            buckets: vec![None; 32],
        }
    }

    /// Records that a step computing `num_tokens` tokens took `seconds`.
    pub fn observe(&mut self, num_tokens: usize, seconds: f64) {
        if num_tokens == 0 || !seconds.is_finite() {
            return;
        }
        let k = (usize::BITS - 1 - num_tokens.leading_zeros()) as usize;
        let bucket = &mut self.buckets[k.min(31)];
        *bucket = Some(match *bucket {
            None => (num_tokens as f64, seconds),
            Some((t, s)) => (t + NEW_WEIGHT * (num_tokens as f64 - t), s + NEW_WEIGHT * (seconds - s)),
        });
    }

    /// Least-squares line `seconds = a + b * tokens` through the bucket means; `None` until two buckets
    /// have data.
    fn fit(&self) -> Option<(f64, f64)> {
        let points: Vec<(f64, f64)> = self.buckets.iter().flatten().copied().collect();
        if points.len() < 2 {
            return None;
        }
        let n = points.len() as f64;
        let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
        let mean_s = points.iter().map(|p| p.1).sum::<f64>() / n;
        let var_t: f64 = points.iter().map(|p| (p.0 - mean_t).powi(2)).sum();
        let cov: f64 = points.iter().map(|p| (p.0 - mean_t) * (p.1 - mean_s)).sum();
        let slope = (cov / var_t).max(1e-9);
        Some((mean_s - slope * mean_t, slope))
    }

    /// The most tokens a step may compute to stay within the target, between `floor` (what running
    /// decodes need anyway) and `cap` (`--max-batch-tokens`). Until the model is learned: `cap`.
    pub fn max_tokens(&self, floor: usize, cap: usize) -> usize {
        match self.fit() {
            None => cap,
            Some((intercept, slope)) => {
                let tokens = ((self.target_s - intercept) / slope).floor();
                (tokens.max(0.0) as usize).clamp(floor.min(cap), cap)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_a_linear_step_time_and_sizes_the_budget() {
        // 5 ms fixed + 0.1 ms per token: a 50 ms target allows 450 tokens.
        let mut budget = ItlBudget::new(50.0);
        assert_eq!(budget.max_tokens(1, 2048), 2048, "no model yet: the cap");
        for tokens in [1, 8, 64, 256, 1024, 2048] {
            for _ in 0..20 {
                budget.observe(tokens, 0.005 + 0.0001 * tokens as f64);
            }
        }
        let allowed = budget.max_tokens(1, 2048);
        assert!((440..=460).contains(&allowed), "{allowed}");
        assert_eq!(
            budget.max_tokens(500, 2048),
            500,
            "never below what running decodes need"
        );
        assert_eq!(budget.max_tokens(1, 100), 100, "never above the cap");
    }

    #[test]
    fn adapts_when_steps_get_slower() {
        let mut budget = ItlBudget::new(50.0);
        for tokens in [16, 256, 1024] {
            budget.observe(tokens, 0.005 + 0.0001 * tokens as f64);
        }
        let before = budget.max_tokens(1, 4096);
        for _ in 0..50 {
            for tokens in [16, 256, 1024] {
                budget.observe(tokens, 0.005 + 0.0002 * tokens as f64);
            }
        }
        let after = budget.max_tokens(1, 4096);
        assert!(after < before * 2 / 3, "{before} -> {after}");
    }
}
