//! The scheduler as the engine holds it: the budgets, the preemption settings and the learned step-time
//! budget, and the decisions around `schedule` that need them: which victim swaps and which recomputes,
//! which waiting requests are looked up in the prefix cache or deferred, and how often each waiting
//! request was overtaken. The engine gathers the facts (views of its sequences, free blocks), asks for a
//! plan, and executes it without deciding anything itself.

use super::{
    choose_preemption, schedule, ItlBudget, PreemptionCosts, PreemptionMode, RequestId, SchedulerConfig, SeqView,
    StepPlan,
};

/// How preemption works, with what the shards measured at warmup.
#[derive(Debug, Clone, Copy)]
pub struct PreemptionConfig {
    pub mode: PreemptionMode,
    /// Host blocks of the swap pool, as Warmup reported (the unused block 0 included); 0 = no swap pool.
    pub num_host_blocks: u32,
    pub costs: PreemptionCosts,
}

/// Waiting requests matched against the prefix cache each step, from the front of the queue: matching is
/// cheap but not free, and only requests near the front can be admitted soon. The others are seen as
/// they are (no cached prefix, never deferred).
pub const LOOKUP_WINDOW: usize = 64;

pub struct Scheduler {
    pub config: SchedulerConfig,
    pub preemption: PreemptionConfig,
    /// Learns step time per token count and bounds the step's tokens, with `--target-itl-ms`.
    itl_budget: Option<ItlBudget>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, preemption: PreemptionConfig, target_itl_ms: Option<f64>) -> Self {
        Self {
            config,
            preemption,
            itl_budget: target_itl_ms.map(ItlBudget::new),
        }
    }

    pub fn has_itl_budget(&self) -> bool {
        self.itl_budget.is_some()
    }

    /// Teaches the ITL budget (if any) that a step of `num_tokens` tokens took `seconds`.
    pub fn observe_step(&mut self, num_tokens: usize, seconds: f64) {
        if let Some(budget) = &mut self.itl_budget {
            budget.observe(num_tokens, seconds);
        }
    }

    /// The most tokens a step with a single sequence may compute now.
    pub fn max_step_tokens(&self) -> usize {
        match &self.itl_budget {
            Some(budget) => budget.max_tokens(1, self.config.max_batch_tokens),
            None => self.config.max_batch_tokens,
        }
    }

    /// Plans one iteration (see `schedule`) and decides the rest: the mechanism of each victim (in
    /// `swapped_out` when its K/V go to the host swap pool, which has `num_free_host_blocks` free), the
    /// deferred waiting requests, and who was overtaken.
    pub fn plan(
        &self,
        running: &[SeqView],
        swapped: &[SeqView],
        waiting: &[SeqView],
        num_free_blocks: usize,
        num_free_host_blocks: usize,
    ) -> StepPlan {
        let mut config = self.config;
        if let Some(budget) = &self.itl_budget {
            let num_decodes = running
                .iter()
                .filter(|s| s.num_tokens - s.num_computed_tokens == 1)
                .count();
            config.max_batch_tokens = budget.max_tokens(num_decodes + 1, config.max_batch_tokens);
        }
        let mut plan = schedule(&config, running, swapped, waiting, num_free_blocks);
        plan.swapped_out = self.choose_swapped_out(&plan.preempted, running, num_free_host_blocks);
        plan.deferred = waiting.iter().filter(|w| w.is_deferred).map(|w| w.id).collect();
        // A request overtaken by later arrivals too often goes first next time (see `admission_order`).
        plan.overtaken = waiting
            .iter()
            .filter(|w| !plan.admitted.contains(&w.id))
            .filter_map(|w| {
                let num_overtakers = plan.admitted.iter().filter(|id| **id > w.id).count() as u32;
                (num_overtakers > 0).then_some((w.id, num_overtakers))
            })
            .collect();
        plan
    }

    /// The victims (in preemption order) whose K/V are swapped out rather than recomputed: each by
    /// `choose_preemption`, with the host blocks the victims before it took.
    fn choose_swapped_out(
        &self,
        preempted: &[RequestId],
        running: &[SeqView],
        num_free_host_blocks: usize,
    ) -> Vec<RequestId> {
        let mut num_free_host_blocks = num_free_host_blocks;
        let mut swapped_out = Vec::new();
        for id in preempted {
            let seq = running.iter().find(|s| s.id == *id).expect("victims run");
            // Only the blocks it holds are copied, not its null entries.
            let num_blocks = seq
                .num_computed_tokens
                .div_ceil(self.config.block_size)
                .saturating_sub(seq.num_null_blocks);
            let mode = choose_preemption(
                self.preemption.mode,
                self.preemption.costs,
                num_blocks,
                seq.num_computed_tokens,
                num_free_host_blocks,
            );
            if mode == super::Preemption::Swap {
                num_free_host_blocks -= num_blocks;
                swapped_out.push(*id);
            }
        }
        swapped_out
    }

    /// Whether a waiting request of `token_ids` in prefix-cache namespace `cache_salt`, whose cached
    /// prefix covers `num_cached_tokens`, should wait rather than be admitted: a prompt ahead of it
    /// (`ahead`: (namespace, prompt) of running sequences still computing theirs, then of the requests
    /// before it in the queue) shares more full blocks of its tokens. Those blocks enter the cache once
    /// computed, so waiting for them beats computing them a second time.
    pub fn is_deferred<'a>(
        &self,
        cache_salt: u64,
        token_ids: &[u32],
        num_cached_tokens: usize,
        ahead: impl IntoIterator<Item = (u64, &'a [u32])>,
    ) -> bool {
        let block_size = self.config.block_size;
        ahead.into_iter().any(|(other_salt, other_prompt)| {
            other_salt == cache_salt && common_full_blocks(other_prompt, token_ids, block_size) > num_cached_tokens
        })
    }
}

/// Tokens in the full blocks that two token sequences share from the start.
fn common_full_blocks(a: &[u32], b: &[u32], block_size: usize) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    (common / block_size) * block_size
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::tests::seq;
    use crate::scheduler::{BatchingMode, KvAdmission};

    fn scheduler(mode: PreemptionMode) -> Scheduler {
        let config = SchedulerConfig {
            max_batch_tokens: 16,
            max_batch_size: 8,
            block_size: 4,
            watermark_blocks: 0,
            mode: BatchingMode::Continuous,
            kv_admission: KvAdmission::Incremental,
            max_times_overtaken: 8,
            kv_window: 0,
            max_loras: 0,
            speculative_max_step_tokens: 0,
        };
        let preemption = PreemptionConfig {
            mode,
            num_host_blocks: 0,
            costs: PreemptionCosts::default(),
        };
        Scheduler::new(config, preemption, None)
    }

    #[test]
    fn victims_swap_while_the_host_pool_has_room_then_recompute() {
        // Four decodes each needing a new block, none free: the youngest in work go first, the 4-token one
        // (1 block, for the oldest), then the 8-token one (2 blocks, for the next); 2 free host blocks
        // take the first victim only, the second recomputes.
        let running = [seq(1, 17, 16, 4), seq(2, 13, 12, 3), seq(3, 9, 8, 2), seq(4, 5, 4, 1)];
        let plan = scheduler(PreemptionMode::Swap).plan(&running, &[], &[], 0, 2);
        assert_eq!(plan.preempted, vec![RequestId(4), RequestId(3)]);
        assert_eq!(plan.swapped_out, vec![RequestId(4)]);
        let plan = scheduler(PreemptionMode::Recompute).plan(&running, &[], &[], 0, 2);
        assert!(plan.swapped_out.is_empty());
    }

    #[test]
    fn deferral_and_overtaking_are_in_the_plan() {
        let s = scheduler(PreemptionMode::Recompute);
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let ahead: [(u64, &[u32]); 1] = [(0, &prompt[..8])];
        assert!(
            s.is_deferred(0, &prompt, 0, ahead),
            "two full blocks ahead, none cached"
        );
        assert!(!s.is_deferred(0, &prompt, 8, ahead), "both already cached");
        assert!(!s.is_deferred(7, &prompt, 0, ahead), "another cache namespace");
        let mut deferred = seq(1, 9, 0, 0);
        deferred.is_deferred = true;
        let mut low = seq(2, 4, 0, 0);
        low.priority = 1;
        let waiting = [deferred, low, seq(3, 4, 0, 0)];
        let plan = s.plan(&[], &[], &waiting, 100, 0);
        assert_eq!(plan.admitted, vec![RequestId(3), RequestId(2)]);
        assert_eq!(plan.deferred, vec![RequestId(1)]);
        assert_eq!(plan.overtaken, vec![(RequestId(1), 2)], "1 waits while 2 and 3 pass it");
    }
}
