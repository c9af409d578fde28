//! Request text → token ids without stalling other requests. A text that cannot fit in
//! `max_model_len` is refused by its size alone, before any tokenization: a token stands for at
//! most [`Qwen2Tokenizer::max_token_bytes`] bytes, times a slack for normalization (NFC can
//! shrink a text up to 3×). Short texts are tokenized on the handler's task (microseconds);
//! long ones on tokio's blocking pool, at most `permits` at once, so the async workers keep
//! serving and the engine thread keeps its core. After a long one the allocator's free pages go
//! back to the OS (glibc keeps them otherwise: a 4 MB prompt's tokenization peaks at hundreds
//! of MB).

use std::sync::Arc;

use model_qwen2::Qwen2Tokenizer;
use tokio::sync::Semaphore;

use super::error::ApiError;

/// Texts up to this many bytes are tokenized inline.
const INLINE_BYTES: usize = 16 << 10;
/// Normalization may shrink a text (NFC composes Hangul jamo 3:1): the byte bound's slack.
const NORMALIZATION_SLACK: usize = 4;

/// The server's tokenization: the byte bound and the blocking-pool permits.
pub struct PromptTokenizer {
    tokenizer: Option<Arc<Qwen2Tokenizer>>,
    max_model_len: usize,
    max_bytes: usize,
    permits: Semaphore,
}

impl PromptTokenizer {
    /// `permits`: long texts tokenized at once (at least 1).
    pub fn new(
        tokenizer: Option<Arc<Qwen2Tokenizer>>,
        max_model_len: usize,
        permits: usize,
    ) -> Self {
        let max_bytes = tokenizer.as_ref().map_or(usize::MAX, |t| {
            max_model_len
                .saturating_mul(t.max_token_bytes())
                .saturating_mul(NORMALIZATION_SLACK)
        });
        Self {
            tokenizer,
            max_model_len,
            max_bytes,
            permits: Semaphore::new(permits.max(1)),
        }
    }

    /// The tokenizer, or a 400 naming `field` when the model has none.
    pub fn tokenizer(&self, field: &str) -> Result<&Arc<Qwen2Tokenizer>, ApiError> {
        self.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                "the model has no tokenizer.json: send token ids".into(),
                Some(field.into()),
            )
        })
    }

    /// Token ids of `text` (the prompt, or the rendered conversation for `field` = `messages`).
    pub async fn encode(&self, text: String, field: &str) -> Result<Vec<u32>, ApiError> {
        let tokenizer = self.tokenizer(field)?.clone();
        if text.len() > self.max_bytes {
            return Err(ApiError::bad_request(
                format!(
                    "the prompt is too long: {} bytes of text are more than max_model_len = {} \
                     tokens can hold (at most {} bytes with this tokenizer)",
                    text.len(),
                    self.max_model_len,
                    self.max_bytes
                ),
                Some(field.into()),
            ));
        }
        let bad =
            |e: model_qwen2::ModelError| ApiError::bad_request(e.to_string(), Some(field.into()));
        if text.len() <= INLINE_BYTES {
            return tokenizer.encode(&text).map_err(bad);
        }
        let _permit = self
            .permits
            .acquire()
            .await
            .expect("the semaphore is never closed");
        let ids = tokio::task::spawn_blocking(move || {
            let ids = tokenizer.encode(&text);
            drop(text);
            release_free_memory();
            ids
        })
        .await
        .map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                format!("tokenization failed: {e}"),
            )
        })?;
        ids.map_err(bad)
    }
}

/// Hands the allocator's free pages back to the OS (glibc; elsewhere nothing).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory to the OS; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
