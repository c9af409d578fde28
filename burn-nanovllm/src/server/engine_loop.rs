//! The engine on its own thread, fed through channels. Handlers `submit` a request and read
//! its outputs from a channel of their own; the thread steps the engine while any request is
//! unfinished and blocks on its command channel when idle. A request whose client went away
//! (its output channel closed) is aborted, which frees its blocks. The number of requests
//! accepted and not yet finished is bounded: past it, `submit` answers 503.
//!
//! A failed step (the device failed) ends the thread: every tracked request gets the error,
//! the failure is reported once (stderr and the `engine_failures` metric) and published to
//! [`EngineHandle::failed`], and later submissions answer 503 with its cause.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Instant;

use axum::http::StatusCode;
use engine::{EngineError, GrammarMatcher, LLMEngine, RequestId, RequestOutput, SamplingParams};
use model_qwen2::Qwen2Tokenizer;
use tokio::sync::{mpsc as tmpsc, oneshot, watch};

use super::error::ApiError;
use super::metrics::Metrics;
use crate::error::LlmError;

/// What a request's channel carries.
#[derive(Debug)]
pub enum Event {
    /// New tokens, text, and at the end the finish reason.
    Output(RequestOutput),
    /// The engine failed (device error); the request is over.
    Failed(String),
}

enum Command {
    Add {
        prompt: Vec<u32>,
        params: Box<SamplingParams>,
        matcher: Option<Box<GrammarMatcher>>,
        events: tmpsc::UnboundedSender<Event>,
        accepted: oneshot::Sender<Result<RequestId, EngineError>>,
    },
    AbortAll,
}

/// A place among the server's `max_pending` requests ([`EngineHandle::reserve`]).
pub struct Place {
    in_flight: Arc<AtomicUsize>,
    /// Still this handle's to free (not yet taken by the engine thread).
    held: bool,
}

impl Drop for Place {
    fn drop(&mut self) {
        if self.held {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// What handlers need to know of the model, read once when the engine starts.
#[derive(Clone)]
pub struct ModelInfo {
    /// The model's tokenizer (`None`: token-id prompts only).
    pub tokenizer: Option<Arc<Qwen2Tokenizer>>,
    /// Sampling defaults from `generation_config.json`.
    pub defaults: SamplingParams,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// The model's (logits') vocabulary.
    pub vocab_size: usize,
    /// Structured outputs' compiler (`None` without a tokenizer).
    pub grammars: Option<Arc<engine::GrammarCompiler>>,
}

/// The handlers' side of the engine thread.
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    alive: Arc<AtomicBool>,
    failure: watch::Receiver<Option<String>>,
    in_flight: Arc<AtomicUsize>,
    max_pending: usize,
    metrics: Metrics,
    /// The model's tokenizer, sampling defaults and limits.
    pub info: ModelInfo,
}

impl EngineHandle {
    /// Starts the engine thread: `make` builds the engine there (it never crosses threads).
    /// At most `max_pending` requests are accepted and unfinished at once.
    pub fn spawn(
        make: impl FnOnce() -> Result<LLMEngine, LlmError> + Send + 'static,
        max_pending: usize,
        metrics: Metrics,
    ) -> Result<Self, LlmError> {
        let (commands, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let alive = Arc::new(AtomicBool::new(true));
        let in_flight = Arc::new(AtomicUsize::new(0));
        let (thread_in_flight, thread_metrics) = (in_flight.clone(), metrics.clone());
        let (failure_tx, failure) = watch::channel(None);
        let guard = AliveGuard {
            alive: alive.clone(),
            failure: failure_tx,
        };
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let guard = guard;
                let mut engine = match make() {
                    Ok(e) => e,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                engine.set_stream_text(true);
                let info = ModelInfo {
                    tokenizer: engine.tokenizer().cloned(),
                    defaults: engine.default_sampling_params(),
                    max_model_len: engine.limits().max_model_len,
                    vocab_size: engine.model_config().vocab_size,
                    grammars: engine.grammar_compiler().ok(),
                };
                if ready_tx.send(Ok(info)).is_ok() {
                    EngineThread {
                        engine,
                        commands: rx,
                        requests: HashMap::new(),
                        in_flight: thread_in_flight,
                        metrics: thread_metrics,
                    }
                    .run(&guard.failure);
                }
            })
            .map_err(|e| LlmError::Invalid(format!("cannot start the engine thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| LlmError::Invalid("the engine thread ended while loading".into()))??;
        Ok(Self {
            commands,
            alive,
            failure,
            in_flight,
            max_pending,
            metrics,
            info,
        })
    }

    /// Whether the engine thread is running and has not failed.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire) && self.failure.borrow().is_none()
    }

    /// Resolves with the cause once the engine has failed (never, while it works).
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.clone();
        let cause = rx
            .wait_for(Option::is_some)
            .await
            .map(|cause| cause.clone().unwrap_or_default());
        match cause {
            Ok(cause) => cause,
            // The thread ended without a failure (the server is being dropped).
            Err(_) => std::future::pending().await,
        }
    }

    /// 503: the engine thread is gone, with the failure's cause when one ended it.
    fn gone(&self) -> ApiError {
        let message = match self.failure.borrow().as_deref() {
            Some(cause) => format!("the engine is not running: {cause}"),
            None => "the engine is not running".to_string(),
        };
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// Takes a place among the `max_pending` requests, before a request's costly work (its
    /// grammar compile, its tokenization), so that work too is bounded by `max_pending`; fails
    /// with 503 (and `Retry-After`) when none is free. Dropped unused, the place is freed.
    pub fn reserve(&self) -> Result<Place, ApiError> {
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= self.max_pending {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            self.metrics.requests_rejected.inc();
            return Err(ApiError {
                retry_after: Some(1),
                ..ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "the server is at its limit of {} queued and running requests: retry later",
                        self.max_pending
                    ),
                )
            });
        }
        Ok(Place {
            in_flight: self.in_flight.clone(),
            held: true,
        })
    }

    /// Queues a request in `place`; its outputs come on the returned channel (drop it to
    /// abort). `matcher` is its constraint compiled off the engine thread (none: the engine
    /// compiles it). Fails with 503 when the engine is gone, 400 when the engine refuses the
    /// request (the error names the field).
    pub async fn submit(
        &self,
        mut place: Place,
        prompt: Vec<u32>,
        params: SamplingParams,
        matcher: Option<GrammarMatcher>,
    ) -> Result<(RequestId, tmpsc::UnboundedReceiver<Event>), ApiError> {
        let (events, rx) = tmpsc::unbounded_channel();
        let (accepted, accepted_rx) = oneshot::channel();
        let sent = self.commands.send(Command::Add {
            prompt,
            params: Box::new(params),
            matcher: matcher.map(Box::new),
            events,
            accepted,
        });
        if sent.is_err() {
            return Err(self.gone());
        }
        // The thread ended before taking the command: the place is freed here, on drop.
        let accepted = accepted_rx.await.map_err(|_| self.gone())?;
        // Taken: the engine thread frees the place (refused at once, or once it finishes).
        place.held = false;
        match accepted {
            Ok(id) => Ok((id, rx)),
            Err(e) => Err(e.into()),
        }
    }

    /// Aborts every request (shutdown past its timeout).
    pub fn abort_all(&self) {
        let _ = self.commands.send(Command::AbortAll);
    }
}

/// Clears the alive flag when the thread ends, however it ends; a panic that ends it is
/// published as the engine's failure.
struct AliveGuard {
    alive: Arc<AtomicBool>,
    failure: watch::Sender<Option<String>>,
}

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::Release);
        if std::thread::panicking() {
            self.failure.send_if_modified(|f| {
                f.get_or_insert_with(|| "the engine thread panicked".into());
                true
            });
        }
    }
}

struct Tracked {
    events: tmpsc::UnboundedSender<Event>,
    arrival: Instant,
    last_token: Option<Instant>,
}

struct EngineThread {
    engine: LLMEngine,
    commands: mpsc::Receiver<Command>,
    requests: HashMap<RequestId, Tracked>,
    in_flight: Arc<AtomicUsize>,
    metrics: Metrics,
}

impl EngineThread {
    /// Steps until the server is dropped (`Ok` return) or a step fails (published on `failure`).
    fn run(mut self, failure: &watch::Sender<Option<String>>) {
        loop {
            // Idle: wait for work (the channel closes when the server is dropped).
            if !self.engine.has_unfinished() {
                match self.commands.recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = self.commands.try_recv() {
                self.handle(cmd);
            }
            self.abort_disconnected();
            if self.engine.has_unfinished() {
                match self.engine.step() {
                    // Gauges first: a client that sees its output sees the state after it.
                    Ok(outputs) => {
                        self.update_gauges();
                        self.dispatch(outputs);
                    }
                    Err(e) => {
                        let cause = e.to_string();
                        eprintln!("burn-nanovllm: {cause}");
                        // Published first: a client that sees the error sees /health 503.
                        self.metrics.engine_failures.inc();
                        failure.send_replace(Some(cause.clone()));
                        self.fail_all(&cause);
                        self.update_gauges();
                        return;
                    }
                }
            }
            self.update_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        let engine = &mut self.engine;
        match cmd {
            Command::Add {
                prompt,
                params,
                matcher,
                events,
                accepted,
            } => match engine.add_compiled_request(prompt, *params, matcher.map(|m| *m)) {
                Ok(id) => {
                    self.requests.insert(
                        id,
                        Tracked {
                            events,
                            arrival: Instant::now(),
                            last_token: None,
                        },
                    );
                    // A handler gone already closed `events`: the next pass aborts the request.
                    let _ = accepted.send(Ok(id));
                }
                Err(e) => {
                    self.in_flight.fetch_sub(1, Ordering::AcqRel);
                    let _ = accepted.send(Err(e));
                }
            },
            Command::AbortAll => {
                let ids: Vec<RequestId> = self.requests.keys().copied().collect();
                for id in ids {
                    let _ = engine.abort(id);
                }
            }
        }
    }

    /// Aborts the requests whose client closed its channel, freeing their blocks now.
    fn abort_disconnected(&mut self) {
        let gone: Vec<RequestId> = self
            .requests
            .iter()
            .filter(|(_, t)| t.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.requests.remove(&id);
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            let _ = self.engine.abort(id);
        }
    }

    fn dispatch(&mut self, outputs: Vec<RequestOutput>) {
        let now = Instant::now();
        let m = &self.metrics;
        let mut finished = Vec::new();
        for out in outputs {
            let Some(t) = self.requests.get_mut(&out.id) else {
                continue; // aborted for a closed channel: its last output has no reader
            };
            if !out.new_token_ids.is_empty() {
                match t.last_token {
                    None => {
                        m.prompt_tokens.inc_by(out.num_prompt_tokens as u64);
                        m.time_to_first_token
                            .observe((now - t.arrival).as_secs_f64());
                    }
                    Some(last) => m.inter_token_latency.observe((now - last).as_secs_f64()),
                }
                m.generation_tokens.inc_by(out.new_token_ids.len() as u64);
                t.last_token = Some(now);
            }
            if out.finish_reason.is_some() {
                m.requests_finished.inc();
                m.e2e_latency.observe((now - t.arrival).as_secs_f64());
                finished.push(out.id);
            }
            let _ = t.events.send(Event::Output(out));
        }
        // Finished: drop the channel (the reader sees its end) and free the queue place.
        for id in finished {
            self.requests.remove(&id);
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// A failed step: every tracked request gets the error and is aborted.
    fn fail_all(&mut self, message: &str) {
        let engine = &mut self.engine;
        for (id, t) in self.requests.drain() {
            let _ = t.events.send(Event::Failed(message.to_string()));
            let _ = engine.abort(id);
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn update_gauges(&self) {
        let e = &self.engine;
        let m = &self.metrics;
        m.running.set(e.num_running() as i64);
        m.waiting.set(e.num_waiting() as i64);
        m.kv_usage.set(e.kv_usage());
        let s = e.stats();
        if s.prefix_queried_tokens > 0 {
            m.prefix_hit_rate
                .set(s.prefix_hit_tokens as f64 / s.prefix_queried_tokens as f64);
        }
    }
}
