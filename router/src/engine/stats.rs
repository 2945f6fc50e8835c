//! What the engine publishes about its state, after every step and whenever it goes idle, on a `watch`
//! channel: `/info` and `/ready` read the latest value without reaching into the engine task (the
//! Prometheus gauges are set from the same value, `EngineCore::publish_stats`).

use std::time::{Duration, Instant};

/// The engine's state as of its latest step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineStats {
    /// Device KV blocks sequences can use (the null block 0 excluded).
    pub num_usable_blocks: u32,
    /// Device blocks on the free list.
    pub num_free_blocks: u32,
    /// Device blocks in the prefix cache that no sequence holds: evicted when an allocation needs them.
    pub num_cached_idle_blocks: u32,
    /// Device blocks in the prefix cache, held or not.
    pub num_prefix_cache_blocks: u32,
    /// Session pins in force.
    pub num_pins: u32,
    /// Cached blocks session pins keep from eviction (part of the cached idle ones unless held).
    pub num_pinned_blocks: u32,
    /// The most blocks session pins may keep (`--max-pinned-kv-fraction` of the pool; 0: pins are off).
    pub max_pinned_blocks: u32,
    /// Requests waiting for admission.
    pub num_waiting: usize,
    /// Sequences admitted and holding device blocks.
    pub num_running: usize,
    /// Sequences preempted into the host swap pool.
    pub num_swapped: usize,
    /// Host swap-pool blocks sequences can use (its block 0 excluded).
    pub num_usable_host_blocks: u32,
    /// Host swap-pool blocks free.
    pub num_free_host_blocks: u32,
    /// With a draft model (`--speculative draft`): its KV pool's usable blocks, and those free. 0 without.
    pub num_usable_draft_blocks: u32,
    pub num_free_draft_blocks: u32,
    /// Prompt tokens the shards computed since the engine started (prefix-cache hits are not computed).
    pub num_prompt_tokens_computed: u64,
    /// Blocks released because the sliding window had left them, since the engine started.
    pub num_window_released_blocks: u64,
    /// When a forward pass last succeeded, or when the engine started if none has yet.
    pub last_progress: Instant,
}

impl EngineStats {
    /// Whether requests wait or run.
    pub fn has_work(&self) -> bool {
        self.num_waiting + self.num_running > 0
    }

    /// Time since the last successful forward pass (or since the engine started).
    pub fn since_progress(&self) -> Duration {
        self.last_progress.elapsed()
    }

    /// Device blocks held by sequences.
    pub fn num_used_blocks(&self) -> u32 {
        self.num_usable_blocks - self.num_free_blocks - self.num_cached_idle_blocks
    }

    /// Share (0 to 1) of the usable device blocks that sequences hold; 0 before the pool is known. Idle
    /// cached blocks are not counted, as vLLM counts them not: an allocation evicts them, so this is how
    /// full the pool is for new work (gateways balance by it).
    pub fn kv_cache_usage(&self) -> f64 {
        if self.num_usable_blocks == 0 {
            return 0.0;
        }
        f64::from(self.num_used_blocks()) / f64::from(self.num_usable_blocks)
    }
}

/// The stats of an engine starting now, before it looked at its pools.
impl Default for EngineStats {
    fn default() -> Self {
        Self {
            num_usable_blocks: 0,
            num_free_blocks: 0,
            num_cached_idle_blocks: 0,
            num_prefix_cache_blocks: 0,
            num_pins: 0,
            num_pinned_blocks: 0,
            max_pinned_blocks: 0,
            num_waiting: 0,
            num_running: 0,
            num_swapped: 0,
            num_usable_host_blocks: 0,
            num_free_host_blocks: 0,
            num_usable_draft_blocks: 0,
            num_free_draft_blocks: 0,
            num_prompt_tokens_computed: 0,
            num_window_released_blocks: 0,
            last_progress: Instant::now(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_is_waiting_or_running_requests() {
        let mut stats = EngineStats::default();
        assert!(!stats.has_work());
        stats.num_swapped = 1;
        assert!(
            !stats.has_work(),
            "a swapped sequence waits for a running one to finish"
        );
        stats.num_waiting = 1;
        assert!(stats.has_work());
        stats.num_waiting = 0;
        stats.num_running = 1;
        assert!(stats.has_work());
    }

    #[test]
    fn used_blocks_are_neither_free_nor_idle_in_the_cache() {
        let stats = EngineStats {
            num_usable_blocks: 63,
            num_free_blocks: 40,
            num_cached_idle_blocks: 3,
            ..EngineStats::default()
        };
        assert_eq!(stats.num_used_blocks(), 20);
        assert_eq!(stats.kv_cache_usage(), 20.0 / 63.0);
        assert_eq!(EngineStats::default().kv_cache_usage(), 0.0, "no pool yet");
    }
}
