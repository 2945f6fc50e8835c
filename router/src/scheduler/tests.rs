//! Policy tests: hand-made cases, then a seeded simulation of thousands of steps that executes plans the
//! way the engine loop does and checks budgets, block accounting, FCFS order and that everything finishes.

use super::*;
use crate::kv::BlockAllocator;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn config(max_batch_tokens: usize, max_batch_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_tokens,
        max_batch_size,
        block_size: 4,
        watermark_blocks: 1,
        mode: BatchingMode::Continuous,
        kv_admission: KvAdmission::Incremental,
        max_times_overtaken: 8,
        kv_window: 0,
        max_loras: 0,
        speculative_max_step_tokens: 0,
    }
}

pub(super) fn seq(id: u64, num_tokens: usize, num_computed_tokens: usize, num_blocks: usize) -> SeqView {
    SeqView {
        id: RequestId(id),
        num_tokens,
        num_computed_tokens,
        num_blocks,
        num_null_blocks: 0,
        num_freeable_blocks: num_blocks,
        priority: 0,
        num_times_overtaken: 0,
        waited_ms: 0,
        num_cached_evictable: 0,
        is_deferred: false,
        max_num_tokens: num_tokens,
        adapter_id: 0,
        num_proposed_tokens: 0,
    }
}

fn with_priority(mut view: SeqView, priority: i32) -> SeqView {
    view.priority = priority;
    view
}

#[test]
fn decodes_first_then_prompt_chunks_fill_the_budget() {
    let running = [seq(1, 9, 8, 2), seq(2, 5, 4, 1)];
    let waiting = [seq(3, 100, 0, 0)];
    let plan = schedule(&config(16, 8), &running, &[], &waiting, 100);
    assert_eq!(
        plan.scheduled[0],
        Scheduled {
            id: RequestId(1),
            num_scheduled_tokens: 1,
            num_speculative_tokens: 0,
            num_new_blocks: 1
        }
    );
    assert_eq!(
        plan.scheduled[1],
        Scheduled {
            id: RequestId(2),
            num_scheduled_tokens: 1,
            num_speculative_tokens: 0,
            num_new_blocks: 1
        }
    );
    assert_eq!(
        plan.scheduled[2],
        Scheduled {
            id: RequestId(3),
            num_scheduled_tokens: 14,
            num_speculative_tokens: 0,
            num_new_blocks: 4
        }
    );
    assert_eq!(plan.admitted, vec![RequestId(3)]);
    assert!(!plan.is_decode_only());
}

#[test]
fn a_long_prompt_continues_in_chunks_next_to_decodes() {
    let running = [seq(1, 100, 14, 4), seq(2, 5, 4, 1)];
    let plan = schedule(&config(16, 8), &running, &[], &[], 100);
    // The younger decode is served before the older prompt's chunk, which gets the rest of the budget.
    assert_eq!(plan.scheduled[0].id, RequestId(2));
    assert_eq!(plan.scheduled[0].num_scheduled_tokens, 1);
    assert_eq!(plan.scheduled[1].id, RequestId(1));
    assert_eq!(plan.scheduled[1].num_scheduled_tokens, 15);
    assert_eq!(plan.num_scheduled_tokens(), 16);
}

#[test]
fn admission_keeps_the_watermark_and_the_queue_order() {
    // Request 1 needs 3 blocks; with 3 free and a watermark of 1 it must wait, and request 2 behind it too.
    let waiting = [seq(1, 12, 0, 0), seq(2, 1, 0, 0)];
    let plan = schedule(&config(64, 8), &[], &[], &waiting, 3);
    assert!(plan.scheduled.is_empty());
    let plan = schedule(&config(64, 8), &[], &[], &waiting, 4);
    assert_eq!(plan.admitted, vec![RequestId(1)]);
}

#[test]
fn preempts_the_newest_when_a_decode_needs_a_block() {
    let running = [seq(1, 9, 8, 2), seq(2, 9, 8, 2), seq(3, 9, 8, 2)];
    let plan = schedule(&config(64, 8), &running, &[], &[seq(4, 1, 0, 0)], 0);
    assert_eq!(plan.preempted, vec![RequestId(3)]);
    let ids: Vec<_> = plan.scheduled.iter().map(|s| s.id).collect();
    assert_eq!(ids, vec![RequestId(1), RequestId(2)]);
    assert!(plan.admitted.is_empty(), "no admission in a step that preempts");
}

#[test]
fn the_newest_needy_sequence_preempts_itself() {
    let running = [seq(1, 9, 8, 2)];
    let plan = schedule(&config(64, 8), &running, &[], &[], 0);
    assert_eq!(plan.preempted, vec![RequestId(1)]);
    assert!(plan.scheduled.is_empty());
}

#[test]
fn batch_size_limits_the_forward() {
    let waiting: Vec<_> = (0..10).map(|i| seq(i, 3, 0, 0)).collect();
    let plan = schedule(&config(1000, 4), &[], &[], &waiting, 1000);
    assert_eq!(plan.scheduled.len(), 4);
}

/// A request in the simulation: its final length and what the engine would track.
struct SimSeq {
    view: SeqView,
    num_final_tokens: usize,
    blocks: Vec<u32>,
}

#[test]
fn random_workloads_finish_within_budgets_and_keep_blocks_whole() {
    let mut rng = StdRng::seed_from_u64(2024);
    for _ in 0..20 {
        let cfg = SchedulerConfig {
            max_batch_tokens: rng.random_range(8..64),
            max_batch_size: rng.random_range(1..12),
            block_size: rng.random_range(1..6),
            watermark_blocks: rng.random_range(0..3),
            mode: BatchingMode::Continuous,
            kv_admission: if rng.random_bool(0.3) {
                KvAdmission::Reserve
            } else {
                KvAdmission::Incremental
            },
            max_times_overtaken: 4,
            kv_window: 0,
            max_loras: rng.random_range(0..3),
            speculative_max_step_tokens: rng.random_range(0..12),
        };
        let num_requests = rng.random_range(1..40);
        // Every request must fit the pool alone, as validation guarantees.
        let max_len: usize = 40;
        let num_blocks = (max_len.div_ceil(cfg.block_size) + cfg.watermark_blocks + rng.random_range(0..30)) as u32 + 1;
        let mut allocator = BlockAllocator::new(num_blocks);
        let mut waiting: std::collections::VecDeque<SimSeq> = std::collections::VecDeque::new();
        let mut running: Vec<SimSeq> = Vec::new();
        // Victims swapped out: they keep their computed tokens but hold no (device) blocks.
        let mut swapped: std::collections::VecDeque<SimSeq> = std::collections::VecDeque::new();
        let mut next_arrival = 0u64;
        let mut admission_order = Vec::new();
        let mut num_finished = 0;
        let mut num_steps = 0;
        while num_finished < num_requests {
            num_steps += 1;
            assert!(num_steps < 100_000, "the workload does not finish");
            if (next_arrival as usize) < num_requests && rng.random_bool(0.3) {
                let prompt = rng.random_range(1..20);
                let num_final_tokens = prompt + rng.random_range(1..=(max_len - prompt));
                let mut view = with_priority(seq(next_arrival, prompt, 0, 0), rng.random_range(0..3));
                view.max_num_tokens = num_final_tokens;
                if cfg.max_loras > 0 {
                    view.adapter_id = rng.random_range(0..5);
                }
                waiting.push_back(SimSeq {
                    view,
                    num_final_tokens,
                    blocks: Vec::new(),
                });
                next_arrival += 1;
            }
            for s in running.iter_mut() {
                // Speculative decoding: a decoding sequence may have proposals (never past its end).
                let is_decoding = s.view.num_tokens - s.view.num_computed_tokens == 1;
                let num_left = s.num_final_tokens - s.view.num_tokens;
                s.view.num_proposed_tokens = if is_decoding { rng.random_range(0..=num_left.min(4)) } else { 0 };
            }
            let running_views: Vec<_> = running.iter().map(|s| s.view).collect();
            let waiting_views: Vec<_> = waiting.iter().map(|s| s.view).collect();
            let swapped_views: Vec<_> = swapped.iter().map(|s| s.view).collect();
            let plan = schedule(
                &cfg,
                &running_views,
                &swapped_views,
                &waiting_views,
                allocator.num_free_blocks() as usize,
            );

            assert!(plan.num_scheduled_tokens() <= cfg.max_batch_tokens);
            let num_decodes = running_views
                .iter()
                .filter(|v| v.num_tokens - v.num_computed_tokens == 1)
                .count();
            let num_proposals: usize = plan.scheduled.iter().map(|s| s.num_speculative_tokens).sum();
            assert!(num_proposals <= cfg.speculative_max_step_tokens.saturating_sub(num_decodes));
            assert!(plan.scheduled.len() <= cfg.max_batch_size);
            if cfg.kv_admission == KvAdmission::Reserve {
                assert!(plan.preempted.is_empty(), "reserve admission never preempts");
            }
            for resumed in &plan.resumed {
                let i = swapped
                    .iter()
                    .position(|s| s.view.id == *resumed)
                    .expect("resumed from swapped");
                running.push(swapped.remove(i).expect("in range"));
            }
            for admitted in &plan.admitted {
                let i = waiting
                    .iter()
                    .position(|s| s.view.id == *admitted)
                    .expect("admitted from waiting");
                let seq = waiting.remove(i).expect("in range");
                if !admission_order.contains(admitted) {
                    admission_order.push(*admitted);
                }
                running.push(seq);
            }
            // The engine's bookkeeping: a waiting request is overtaken by each later arrival admitted.
            for w in waiting.iter_mut() {
                let overtakers = plan.admitted.iter().filter(|a| **a > w.view.id).count() as u32;
                w.view.num_times_overtaken += overtakers;
                // A request waiting for an adapter slot is passed over until one frees (base requests
                // still overtake it); that it finishes at all is checked at the end.
                assert!(
                    w.view.adapter_id != 0
                        || w.view.num_times_overtaken <= cfg.max_times_overtaken + cfg.max_batch_size as u32,
                    "request {} starves: overtaken {} times",
                    w.view.id,
                    w.view.num_times_overtaken
                );
            }
            for victim in plan.preempted.iter().rev() {
                let i = running.iter().position(|s| s.view.id == *victim).expect("victim runs");
                let mut s = running.remove(i);
                allocator.free(&s.blocks).expect("victim blocks are owned");
                s.blocks.clear();
                s.view.num_blocks = 0;
                s.view.num_freeable_blocks = 0;
                if s.view.num_computed_tokens > 0 && rng.random_bool(0.5) {
                    swapped.push_back(s);
                } else {
                    s.view.num_computed_tokens = 0;
                    waiting.push_front(s);
                }
            }
            for step in &plan.scheduled {
                let s = running
                    .iter_mut()
                    .find(|s| s.view.id == step.id)
                    .expect("scheduled runs");
                let new = allocator
                    .allocate(step.num_new_blocks as u32)
                    .expect("plan fits the free blocks");
                s.blocks.extend(new);
                s.view.num_blocks = s.blocks.len();
                s.view.num_freeable_blocks = s.blocks.len();
                assert!(step.num_speculative_tokens <= s.view.num_proposed_tokens);
                assert!(step.num_speculative_tokens == 0 || step.num_scheduled_tokens == step.num_speculative_tokens + 1);
                assert!(
                    s.view.num_computed_tokens + step.num_scheduled_tokens <= s.blocks.len() * cfg.block_size,
                    "the proposals have their blocks"
                );
                let num_real_tokens = step.num_scheduled_tokens - step.num_speculative_tokens;
                s.view.num_computed_tokens += num_real_tokens;
                assert!(s.view.num_computed_tokens <= s.view.num_tokens);
                if s.view.num_computed_tokens == s.view.num_tokens {
                    // Some proposals are accepted (they were computed), then the sampled token.
                    let num_accepted = rng.random_range(0..=step.num_speculative_tokens);
                    s.view.num_computed_tokens += num_accepted;
                    s.view.num_tokens += num_accepted + 1;
                    // The blocks of rejected proposals go back, as the engine does.
                    let num_kept = s.view.num_computed_tokens.div_ceil(cfg.block_size);
                    allocator.free(&s.blocks.split_off(num_kept)).expect("rejected blocks are owned");
                    s.view.num_blocks = s.blocks.len();
                    s.view.num_freeable_blocks = s.blocks.len();
                }
            }
            running.retain(|s| {
                let done = s.view.num_tokens == s.num_final_tokens;
                if done {
                    allocator.free(&s.blocks).expect("finished blocks are owned");
                    num_finished += 1;
                }
                !done
            });
            allocator.check_invariants();
            let mut adapters: Vec<u32> = running.iter().map(|s| s.view.adapter_id).filter(|&a| a != 0).collect();
            adapters.sort_unstable();
            adapters.dedup();
            assert!(adapters.len() <= cfg.max_loras, "running adapters {adapters:?}");
            let num_held: usize = running.iter().map(|s| s.blocks.len()).sum();
            assert_eq!(
                num_held as u32,
                (allocator.num_usable_blocks() - allocator.num_free_blocks())
            );
        }
        assert_eq!((allocator.num_usable_blocks() - allocator.num_free_blocks()), 0);
        assert_eq!(admission_order.len(), num_requests);
    }
}

#[test]
fn lower_priority_numbers_run_first_fcfs_within_a_level() {
    let waiting = [
        with_priority(seq(1, 4, 0, 0), 2),
        with_priority(seq(2, 4, 0, 0), 0),
        with_priority(seq(3, 4, 0, 0), 0),
    ];
    let plan = schedule(&config(8, 8), &[], &[], &waiting, 100);
    assert_eq!(plan.admitted, vec![RequestId(2), RequestId(3)]);
}

#[test]
fn a_request_overtaken_too_often_goes_first() {
    let mut starving = with_priority(seq(1, 4, 0, 0), 5);
    starving.num_times_overtaken = 8;
    let waiting = [starving, seq(2, 4, 0, 0)];
    let plan = schedule(&config(4, 8), &[], &[], &waiting, 100);
    assert_eq!(plan.admitted, vec![RequestId(1)]);
}

#[test]
fn the_lowest_priority_is_preempted_first() {
    let running = [
        with_priority(seq(1, 9, 8, 2), 0),
        with_priority(seq(2, 9, 8, 2), 3),
        seq(3, 9, 8, 2),
    ];
    let plan = schedule(&config(64, 8), &running, &[], &[], 0);
    assert_eq!(plan.preempted, vec![RequestId(2)]);
}

#[test]
fn static_batches_wait_to_fill_and_admit_nothing_while_running() {
    let mut cfg = config(64, 3);
    cfg.mode = BatchingMode::Static { max_wait_ms: 100 };
    let waiting = [seq(1, 2, 0, 0), seq(2, 2, 0, 0)];
    assert!(
        schedule(&cfg, &[], &[], &waiting, 100).admitted.is_empty(),
        "not full and nobody waited long"
    );
    let mut old = waiting;
    old[0].waited_ms = 150;
    assert_eq!(
        schedule(&cfg, &[], &[], &old, 100).admitted.len(),
        2,
        "the timeout starts a partial batch"
    );
    let full = [seq(1, 2, 0, 0), seq(2, 2, 0, 0), seq(3, 2, 0, 0)];
    assert_eq!(schedule(&cfg, &[], &[], &full, 100).admitted.len(), 3);
    let running = [seq(9, 5, 4, 1)];
    let plan = schedule(&cfg, &running, &[], &full, 100);
    assert!(plan.admitted.is_empty(), "nothing joins a running static batch");
    assert_eq!(plan.scheduled.len(), 1);
}

#[test]
fn cached_prefixes_go_first_within_a_priority_level() {
    // Request 2 would start from 8 cached tokens; it is admitted before request 1, which fits no more.
    let waiting = [seq(1, 12, 0, 0), seq(2, 12, 8, 2)];
    let plan = schedule(&config(64, 8), &[], &[], &waiting, 3);
    assert_eq!(plan.admitted, vec![RequestId(2)]);
    assert_eq!(plan.scheduled[0].num_scheduled_tokens, 4);
    assert_eq!(plan.scheduled[0].num_new_blocks, 1);
}

#[test]
fn deferred_requests_are_skipped_not_blocking() {
    let mut deferred = seq(1, 12, 0, 0);
    deferred.is_deferred = true;
    let plan = schedule(&config(64, 8), &[], &[], &[deferred, seq(2, 4, 0, 0)], 100);
    assert_eq!(plan.admitted, vec![RequestId(2)]);
}

#[test]
fn claiming_evictable_cached_blocks_counts_against_free_blocks() {
    let mut hit = seq(1, 12, 8, 2);
    hit.num_cached_evictable = 2;
    // 1 new block + 2 claimed + watermark 1 = 4 > 3 available.
    assert!(schedule(&config(64, 8), &[], &[], &[hit], 3).admitted.is_empty());
    assert_eq!(
        schedule(&config(64, 8), &[], &[], &[hit], 4).admitted,
        vec![RequestId(1)]
    );
}

#[test]
fn swapped_sequences_resume_before_new_admissions() {
    // Swapped 7 has 9 tokens, 8 computed: it needs 3 blocks (9 tokens) back; 1 block is the watermark.
    let swapped = [seq(7, 9, 8, 0), seq(8, 5, 4, 0)];
    let waiting = [seq(9, 4, 0, 0)];
    let plan = schedule(&config(64, 8), &[], &swapped, &waiting, 4);
    assert_eq!(plan.resumed, vec![RequestId(7)]);
    assert_eq!(
        plan.scheduled,
        vec![Scheduled {
            id: RequestId(7),
            num_scheduled_tokens: 1,
            num_speculative_tokens: 0,
            num_new_blocks: 3
        }]
    );
    assert!(
        plan.admitted.is_empty(),
        "nothing overtakes a swapped sequence that waits for room"
    );
    let plan = schedule(&config(64, 8), &[], &swapped, &waiting, 100);
    assert_eq!(plan.resumed, vec![RequestId(7), RequestId(8)]);
    assert_eq!(plan.admitted, vec![RequestId(9)]);
    // A step that preempts resumes nothing.
    let running = [seq(1, 5, 4, 1), seq(2, 5, 4, 1)];
    let plan = schedule(&config(64, 8), &running, &swapped, &[], 1);
    assert_eq!(plan.preempted, vec![RequestId(2)]);
    assert!(plan.resumed.is_empty());
}

#[test]
fn reserve_admission_claims_max_new_tokens_and_counts_running_growth() {
    let mut cfg = config(64, 8);
    cfg.kv_admission = KvAdmission::Reserve;
    let mut request = seq(1, 4, 0, 0);
    request.max_num_tokens = 4 + 12; // 4 blocks of 4
    assert!(schedule(&cfg, &[], &[], &[request], 3).admitted.is_empty());
    assert_eq!(schedule(&cfg, &[], &[], &[request], 4).admitted, vec![RequestId(1)]);
    // A running sequence holding 1 block may grow to 3: 2 more blocks are not free to admit with.
    let mut running = seq(2, 3, 2, 1);
    running.max_num_tokens = 12;
    assert!(schedule(&cfg, &[running], &[], &[request], 5).admitted.is_empty());
    assert_eq!(
        schedule(&cfg, &[running], &[], &[request], 6).admitted,
        vec![RequestId(1)]
    );
}

#[test]
fn a_windowed_sequence_counts_only_its_live_blocks() {
    let mut cfg = config(16, 8);
    cfg.kv_window = 8;
    // Next query at 13 reads 6..=13: block 0 (positions 0..3) is dead, block 1 (4..7) is not.
    assert_eq!(cfg.num_dead_blocks(13), 1);
    assert_eq!(cfg.num_dead_blocks(6), 0);
    assert_eq!(config(16, 8).num_dead_blocks(1000), 0, "no window, nothing dies");
    // A swapped sequence at 40 computed tokens whose 8 first entries are null resumes into 3 new blocks
    // (its table grows to 11 entries for the token at position 40), not 11.
    let mut swapped = seq(1, 41, 40, 8);
    swapped.num_null_blocks = 8;
    swapped.num_freeable_blocks = 0;
    let plan = schedule(&cfg, &[], &[swapped], &[], 4);
    assert_eq!(plan.resumed, vec![RequestId(1)]);
    assert_eq!(plan.scheduled[0].num_new_blocks, 3);
    // Reserve admission reserves the window's blocks, not max_num_tokens' worth.
    cfg.kv_admission = KvAdmission::Reserve;
    let mut long = seq(2, 4, 0, 0);
    long.max_num_tokens = 400;
    let plan = schedule(&cfg, &[], &[], &[long], 4);
    assert_eq!(plan.admitted, vec![RequestId(2)], "3 blocks of window reserved");
}

#[test]
fn a_windowed_victim_swaps_only_its_live_blocks() {
    use super::{PreemptionConfig, Scheduler};
    let mut cfg = config(16, 8);
    cfg.kv_window = 8;
    cfg.watermark_blocks = 0;
    let preemption = PreemptionConfig {
        mode: PreemptionMode::Swap,
        num_host_blocks: 0,
        costs: PreemptionCosts::default(),
    };
    let scheduler = Scheduler::new(cfg, preemption, None);
    // Two decodes at 40 tokens, both needing a new block; none free. The victim holds 3 of its 10
    // entries, so 3 free host blocks are enough to swap it.
    let mut a = seq(1, 41, 40, 10);
    a.num_null_blocks = 7;
    a.num_freeable_blocks = 3;
    let mut b = a;
    b.id = RequestId(2);
    let plan = scheduler.plan(&[a, b], &[], &[], 0, 3);
    assert_eq!(plan.preempted, vec![RequestId(2)]);
    assert_eq!(plan.swapped_out, vec![RequestId(2)]);
}

fn with_adapter(mut view: SeqView, adapter_id: u32) -> SeqView {
    view.adapter_id = adapter_id;
    view
}

#[test]
fn a_request_over_the_adapter_bound_waits_and_later_ones_pass_it() {
    let mut cfg = config(64, 8);
    cfg.max_loras = 2;
    let running = [with_adapter(seq(1, 5, 4, 1), 1), with_adapter(seq(2, 5, 4, 1), 2)];
    let waiting = [
        with_adapter(seq(3, 4, 0, 0), 3),
        seq(4, 4, 0, 0),
        with_adapter(seq(5, 4, 0, 0), 1),
        with_adapter(seq(6, 4, 0, 0), 4),
    ];
    let plan = schedule(&cfg, &running, &[], &waiting, 100);
    assert_eq!(
        plan.admitted,
        vec![RequestId(4), RequestId(5)],
        "3 and 6 need a third slot; the base request and adapter 1's are admitted"
    );
    // Once adapter 2's sequence has ended, a slot is free: 3 (the oldest) takes it, and 6 waits.
    let plan = schedule(&cfg, &running[..1], &[], &waiting, 100);
    assert_eq!(plan.admitted, vec![RequestId(3), RequestId(4), RequestId(5)]);
    // LoRA off: every sequence runs the base model.
    let plan = schedule(&config(64, 8), &[], &[], &[seq(7, 4, 0, 0)], 100);
    assert_eq!(plan.admitted, vec![RequestId(7)]);
}

#[test]
fn a_starving_request_over_the_adapter_bound_lets_only_base_requests_pass() {
    let mut cfg = config(64, 8);
    cfg.max_loras = 1;
    let running = [with_adapter(seq(1, 5, 4, 1), 1)];
    let mut starving = with_adapter(seq(2, 4, 0, 0), 2);
    starving.num_times_overtaken = cfg.max_times_overtaken;
    let waiting = [starving, with_adapter(seq(3, 4, 0, 0), 1), seq(4, 4, 0, 0)];
    let plan = schedule(&cfg, &running, &[], &waiting, 100);
    assert_eq!(
        plan.admitted,
        vec![RequestId(4)],
        "adapter 1 gets no new request, so that its slot frees for 2"
    );
}

#[test]
fn a_swapped_sequence_resumes_only_within_the_adapter_bound() {
    let mut cfg = config(64, 8);
    cfg.max_loras = 1;
    let running = [with_adapter(seq(1, 5, 4, 1), 1)];
    let swapped = [with_adapter(seq(2, 9, 8, 0), 2), with_adapter(seq(3, 9, 8, 0), 1)];
    let waiting = [with_adapter(seq(4, 4, 0, 0), 1), seq(5, 4, 0, 0)];
    let plan = schedule(&cfg, &running, &swapped, &waiting, 100);
    assert_eq!(plan.resumed, vec![RequestId(3)], "2 waits for adapter 1 to end");
    assert_eq!(plan.admitted, vec![RequestId(5)], "only base requests join meanwhile");
}

fn with_proposals(mut view: SeqView, num_proposed_tokens: usize) -> SeqView {
    view.num_proposed_tokens = num_proposed_tokens;
    view
}

#[test]
fn proposals_ride_along_within_the_speculative_step_budget_oldest_first() {
    let mut cfg = config(64, 8);
    cfg.speculative_max_step_tokens = 8;
    // Three decodes (8 - 3 = 5 proposal tokens left), then a prompt mid-prefill.
    let running = [
        with_proposals(seq(1, 9, 8, 3), 4),
        with_proposals(seq(2, 9, 8, 3), 4),
        with_proposals(seq(3, 9, 8, 3), 4),
        seq(4, 30, 4, 1),
    ];
    let plan = schedule(&cfg, &running, &[], &[], 100);
    let spec: Vec<_> = plan
        .scheduled
        .iter()
        .map(|s| (s.id.0, s.num_scheduled_tokens, s.num_speculative_tokens))
        .collect();
    assert_eq!(spec, [(1, 5, 4), (2, 2, 1), (3, 1, 0), (4, 26, 0)]);
    // The proposals count in the token budget: the prompt chunk took what was left.
    assert_eq!(plan.num_scheduled_tokens(), 34);
    assert!(!plan.is_decode_only());
}

#[test]
fn proposals_never_preempt_nor_exceed_the_token_budget() {
    let mut cfg = config(3, 8);
    cfg.speculative_max_step_tokens = 64;
    // Block size 4: sequence 1 holds 2 blocks (8 positions) and computes position 8, so it needs a new
    // block; there is one free block, enough for positions 8..12: 3 proposals fit, the budget allows 2.
    let running = [with_proposals(seq(1, 9, 8, 2), 4)];
    let plan = schedule(&cfg, &running, &[], &[], 1);
    assert_eq!(plan.scheduled[0].num_speculative_tokens, 2);
    assert!(plan.preempted.is_empty());
    // Without a free block for the proposals (it computes position 11, the last of its third block), none.
    let running = [with_proposals(seq(1, 12, 11, 3), 4)];
    let plan = schedule(&config_with_spec(64), &running, &[], &[], 0);
    assert!(plan.preempted.is_empty());
    assert_eq!(plan.scheduled[0].num_speculative_tokens, 0);
    // Off: no proposal is ever scheduled.
    let running = [with_proposals(seq(1, 9, 8, 3), 4)];
    assert_eq!(schedule(&config(64, 8), &running, &[], &[], 100).scheduled[0].num_speculative_tokens, 0);
}

fn config_with_spec(speculative_max_step_tokens: usize) -> SchedulerConfig {
    let mut cfg = config(64, 8);
    cfg.speculative_max_step_tokens = speculative_max_step_tokens;
    cfg
}
