//! Loading and unloading LoRA adapters at run time, in vLLM's shape: `POST /v1/load_lora_adapter`
//! `{"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter` `{"lora_name"}`, each answering 200
//! with a short text. Off unless `--enable-lora-loading` (404 naming the flag). An unloaded adapter's name
//! is free at once; requests already running with it finish first (see `crate::lora`). `load_adapter` is
//! also how `--lora-adapters` are loaded at start.

use axum::{
    extract::{rejection::JsonRejection, State},
    Json,
};

use super::{error::OpenAiError, openai::now, ApiError, AppState};
use crate::{
    api::openai::{ErrorResponse, LoadLoraAdapterRequest, UnloadLoraAdapterRequest},
    lora::{AdapterInfo, Adapters},
    shard::{pb, ShardClient},
};

/// Loads the PEFT folder `path` on every shard as adapter `name` (under a new id); requests may name it
/// once this returns Ok. `base_name` (the served model's) is no adapter's name.
pub(super) async fn load_adapter(
    adapters: &Adapters,
    shards: &dyn ShardClient,
    name: &str,
    path: &str,
    base_name: &str,
) -> Result<AdapterInfo, ApiError> {
    let id = adapters.reserve(name, base_name)?;
    let request = pb::LoadAdapterRequest {
        adapter_id: id,
        path: path.into(),
    };
    match shards.load_adapter(request).await {
        Ok(loaded) => {
            let info = AdapterInfo {
                id,
                name: name.into(),
                path: path.into(),
                rank: loaded.rank,
                target_modules: loaded.target_modules,
                created: now(),
            };
            adapters.complete(info.clone());
            Ok(info)
        }
        Err(error) => {
            adapters.cancel(name);
            Err(ApiError::LoraLoad {
                name: name.into(),
                path: path.into(),
                error,
            })
        }
    }
}

fn check_enabled(state: &AppState) -> Result<(), ApiError> {
    match state.is_lora_loading_enabled {
        true => Ok(()),
        false => Err(ApiError::LoraLoadingDisabled),
    }
}

/// Load a LoRA adapter on every shard; requests may name it once this answers.
#[utoipa::path(post, path = "/v1/load_lora_adapter", tag = "lora", request_body = LoadLoraAdapterRequest,
    responses((status = 200, body = String), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
              (status = 404, body = ErrorResponse), (status = 422, body = ErrorResponse),
              (status = 500, body = ErrorResponse)))]
pub async fn load(
    State(state): State<AppState>,
    body: Result<Json<LoadLoraAdapterRequest>, JsonRejection>,
) -> Result<String, OpenAiError> {
    check_enabled(&state)?;
    let Json(request) = body?;
    let shards = state.engine.shards();
    let adapter = load_adapter(
        &state.engine.adapters,
        &*shards,
        &request.lora_name,
        &request.lora_path,
        &state.served_model_name,
    )
    .await?;
    tracing::info!(name = %adapter.name, path = adapter.path, id = adapter.id, rank = adapter.rank, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{}' added successfully.", adapter.name))
}

/// Unload a LoRA adapter: new requests for it get 404 at once; those running with it finish.
#[utoipa::path(post, path = "/v1/unload_lora_adapter", tag = "lora", request_body = UnloadLoraAdapterRequest,
    responses((status = 200, body = String), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse),
              (status = 422, body = ErrorResponse)))]
pub async fn unload(
    State(state): State<AppState>,
    body: Result<Json<UnloadLoraAdapterRequest>, JsonRejection>,
) -> Result<String, OpenAiError> {
    check_enabled(&state)?;
    let Json(request) = body?;
    state.engine.adapters.unload(&request.lora_name)?;
    tracing::info!(name = request.lora_name, "LoRA adapter unloaded");
    Ok(format!(
        "Success: LoRA adapter '{}' removed successfully.",
        request.lora_name
    ))
}
