//! gRPC over unix sockets to every shard rank (tonic).

use std::{path::PathBuf, time::Duration};

use futures::{future::BoxFuture, FutureExt};
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use super::{pb, pb::shard_client::ShardClient as RankClient, ShardClient, ShardError};
use crate::telemetry;

/// Largest message in either direction; a forward call over a long batch carries block tables.
const MAX_MESSAGE_BYTES: usize = 256 << 20;

/// One client per rank, rank 0 first.
#[derive(Clone)]
pub struct GrpcShards {
    ranks: Vec<RankClient<Channel>>,
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
        Ok(Self { ranks })
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Sends the same call to every rank concurrently; fails if any rank fails; returns rank 0's reply.
    async fn broadcast<T, F, Fut>(&self, call: F) -> Result<T, ShardError>
    where
        F: Fn(RankClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let replies = futures::future::join_all(self.ranks.iter().cloned().map(call)).await;
        let mut first = None;
        for (rank, reply) in replies.into_iter().enumerate() {
            let reply = reply.map_err(|status| ShardError::Rpc {
                rank,
                message: format!("{}: {}", status.code(), status.message()),
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
        self.broadcast(|mut c| async move { c.info(pb::InfoRequest {}).await })
            .boxed()
    }

    fn health(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        async move {
            self.broadcast(|mut c| async move { c.health(pb::HealthRequest {}).await })
                .await
                .map(|_| ())
        }
        .boxed()
    }

    fn warmup(&self, request: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>> {
        self.broadcast(move |mut c| async move { c.warmup(request).await })
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
            self.broadcast(move |mut c| {
                let call = tonic::Request::from_parts(metadata.clone(), Default::default(), request.clone());
                async move {
                    if is_decode {
                        c.decode(call).await
                    } else {
                        c.prefill(call).await
                    }
                }
            })
            .await
        }
        .boxed()
    }

    fn clear_cache(&self) -> BoxFuture<'_, Result<(), ShardError>> {
        async move {
            self.broadcast(|mut c| async move { c.clear_cache(pb::ClearCacheRequest {}).await })
                .await
                .map(|_| ())
        }
        .boxed()
    }
}
