//! `benches serve`: vLLM's `bench serve`, against a running OpenAI-compatible server (`--url`,
//! streamed `/v1/completions`) or in process (the server's engine thread, `EngineHandle`, without
//! HTTP). vLLM's random dataset ([`random_requests`]: the throughput suite's requests for the
//! same arguments): token-id prompts of `input_len`, `output_len` tokens each, or lengths varied
//! by ± `range_ratio` (`ignore_eos`, greedy); arrivals all at once (`inf`) or Poisson at each
//! request rate, at most `max_concurrency` in flight (vLLM's `--max-concurrency`). Per request: TTFT
//! (send → first token), TPOT ((end − first token) / (tokens − 1)), ITL (gaps between streamed
//! chunks) and end-to-end latency; p50/p90/p99 of each, and throughput.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use burn_nanovllm::SamplingParams;
use burn_nanovllm::server::{EngineHandle, Event};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::report::{Report, percentile};
use crate::workload::random_requests;

/// Where the requests go.
#[derive(Clone)]
pub enum Target {
    /// A running server's base URL.
    Url(String),
    /// An engine in this process, behind the server's engine thread.
    Engine(Arc<EngineHandle>),
}

impl Target {
    fn name(&self) -> &str {
        match self {
            Target::Url(url) => url,
            Target::Engine(_) => "in-process",
        }
    }
}

/// Starts the OpenAI server (`burn-nanovllm serve`'s) over the engine `make` builds, on a
/// loopback port of its own thread and runtime; returns its base URL. It serves until the
/// process exits.
pub fn spawn_server(
    make: impl FnOnce() -> Result<burn_nanovllm::LLMEngine, burn_nanovllm::LlmError> + Send + 'static,
) -> Result<String> {
    let config = burn_nanovllm::server::ServerConfig {
        model_name: "bench".into(),
        max_pending: usize::MAX,
        ..Default::default()
    };
    let server = burn_nanovllm::server::Server::new(make, config)?;
    let runtime = tokio::runtime::Runtime::new()?;
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let url = format!("http://{}", listener.local_addr()?);
    std::thread::spawn(move || {
        if let Err(e) = runtime.block_on(server.serve(listener, std::future::pending())) {
            eprintln!("benchmark server: {e}");
        }
    });
    Ok(url)
}

/// The workload and where to send it.
pub struct ServeWorkload<'a> {
    pub target: Target,
    /// Requests per second; infinite sends every request at t = 0.
    pub rates: &'a [f64],
    pub num_prompts: usize,
    /// Prompt ids are drawn below this (bench.py's 10,000, or a smaller vocabulary).
    pub vocab: u32,
    pub input_len: usize,
    pub output_len: usize,
    /// Lengths vary uniformly by ± this fraction.
    pub range_ratio: f64,
    /// Most requests in flight (`None`: no bound).
    pub max_concurrency: Option<usize>,
    pub seed: u64,
}

/// One request's timings.
struct Timed {
    ttft: f64,
    e2e: f64,
    gaps: Vec<f64>,
    tokens: usize,
}

/// Times one streamed request: when it was sent, and when each chunk with tokens arrived.
struct StreamClock {
    sent: Instant,
    first: Option<Instant>,
    last: Instant,
    gaps: Vec<f64>,
}

impl StreamClock {
    fn start() -> Self {
        let sent = Instant::now();
        Self {
            sent,
            first: None,
            last: sent,
            gaps: Vec::new(),
        }
    }

    /// A chunk carrying new tokens arrived at `now`.
    fn tokens_at(&mut self, now: Instant) {
        if self.first.is_none() {
            self.first = Some(now);
        } else {
            self.gaps.push((now - self.last).as_secs_f64());
        }
        self.last = now;
    }

    /// The request's timings, `tokens` generated in all.
    fn finish(self, tokens: usize) -> Result<Timed> {
        let first = self.first.context("no token came back")?;
        Ok(Timed {
            ttft: (first - self.sent).as_secs_f64(),
            e2e: (self.last - self.sent).as_secs_f64(),
            gaps: self.gaps,
            tokens,
        })
    }
}

/// Runs the workload at every rate; one row per rate.
pub fn run(w: &ServeWorkload) -> Result<Report> {
    let runtime = tokio::runtime::Runtime::new()?;
    let mut report = Report::new(
        "serve",
        &[
            "target",
            "request_rate",
            "num_prompts",
            "input_len",
            "output_len",
            "range_ratio",
            "max_concurrency",
            "prompt_tokens",
            "duration_s",
            "requests_per_s",
            "output_tok_per_s",
            "total_tok_per_s",
            "ttft_p50_ms",
            "ttft_p90_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p90_ms",
            "tpot_p99_ms",
            "itl_p50_ms",
            "itl_p90_ms",
            "itl_p99_ms",
            "e2e_p50_ms",
            "e2e_p99_ms",
        ],
    );
    runtime.block_on(async {
        let http = reqwest::Client::new();
        let mut rng = StdRng::seed_from_u64(w.seed);
        let requests = random_requests(
            w.num_prompts,
            w.input_len,
            w.output_len,
            w.range_ratio,
            w.vocab,
            w.seed,
        );
        let prompt_tokens: usize = requests.iter().map(|r| r.prompt.len()).sum();
        // Warm-up: one request of the mean shape (autotuning, first-use compilation).
        let warm = random_requests(1, w.input_len, w.output_len, 0.0, w.vocab, w.seed ^ 1);
        one(&http, &w.target, warm[0].prompt.clone(), w.output_len)
            .await
            .context("warm-up request")?;
        for &rate in w.rates {
            let slots = Arc::new(Semaphore::new(
                w.max_concurrency.unwrap_or(Semaphore::MAX_PERMITS),
            ));
            let mut at = 0.0f64;
            let start = Instant::now();
            let mut tasks = Vec::with_capacity(requests.len());
            for r in &requests {
                if rate.is_finite() {
                    // Exponential gaps: a Poisson process of `rate` requests per second.
                    at += -(1.0 - rng.random::<f64>()).ln() / rate;
                }
                let (http, target, slots) = (http.clone(), w.target.clone(), slots.clone());
                let (prompt, out) = (r.prompt.clone(), r.max_tokens);
                let send_at = start + Duration::from_secs_f64(at);
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep_until(send_at.into()).await;
                    let _slot = slots.acquire().await?;
                    one(&http, &target, prompt, out).await
                }));
            }
            let mut timed = Vec::with_capacity(tasks.len());
            for t in tasks {
                timed.push(t.await??);
            }
            let secs = start.elapsed().as_secs_f64();
            let tokens: usize = timed.iter().map(|t| t.tokens).sum();
            let ms = |mut v: Vec<f64>, q: f64| percentile(&mut v, q) * 1e3;
            let ttft: Vec<f64> = timed.iter().map(|t| t.ttft).collect();
            let e2e: Vec<f64> = timed.iter().map(|t| t.e2e).collect();
            let tpot: Vec<f64> = timed
                .iter()
                .filter(|t| t.tokens > 1)
                .map(|t| (t.e2e - t.ttft) / (t.tokens - 1) as f64)
                .collect();
            let itl: Vec<f64> = timed.iter().flat_map(|t| t.gaps.clone()).collect();
            report.row(vec![
                json!(w.target.name()),
                json!(if rate.is_finite() {
                    json!(rate)
                } else {
                    json!("inf")
                }),
                json!(w.num_prompts),
                json!(w.input_len),
                json!(w.output_len),
                json!(w.range_ratio),
                json!(w.max_concurrency),
                json!(prompt_tokens),
                json!(secs),
                json!(w.num_prompts as f64 / secs),
                json!(tokens as f64 / secs),
                json!((tokens + prompt_tokens) as f64 / secs),
                json!(ms(ttft.clone(), 0.5)),
                json!(ms(ttft.clone(), 0.9)),
                json!(ms(ttft, 0.99)),
                json!(ms(tpot.clone(), 0.5)),
                json!(ms(tpot.clone(), 0.9)),
                json!(ms(tpot, 0.99)),
                json!(ms(itl.clone(), 0.5)),
                json!(ms(itl.clone(), 0.9)),
                json!(ms(itl, 0.99)),
                json!(ms(e2e.clone(), 0.5)),
                json!(ms(e2e, 0.99)),
            ]);
        }
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(report)
}

/// Sends one streamed request of token-id `prompt` and times its chunks.
async fn one(
    http: &reqwest::Client,
    target: &Target,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> Result<Timed> {
    match target {
        Target::Url(url) => one_http(http, url, prompt, max_tokens).await,
        Target::Engine(engine) => one_in_process(engine, prompt, max_tokens).await,
    }
}

/// One request through the engine thread: the same greedy `ignore_eos` request as over HTTP.
async fn one_in_process(
    engine: &EngineHandle,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> Result<Timed> {
    let params = SamplingParams {
        max_tokens,
        ignore_eos: true,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let mut clock = StreamClock::start();
    let place = engine
        .reserve()
        .map_err(|e| anyhow!("refused: {}", e.message))?;
    let (_, mut events) = engine
        .submit(place, prompt, params, None)
        .await
        .map_err(|e| anyhow!("refused: {}", e.message))?;
    let mut tokens = 0;
    while let Some(event) = events.recv().await {
        let output = match event {
            Event::Output(o) => o,
            Event::Failed(message) => bail!("engine failed: {message}"),
        };
        if !output.new_token_ids.is_empty() {
            clock.tokens_at(Instant::now());
        }
        tokens = output.num_output_tokens;
        if output.finish_reason.is_some() {
            break;
        }
    }
    clock.finish(tokens)
}

/// Sends `body` to the server's `/v1/completions`; the response, whatever its status.
pub async fn post_completion(
    http: &reqwest::Client,
    url: &str,
    body: &serde_json::Value,
) -> Result<reqwest::Response> {
    http.post(format!("{url}/v1/completions"))
        .json(body)
        .send()
        .await
        .with_context(|| format!("POST {url}/v1/completions"))
}

/// One streamed `/v1/completions` request.
async fn one_http(
    http: &reqwest::Client,
    url: &str,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> Result<Timed> {
    let body = json!({
        "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0,
        "stream": true, "stream_options": {"include_usage": true},
    });
    let mut clock = StreamClock::start();
    let mut resp = post_completion(http, url, &body).await?;
    if !resp.status().is_success() {
        bail!(
            "{}: {}",
            resp.status(),
            resp.text().await.unwrap_or_default()
        );
    }
    let mut tokens = 0;
    let mut buffer = String::new();
    while let Some(bytes) = resp.chunk().await? {
        let now = Instant::now();
        buffer.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data).with_context(|| data.to_string())?;
            if let Some(err) = v.get("error") {
                bail!("server error: {err}");
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
            // A chunk with a choice carries the step's new tokens (its text may be empty while
            // a multi-byte character is incomplete); the usage chunk has none.
            if v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                clock.tokens_at(now);
            }
        }
    }
    clock.finish(tokens)
}
