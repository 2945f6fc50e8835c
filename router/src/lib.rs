//! The router as a library: the binary (`main.rs`) wires these modules together; benchmarks use them
//! directly.

pub mod api;
pub mod chat_template;
pub mod config;
pub mod engine;
pub mod grammar;
pub mod http;
pub mod kv;
pub mod kv_events;
pub mod lora;
pub mod metrics;
pub mod scheduler;
pub mod shard;
pub mod speculative;
pub mod telemetry;
pub mod text;
pub mod validation;
