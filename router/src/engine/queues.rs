//! The engine's three queues of sequences. Every sequence the engine knows is in exactly one of them,
//! from `Sequence::new` until it leaves through the one release path (`release.rs`); only the engine
//! task touches them, and the scheduler sees them through views (`plan.rs`).

use std::collections::VecDeque;

use super::{request::Sequence, RequestId};

/// The sequences the engine holds, by where they stand.
#[derive(Default)]
pub struct Queues {
    /// Sequences waiting for admission: new requests in arrival order, recompute victims pushed to the
    /// front. None holds device or host blocks.
    pub waiting: VecDeque<Sequence>,
    /// Admitted sequences, each holding the device blocks of its computed tokens; the forward pass
    /// computes some of them each step.
    pub running: Vec<Sequence>,
    /// Sequences preempted by swapping, in the order they were swapped out: admitted, their K/V in the
    /// host swap pool (`host_blocks`), their state kept by the shards; resumed before new admissions.
    pub swapped: VecDeque<Sequence>,
}

impl Queues {
    /// No sequence anywhere: the engine has nothing to do until a request arrives.
    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.swapped.is_empty()
    }

    /// Where running sequence `id` is in `running`.
    pub fn running_index(&self, id: RequestId) -> usize {
        self.running
            .iter()
            .position(|seq| seq.id == id)
            .expect("the plan and the shards only name running sequences")
    }

    /// Removes waiting sequence `id` (to admit it).
    pub fn take_waiting(&mut self, id: RequestId) -> Sequence {
        let i = self
            .waiting
            .iter()
            .position(|seq| seq.id == id)
            .expect("admitted requests wait");
        self.waiting.remove(i).expect("index in range")
    }

    /// Moves swapped sequence `id` to the running set (its blocks come with its next chunk).
    pub fn resume(&mut self, id: RequestId) -> &Sequence {
        let i = self
            .swapped
            .iter()
            .position(|seq| seq.id == id)
            .expect("resumed sequences are swapped");
        let seq = self.swapped.remove(i).expect("index in range");
        self.running.push(seq);
        self.running.last().expect("just pushed")
    }

    /// Removes and returns the sequences that match `pred`, wherever they are: running ones first, then
    /// waiting, then swapped, each queue in its order.
    pub fn take_where(&mut self, pred: impl Fn(&Sequence) -> bool) -> Vec<Sequence> {
        let mut taken: Vec<Sequence> = self.running.extract_if(.., |seq| pred(seq)).collect();
        taken.extend(take_from(&mut self.waiting, &pred));
        taken.extend(take_from(&mut self.swapped, &pred));
        taken
    }

    /// Removes and returns the waiting sequences that match `pred`, in queue order.
    pub fn take_waiting_where(&mut self, pred: impl Fn(&Sequence) -> bool) -> Vec<Sequence> {
        take_from(&mut self.waiting, &pred)
    }
}

fn take_from(queue: &mut VecDeque<Sequence>, pred: &impl Fn(&Sequence) -> bool) -> Vec<Sequence> {
    let mut taken = Vec::new();
    let mut i = 0;
    while i < queue.len() {
        if pred(&queue[i]) {
            taken.push(queue.remove(i).expect("index in range"));
        } else {
            i += 1;
        }
    }
    taken
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tokio::sync::mpsc;

    use super::*;
    use crate::{
        engine::{EventReceiver, NewRequest},
        validation::{ValidRequest, ValidSampling},
    };

    /// A sequence with id `id`, and the receiving end of its events (dropping it cancels the sequence).
    fn sequence(id: u64) -> (Sequence, EventReceiver) {
        let request = ValidRequest {
            prompt_ids: vec![1, 2, 3],
            max_new_tokens: 4,
            sampling: ValidSampling {
                do_sample: false,
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                typical_p: 1.0,
                seed: 0,
                repetition_penalty: 1.0,
                frequency_penalty: 0.0,
                presence_penalty: 0.0,
                logit_bias: HashMap::new(),
            },
            stop_sequences: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_new_tokens: 0,
            skip_special_tokens: true,
            kept_special_tokens: Vec::new(),
            top_n_tokens: 0,
            priority: 0,
            cache_salt: 0,
            grammar: None,
            timeout: None,
            cache_pin: None,
            adapter: None,
        };
        let (events, receiver) = mpsc::channel(2);
        let new = NewRequest {
            id: RequestId(id),
            request,
            events,
            forks: Vec::new(),
            waiting_permit: None,
            tag: format!("r{id}"),
            span: tracing::Span::none(),
            deadline: None,
        };
        (Sequence::new(new), receiver)
    }

    fn ids<'a>(seqs: impl IntoIterator<Item = &'a Sequence>) -> Vec<u64> {
        seqs.into_iter().map(|seq| seq.id.0).collect()
    }

    /// Running 1, 2; waiting 3, 4; swapped 5, 6; and the receivers that keep them alive.
    fn queues() -> (Queues, Vec<EventReceiver>) {
        let mut queues = Queues::default();
        let mut receivers = Vec::new();
        for id in 1..=6 {
            let (seq, receiver) = sequence(id);
            receivers.push(receiver);
            match id {
                1 | 2 => queues.running.push(seq),
                3 | 4 => queues.waiting.push_back(seq),
                _ => queues.swapped.push_back(seq),
            }
        }
        (queues, receivers)
    }

    #[test]
    fn empty_only_when_every_queue_is() {
        let mut queues = Queues::default();
        assert!(queues.is_empty());
        let (seq, _receiver) = sequence(1);
        queues.swapped.push_back(seq);
        assert!(!queues.is_empty());
    }

    #[test]
    fn admission_and_resumption_move_one_sequence_each() {
        let (mut queues, _receivers) = queues();
        let admitted = queues.take_waiting(RequestId(4));
        assert_eq!(admitted.id, RequestId(4));
        assert_eq!(ids(&queues.waiting), [3]);
        assert_eq!(queues.resume(RequestId(5)).id, RequestId(5));
        assert_eq!(ids(&queues.swapped), [6]);
        assert_eq!(ids(&queues.running), [1, 2, 5]);
        assert_eq!(queues.running_index(RequestId(5)), 2);
    }

    #[test]
    #[should_panic(expected = "admitted requests wait")]
    fn admitting_a_sequence_that_does_not_wait_is_a_bug() {
        let (mut queues, _receivers) = queues();
        queues.take_waiting(RequestId(1));
    }

    #[test]
    #[should_panic(expected = "only name running sequences")]
    fn a_running_index_of_a_waiting_sequence_is_a_bug() {
        let (queues, _receivers) = queues();
        queues.running_index(RequestId(3));
    }

    #[test]
    fn take_where_looks_everywhere_and_keeps_the_order_of_the_rest() {
        let (mut queues, mut receivers) = queues();
        // Clients of 2, 3 and 6 go away.
        for id in [6, 3, 2] {
            drop(receivers.remove(id - 1));
        }
        let taken = queues.take_where(Sequence::is_cancelled);
        assert_eq!(ids(&taken), [2, 3, 6]);
        assert_eq!(ids(&queues.running), [1]);
        assert_eq!(ids(&queues.waiting), [4]);
        assert_eq!(ids(&queues.swapped), [5]);
    }

    #[test]
    fn take_waiting_where_leaves_the_other_queues_alone() {
        let (mut queues, _receivers) = queues();
        let taken = queues.take_waiting_where(|seq| seq.id.0 % 2 == 0);
        assert_eq!(ids(&taken), [4]);
        assert_eq!(ids(&queues.waiting), [3]);
        assert_eq!(ids(&queues.running), [1, 2]);
        assert_eq!(ids(&queues.swapped), [5, 6]);
    }
}
