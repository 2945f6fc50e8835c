//! Talking to the model shards: the `ShardClient` trait the engine drives, and its gRPC implementation
//! that fans every call out to all tensor-parallel ranks and answers with rank 0's reply.

#[cfg(test)]
pub mod fake;
mod grpc;

use futures::future::BoxFuture;
use thiserror::Error;

pub use grpc::GrpcShards;

/// Generated from `proto/shard/v1/shard.proto` by `build.rs`.
pub mod pb {
    tonic::include_proto!("rill.shard.v1");
}

#[derive(Debug, Error)]
pub enum ShardError {
    #[error("cannot connect to shard at {path}: {message}")]
    Connect { path: String, message: String },
    #[error("shard rank {rank} failed: {message}")]
    Rpc { rank: usize, message: String },
    /// The shard refused the call's argument (gRPC INVALID_ARGUMENT): `message` is its reason.
    #[error("shard rank {rank} refused: {message}")]
    Refused { rank: usize, message: String },
    #[error("shard call {call} missed its {seconds:.1} s deadline: a shard is hung or stopped")]
    Timeout { call: &'static str, seconds: f64 },
}

/// What the engine needs from the shards. Every call goes to every rank; the answer is rank 0's.
pub trait ShardClient: Send + Sync {
    fn info(&self) -> BoxFuture<'_, Result<pb::InfoResponse, ShardError>>;
    /// A cheap check that every rank answers; whether the shards are warmed up (false after a restart:
    /// every rank restarts together, so rank 0 speaks for all).
    fn health(&self) -> BoxFuture<'_, Result<bool, ShardError>>;
    fn warmup(&self, request: pb::WarmupRequest) -> BoxFuture<'_, Result<pb::WarmupResponse, ShardError>>;
    /// One forward pass: `Decode` when every sequence computes one token, else `Prefill`.
    fn forward(
        &self,
        request: pb::ForwardRequest,
        is_decode: bool,
    ) -> BoxFuture<'_, Result<pb::ForwardResponse, ShardError>>;
    fn clear_cache(&self) -> BoxFuture<'_, Result<(), ShardError>>;
    /// Loads a LoRA adapter on every rank under the router's id; fails unless every rank loaded it.
    fn load_adapter(
        &self,
        request: pb::LoadAdapterRequest,
    ) -> BoxFuture<'_, Result<pb::LoadAdapterResponse, ShardError>>;
}
