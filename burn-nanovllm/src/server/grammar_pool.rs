//! Compiling requests' constraints off the async workers and off the engine thread: on a
//! bounded number of blocking threads, each compile bounded by llguidance's own limits (set by
//! the engine's compiler) and by a wall-clock limit, after the request has taken its place
//! among `max_pending`. The engine receives the compiled matcher and never compiles.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use engine::{GrammarCompiler, GrammarMatcher, StructuredOutput};
use tokio::sync::Semaphore;

use super::error::ApiError;

/// The compile threads and their bound.
pub struct GrammarPool {
    compiler: Option<Arc<GrammarCompiler>>,
    permits: Arc<Semaphore>,
    timeout: Duration,
}

impl GrammarPool {
    /// Compiles with `compiler` (none: the model has no tokenizer) on at most `threads`
    /// threads at once, each compile given `timeout`.
    pub fn new(compiler: Option<Arc<GrammarCompiler>>, threads: usize, timeout: Duration) -> Self {
        Self {
            compiler,
            permits: Arc::new(Semaphore::new(threads.max(1))),
            timeout,
        }
    }

    /// A fresh matcher of `constraint`: 400 naming `field` when it is invalid, too large for
    /// llguidance's limits, or not compiled within the timeout (the thread still finishes its
    /// bounded work, holding its place in the pool, so that slow compiles cannot pile up).
    pub async fn compile(
        &self,
        constraint: &StructuredOutput,
        field: &str,
    ) -> Result<GrammarMatcher, ApiError> {
        let bad = |message: String| ApiError::bad_request(message, Some(field.to_string()));
        let compiler = self.compiler.clone().ok_or_else(|| {
            bad("structured outputs need the model's tokenizer.json, which this model lacks".into())
        })?;
        let permit = self.permits.clone().acquire_owned().await.map_err(|_| {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "the server is stopping")
        })?;
        let constraint = constraint.clone();
        let job = tokio::task::spawn_blocking(move || {
            let compiled = compiler.compile(&constraint);
            drop(permit);
            compiled
        });
        let compiled = match tokio::time::timeout(self.timeout, job).await {
            Err(_) => {
                return Err(bad(format!(
                    "{field}: the constraint did not compile within {} s",
                    self.timeout.as_secs_f32()
                )));
            }
            Ok(joined) => joined.map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("compiling the constraint failed: {e}"),
                )
            })?,
        };
        compiled.map_err(|e| {
            let message = match e {
                engine::EngineError::InvalidParam { message, .. } => message,
                other => other.to_string(),
            };
            bad(format!("{field}: {message}"))
        })
    }
}
