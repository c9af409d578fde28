//! The server's Prometheus metrics (`GET /metrics`, text format), vLLM's set: requests running
//! and waiting, KV-block usage, prefix-cache hit rate, prompt and generated token counters,
//! engine failures, TTFT, inter-token and end-to-end latency histograms.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Handles to every metric (cheap clones sharing the values); the engine thread updates them.
#[derive(Clone)]
pub struct Metrics {
    /// Requests in the running batch.
    pub running: Gauge,
    /// Requests waiting to be scheduled.
    pub waiting: Gauge,
    /// Fraction of the KV pool held by requests, 0–1.
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// Prefix-cache hits over queried prompt tokens, 0–1.
    pub prefix_hit_rate: Gauge<f64, AtomicU64>,
    /// Prompt tokens of started requests.
    pub prompt_tokens: Counter,
    /// Tokens generated.
    pub generation_tokens: Counter,
    /// Requests finished (any reason).
    pub requests_finished: Counter,
    /// Requests refused because the queue was full (503).
    pub requests_rejected: Counter,
    /// Device failures that stopped the engine (0 or 1: the server exits after one).
    pub engine_failures: Counter,
    /// Seconds from arrival to the first token.
    pub time_to_first_token: Histogram,
    /// Seconds between consecutive tokens of a request.
    pub inter_token_latency: Histogram,
    /// Seconds from arrival to the last token.
    pub e2e_latency: Histogram,
}

impl Metrics {
    /// The metrics and the registry that exports them (names prefixed `burn_nanovllm_`).
    pub fn new() -> (Self, Registry) {
        let seconds = |start| Histogram::new(exponential_buckets(start, 2.0, 18));
        let m = Self {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_hit_rate: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            requests_finished: Counter::default(),
            requests_rejected: Counter::default(),
            engine_failures: Counter::default(),
            time_to_first_token: seconds(0.001),
            inter_token_latency: seconds(0.0005),
            e2e_latency: seconds(0.01),
        };
        let mut r = Registry::with_prefix("burn_nanovllm");
        r.register(
            "num_requests_running",
            "Requests in the running batch",
            m.running.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Requests waiting to be scheduled",
            m.waiting.clone(),
        );
        r.register(
            "kv_cache_usage_perc",
            "Fraction of KV blocks in use (0-1)",
            m.kv_usage.clone(),
        );
        r.register(
            "prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache / prompt tokens queried",
            m.prefix_hit_rate.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of started requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        r.register(
            "requests_finished",
            "Requests finished",
            m.requests_finished.clone(),
        );
        r.register(
            "requests_rejected",
            "Requests refused because the queue was full",
            m.requests_rejected.clone(),
        );
        r.register(
            "engine_failures",
            "Device failures that stopped the engine",
            m.engine_failures.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "Arrival to first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            m.inter_token_latency.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Arrival to finish",
            m.e2e_latency.clone(),
        );
        (m, r)
    }
}

/// The registry in Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    encode(&mut out, registry).expect("writing to a String cannot fail");
    out
}
