//! Where sequences leave other than by finishing: cancelled by their client (gone, or too slow a reader),
//! expired (in the queue, or past their deadline), or failed with the shards; and the one release path
//! every leaving sequence takes, which returns its blocks (device and host) and tells the shards to drop
//! its state.

use std::time::Instant;

use super::{request::Sequence, EngineCore, EngineError};
use crate::{
    kv::{CacheActivity, PinKey},
    metrics::{Outcome, PinRelease},
};

impl EngineCore {
    /// Cancels sequences whose clients have gone or were cut off for reading too slowly, wherever they
    /// are. Choices waiting on a cancelled sequence's prompt are not lost: the first of them takes its
    /// place in the waiting queue.
    pub(super) fn drop_cancelled(&mut self) {
        for mut seq in self.queues.take_where(Sequence::is_cancelled) {
            if seq.is_slow_reader {
                tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "cancelled", reason = "slow_reader", "client fell too far behind the stream (--max-unread-tokens)");
                self.metrics.slow_readers.inc();
            } else {
                tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "cancelled", reason = "client_gone", "client went away");
            }
            self.metrics.count_request(Outcome::Cancelled);
            self.metrics.cancelled_tokens.inc_by(seq.token_ids.len() as u64);
            self.release(&mut seq);
            let mut forks = std::mem::take(&mut seq.forks);
            if !forks.is_empty() {
                let mut heir = forks.remove(0);
                heir.forks = forks;
                self.queues.waiting.push_front(Sequence::new(heir));
            }
        }
    }

    /// Ends requests that ran past their deadline (`timeout`, `--request-timeout`) with
    /// `EngineError::Deadline`, wherever they are, and frees their blocks.
    pub(super) fn expire_deadlines(&mut self) {
        let now = Instant::now();
        for mut seq in self
            .queues
            .take_where(|seq| seq.deadline.is_some_and(|deadline| deadline <= now))
        {
            tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "timeout", "ran past its deadline");
            seq.fail(EngineError::Deadline(seq.timeout_s()));
            for _ in 0..=seq.forks.len() {
                self.metrics.count_request(Outcome::Timeout);
            }
            self.release(&mut seq);
        }
    }

    /// Fails requests that have waited for admission longer than `--max-queue-time`.
    pub(super) fn expire_waiting(&mut self) {
        let Some(limit) = self.max_queue_time else { return };
        let now = Instant::now();
        let expired = self
            .queues
            .take_waiting_where(|seq| seq.admitted_at.is_none() && now - seq.arrived_at > limit);
        for mut seq in expired {
            tracing::info!(request_id = %seq.tag, sequence_id = %seq.id, outcome = "expired", "waited longer than --max-queue-time");
            seq.fail(EngineError::QueueTimeout(limit.as_secs()));
            for _ in 0..=seq.forks.len() {
                self.metrics.count_request(Outcome::Failed);
            }
            self.release(&mut seq);
        }
    }

    /// A failed forward leaves the shards' state unknown: every running request fails, the shards are
    /// cleared, and waiting requests start afresh.
    pub(super) async fn fail_all(&mut self, message: String) {
        tracing::error!(%message, "forward pass failed; failing the running requests");
        // Swapped sequences too: the failed call may have carried their copies out.
        let failed: Vec<_> = std::mem::take(&mut self.queues.running)
            .into_iter()
            .chain(std::mem::take(&mut self.queues.swapped))
            .collect();
        for mut seq in failed {
            seq.fail(EngineError::Shard(message.clone()));
            for _ in 0..=seq.forks.len() {
                self.metrics.count_request(Outcome::Failed);
            }
            self.release(&mut seq);
        }
        self.outbox.clear();
        if let Err(e) = self.shards.clear_cache().await {
            // The shards are gone: nobody knows when (or whether) they come back, so the queued requests
            // fail now rather than hang; requests that arrive later wait for the recovery.
            tracing::error!(error = %e, "the shards do not answer; failing the queue, waiting for them");
            for seq in std::mem::take(&mut self.queues.waiting) {
                seq.fail(EngineError::Shard(message.clone()));
                for _ in 0..=seq.forks.len() {
                    self.metrics.count_request(Outcome::Failed);
                }
            }
            self.publish_stats();
            self.recover().await;
        } else {
            // The shards answer: a restart (no pool yet, so the forward was refused) is recovered now.
            self.recover_restarted_shards().await;
        }
    }

    /// Returns a sequence's blocks (device and host, and the draft model's) to their pools and tells the
    /// shards to drop its state on the next call.
    pub(super) fn release(&mut self, seq: &mut Sequence) {
        if let Some(draft) = &mut self.draft {
            draft.release(seq.id);
        }
        if seq.is_known_to_shards {
            self.outbox.release(seq.id);
        }
        if !seq.host_blocks.is_empty() {
            let host_blocks = std::mem::take(&mut seq.host_blocks);
            self.outbox.cancel_swap_out(&host_blocks);
            self.swap.release(&host_blocks);
        }
        // Prompt and generated tokens stay cached (the next turn of a chat, a resumed preemption hits).
        self.cache_computed(seq);
        let blocks = seq.reset_kv();
        self.kv.release(&blocks);
    }

    /// Enters a sequence's computed full blocks into the prefix cache.
    pub(super) fn cache_computed(&mut self, seq: &Sequence) {
        let mut activity = CacheActivity::default();
        let tokens = &seq.token_ids[..seq.num_computed_tokens];
        self.kv.cache(seq.cache_salt(), tokens, &seq.blocks, &mut activity);
        self.count_cache_activity(activity);
    }

    /// A sequence that finished normally with a `cache_pin`: its computed blocks enter the cache and its
    /// cached prefix (prompt and output) is pinned under the session key until `now` + the pin's TTL.
    pub(super) fn pin_prefix(&mut self, seq: &Sequence, now: Instant) {
        let Some(pin) = seq.cache_pin() else { return };
        self.cache_computed(seq);
        let key = PinKey {
            salt: seq.cache_salt(),
            key: pin.key.clone(),
        };
        let outcome = self
            .kv
            .pin(key, &seq.token_ids[..seq.num_computed_tokens], now + pin.ttl);
        if outcome.num_blocks > 0 {
            self.metrics.pins_created.inc();
        }
        self.metrics
            .count_pins_released(PinRelease::Bound, outcome.num_released_for_bound);
    }

    /// Releases the session pins whose deadline has passed.
    pub(super) fn expire_pins(&mut self) {
        let num_expired = self.kv.expire_pins(Instant::now());
        self.metrics.count_pins_released(PinRelease::Expired, num_expired);
    }

    pub(super) fn count_cache_activity(&self, activity: CacheActivity) {
        self.metrics
            .prefix_cache_inserted_blocks
            .inc_by(activity.num_inserted_blocks as u64);
        self.metrics
            .prefix_cache_evicted_blocks
            .inc_by(activity.num_evicted_blocks as u64);
        self.metrics
            .count_pins_released(PinRelease::Pressure, activity.num_pins_released_under_pressure);
    }
}
