//! The OpenAI-compatible HTTP server (axum + tokio): `POST /v1/completions`,
//! `POST /v1/chat/completions` (JSON, or server-sent events with `stream: true`),
//! `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus). The engine runs on its own
//! thread ([`EngineHandle`]); handlers talk to it through channels.

mod engine_loop;
mod error;
mod metrics;
mod protocol;
mod routes;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use engine::LLMEngine;
use tokio::net::TcpListener;

pub use engine_loop::{EngineHandle, Event};
pub use metrics::Metrics;

use crate::error::LlmError;
use routes::AppState;

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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model_name: "default".into(),
            api_key: None,
            max_pending: 1024,
            max_body_bytes: 4 << 20,
            shutdown_timeout: Duration::from_secs(30),
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
        let state = Arc::new(AppState {
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
            .route_layer(axum::middleware::from_fn_with_state(
                state.clone(),
                routes::require_key,
            ));
        let router = Router::new()
            .nest("/v1", v1)
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

    /// Serves on `listener` until `shutdown` resolves; then stops accepting, lets in-flight
    /// requests finish for `shutdown_timeout`, aborts the rest, and returns once every
    /// connection has closed.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let state = self.state.clone();
        let timeout = self.config.shutdown_timeout;
        axum::serve(listener, self.router)
            .with_graceful_shutdown(async move {
                shutdown.await;
                tokio::spawn(async move {
                    tokio::time::sleep(timeout).await;
                    state.engine.abort_all();
                });
            })
            .await
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
