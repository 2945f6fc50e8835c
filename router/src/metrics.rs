//! Every metric the router exports, named in one place (Prometheus text format at `GET /metrics`).
//! Counters for things that happen (requests, tokens, preemptions, cancellations), gauges only for
//! saturation (queue depth, running sequences, free KV blocks), histograms for latencies and step sizes.

use prometheus::{
    core::Collector, exponential_buckets, Counter, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec,
    IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Request outcomes, the label values of `rill_requests_total`.
#[derive(Debug, Clone, Copy)]
pub enum Outcome {
    /// Finished with its output.
    Success,
    /// Rejected by validation (4xx).
    Invalid,
    /// Rejected because the server was full (429).
    Overloaded,
    /// The client went away first, or was cut off for reading too slowly (`--max-unread-tokens`).
    Cancelled,
    /// Ran past its deadline (`timeout`, `--request-timeout`): 504, or an SSE `error` event.
    Timeout,
    /// Failed inside the server (shard error).
    Failed,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Invalid => "invalid",
            Outcome::Overloaded => "overloaded",
            Outcome::Cancelled => "cancelled",
            Outcome::Timeout => "timeout",
            Outcome::Failed => "failed",
        }
    }
}

/// Why a session pin was released before the next turn replaced it, the label values of
/// `rill_kv_pins_released_total`.
#[derive(Debug, Clone, Copy)]
pub enum PinRelease {
    /// Its TTL ran out.
    Expired,
    /// An allocation needed its blocks (after every unpinned cached block was evicted).
    Pressure,
    /// A newer pin needed room within `--max-pinned-kv-fraction` (the oldest pins go first).
    Bound,
}

impl PinRelease {
    const ALL: [PinRelease; 3] = [PinRelease::Expired, PinRelease::Pressure, PinRelease::Bound];

    fn label(self) -> &'static str {
        match self {
            PinRelease::Expired => "expired",
            PinRelease::Pressure => "pressure",
            PinRelease::Bound => "bound",
        }
    }
}

pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    pub queue_depth: IntGauge,
    pub running_sequences: IntGauge,
    pub kv_blocks_total: IntGauge,
    pub kv_blocks_free: IntGauge,
    /// Cached blocks no sequence holds: they serve prefix hits and are evicted when blocks run short.
    pub kv_blocks_cached_idle: IntGauge,
    pub prefix_cache_blocks: IntGauge,
    /// Share (0 to 1) of the usable KV blocks that sequences hold: vLLM's `vllm:kv_cache_usage_perc`, the
    /// gauge gateways balance by. Idle cached blocks do not count (an allocation evicts them), so it reads
    /// how full the pool is for new work.
    pub kv_cache_usage: Gauge,
    /// vLLM's `vllm:cache_config_info` in Rill's name (`set_kv_cache_config`): one series at a time.
    kv_cache_config_info: IntGaugeVec,
    /// The labels of its series now: block size and usable blocks.
    kv_cache_config_labels: std::sync::Mutex<Option<(usize, u32)>>,
    /// Session pins in force, and the cached blocks they keep from eviction.
    pub kv_pins: IntGauge,
    pub kv_pinned_blocks: IntGauge,
    /// Session pins made (a finished request with a `cache_pin`, e.g. `prompt_cache_key`).
    pub pins_created: IntCounter,
    /// Session pins released before their key's next turn replaced them, by `reason` (`PinRelease`).
    pins_released: IntCounterVec,
    /// Responses in the `/v1/responses` store, and their size in bytes (updated when read).
    pub responses_stored: IntGauge,
    pub responses_stored_bytes: IntGauge,
    pub prefix_cache_queried_tokens: IntCounter,
    pub prefix_cache_hit_tokens: IntCounter,
    pub prefix_cache_inserted_blocks: IntCounter,
    pub prefix_cache_evicted_blocks: IntCounter,
    /// KV-cache events (`--kv-events-endpoint`) dropped because the queue to the socket was full.
    pub kv_events_dropped: IntCounter,
    pub prompt_tokens_computed: IntCounter,
    pub generated_tokens: IntCounter,
    /// Preemptions by mechanism (`mode`: recompute or swap).
    pub preemptions: IntCounterVec,
    pub swapped_out_blocks: IntCounter,
    pub swapped_in_blocks: IntCounter,
    /// Blocks running sequences let go of because every layer's sliding window had left them.
    pub window_released_blocks: IntCounter,
    pub recomputed_tokens: IntCounter,
    pub swapped_sequences: IntGauge,
    pub swap_blocks_total: IntGauge,
    pub swap_blocks_free: IntGauge,
    pub cancelled_tokens: IntCounter,
    /// Requests cut off because their client left more than `--max-unread-tokens` events unread (also
    /// counted as `cancelled`).
    pub slow_readers: IntCounter,
    /// Seconds of model forward reported by the shards; against `step_duration`'s sum it gives the share
    /// of each step spent outside the model (planning, gRPC, batch preparation, sampling).
    pub model_forward_seconds: Counter,
    /// Seconds the engine loop spent on its own work around each forward call: planning the step
    /// (prefix-cache lookups, admission, preemption), applying it to the KV pool, and applying the sampled
    /// tokens (stop checks, caching computed blocks, releasing finished sequences).
    pub engine_planning_seconds: Counter,
    /// Seconds the engine spent computing constrained sequences' allowed-token masks (part of
    /// `engine_planning_seconds`).
    pub grammar_mask_seconds: Counter,
    /// Speculative decoding (vLLM's `spec_decode_*` counters): verifications (a sequence's proposals in
    /// one step), the tokens proposed, those accepted, and the engine loop's time spent proposing.
    pub spec_decode_drafts: IntCounter,
    pub spec_decode_draft_tokens: IntCounter,
    pub spec_decode_accepted_tokens: IntCounter,
    pub spec_decode_proposal_seconds: Counter,
    /// Seconds to get a request's compiled grammar, by `cache` (`miss`: compiled; `hit`: found).
    pub grammar_compile_seconds: HistogramVec,
    pub step_tokens: Histogram,
    pub step_duration: Histogram,
    pub queue_time: Histogram,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub end_to_end_latency: Histogram,
    /// Unix time of the last forward pass that succeeded, for readiness.
    pub last_progress_ms: IntGauge,
    /// Unknown OpenAI request fields that were ignored, by field name (see `count_ignored_field`).
    ignored_request_fields: IntCounterVec,
    /// The field names that have a series of their own, at most `MAX_IGNORED_FIELD_LABELS`.
    ignored_field_labels: std::sync::Mutex<std::collections::HashSet<String>>,
    /// vLLM's `vllm:lora_requests_info` in Rill's name (`set_lora_info`): one series at a time.
    lora_requests_info: GaugeVec,
    /// The labels of its series now: running adapters, waiting adapters, max_lora.
    lora_info_labels: std::sync::Mutex<[String; 3]>,
    /// Requests accepted (validated and queued) for a LoRA adapter, by `adapter` name.
    lora_requests: IntCounterVec,
}

/// Distinct field names `rill_ignored_request_fields_total` labels; later ones count under `other`, so
/// clients cannot grow the metric without bound.
const MAX_IGNORED_FIELD_LABELS: usize = 64;

/// Registers `metric` under its (unique) name and returns it.
fn register<M: Collector + Clone + 'static>(registry: &Registry, metric: M) -> M {
    registry
        .register(Box::new(metric.clone()))
        .expect("metric names are unique");
    metric
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let opts = HistogramOpts::new(name, help).buckets(buckets);
    register(registry, Histogram::with_opts(opts).expect("valid histogram"))
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    register(registry, IntGauge::new(name, help).expect("valid gauge"))
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    register(registry, IntCounter::new(name, help).expect("valid counter"))
}

fn float_counter(registry: &Registry, name: &str, help: &str) -> Counter {
    register(registry, Counter::new(name, help).expect("valid counter"))
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "rill_requests_total",
                    "Requests by outcome: success, invalid, overloaded, cancelled, failed",
                ),
                &["outcome"],
            )
            .expect("valid counter"),
        );
        // 1 ms .. ~33 s, and 1 .. 32k tokens.
        let seconds = exponential_buckets(0.001, 2.0, 16).expect("valid buckets");
        let tokens = exponential_buckets(1.0, 2.0, 16).expect("valid buckets");
        Self {
            queue_depth: gauge(&registry, "rill_queue_depth", "Requests waiting for admission"),
            running_sequences: gauge(&registry, "rill_running_sequences", "Sequences being computed"),
            kv_blocks_total: gauge(&registry, "rill_kv_blocks_total", "KV blocks a sequence can use"),
            kv_blocks_free: gauge(&registry, "rill_kv_blocks_free", "KV blocks free now"),
            kv_blocks_cached_idle: gauge(
                &registry,
                "rill_kv_blocks_cached_idle",
                "Cached KV blocks no sequence holds (evictable; pinned ones last)",
            ),
            prefix_cache_blocks: gauge(&registry, "rill_prefix_cache_blocks", "KV blocks in the prefix cache"),
            kv_cache_usage: register(
                &registry,
                Gauge::new(
                    "rill_kv_cache_usage_ratio",
                    "Share (0 to 1) of the usable KV blocks sequences hold (idle cached blocks do not count)",
                )
                .expect("valid gauge"),
            ),
            kv_cache_config_info: register(
                &registry,
                IntGaugeVec::new(
                    Opts::new(
                        "rill_kv_cache_config_info",
                        "The KV pool's block size in tokens and its usable blocks (labels; the value is 1)",
                    ),
                    &["block_size", "num_gpu_blocks"],
                )
                .expect("valid gauge"),
            ),
            kv_cache_config_labels: Default::default(),
            kv_pins: gauge(&registry, "rill_kv_pins", "Session pins in force"),
            kv_pinned_blocks: gauge(
                &registry,
                "rill_kv_pinned_blocks",
                "Cached KV blocks session pins keep from eviction",
            ),
            pins_created: counter(
                &registry,
                "rill_kv_pins_created_total",
                "Session pins made by finished requests (prompt_cache_key)",
            ),
            pins_released: {
                let released = register(
                    &registry,
                    IntCounterVec::new(
                        Opts::new(
                            "rill_kv_pins_released_total",
                            "Session pins released, by reason: expired, pressure (blocks were needed), bound \
                             (--max-pinned-kv-fraction)",
                        ),
                        &["reason"],
                    )
                    .expect("valid counter"),
                );
                for reason in PinRelease::ALL {
                    released.with_label_values(&[reason.label()]);
                }
                released
            },
            responses_stored: gauge(
                &registry,
                "rill_responses_stored",
                "Responses in the /v1/responses store",
            ),
            responses_stored_bytes: gauge(
                &registry,
                "rill_responses_stored_bytes",
                "Bytes of the responses in the /v1/responses store",
            ),
            prefix_cache_queried_tokens: counter(
                &registry,
                "rill_prefix_cache_queried_tokens_total",
                "Prompt tokens looked up in the prefix cache at first admission",
            ),
            prefix_cache_hit_tokens: counter(
                &registry,
                "rill_prefix_cache_hit_tokens_total",
                "Prompt tokens found in the prefix cache (not computed)",
            ),
            prefix_cache_inserted_blocks: counter(
                &registry,
                "rill_prefix_cache_inserted_blocks_total",
                "KV blocks entered into the prefix cache",
            ),
            prefix_cache_evicted_blocks: counter(
                &registry,
                "rill_prefix_cache_evicted_blocks_total",
                "KV blocks evicted from the prefix cache to make room",
            ),
            kv_events_dropped: counter(
                &registry,
                "rill_kv_events_dropped_total",
                "KV-cache events dropped because the queue to the events socket was full (the whole cache state follows)",
            ),
            prompt_tokens_computed: counter(
                &registry,
                "rill_prompt_tokens_computed_total",
                "Prompt tokens the shards computed (reused prompt tokens excluded)",
            ),
            generated_tokens: counter(&registry, "rill_generated_tokens_total", "Tokens generated"),
            preemptions: {
                let preemptions = register(
                    &registry,
                    IntCounterVec::new(
                        Opts::new(
                            "rill_preemptions_total",
                            "Sequences preempted to free KV blocks, by mode: recompute or swap",
                        ),
                        &["mode"],
                    )
                    .expect("valid counter"),
                );
                for mode in ["recompute", "swap"] {
                    preemptions.with_label_values(&[mode]);
                }
                preemptions
            },
            swapped_out_blocks: counter(
                &registry,
                "rill_swapped_out_blocks_total",
                "KV blocks copied to the host swap pool by swap preemptions",
            ),
            swapped_in_blocks: counter(
                &registry,
                "rill_swapped_in_blocks_total",
                "KV blocks copied back from the host swap pool when swapped sequences resumed",
            ),
            window_released_blocks: counter(
                &registry,
                "rill_window_released_blocks_total",
                "KV blocks running sequences released because the sliding window of every layer had left them",
            ),
            recomputed_tokens: counter(
                &registry,
                "rill_recomputed_tokens_total",
                "Tokens computed again after recompute preemptions (prefix-cache hits excluded)",
            ),
            swapped_sequences: gauge(
                &registry,
                "rill_swapped_sequences",
                "Sequences preempted to the host swap pool, waiting to resume",
            ),
            swap_blocks_total: gauge(&registry, "rill_swap_blocks_total", "Blocks of the host swap pool"),
            swap_blocks_free: gauge(&registry, "rill_swap_blocks_free", "Host swap-pool blocks free now"),
            cancelled_tokens: counter(
                &registry,
                "rill_cancelled_tokens_total",
                "Tokens (prompt + generated) held by requests when they were cancelled",
            ),
            slow_readers: counter(
                &registry,
                "rill_slow_readers_total",
                "Requests cancelled because their client fell more than --max-unread-tokens events behind",
            ),
            model_forward_seconds: float_counter(
                &registry,
                "rill_model_forward_seconds_total",
                "Seconds the shards spent in the model forward itself",
            ),
            engine_planning_seconds: float_counter(
                &registry,
                "rill_engine_planning_seconds_total",
                "Seconds the router's engine loop spent planning steps and applying their outputs",
            ),
            step_tokens: histogram(&registry, "rill_step_tokens", "Tokens computed per iteration", tokens),
            grammar_mask_seconds: float_counter(
                &registry,
                "rill_grammar_mask_seconds_total",
                "Seconds the engine loop spent computing allowed-token masks of constrained sequences",
            ),
            spec_decode_drafts: counter(
                &registry,
                "rill_spec_decode_num_drafts_total",
                "Speculative decoding: sequence steps that verified proposed tokens",
            ),
            spec_decode_draft_tokens: counter(
                &registry,
                "rill_spec_decode_num_draft_tokens_total",
                "Speculative decoding: tokens proposed and verified",
            ),
            spec_decode_accepted_tokens: counter(
                &registry,
                "rill_spec_decode_num_accepted_tokens_total",
                "Speculative decoding: proposed tokens accepted (equal to the token sampled at their position)",
            ),
            spec_decode_proposal_seconds: float_counter(
                &registry,
                "rill_spec_decode_proposal_seconds_total",
                "Speculative decoding: seconds the engine loop spent making proposals",
            ),
            grammar_compile_seconds: register(
                &registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "rill_grammar_compile_seconds",
                        "Seconds to get a request's compiled grammar, by cache (miss: compiled, hit: cached)",
                    )
                    .buckets(exponential_buckets(1e-5, 4.0, 12).expect("valid buckets")),
                    &["cache"],
                )
                .expect("valid histogram"),
            ),
            step_duration: histogram(
                &registry,
                "rill_step_duration_seconds",
                "Wall time of one iteration's forward call",
                seconds.clone(),
            ),
            queue_time: histogram(
                &registry,
                "rill_queue_time_seconds",
                "Time from arrival to first admission",
                seconds.clone(),
            ),
            time_to_first_token: histogram(
                &registry,
                "rill_time_to_first_token_seconds",
                "Time from arrival to the first token",
                seconds.clone(),
            ),
            inter_token_latency: histogram(
                &registry,
                "rill_inter_token_latency_seconds",
                "Time between two tokens of a request",
                seconds.clone(),
            ),
            end_to_end_latency: histogram(
                &registry,
                "rill_end_to_end_latency_seconds",
                "Time from arrival to the last token",
                seconds,
            ),
            last_progress_ms: gauge(
                &registry,
                "rill_last_progress_timestamp_milliseconds",
                "Unix time of the last successful forward pass",
            ),
            ignored_request_fields: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "rill_ignored_request_fields_total",
                        "Unknown request fields ignored, by name (`other` past 64 distinct names)",
                    ),
                    &["field"],
                )
                .expect("valid counter"),
            ),
            ignored_field_labels: Default::default(),
            lora_requests_info: register(
                &registry,
                GaugeVec::new(
                    Opts::new(
                        "rill_lora_requests_info",
                        "LoRA adapters of running and waiting requests (comma-separated names) and the \
                         adapters one batch may use; the value is the Unix time of the last change",
                    ),
                    &["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                )
                .expect("valid gauge"),
            ),
            lora_info_labels: Default::default(),
            lora_requests: register(
                &registry,
                IntCounterVec::new(
                    Opts::new(
                        "rill_lora_requests_total",
                        "Requests accepted (validated and queued) for a LoRA adapter, by adapter name",
                    ),
                    &["adapter"],
                )
                .expect("valid counter"),
            ),
            requests,
            registry,
        }
    }

    /// Counts an ignored request field under its own name while fewer than 64 names have a series (and
    /// the name is a short identifier), else under `other`.
    pub fn count_ignored_field(&self, field: &str) {
        let is_identifier =
            field.len() <= 64 && !field.is_empty() && field.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        let mut labels = self
            .ignored_field_labels
            .lock()
            .expect("never poisoned: no panics while held");
        let has_room = labels.len() < MAX_IGNORED_FIELD_LABELS;
        let label = if is_identifier && (labels.contains(field) || has_room) {
            labels.insert(field.to_owned());
            field
        } else {
            "other"
        };
        self.ignored_request_fields.with_label_values(&[label]).inc();
    }

    pub fn count_pins_released(&self, reason: PinRelease, num_pins: usize) {
        self.pins_released
            .with_label_values(&[reason.label()])
            .inc_by(num_pins as u64);
    }

    #[cfg(test)]
    pub fn num_pins_released(&self, reason: PinRelease) -> u64 {
        self.pins_released.with_label_values(&[reason.label()]).get()
    }

    pub fn count_request(&self, outcome: Outcome) {
        self.requests.with_label_values(&[outcome.label()]).inc();
    }

    #[cfg(test)]
    pub fn num_requests(&self, outcome: Outcome) -> u64 {
        self.requests.with_label_values(&[outcome.label()]).get()
    }

    /// Sets `rill_lora_requests_info`, in the shape of vLLM's `vllm:lora_requests_info` that the Gateway API
    /// Inference Extension's endpoint picker reads (`--lora-info-metric`) to route a request to a replica
    /// that runs its adapter: labels `running_lora_adapters` and `waiting_lora_adapters` (the adapters'
    /// names, comma-separated) and `max_lora`; the value is the Unix time (seconds) of the last change.
    /// Unlike vLLM, which leaves a series behind at every change (readers take the newest), the previous
    /// series is removed, so there is one.
    pub fn set_lora_info(&self, running: &str, waiting: &str, max_lora: u32) {
        let labels = [running.to_owned(), waiting.to_owned(), max_lora.to_string()];
        let mut current = self
            .lora_info_labels
            .lock()
            .expect("never poisoned: no panics while held");
        // (The labels start empty, so the first call always sets a series: `max_lora` is never empty.)
        if *current == labels {
            return;
        }
        self.lora_requests_info.reset();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or_default();
        let label_refs: Vec<&str> = labels.iter().map(String::as_str).collect();
        self.lora_requests_info.with_label_values(&label_refs).set(now);
        *current = labels;
    }

    /// Sets `rill_kv_cache_config_info`, in the shape of vLLM's `vllm:cache_config_info` that the Gateway
    /// API Inference Extension's endpoint picker reads (`cacheInfoSpec`): labels `block_size` (tokens) and
    /// `num_gpu_blocks` (the usable blocks of the device pool, whatever the device: the label keeps vLLM's
    /// name so readers of vLLM's metric read Rill's), value 1. The pool is sized again after a shard
    /// restart, so a change replaces the series.
    pub fn set_kv_cache_config(&self, block_size: usize, num_blocks: u32) {
        let mut current = self
            .kv_cache_config_labels
            .lock()
            .expect("never poisoned: no panics while held");
        if *current == Some((block_size, num_blocks)) {
            return;
        }
        self.kv_cache_config_info.reset();
        self.kv_cache_config_info
            .with_label_values(&[&block_size.to_string(), &num_blocks.to_string()])
            .set(1);
        *current = Some((block_size, num_blocks));
    }

    /// Counts a request accepted for LoRA adapter `adapter`.
    pub fn count_lora_request(&self, adapter: &str) {
        self.lora_requests.with_label_values(&[adapter]).inc();
    }

    /// Records that a forward pass succeeded now.
    pub fn mark_progress(&self) {
        self.last_progress_ms.set(unix_ms());
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buffer = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buffer)
            .expect("encoding into a Vec cannot fail");
        String::from_utf8(buffer).expect("the text format is UTF-8")
    }
}

fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_config_info_has_one_series_with_vllms_labels() {
        let metrics = Metrics::new();
        metrics.set_kv_cache_config(16, 100);
        metrics.set_kv_cache_config(16, 100);
        let text = metrics.render();
        assert!(
            text.contains("rill_kv_cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\"} 1"),
            "{text}"
        );
        metrics.set_kv_cache_config(16, 80);
        let text = metrics.render();
        assert!(
            text.contains("rill_kv_cache_config_info{block_size=\"16\",num_gpu_blocks=\"80\"} 1"),
            "{text}"
        );
        assert_eq!(text.matches("rill_kv_cache_config_info{").count(), 1, "{text}");
    }
}
