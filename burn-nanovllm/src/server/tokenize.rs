//! Request text → token ids without stalling other requests. A text that cannot fit in
//! `max_model_len` is refused by its size alone, before any tokenization: a token stands for at
//! most [`Qwen2Tokenizer::max_token_bytes`] bytes, times a slack for normalization (NFC can
//! shrink a text up to 3×). That bound is sound but loose (Qwen's longest vocabulary entry is
//! 256 bytes: 32 MiB of text for a 32k context, eight times the default body limit), so a text
//! past [`PROBE_BYTES_PER_TOKEN`] bytes a token of context is probed first: only a prefix of
//! that many bytes is tokenized, cut where the pre-tokenizer splits anyway
//! ([`Qwen2Tokenizer::prefix_split`]), and a prefix that already holds more than
//! `max_model_len` tokens refuses the text without tokenizing the rest. No request costs more
//! tokenization than about the longest one that fits. Short texts are tokenized on the
//! handler's task (microseconds); long ones on tokio's blocking pool, at most `permits` at once, so the async workers keep
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
/// Texts longer than this many bytes per token of context are probed by a prefix first (text
/// averages 3–5 bytes a token with Qwen's vocabulary, code and whitespace runs more).
pub const PROBE_BYTES_PER_TOKEN: usize = 16;

/// The server's tokenization: the byte bound and the blocking-pool permits.
pub struct PromptTokenizer {
    tokenizer: Option<Arc<Qwen2Tokenizer>>,
    max_model_len: usize,
    max_bytes: usize,
    probe_bytes: usize,
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
            probe_bytes: max_model_len.saturating_mul(PROBE_BYTES_PER_TOKEN),
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
        let (probe_bytes, max_model_len) = (self.probe_bytes, self.max_model_len);
        let outcome = tokio::task::spawn_blocking(move || {
            let probe = (text.len() > probe_bytes)
                .then(|| tokenizer.prefix_split(&text, probe_bytes))
                .flatten();
            let result = match probe {
                Some(cut) => match tokenizer.encode(&text[..cut]) {
                    Ok(ids) if ids.len() > max_model_len => Err(Refusal::Probe(cut)),
                    Ok(_) => tokenizer.encode(&text).map_err(Refusal::Tokenizer),
                    Err(e) => Err(Refusal::Tokenizer(e)),
                },
                None => tokenizer.encode(&text).map_err(Refusal::Tokenizer),
            };
            let len = text.len();
            drop(text);
            release_free_memory();
            (result, len)
        })
        .await
        .map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                format!("tokenization failed: {e}"),
            )
        })?;
        match outcome {
            (Ok(ids), _) => Ok(ids),
            (Err(Refusal::Tokenizer(e)), _) => Err(bad(e)),
            (Err(Refusal::Probe(cut)), len) => Err(ApiError::bad_request(
                format!(
                    "the prompt is too long: its first {cut} of {len} bytes already hold more \
                     than max_model_len = {max_model_len} tokens"
                ),
                Some(field.into()),
            )),
        }
    }
}

/// Why a long text was not tokenized whole.
enum Refusal {
    /// Its first `.0` bytes alone are more tokens than the context holds.
    Probe(usize),
    Tokenizer(model_qwen2::ModelError),
}

/// Hands the allocator's free pages back to the OS (glibc; elsewhere nothing).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only returns free memory to the OS; it is thread-safe.
    unsafe {
        libc::malloc_trim(0);
    }
}
