//! Service routes: health, info, tokenization, and the API's own description.

use axum::{
    extract::{rejection::JsonRejection, State},
    http::StatusCode,
    response::{Html, IntoResponse, Response},
    Json,
};
use utoipa::OpenApi;

use super::{ApiError, AppState};
use crate::api::{
    AttentionInfo, DetokenizeRequest, DetokenizeResponse, ErrorResponse, Info, KvInfo, LoadsResponse, LoraAdapterInfo,
    LoraInfo, PinInfo, RankLoad, TokenSpan, TokenizeRequest, TokenizeResponse,
};
use crate::engine::{EngineError, EngineStats};
use crate::kv::kv_window;

/// Liveness: 200 while the router and its engine task run; 503 once the engine task has died (the
/// router then exits, for its supervisor to restart it).
#[utoipa::path(get, path = "/health", tag = "service", responses((status = 200), (status = 503)))]
pub async fn health(State(state): State<AppState>) -> Response {
    if state.engine.is_running() {
        StatusCode::OK.into_response()
    } else {
        not_ready(EngineError::Stopped.to_string())
    }
}

/// 503 with a JSON body naming the reason.
fn not_ready(reason: String) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(serde_json::json!({"status": "not_ready", "reason": reason})),
    )
        .into_response()
}

/// How long the engine may go without a successful forward pass while it has work, and still be ready.
const MAX_STALL: std::time::Duration = std::time::Duration::from_secs(60);

/// Readiness: the engine runs, the shards answer and, whenever requests wait or run, the engine made
/// forward progress within the last minute. 503 with the reason otherwise.
#[utoipa::path(get, path = "/ready", tag = "service", responses((status = 200), (status = 503)))]
pub async fn ready(State(state): State<AppState>) -> Response {
    if state.draining.load(std::sync::atomic::Ordering::SeqCst) {
        return not_ready("shutting down: finishing the requests in flight".into());
    }
    if let Err(e) = state.engine.health().await {
        return not_ready(e.to_string());
    }
    let stats = state.engine.stats();
    let stalled = stats.since_progress();
    if stats.has_work() && stalled > MAX_STALL {
        return not_ready(format!(
            "no forward progress for {} s while requests wait",
            stalled.as_secs()
        ));
    }
    Json(serde_json::json!({"status": "ready"})).into_response()
}

/// Prometheus metrics.
#[utoipa::path(get, path = "/metrics", tag = "service", responses((status = 200, content_type = "text/plain")))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    super::responses::store_size(&state);
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.engine.metrics.render(),
    )
        .into_response()
}

/// The model, the limits, and the KV pool as the engine last published it (after its latest step).
#[utoipa::path(get, path = "/info", tag = "service", responses((status = 200, body = Info)))]
pub async fn info(State(state): State<AppState>) -> Json<Info> {
    let stats = state.engine.stats();
    Json(Info {
        model_id: state.model_id.clone(),
        served_model_name: state.served_model_name.clone(),
        model_type: state.shard_info.model_type.clone(),
        model_architecture: state.shard_info.architecture.clone(),
        attention: AttentionInfo::from_windows(&state.shard_info.sliding_windows),
        model_dtype: state.shard_info.dtype.clone(),
        model_device_type: state.shard_info.device.clone(),
        num_shard: state.shard_info.world_size,
        max_input_tokens: state.limits.max_input_tokens,
        max_total_tokens: state.limits.max_total_tokens,
        max_batch_tokens: state.batch.max_batch_tokens,
        max_batch_size: state.batch.max_batch_size,
        max_concurrent_requests: state.limits.max_concurrent_requests,
        max_stop_sequences: state.limits.max_stop_sequences,
        kv: KvInfo {
            block_size: state.shard_info.block_size,
            total_blocks: stats.num_usable_blocks,
            free_blocks: stats.num_free_blocks,
            cached_blocks: stats.num_cached_idle_blocks,
            used_blocks: stats.num_used_blocks(),
            prefix_cache_blocks: stats.num_prefix_cache_blocks,
            waiting_requests: stats.num_waiting as u32,
            running_requests: stats.num_running as u32,
            prompt_tokens_computed: stats.num_prompt_tokens_computed,
            kv_window: kv_window(&state.shard_info.sliding_windows) as u32,
            window_released_blocks: stats.num_window_released_blocks,
            pins: PinInfo {
                pins: stats.num_pins,
                pinned_blocks: stats.num_pinned_blocks,
                max_pinned_blocks: stats.max_pinned_blocks,
                default_ttl_s: state.limits.cache_pin_ttl.as_secs(),
                max_ttl_s: state.limits.max_cache_pin_ttl.as_secs(),
            },
            draft_total_blocks: stats.num_usable_draft_blocks,
            draft_free_blocks: stats.num_free_draft_blocks,
        },
        memory: state.memory.clone(),
        responses_store: super::responses::store_size(&state),
        lora: LoraInfo {
            max_loras: state.engine.adapters.max_loras,
            max_lora_rank: state.engine.adapters.max_lora_rank,
            runtime_loading: state.is_lora_loading_enabled,
            adapters: state
                .engine
                .adapters
                .ready()
                .into_iter()
                .map(|adapter| LoraAdapterInfo {
                    name: adapter.name.to_string(),
                    id: adapter.id,
                    path: adapter.path,
                    rank: adapter.rank,
                    target_modules: adapter.target_modules,
                })
                .collect(),
        },
        version: env!("CARGO_PKG_VERSION"),
    })
}

/// The replica's load for gateways that balance by it (smg): SGLang's `/v1/loads` schema. The `include`
/// query smg sends is accepted and the `core` section is what comes back.
#[utoipa::path(get, path = "/v1/loads", tag = "service", responses((status = 200, body = LoadsResponse)))]
pub async fn loads(State(state): State<AppState>) -> Json<LoadsResponse> {
    let metrics = &state.engine.metrics;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or_default();
    Json(LoadsResponse {
        timestamp: rfc3339_utc(now),
        dp_rank_count: 1,
        loads: vec![rank_load(
            &state.engine.stats(),
            state.shard_info.block_size,
            (
                metrics.prefix_cache_hit_tokens.get(),
                metrics.prefix_cache_queried_tokens.get(),
            ),
            state.batch.max_batch_size,
        )],
    })
}

/// The load of the engine in `stats`; `(hit, queried)`: prompt tokens found in the prefix cache and
/// looked up, since start.
fn rank_load(stats: &EngineStats, block_size: u32, (hit, queried): (u64, u64), max_batch_size: u32) -> RankLoad {
    let num_waiting = (stats.num_waiting + stats.num_swapped) as u32;
    RankLoad {
        dp_rank: 0,
        num_running_reqs: stats.num_running as u32,
        num_waiting_reqs: num_waiting,
        num_total_reqs: stats.num_running as u32 + num_waiting,
        num_used_tokens: u64::from(stats.num_used_blocks()) * u64::from(block_size),
        max_total_num_tokens: u64::from(stats.num_usable_blocks) * u64::from(block_size),
        token_usage: stats.kv_cache_usage(),
        cache_hit_rate: if queried == 0 { 0.0 } else { hit as f64 / queried as f64 },
        max_running_requests: max_batch_size,
    }
}

/// `unix_s` as RFC 3339 in UTC (`2026-12-06T16:59:26Z`); the days become a civil date by Howard Hinnant's
/// `civil_from_days`.
fn rfc3339_utc(unix_s: u64) -> String {
    let (days, seconds) = (unix_s / 86_400, unix_s % 86_400);
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        seconds / 3_600,
        seconds % 3_600 / 60,
        seconds % 60
    )
}

/// Token ids and their text, for a plain prompt or for chat messages (rendered with the chat template).
#[utoipa::path(post, path = "/tokenize", tag = "service", request_body = TokenizeRequest,
    responses((status = 200, body = TokenizeResponse), (status = 400, body = ErrorResponse),
              (status = 401, body = ErrorResponse), (status = 413, body = ErrorResponse),
              (status = 422, body = ErrorResponse)))]
pub async fn tokenize(
    State(state): State<AppState>,
    body: Result<Json<TokenizeRequest>, JsonRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let Json(request) = body?;
    let mut variables = serde_json::Map::new();
    if let Some(tools) = request.tools.filter(|tools| !tools.is_empty()) {
        variables.insert("tools".into(), serde_json::to_value(tools).expect("tools serialize"));
    }
    let (prompt, add_special_tokens) = match (request.prompt, request.messages) {
        (Some(prompt), None) if variables.is_empty() => (prompt, request.add_special_tokens.unwrap_or(true)),
        (None, Some(messages)) => (
            state.render_chat(&messages, request.add_generation_prompt.unwrap_or(true), &variables)?,
            false,
        ),
        _ => {
            return Err(ApiError::Unprocessable(
                "give exactly one of `prompt` (or `inputs`) and `messages` (`tools` go with `messages`)".into(),
            ))
        }
    };
    let encoding = state.validator.tokenize(prompt.clone(), add_special_tokens).await?;
    let max = state.limits.max_input_tokens;
    if encoding.len() > max as usize {
        return Err(crate::validation::ValidationError::InputTooLong(encoding.len(), max).into());
    }
    let tokens: Vec<TokenSpan> = encoding
        .get_ids()
        .iter()
        .zip(encoding.get_offsets())
        .map(|(&id, &(start, stop))| TokenSpan {
            id,
            text: prompt.get(start..stop).unwrap_or_default().to_owned(),
            start,
            stop,
        })
        .collect();
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        prompt,
        tokens,
        max_input_tokens: state.limits.max_input_tokens,
    }))
}

/// Text of token ids.
#[utoipa::path(post, path = "/detokenize", tag = "service", request_body = DetokenizeRequest,
    responses((status = 200, body = DetokenizeResponse), (status = 400, body = ErrorResponse),
              (status = 401, body = ErrorResponse), (status = 413, body = ErrorResponse),
              (status = 422, body = ErrorResponse)))]
pub async fn detokenize(
    State(state): State<AppState>,
    body: Result<Json<DetokenizeRequest>, JsonRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let Json(request) = body?;
    let vocab_size = state.shard_info.vocab_size;
    if let Some(&id) = request.tokens.iter().find(|&&id| id >= vocab_size) {
        return Err(crate::validation::ValidationError::TokenOutOfVocab(id, "tokens", vocab_size).into());
    }
    Ok(Json(DetokenizeResponse {
        prompt: state.decode(&request.tokens, request.skip_special_tokens.unwrap_or(true)),
    }))
}

/// The OpenAPI document of every route, generated from the code.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rill",
        description = "LLM serving: TGI-compatible, OpenAI-compatible and Anthropic-compatible APIs"
    ),
    paths(
        super::native::compat,
        super::native::generate,
        super::native::generate_stream,
        super::openai::completions,
        super::chat::chat_completions,
        super::render::completions,
        super::render::chat_completions,
        super::messages::messages,
        super::messages::count_tokens,
        super::responses::create,
        super::responses::retrieve,
        super::responses::delete,
        super::responses::cancel,
        super::responses::input_items,
        super::openai::models,
        super::openai::model,
        super::lora::load,
        super::lora::unload,
        health,
        ready,
        metrics,
        info,
        loads,
        tokenize,
        detokenize,
    )
)]
pub struct ApiDoc;

/// `GET /openapi.json`.
pub async fn openapi() -> Json<utoipa::openapi::OpenApi> {
    Json(ApiDoc::openapi())
}

/// `GET /docs`: a self-contained page (no scripts from elsewhere) listing every route and its schemas.
pub async fn docs() -> Html<String> {
    let doc = ApiDoc::openapi();
    let mut html = String::from(
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>Rill API</title><style>\
         body{font-family:sans-serif;max-width:60em;margin:2em auto}code,pre{background:#f4f4f4}\
         pre{padding:1em;overflow:auto}h2{border-top:1px solid #ccc;padding-top:1em}</style></head><body>\
         <h1>Rill API</h1><p>Machine-readable: <a href=\"/openapi.json\">/openapi.json</a></p>",
    );
    for (path, item) in &doc.paths.paths {
        for (method, operation) in [("GET", &item.get), ("POST", &item.post)] {
            let Some(operation) = operation else { continue };
            html.push_str(&format!(
                "<h2><code>{method} {}</code></h2><p>{}</p>",
                escape(path),
                escape(
                    operation
                        .description
                        .as_deref()
                        .or(operation.summary.as_deref())
                        .unwrap_or_default()
                )
            ));
            if let Some(body) = &operation.request_body {
                let json = serde_json::to_string_pretty(body).unwrap_or_default();
                html.push_str(&format!(
                    "<details><summary>request body</summary><pre>{}</pre></details>",
                    escape(&json)
                ));
            }
        }
    }
    if let Some(components) = &doc.components {
        html.push_str("<h2>Schemas</h2>");
        for (name, schema) in &components.schemas {
            let json = serde_json::to_string_pretty(schema).unwrap_or_default();
            html.push_str(&format!(
                "<details><summary><code>{}</code></summary><pre>{}</pre></details>",
                escape(name),
                escape(&json)
            ));
        }
    }
    html.push_str("</body></html>");
    Html(html)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unix_time_reads_as_rfc3339() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_796_575_166), "2026-12-06T16:39:26Z");
    }

    #[test]
    fn the_load_counts_held_blocks_and_everything_not_running_as_waiting() {
        let stats = EngineStats {
            num_usable_blocks: 100,
            num_free_blocks: 60,
            num_cached_idle_blocks: 15,
            num_waiting: 3,
            num_running: 5,
            num_swapped: 2,
            ..EngineStats::default()
        };
        let load = rank_load(&stats, 16, (30, 120), 8);
        assert_eq!(
            load,
            RankLoad {
                dp_rank: 0,
                num_running_reqs: 5,
                num_waiting_reqs: 5,
                num_total_reqs: 10,
                num_used_tokens: 25 * 16,
                max_total_num_tokens: 1_600,
                token_usage: 0.25,
                cache_hit_rate: 0.25,
                max_running_requests: 8,
            }
        );
        assert_eq!(rank_load(&EngineStats::default(), 16, (0, 0), 8).cache_hit_rate, 0.0);
    }
}
