//! gRPC over unix sockets to every shard rank (tonic).
//!
//! Every call has a deadline, so a shard that stops answering without exiting (a deadlock, a stuck
//! collective, a stopped process) fails the call with `ShardError::Timeout` instead of hanging the engine:
//! the engine then fails the step's requests and reports the shards not ready, as for a dead shard.
//! A forward call's deadline follows the measured step time (`ForwardDeadline`).

use std::{
    path::PathBuf,
    sync::{
        atomic::{AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use futures::{future::BoxFuture, FutureExt};
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use super::{pb, pb::shard_client::ShardClient as RankClient, ShardClient, ShardError};
use crate::telemetry;

/// Largest message in either direction; a forward call over a long batch carries block tables.
const MAX_MESSAGE_BYTES: usize = 256 << 20;
/// Deadline of the cheap calls (Info, Health, ClearCache).
const SMALL_CALL_DEADLINE: Duration = Duration::from_secs(10);
/// Deadline of LoadAdapter: reading an adapter's safetensors (rank 64 on every projection of a large
/// model is gigabytes).
const LOAD_ADAPTER_DEADLINE: Duration = Duration::from_secs(300);
/// Deadline of Warmup: a forward at the largest batch, pool allocation, swap measurement, CUDA graphs.
const WARMUP_DEADLINE: Duration = Duration::from_secs(600);
/// A forward call's automatic deadline: this multiple of the slowest forward measured so far (the warmup's
/// largest-batch forward included), and never less than the floor.
const FORWARD_DEADLINE_MULTIPLE: u32 = 20;
const FORWARD_DEADLINE_FLOOR: Duration = Duration::from_secs(30);

/// One client per rank, rank 0 first.
#[derive(Clone)]
pub struct GrpcShards {
    ranks: Vec<RankClient<Channel>>,
    forward_deadline: ForwardDeadline,
}

/// How long a forward call may take: fixed (`--forward-timeout`), or derived from the slowest forward seen.
#[derive(Clone, Default)]
struct ForwardDeadline {
    fixed: Option<Duration>,
    slowest_us: Arc<AtomicU64>,
}

impl ForwardDeadline {
    fn get(&self) -> Duration {
        self.fixed.unwrap_or_else(|| {
            let slowest = Duration::from_micros(self.slowest_us.load(Ordering::Relaxed));
            (slowest * FORWARD_DEADLINE_MULTIPLE).max(FORWARD_DEADLINE_FLOOR)
        })
    }

    fn record(&self, elapsed: Duration) {
        let elapsed_us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        self.slowest_us.fetch_max(elapsed_us, Ordering::Relaxed);
    }
}

impl GrpcShards {
    /// Connects to every rank's unix socket, retrying until `timeout` while a socket does not answer yet.
    pub async fn connect(paths: &[PathBuf], timeout: Duration) -> Result<Self, ShardError> {
        let mut ranks = Vec::with_capacity(paths.len());
        for path in paths {
            let deadline = tokio::time::Instant::now() + timeout;
            let channel = loop {
                match connect_unix(path.clone()).await {
                    Ok(channel) => break channel,
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        return Err(ShardError::Connect {
                            path: path.display().to_string(),
                            message: e.to_string(),
                        })
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            };
            ranks.push(
                RankClient::new(channel)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES),
            );
        }
        Ok(Self {
            ranks,
            forward_deadline: ForwardDeadline::default(),
        })
    }

    /// Every forward call gets `deadline` instead of one derived from the measured step time.
    pub fn with_forward_deadline(mut self, deadline: Option<Duration>) -> Self {
        self.forward_deadline.fixed = deadline;
        self
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Sends the same call to every rank concurrently; fails if any rank fails or not every rank has
    /// answered within `deadline`; returns rank 0's reply.
    async fn broadcast<T, F, Fut>(&self, name: &'static str, deadline: Duration, call: F) -> Result<T, ShardError>
    where
        F: Fn(RankClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let replies = futures::future::join_all(self.ranks.iter().cloned().map(call));
        let replies = tokio::time::timeout(deadline, replies)
            .await
            .map_err(|_| ShardError::Timeout {
                call: name,
                seconds: deadline.as_secs_f64(),
            })?;
        let mut first = None;
        for (rank, reply) in replies.into_iter().enumerate() {
            let reply = reply.map_err(|status| match status.code() {
                tonic::Code::InvalidArgument => ShardError::Refused {
                    rank,
                    message: status.message().into(),
                },
                code => ShardError::Rpc {
                    rank,
                    message: format!("{code}: {}", status.message()),
                },
            })?;
            if rank == 0 {
                first = Some(reply.into_inner());
            }
        }
        Ok(first.expect("the router is started with at least one shard socket"))
    }
}

async fn connect_unix(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    // The URI is required by tonic but unused: the connector below dials the socket.
    Endpoint::from_static("http://[::]:50051")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(stream))
            }
        }))
        .await
}

impl ShardClient for GrpcShards {
    fn info(&self) -> BoxFuture<'_, Result<pb::InfoResponse, ShardError>> {
        self.broadcast("Info", SMALL_CALL_DEADLINE, |mut c| async move {
            c.info(pb::InfoRequest {}).await
        })
        .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<bool, ShardError>> {
        async move {
            self.broadcast("Health", SMALL_CALL_DEADLINE, |mut c| async move {
                c.health(pb::HealthRequest {}).await
            })
            .await
            .map(|health| health.warmed_up)
        }
        .boxed()
    }

    fn warmup(&self, request: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>> {
        async move {
            let max_batch_tokens = request.max_batch_tokens;
            let warmup = self
                .broadcast("Warmup", WARMUP_DEADLINE, move |mut c| async move {
                    c.warmup(request).await
                })
                .await?;
            let largest_forward_s = f64::from(warmup.prefill_seconds_per_token) * f64::from(max_batch_tokens);
            if largest_forward_s.is_finite() && largest_forward_s > 0.0 {
                self.forward_deadline.record(Duration::from_secs_f64(largest_forward_s));
            }
            Ok(warmup)
        }
        .boxed()
    }

    fn forward(
        &self,
        request: pb::ForwardRequest,
        is_decode: bool,
    ) -> BoxFuture<'_, Result<pb::ForwardResponse, ShardError>> {
        async move {
            // Read when polled, inside the caller's step span: the shards' spans become its children.
            let metadata = telemetry::grpc_metadata();
            let started = Instant::now();
            let name = if is_decode { "Decode" } else { "Prefill" };
            let response = self
                .broadcast(name, self.forward_deadline.get(), move |mut c| {
                    let call = tonic::Request::from_parts(metadata.clone(), Default::default(), request.clone());
                    async move {
                        if is_decode {
                            c.decode(call).await
                        } else {
                            c.prefill(call).await
                        }
                    }
                })
                .await?;
            self.forward_deadline.record(started.elapsed());
            Ok(response)
        }
        .boxed()
    }

    fn clear_cache(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        async move {
            self.broadcast("ClearCache", SMALL_CALL_DEADLINE, |mut c| async move {
                c.clear_cache(pb::ClearCacheRequest {}).await
            })
            .await
            .map(|_| ())
        }
        .boxed()
    }

    fn load_adapter(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, Result<pb::LoadAdapterResponse, ShardError>> {
        self.broadcast("LoadAdapter", LOAD_ADAPTER_DEADLINE, move |mut c| {
            let request = request.clone();
            async move { c.load_adapter(request).await }
        })
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forward_deadline_follows_the_slowest_step_above_a_floor() {
        let deadline = ForwardDeadline::default();
        assert_eq!(deadline.get(), FORWARD_DEADLINE_FLOOR);
        deadline.record(Duration::from_millis(100));
        assert_eq!(deadline.get(), FORWARD_DEADLINE_FLOOR, "2 s is below the floor");
        deadline.record(Duration::from_secs(3));
        deadline.record(Duration::from_secs(1));
        assert_eq!(
            deadline.get(),
            Duration::from_secs(60),
            "20 x the slowest, not the latest"
        );
        let fixed = ForwardDeadline {
            fixed: Some(Duration::from_secs(2)),
            ..deadline
        };
        assert_eq!(fixed.get(), Duration::from_secs(2));
    }
}
