//! The api's Prometheus series, through the `metrics` facade and its Prometheus exporter
//! (`metrics-exporter-prometheus`, without its HTTP listener: `/metrics` is our route).
//! The pair is the de-facto standard in Rust services (TGI uses it): macros that record
//! from any task without a registry to pass around, lock-free histograms, and a renderer
//! of the text format, so no exposition is written by hand here.
//!
//! Series follow vLLM's names with the `mmserve_` prefix (a vLLM dashboard ports by
//! changing the prefix) and carry a `model_name` label; `docs/metrics.md` lists every one
//! with its type, labels, meaning and vLLM counterpart. Three kinds of source:
//! - per request, recorded here as choices progress ([`ChoiceMeter`]): latencies, token
//!   counts, finish reasons; the engine's queue, prefill and decode intervals come with a
//!   choice's last event, the encoder's per-item times with its `encode` answer;
//! - the other services' counters and gauges, read from their stats at each scrape;
//! - the api's own queue.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use mmserve_protocol::{CacheStats, EncoderStats, EngineInfo, FinishReason, ItemTiming, RequestTiming};

/// Seconds to the first token (vLLM's buckets, with finer ones below 10 ms).
const TTFT: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// Seconds between tokens (vLLM's, from 1 ms: a GPU decodes a token in a few).
const PER_TOKEN: &[f64] = &[
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
];
/// Seconds a request or a phase of it takes (vLLM's, from 10 ms).
const REQUEST: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
];
/// Seconds an item's preprocessing or tower forward takes.
const ENCODER: &[f64] = &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

pub const TIME_TO_FIRST_TOKEN: &str = "mmserve_time_to_first_token_seconds";
pub const TIME_PER_OUTPUT_TOKEN: &str = "mmserve_time_per_output_token_seconds";
pub const INTER_TOKEN_LATENCY: &str = "mmserve_inter_token_latency_seconds";
pub const E2E_LATENCY: &str = "mmserve_e2e_request_latency_seconds";
pub const QUEUE_TIME: &str = "mmserve_request_queue_time_seconds";
pub const PREFILL_TIME: &str = "mmserve_request_prefill_time_seconds";
pub const DECODE_TIME: &str = "mmserve_request_decode_time_seconds";
pub const INFERENCE_TIME: &str = "mmserve_request_inference_time_seconds";
pub const PROMPT_TOKENS: &str = "mmserve_request_prompt_tokens";
pub const GENERATION_TOKENS: &str = "mmserve_request_generation_tokens";
pub const CACHED_TOKENS: &str = "mmserve_request_cached_tokens";
pub const SUCCESS: &str = "mmserve_request_success_total";
pub const PREPROCESS_TIME: &str = "mmserve_encoder_preprocess_seconds";
pub const TOWER_TIME: &str = "mmserve_encoder_tower_seconds";
pub const REQUESTS: &str = "mmserve_requests_total";
pub const FAILED: &str = "mmserve_requests_failed_total";
pub const SHED: &str = "mmserve_requests_shed_total";
pub const PROMPT_TOKENS_TOTAL: &str = "mmserve_prompt_tokens_total";
pub const GENERATION_TOKENS_TOTAL: &str = "mmserve_generation_tokens_total";

/// The process's recorder: installed once (the first model name labels every series).
static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the recorder (once per process), describes every series, and keeps the
/// exporter's histograms drained between scrapes.
pub fn install(model_name: &str, max_model_len: u64) -> PrometheusHandle {
    let handle = HANDLE.get_or_init(|| {
        let tokens = tokens_buckets(max_model_len);
        let mut builder = PrometheusBuilder::new().add_global_label("model_name", model_name);
        let buckets: [(&str, &[f64]); 14] = [
            (TIME_TO_FIRST_TOKEN, TTFT),
            (TIME_PER_OUTPUT_TOKEN, PER_TOKEN),
            (INTER_TOKEN_LATENCY, PER_TOKEN),
            (E2E_LATENCY, REQUEST),
            (QUEUE_TIME, REQUEST),
            (PREFILL_TIME, REQUEST),
            (DECODE_TIME, REQUEST),
            (INFERENCE_TIME, REQUEST),
            (PROMPT_TOKENS, &tokens),
            (GENERATION_TOKENS, &tokens),
            (CACHED_TOKENS, &tokens),
            (PREPROCESS_TIME, ENCODER),
            (TOWER_TIME, ENCODER),
            (REQUESTS, &[]),
        ];
        for (name, b) in buckets.into_iter().filter(|(_, b)| !b.is_empty()) {
            // Only an empty bucket list is refused, and none is.
            builder = builder.set_buckets_for_metric(Matcher::Full(name.into()), b).unwrap_or_else(|_| unreachable!());
        }
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics shows none of the api's series");
        }
        describe();
        // Every series from the start (at zero), so that dashboards and the gateway see
        // them before the first request.
        for name in [REQUESTS, FAILED, SHED, PROMPT_TOKENS_TOTAL, GENERATION_TOKENS_TOTAL] {
            counter!(name).increment(0);
        }
        for reason in ["stop", "length", "abort", "error"] {
            counter!(SUCCESS, "finished_reason" => reason).increment(0);
        }
        let upkeep = handle.clone();
        // Histograms buffer samples until a render or an upkeep drains them: bound that
        // buffer when nothing scrapes.
        std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::park_timeout(Duration::from_secs(5));
                    upkeep.run_upkeep();
                }
            })
            .ok();
        handle
    });
    handle.clone()
}

/// 1, 2, 5, 10, 20, 50, … up to `max` (vLLM's token buckets).
fn tokens_buckets(max: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale = 1u64;
    'outer: loop {
        for m in [1, 2, 5] {
            let v = m * scale;
            if v > max.max(1) {
                break 'outer;
            }
            out.push(v as f64);
        }
        scale = scale.saturating_mul(10);
    }
    out
}

fn describe() {
    describe_histogram!(TIME_TO_FIRST_TOKEN, "Seconds from a request's arrival to a choice's first token.");
    describe_histogram!(
        TIME_PER_OUTPUT_TOKEN,
        "Seconds per output token after the first, per finished choice: (last − first token) / (tokens − 1)."
    );
    describe_histogram!(INTER_TOKEN_LATENCY, "Seconds between consecutive tokens of a choice, each gap.");
    describe_histogram!(E2E_LATENCY, "Seconds from a request's arrival to a choice's last token (finished choices).");
    describe_histogram!(QUEUE_TIME, "Seconds a choice waited in the engine before its first scheduled step.");
    describe_histogram!(PREFILL_TIME, "Seconds from a choice's first scheduled step to its first token.");
    describe_histogram!(DECODE_TIME, "Seconds from a choice's first token to its last.");
    describe_histogram!(INFERENCE_TIME, "Seconds from a choice's first scheduled step to its last token.");
    describe_histogram!(PROMPT_TOKENS, "Prompt tokens of a finished choice, expanded media included.");
    describe_histogram!(GENERATION_TOKENS, "Tokens generated by a finished choice.");
    describe_histogram!(CACHED_TOKENS, "Prompt tokens of a finished choice served from the prefix cache.");
    describe_histogram!(PREPROCESS_TIME, "Seconds the encoder took to decode and preprocess an item.");
    describe_histogram!(TOWER_TIME, "Seconds of the encoder tower forward (its whole batch) an item was in.");
    describe_counter!(SUCCESS, "Choices ended, by finished_reason (stop, length, abort, error).");
    describe_counter!(REQUESTS, "Chat completion requests received.");
    describe_counter!(FAILED, "Requests answered with an error.");
    describe_counter!(SHED, "Requests refused with 429 (queue full).");
    describe_counter!(PROMPT_TOKENS_TOTAL, "Prompt tokens of started requests, expanded media included.");
    describe_counter!(GENERATION_TOKENS_TOTAL, "Generated tokens.");
    describe_gauge!("mmserve_queued_requests", "Requests in the api waiting for their first token.");
    describe_gauge!("mmserve_queued_prompt_tokens", "Prompt tokens of the requests waiting in the api.");
    describe_counter!("mmserve_embed_cache_hits_total", "Items found in the embed cache.");
    describe_counter!("mmserve_embed_cache_misses_total", "Items added to the embed cache.");
    describe_counter!("mmserve_embed_cache_evictions_total", "Items evicted from the embed cache.");
    describe_gauge!("mmserve_embed_cache_items", "Items in the embed cache.");
    describe_gauge!("mmserve_embed_cache_slots_used", "Embedding slots in use.");
    describe_gauge!("mmserve_embed_cache_slots_total", "Embedding slots in the arena.");
    describe_gauge!("mmserve_embed_cache_references", "References held by requests in flight.");
    describe_gauge!("mmserve_embed_cache_waiting", "Requests waiting for embed-cache capacity.");
    describe_counter!("mmserve_encoder_items_total", "Items run through the encoder tower.");
    describe_counter!("mmserve_encoder_batches_total", "Encoder tower forwards.");
    describe_gauge!("mmserve_num_requests_running", "Requests in the engine's running batch.");
    describe_gauge!("mmserve_num_requests_waiting", "Requests waiting in the engine to be scheduled.");
    describe_gauge!("mmserve_kv_cache_usage_perc", "Fraction of KV blocks in use (0 to 1).");
    describe_gauge!("mmserve_kv_blocks_used", "KV blocks held by running requests.");
    describe_gauge!("mmserve_kv_blocks_total", "KV blocks in the pool.");
    describe_gauge!("mmserve_cache_config_info", "The KV cache's configuration, in labels (value 1).");
    describe_gauge!("vllm:num_requests_waiting", "Inference gateway protocol: requests not yet giving tokens.");
    describe_gauge!("vllm:num_requests_running", "Inference gateway protocol: requests in the running batch.");
    describe_gauge!("vllm:kv_cache_usage_perc", "Inference gateway protocol: fraction of KV blocks in use.");
    describe_gauge!("vllm:cache_config_info", "Inference gateway protocol: block_size and num_gpu_blocks.");
    describe_counter!("mmserve_prefix_cache_hit_tokens_total", "Prompt tokens whose KV came from the prefix cache.");
    describe_counter!("mmserve_num_preemptions_total", "Requests preempted for lack of KV blocks.");
    describe_counter!("mmserve_prefill_tokens_total", "Prompt tokens computed by the engine.");
    describe_counter!("mmserve_forks_total", "Choices started from a sibling's prompt.");
    describe_counter!("mmserve_engine_steps_total", "Model steps of the engine.");
    describe_counter!("mmserve_engine_schedule_microseconds_total", "Time the engine spent scheduling.");
    describe_counter!("mmserve_engine_step_microseconds_total", "Time the engine spent in steps.");
}

/// The finish reason's label value.
pub fn reason_label(r: &FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Abort => "abort",
        FinishReason::Error(_) | FinishReason::Retry(_) => "error",
    }
}

/// The encoder's times of the items a request had encoded.
pub fn encoded(timings: &[ItemTiming]) {
    for t in timings {
        histogram!(PREPROCESS_TIME).record(t.preprocess_s);
        histogram!(TOWER_TIME).record(t.tower_s);
    }
}

/// One choice's progress, from its request's arrival: each token feeds the latency
/// histograms, the end the per-choice ones and the success counter. A choice dropped
/// before its end (the client went away, or the request failed) counts as aborted.
pub struct ChoiceMeter {
    arrived: Instant,
    prompt_tokens: u64,
    first: Option<Instant>,
    last: Option<Instant>,
    tokens: u64,
    ended: bool,
}

impl ChoiceMeter {
    pub fn new(arrived: Instant, prompt_tokens: u64) -> Self {
        ChoiceMeter { arrived, prompt_tokens, first: None, last: None, tokens: 0, ended: false }
    }

    /// A token arrived.
    pub fn token(&mut self) {
        let now = Instant::now();
        match self.last {
            None => histogram!(TIME_TO_FIRST_TOKEN).record((now - self.arrived).as_secs_f64()),
            Some(last) => histogram!(INTER_TOKEN_LATENCY).record((now - last).as_secs_f64()),
        }
        self.first.get_or_insert(now);
        self.last = Some(now);
        self.tokens += 1;
        counter!(GENERATION_TOKENS_TOTAL).increment(1);
    }

    /// The choice ended for `reason`; `timing`, the engine's account, when it sent one.
    pub fn end(&mut self, reason: &FinishReason, timing: Option<&RequestTiming>) {
        self.ended = true;
        counter!(SUCCESS, "finished_reason" => reason_label(reason)).increment(1);
        if !matches!(reason, FinishReason::Stop | FinishReason::Length) {
            return;
        }
        let now = Instant::now();
        histogram!(E2E_LATENCY).record((now - self.arrived).as_secs_f64());
        histogram!(PROMPT_TOKENS).record(self.prompt_tokens as f64);
        histogram!(GENERATION_TOKENS).record(self.tokens as f64);
        if let (Some(first), Some(last)) = (self.first, self.last)
            && self.tokens > 1
        {
            histogram!(TIME_PER_OUTPUT_TOKEN).record((last - first).as_secs_f64() / (self.tokens - 1) as f64);
        }
        if let Some(t) = timing {
            histogram!(QUEUE_TIME).record(t.queued_s);
            histogram!(PREFILL_TIME).record(t.prefill_s);
            histogram!(DECODE_TIME).record(t.decode_s);
            histogram!(INFERENCE_TIME).record(t.prefill_s + t.decode_s);
            histogram!(CACHED_TOKENS).record(t.cached_tokens as f64);
        }
    }
}

impl Drop for ChoiceMeter {
    fn drop(&mut self) {
        if !self.ended {
            counter!(SUCCESS, "finished_reason" => "abort").increment(1);
        }
    }
}

/// The other services' counters and gauges as of now (`None`: the service did not
/// answer; its series keep their last values), and the api's queue.
pub fn refresh(
    cache: Option<&CacheStats>,
    encoder: Option<&EncoderStats>,
    engine: Option<&EngineInfo>,
    (queued, queued_tokens): (usize, u64),
) {
    gauge!("mmserve_queued_requests").set(queued as f64);
    // The inference gateway's model-server protocol, under the names its endpoint picker
    // reads by default (vLLM's): queued requests are those not yet giving tokens.
    gauge!("vllm:num_requests_waiting").set(queued as f64);
    gauge!("mmserve_queued_prompt_tokens").set(queued_tokens as f64);
    if let Some(s) = cache {
        counter!("mmserve_embed_cache_hits_total").absolute(s.hits);
        counter!("mmserve_embed_cache_misses_total").absolute(s.misses);
        counter!("mmserve_embed_cache_evictions_total").absolute(s.evictions);
        gauge!("mmserve_embed_cache_items").set(s.items as f64);
        gauge!("mmserve_embed_cache_slots_used").set(s.slots_used as f64);
        gauge!("mmserve_embed_cache_slots_total").set(s.slots_total as f64);
        gauge!("mmserve_embed_cache_references").set(s.references as f64);
        gauge!("mmserve_embed_cache_waiting").set(s.waiting as f64);
    }
    if let Some(s) = encoder {
        counter!("mmserve_encoder_items_total").absolute(s.items_encoded);
        counter!("mmserve_encoder_batches_total").absolute(s.batches);
    }
    if let Some(s) = engine {
        gauge!("mmserve_num_requests_running").set(s.running as f64);
        gauge!("mmserve_num_requests_waiting").set(s.waiting as f64);
        let usage = if s.kv_blocks_total == 0 { 0.0 } else { s.kv_blocks_used as f64 / s.kv_blocks_total as f64 };
        gauge!("mmserve_kv_cache_usage_perc").set(usage);
        gauge!("vllm:num_requests_running").set(s.running as f64);
        gauge!("vllm:kv_cache_usage_perc").set(usage);
        gauge!("mmserve_kv_blocks_used").set(s.kv_blocks_used as f64);
        gauge!("mmserve_kv_blocks_total").set(s.kv_blocks_total as f64);
        for name in ["mmserve_cache_config_info", "vllm:cache_config_info"] {
            let (block_size, blocks) = (s.kv_block_size.to_string(), s.kv_blocks_total.to_string());
            gauge!(name, "block_size" => block_size, "num_gpu_blocks" => blocks).set(1.0);
        }
        counter!("mmserve_prefix_cache_hit_tokens_total").absolute(s.prefix_cache_hit_tokens);
        counter!("mmserve_num_preemptions_total").absolute(s.preemptions);
        counter!("mmserve_prefill_tokens_total").absolute(s.prefill_tokens);
        counter!("mmserve_forks_total").absolute(s.forks);
        counter!("mmserve_engine_steps_total").absolute(s.steps);
        // Seconds as counters: the float is kept to the microsecond.
        counter!("mmserve_engine_schedule_microseconds_total").absolute((s.schedule_seconds * 1e6) as u64);
        counter!("mmserve_engine_step_microseconds_total").absolute((s.step_seconds * 1e6) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_buckets_run_1_2_5_up_to_the_context() {
        assert_eq!(tokens_buckets(60), [1.0, 2.0, 5.0, 10.0, 20.0, 50.0]);
        assert_eq!(tokens_buckets(4096).last(), Some(&2000.0));
        assert_eq!(tokens_buckets(0), [1.0]);
    }
}
