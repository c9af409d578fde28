//! The OpenAI-compatible HTTP server (axum + tokio): `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/responses` (JSON, or server-sent events with
//! `stream: true`), `GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`,
//! `GET /health`, `GET /metrics` (Prometheus). The engine runs on its own
//! thread ([`EngineHandle`]); handlers talk to it through channels.

mod admission;
mod constraints;
mod engine_loop;
mod error;
mod grammar_pool;
mod metrics;
mod protocol;
mod responses;
mod routes;
mod token_routes;
mod tokenize;
mod tool_calls;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use engine::LLMEngine;
use tokio::net::TcpListener;

pub use engine_loop::{EngineHandle, Event, ModelInfo, Place};
pub use metrics::Metrics;

use crate::error::LlmError;
use routes::AppState;
use tokenize::PromptTokenizer;

/// Server options.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The name clients pass as `model` (and `/v1/models` lists).
    pub model_name: String,
    /// Required as `Authorization: Bearer …` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Most requests accepted and unfinished at once; past it, 503 with `Retry-After`.
    pub max_pending: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// After a shutdown signal, how long in-flight requests may run before they are aborted.
    pub shutdown_timeout: Duration,
    /// After the engine fails, how long the server still answers (`/health` 503, `/metrics`,
    /// 503 to new requests) before it shuts down and [`Server::serve`] returns the failure.
    pub failure_grace: Duration,
    /// Long prompts tokenized at once, on tokio's blocking pool (short ones are tokenized
    /// inline).
    pub tokenizer_threads: usize,
    /// Constraints (`response_format`, `structured_outputs`, `tools`) compiled at once, on
    /// tokio's blocking pool; the others wait (holding their place among `max_pending`).
    pub grammar_threads: usize,
    /// Longest a constraint's compile may take before its request is refused (400).
    pub grammar_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "default".into(),
            api_key: None,
            max_pending: 1024,
            max_body_bytes: 4 << 20,
            shutdown_timeout: Duration::from_secs(30),
            failure_grace: Duration::from_secs(2),
            tokenizer_threads: std::thread::available_parallelism()
                .map_or(1, |n| (n.get() / 2).max(1)),
            grammar_threads: std::thread::available_parallelism()
                .map_or(1, |n| (n.get() / 2).max(1)),
            grammar_timeout: Duration::from_secs(10),
        }
    }
}

/// A server ready to run: the engine thread started, the routes built.
pub struct Server {
    router: Router,
    state: Arc<AppState>,
    config: ServerConfig,
}

impl Server {
    /// Starts the engine thread (`make` builds the engine there) and builds the routes.
    pub fn new(
        make: impl FnOnce() -> Result<LLMEngine, LlmError> + Send + 'static,
        config: ServerConfig,
    ) -> Result<Self, LlmError> {
        let (metrics, registry) = Metrics::new();
        let engine = EngineHandle::spawn(make, config.max_pending, metrics)?;
        let started = routes::unix_now();
        let tokenizer = PromptTokenizer::new(
            engine.info.tokenizer.clone(),
            engine.info.max_model_len,
            config.tokenizer_threads,
        );
        let grammars = grammar_pool::GrammarPool::new(
            engine.info.grammars.clone(),
            config.grammar_threads,
            config.grammar_timeout,
        );
        let state = Arc::new(AppState {
            tokenizer,
            grammars,
            engine,
            model_name: config.model_name.clone(),
            api_key: config.api_key.clone(),
            registry,
            started,
        });
        let v1 = Router::new()
            .route("/completions", post(routes::completions))
            .route("/chat/completions", post(routes::chat_completions))
            .route("/models", get(routes::models))
            .route("/responses", post(responses::responses))
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                routes::require_key,
            ));
        // vLLM's token routes, at the root as there, behind the same key.
        let tokens = Router::new()
            .route("/tokenize", post(token_routes::tokenize_route))
            .route("/detokenize", post(token_routes::detokenize))
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                routes::require_key,
            ));
        let router = Router::new()
            .nest("/v1", v1)
            .merge(tokens)
            .route("/health", get(routes::health))
            .route("/metrics", get(routes::metrics))
            .layer(DefaultBodyLimit::max(config.max_body_bytes))
            .with_state(state.clone());
        Ok(Self {
            router,
            state,
            config,
        })
    }

    /// What the handlers know of the served model (its tokenizer, defaults, `max_model_len`).
    pub fn model_info(&self) -> &engine_loop::ModelInfo {
        &self.state.engine.info
    }

    /// Serves on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
    /// requests finish for `shutdown_timeout`, aborts the rest, and returns once every
    /// connection has closed. When the engine fails (the device failed), every request has
    /// its error; the server keeps answering for `failure_grace` (`/health` 503), shuts down and
    /// returns an error naming the cause, within another `failure_grace`, so that a supervisor
    /// restarts the process.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let (state, failed) = (self.state.clone(), self.state.clone());
        let (timeout, grace) = (self.config.shutdown_timeout, self.config.failure_grace);
        let (failure_tx, mut failure_rx) = tokio::sync::oneshot::channel::<String>();
        let stop = async move {
            tokio::select! {
                _ = shutdown => {
                    tokio::spawn(async move {
                        tokio::time::sleep(timeout).await;
                        state.engine.abort_all();
                    });
                }
                cause = failed.engine.failed() => {
                    tokio::time::sleep(grace).await;
                    let _ = failure_tx.send(cause);
                }
            }
        };
        let server = axum::serve(listener, self.router).with_graceful_shutdown(stop);
        let mut server = std::pin::pin!(server.into_future());
        let served = tokio::select! {
            served = &mut server => served,
            // Failed: the connections left get `grace` to close, then the server is dropped.
            Ok(cause) = &mut failure_rx => {
                let _ = tokio::time::timeout(grace, &mut server).await;
                return Err(std::io::Error::other(format!("the engine failed: {cause}")));
            }
        };
        match failure_rx.try_recv() {
            Ok(cause) => Err(std::io::Error::other(format!("the engine failed: {cause}"))),
            Err(_) => served,
        }
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
