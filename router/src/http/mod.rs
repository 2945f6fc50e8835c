//! The HTTP API (axum): routes, handlers, streaming, and the mapping of errors to responses.
//! Handlers validate, submit to the engine and shape its events; they never tokenize, schedule or touch KV.

mod error;
mod handlers;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::{
    routing::{get, post},
    Router,
};
use tokio::sync::Semaphore;

pub use error::ApiError;

use crate::{config::LimitsConfig, engine::EngineHandle, shard::pb, validation::Validator};

/// Everything the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub validator: Validator,
    /// One permit per request in the server; none left means 429.
    pub admission: Arc<Semaphore>,
    pub model_id: String,
    pub shard_info: pb::InfoResponse,
    pub limits: LimitsConfig,
    pub batch: crate::config::BatchConfig,
}

/// The router's HTTP application.
pub fn app(state: AppState) -> Router {
    Router::new()
        .route("/generate", post(handlers::generate))
        .route("/generate_stream", post(handlers::generate_stream))
        .route("/health", get(handlers::health))
        .route("/info", get(handlers::info))
        .with_state(state)
}
