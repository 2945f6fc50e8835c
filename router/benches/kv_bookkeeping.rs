//! The router's per-step KV bookkeeping with the prefix cache on and off, at a 0% hit rate and at GPU
//! scale: what the cache costs the engine loop when it never helps.
//!
//!     cargo bench --bench kv_bookkeeping
//!
//! A pool of 65,536 blocks of 16 tokens (about 1M tokens of KV, an 8B model on one 141 GB GPU) serves 256
//! running sequences with random 1,024-token prompts that each generate 256 tokens; a finished sequence
//! is replaced by a new one. Every step does what the engine does around a forward: each running
//! sequence's freeable blocks (for preemption planning), the available blocks (for the plan and the
//! gauges), a prefix match for each newcomer, one token for every sequence (a new block every 16 tokens),
//! caching computed prompts and finished sequences, and releasing finished ones. With the cache on, the
//! pool fills with cached blocks within the warmup steps and every later allocation evicts.

use std::time::{Duration, Instant};

use rand::{rngs::StdRng, Rng, SeedableRng};
use rill_router::kv::{CacheActivity, KvPool};

const NUM_BLOCKS: u32 = 65_536;
const BLOCK_SIZE: usize = 16;
const NUM_RUNNING: usize = 256;
const PROMPT_TOKENS: usize = 1_024;
const OUTPUT_TOKENS: usize = 256;
const WARMUP_STEPS: usize = 2_000;
const MEASURED_STEPS: usize = 2_000;

struct Sequence {
    tokens: Vec<u32>,
    blocks: Vec<u32>,
}

struct Engine {
    pool: KvPool,
    rng: StdRng,
    running: Vec<Sequence>,
    activity: CacheActivity,
}

impl Engine {
    fn new(prefix_caching: bool) -> Self {
        let mut engine = Self {
            pool: KvPool::new(NUM_BLOCKS, BLOCK_SIZE, prefix_caching),
            rng: StdRng::seed_from_u64(7),
            running: Vec::new(),
            activity: CacheActivity::default(),
        };
        // Staggered starts, so that about one sequence finishes a step.
        for i in 0..NUM_RUNNING {
            engine.admit();
            for _ in 0..i * OUTPUT_TOKENS / NUM_RUNNING {
                engine.append(i);
            }
        }
        engine
    }

    /// A new random prompt: matched against the cache (never a hit), allocated, prefilled and cached.
    fn admit(&mut self) {
        let tokens: Vec<u32> = (0..PROMPT_TOKENS).map(|_| self.rng.random_range(0..50_000)).collect();
        let hit = self.pool.match_prefix(0, &tokens, tokens.len() - 1);
        assert_eq!(hit.num_tokens, 0, "random prompts never hit");
        let blocks = self
            .pool
            .allocate(PROMPT_TOKENS.div_ceil(BLOCK_SIZE), &mut self.activity)
            .expect("the pool fits every running sequence");
        self.pool.cache(0, &tokens, &blocks, &mut self.activity);
        self.running.push(Sequence { tokens, blocks });
    }

    /// Sequence `i` generates a token, in a new block when its last one is full.
    fn append(&mut self, i: usize) {
        if self.running[i].tokens.len().is_multiple_of(BLOCK_SIZE) {
            let block = self
                .pool
                .allocate(1, &mut self.activity)
                .expect("room for one more block");
            self.running[i].blocks.extend(block);
        }
        let token = self.rng.random_range(0..50_000);
        self.running[i].tokens.push(token);
    }

    /// One engine step's KV work; returns a value so nothing is optimized away.
    fn step(&mut self) -> usize {
        let mut sink: usize = self.running.iter().map(|seq| self.pool.num_freeable(&seq.blocks)).sum();
        sink += self.pool.num_available_blocks();
        for i in 0..self.running.len() {
            self.append(i);
        }
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].tokens.len() < PROMPT_TOKENS + OUTPUT_TOKENS {
                i += 1;
                continue;
            }
            let seq = self.running.swap_remove(i);
            self.pool.cache(0, &seq.tokens, &seq.blocks, &mut self.activity);
            self.pool.release(&seq.blocks);
            self.admit();
        }
        sink + self.pool.num_available_blocks()
    }
}

fn measure(prefix_caching: bool) -> (Duration, Engine) {
    let mut engine = Engine::new(prefix_caching);
    let mut sink = 0;
    for _ in 0..WARMUP_STEPS {
        sink += engine.step();
    }
    let started = Instant::now();
    for _ in 0..MEASURED_STEPS {
        sink += engine.step();
    }
    let elapsed = started.elapsed();
    assert!(sink > 0);
    engine.pool.check_invariants();
    (elapsed / MEASURED_STEPS as u32, engine)
}

fn main() {
    println!(
        "{NUM_RUNNING} running sequences, {PROMPT_TOKENS}-token random prompts, {OUTPUT_TOKENS} output tokens, \
         {NUM_BLOCKS} blocks of {BLOCK_SIZE}; {MEASURED_STEPS} steps measured after {WARMUP_STEPS}"
    );
    let (off, _) = measure(false);
    let (on, engine) = measure(true);
    println!("cache off: {:>8.1} us a step", off.as_secs_f64() * 1e6);
    println!(
        "cache on:  {:>8.1} us a step ({} blocks cached, {} evicted so far)",
        on.as_secs_f64() * 1e6,
        engine.pool.num_cached_blocks(),
        engine.activity.num_evicted_blocks
    );
    let extra = on.saturating_sub(off).as_secs_f64();
    println!(
        "on/off {:.2}x; the cache adds {:.1} us a step: {:.3}% of a 20 ms decode step",
        on.as_secs_f64() / off.as_secs_f64(),
        extra * 1e6,
        extra / 0.020 * 100.0
    );
}
