//! How a preempted sequence gives up its KV blocks: recomputed later, or swapped out to host memory and
//! copied back. The scheduler chooses victims; this small policy chooses the mechanism per victim from the
//! costs the shards measured at warmup. Pure: no I/O, no state.

/// `--preemption-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Always free the blocks; the sequence recomputes its K/V when readmitted (prefix-cache hits on its
    /// own released blocks make that cheap while they stay cached).
    Recompute,
    /// Copy the blocks to the host swap pool and back when room returns; recompute when the pool is full.
    Swap,
    /// Swap when the swap pool has room and copying is cheaper than recomputing, else recompute.
    Auto,
}

/// What one victim's suspension will do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preemption {
    Recompute,
    Swap,
}

impl Preemption {
    /// The label value of `rill_preemptions_total`.
    pub fn label(self) -> &'static str {
        match self {
            Preemption::Recompute => "recompute",
            Preemption::Swap => "swap",
        }
    }
}

/// Costs the shards measured at warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PreemptionCosts {
    /// Seconds to copy one KV block out to the host and back in.
    pub swap_seconds_per_block: f64,
    /// Seconds to compute one token's K/V in a prefill.
    pub prefill_seconds_per_token: f64,
}

/// The mechanism for a victim holding `num_blocks` blocks of `num_computed_tokens` computed tokens, with
/// `num_free_host_blocks` free in the swap pool. Auto compares the copy (out and back in) with recomputing
/// every computed token: an upper bound on recomputation, since a resumed sequence often hits its own
/// blocks in the prefix cache, but one the router can know now.
pub fn choose_preemption(
    mode: PreemptionMode,
    costs: PreemptionCosts,
    num_blocks: usize,
    num_computed_tokens: usize,
    num_free_host_blocks: usize,
) -> Preemption {
    if num_blocks == 0 || num_blocks > num_free_host_blocks {
        return Preemption::Recompute;
    }
    match mode {
        PreemptionMode::Recompute => Preemption::Recompute,
        PreemptionMode::Swap => Preemption::Swap,
        PreemptionMode::Auto => {
            let swap_s = num_blocks as f64 * costs.swap_seconds_per_block;
            let recompute_s = num_computed_tokens as f64 * costs.prefill_seconds_per_token;
            if swap_s < recompute_s {
                Preemption::Swap
            } else {
                Preemption::Recompute
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COSTS: PreemptionCosts = PreemptionCosts {
        swap_seconds_per_block: 1e-4,
        prefill_seconds_per_token: 1e-5,
    };

    #[test]
    fn the_mode_decides_when_the_swap_pool_has_room() {
        assert_eq!(
            choose_preemption(PreemptionMode::Recompute, COSTS, 4, 64, 100),
            Preemption::Recompute
        );
        assert_eq!(
            choose_preemption(PreemptionMode::Swap, COSTS, 4, 64, 100),
            Preemption::Swap
        );
    }

    #[test]
    fn a_full_swap_pool_falls_back_to_recompute() {
        assert_eq!(
            choose_preemption(PreemptionMode::Swap, COSTS, 4, 64, 3),
            Preemption::Recompute
        );
        assert_eq!(
            choose_preemption(PreemptionMode::Auto, COSTS, 4, 64, 0),
            Preemption::Recompute
        );
        assert_eq!(
            choose_preemption(PreemptionMode::Swap, COSTS, 0, 0, 10),
            Preemption::Recompute
        );
    }

    #[test]
    fn auto_swaps_only_when_copying_is_cheaper() {
        // 4 blocks cost 4e-4 s to copy; 64 tokens cost 6.4e-4 s to recompute, 16 tokens 1.6e-4 s.
        assert_eq!(
            choose_preemption(PreemptionMode::Auto, COSTS, 4, 64, 100),
            Preemption::Swap
        );
        assert_eq!(
            choose_preemption(PreemptionMode::Auto, COSTS, 4, 16, 100),
            Preemption::Recompute
        );
    }
}
