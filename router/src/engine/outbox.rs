//! The outbox: shard work decided between two forward calls and sent with the next one. The engine owns
//! the only one; every path that decides such work (release, preemption, resumption, failure) writes it
//! here, and only `take_request` empties it.

use super::RequestId;
use crate::{kv::BlockCopy, shard::pb};

/// Work for the shards, in the order they run it: drop the released sequences' state, copy blocks out to
/// the host swap pool, then back in, all before the forward pass of the call that carries it.
#[derive(Debug, Default)]
pub struct Outbox {
    released_ids: Vec<u64>,
    swap_out: Vec<pb::BlockCopy>,
    swap_in: Vec<pb::BlockCopy>,
    unloaded_adapter_ids: Vec<u32>,
}

impl Outbox {
    /// The shards drop the state they hold for `id` (its sampling params, its grammar mask, its history).
    pub fn release(&mut self, id: RequestId) {
        self.released_ids.push(id.0);
    }

    /// The shards free these LoRA adapters (drained: no sequence of the next call or later uses them).
    pub fn unload_adapters(&mut self, ids: Vec<u32>) {
        self.unloaded_adapter_ids.extend(ids);
    }

    /// Queues copies of device blocks to the host swap pool (a swap preemption).
    pub fn swap_out(&mut self, copies: Vec<BlockCopy>) {
        self.swap_out.extend(copies.into_iter().map(to_pb));
    }

    /// Queues copies of host blocks back to the device (a resumption).
    pub fn swap_in(&mut self, copies: Vec<BlockCopy>) {
        self.swap_in.extend(copies.into_iter().map(to_pb));
    }

    /// Drops the copies out not sent yet into these host blocks, which are being freed: a copy must not
    /// land in blocks someone else may get now.
    pub fn cancel_swap_out(&mut self, host_blocks: &[u32]) {
        self.swap_out.retain(|copy| !host_blocks.contains(&copy.host_block));
    }

    /// Forgets everything: the shards were cleared, so there is nothing left to drop or copy.
    pub fn clear(&mut self) {
        *self = Self::default();
    }

    /// The next forward call: the outbox's work, emptied into it, and the sequences to compute.
    pub fn take_request(&mut self, sequences: Vec<pb::SequenceChunk>) -> pb::ForwardRequest {
        let Self {
            released_ids,
            swap_out,
            swap_in,
            unloaded_adapter_ids,
        } = std::mem::take(self);
        pb::ForwardRequest {
            released_ids,
            sequences,
            swap_out,
            swap_in,
            unloaded_adapter_ids,
        }
    }
}

fn to_pb(copy: BlockCopy) -> pb::BlockCopy {
    pb::BlockCopy {
        device_block: copy.device_block,
        host_block: copy.host_block,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(device_block: u32, host_block: u32) -> BlockCopy {
        BlockCopy {
            device_block,
            host_block,
        }
    }

    fn pb_copy(device_block: u32, host_block: u32) -> pb::BlockCopy {
        pb::BlockCopy {
            device_block,
            host_block,
        }
    }

    #[test]
    fn a_request_carries_everything_once() {
        let mut outbox = Outbox::default();
        outbox.release(RequestId(3));
        outbox.swap_out(vec![copy(5, 1), copy(6, 2)]);
        outbox.swap_in(vec![copy(7, 3)]);
        outbox.release(RequestId(4));
        outbox.unload_adapters(vec![2]);
        let request = outbox.take_request(Vec::new());
        assert_eq!(request.released_ids, [3, 4]);
        assert_eq!(request.unloaded_adapter_ids, [2]);
        assert_eq!(request.swap_out, [pb_copy(5, 1), pb_copy(6, 2)]);
        assert_eq!(request.swap_in, [pb_copy(7, 3)]);
        let next = outbox.take_request(Vec::new());
        assert_eq!(next, pb::ForwardRequest::default());
    }

    #[test]
    fn the_sequences_go_with_the_work() {
        let mut outbox = Outbox::default();
        outbox.release(RequestId(1));
        let chunk = pb::SequenceChunk {
            id: 2,
            ..Default::default()
        };
        let request = outbox.take_request(vec![chunk.clone()]);
        assert_eq!(request.sequences, [chunk]);
        assert_eq!(request.released_ids, [1]);
    }

    #[test]
    fn cancelling_drops_only_the_copies_into_freed_host_blocks() {
        let mut outbox = Outbox::default();
        outbox.swap_out(vec![copy(5, 1), copy(6, 2), copy(7, 3)]);
        outbox.swap_in(vec![copy(8, 2)]);
        outbox.cancel_swap_out(&[1, 3]);
        let request = outbox.take_request(Vec::new());
        assert_eq!(request.swap_out, [pb_copy(6, 2)]);
        assert_eq!(request.swap_in, [pb_copy(8, 2)], "copies in are not cancelled");
    }

    #[test]
    fn clearing_forgets_everything() {
        let mut outbox = Outbox::default();
        outbox.release(RequestId(1));
        outbox.swap_out(vec![copy(5, 1)]);
        outbox.swap_in(vec![copy(6, 2)]);
        outbox.clear();
        assert_eq!(outbox.take_request(Vec::new()), pb::ForwardRequest::default());
    }
}
