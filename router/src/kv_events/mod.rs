//! KV-cache events on the wire (`--kv-events-endpoint`): the prefix cache's [`KvEvent`]s, published on a
//! ZMQ PUB socket in vLLM's format, so a gateway's indexer (llm-d's precise prefix-cache scorer) knows
//! exactly which prefixes this replica holds. The router owns the radix tree, so there is one exact stream
//! per replica whatever the number of shards.
//!
//! Each message is three frames: the topic, a sequence number (8 bytes, big-endian, +1 per message from 0)
//! and the payload (`wire`). The engine loop never waits on it: it hands each step's events to a bounded
//! queue ([`KvEventPublisher::publish`]) and a task encodes and sends them. When the queue is full the
//! events are dropped and counted (`rill_kv_events_dropped_total`), and the next batch that fits is the
//! cache's whole state instead (`AllBlocksCleared`, then every cached block, parents first), so
//! subscribers are consistent again without a replay socket.

mod wire;

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bytes::Bytes;
use prometheus::IntCounter;
use tokio::sync::mpsc;
use zeromq::{Endpoint, Host, Socket, SocketSend, ZmqMessage};

use crate::kv::KvEvent;

/// Batches (one per engine step) the queue holds before events are dropped: seconds of steps.
const QUEUE_BATCHES: usize = 1024;

/// Where and under which topic the events go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventsConfig {
    pub socket: KvEventsSocket,
    /// The first frame of every message; llm-d reads `kv@<pod>@<model>`.
    pub topic: String,
}

/// vLLM's convention: a `*` host binds, any other connects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventsSocket {
    /// Subscribers connect to this address (llm-d discovering the pods).
    Bind(Endpoint),
    /// The router connects to a subscriber that binds (a central indexer), reconnecting as needed.
    Connect(Endpoint),
}

impl KvEventsSocket {
    /// `tcp://*:PORT` binds on every interface; `tcp://HOST:PORT` connects.
    pub fn parse(endpoint: &str) -> anyhow::Result<Self> {
        let parsed: Endpoint = endpoint
            .parse()
            .with_context(|| format!("--kv-events-endpoint takes tcp://*:PORT or tcp://HOST:PORT, got {endpoint:?}"))?;
        match parsed {
            Endpoint::Tcp(Host::Domain(host), port) if host == "*" => {
                Ok(Self::Bind(Endpoint::Tcp(Host::Ipv4([0, 0, 0, 0].into()), port)))
            }
            Endpoint::Tcp(..) => Ok(Self::Connect(parsed)),
            _ => anyhow::bail!("--kv-events-endpoint takes a tcp:// endpoint, got {endpoint:?}"),
        }
    }
}

/// The engine's end of the queue to the sending task.
pub struct KvEventPublisher {
    queue: mpsc::Sender<Vec<KvEvent>>,
    /// Events were dropped: subscribers need the whole state before anything else.
    is_out_of_sync: bool,
    dropped: IntCounter,
}

impl KvEventPublisher {
    /// Binds the socket (or starts connecting it) and spawns the task that sends the batches published
    /// here, for a cache of `block_size`-token blocks. Dropped events count in `dropped`.
    pub async fn start(config: &KvEventsConfig, block_size: usize, dropped: IntCounter) -> anyhow::Result<Self> {
        let mut socket = zeromq::PubSocket::new();
        if let KvEventsSocket::Bind(endpoint) = &config.socket {
            socket
                .bind(&endpoint.to_string())
                .await
                .with_context(|| format!("cannot bind the KV-cache events socket to {endpoint}"))?;
        }
        let connect = match &config.socket {
            KvEventsSocket::Connect(endpoint) => Some(endpoint.to_string()),
            KvEventsSocket::Bind(_) => None,
        };
        tracing::info!(socket = ?config.socket, topic = %config.topic, "publishing KV-cache events");
        let (queue, batches) = mpsc::channel(QUEUE_BATCHES);
        let topic = Bytes::from(config.topic.clone().into_bytes());
        tokio::spawn(send_batches(socket, connect, batches, topic, block_size));
        Ok(Self::new(queue, dropped))
    }

    fn new(queue: mpsc::Sender<Vec<KvEvent>>, dropped: IntCounter) -> Self {
        Self {
            queue,
            is_out_of_sync: false,
            dropped,
        }
    }

    /// Queues `events` (the cache's changes since the last call) without waiting. After a drop, queues
    /// `snapshot()` (the cache's whole state, which covers `events`) as soon as the queue has room.
    pub fn publish(&mut self, events: Vec<KvEvent>, snapshot: impl FnOnce() -> Vec<KvEvent>) {
        if self.is_out_of_sync {
            match self.queue.try_reserve() {
                Ok(permit) => {
                    permit.send(snapshot());
                    self.is_out_of_sync = false;
                }
                Err(_) => self.dropped.inc_by(events.len() as u64),
            }
            return;
        }
        if events.is_empty() {
            return;
        }
        if let Err(error) = self.queue.try_send(events) {
            let (mpsc::error::TrySendError::Full(batch) | mpsc::error::TrySendError::Closed(batch)) = error;
            self.dropped.inc_by(batch.len() as u64);
            self.is_out_of_sync = true;
        }
    }
}

/// Sends each batch as one message, numbered from 0; connects first when the socket connects.
async fn send_batches(
    mut socket: zeromq::PubSocket,
    connect: Option<String>,
    mut batches: mpsc::Receiver<Vec<KvEvent>>,
    topic: Bytes,
    block_size: usize,
) {
    if let Some(endpoint) = connect {
        // Retries until the subscriber's socket answers; meanwhile the queue fills and then drops.
        if let Err(e) = socket.connect(&endpoint).await {
            tracing::error!(error = %e, %endpoint, "cannot connect the KV-cache events socket; no events are sent");
            return;
        }
    }
    let mut sequence: u64 = 0;
    while let Some(events) = batches.recv().await {
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let frames = vec![
            topic.clone(),
            Bytes::copy_from_slice(&sequence.to_be_bytes()),
            Bytes::from(wire::encode_batch(ts, &events, block_size)),
        ];
        let message = ZmqMessage::try_from(frames).expect("three frames are a message");
        if let Err(e) = socket.send(message).await {
            tracing::warn!(error = %e, sequence, "sending KV-cache events failed");
        }
        sequence += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(hash: u64) -> KvEvent {
        KvEvent::Stored {
            block_hashes: vec![hash],
            parent_block_hash: None,
            token_ids: vec![1, 2],
            namespace: 0,
        }
    }

    #[test]
    fn endpoints_bind_on_a_star_and_connect_otherwise() {
        let bind = KvEventsSocket::parse("tcp://*:5557").unwrap();
        assert_eq!(bind, KvEventsSocket::Bind("tcp://0.0.0.0:5557".parse().unwrap()));
        let connect = KvEventsSocket::parse("tcp://indexer:5557").unwrap();
        assert_eq!(connect, KvEventsSocket::Connect("tcp://indexer:5557".parse().unwrap()));
        for bad in ["5557", "tcp://*", "udp://*:5557", "tcp://*:99999"] {
            assert!(KvEventsSocket::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_full_queue_drops_and_counts_then_the_whole_state_follows() {
        let (queue, mut batches) = mpsc::channel(1);
        let dropped = IntCounter::new("dropped", "test").unwrap();
        let mut publisher = KvEventPublisher::new(queue, dropped.clone());
        let no_snapshot = || -> Vec<KvEvent> { panic!("in sync: no snapshot") };
        publisher.publish(Vec::new(), no_snapshot);
        publisher.publish(vec![stored(1)], no_snapshot);
        // The queue is full: these two events are lost.
        publisher.publish(vec![stored(2), stored(3)], no_snapshot);
        assert_eq!(dropped.get(), 2);
        // Still full: the next events go too, and no snapshot is taken.
        publisher.publish(vec![KvEvent::Removed { block_hashes: vec![1] }], no_snapshot);
        assert_eq!(dropped.get(), 3);
        assert_eq!(batches.try_recv().unwrap(), vec![stored(1)]);
        // Room again: the whole state replaces the events it covers, even when there are none.
        let snapshot = vec![KvEvent::AllCleared, stored(2), stored(3)];
        publisher.publish(Vec::new(), || snapshot.clone());
        assert_eq!(batches.try_recv().unwrap(), snapshot);
        publisher.publish(vec![stored(4)], no_snapshot);
        assert_eq!(batches.try_recv().unwrap(), vec![stored(4)]);
        assert_eq!(dropped.get(), 3);
    }
}
