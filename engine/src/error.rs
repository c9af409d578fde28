//! Errors of the engine: typed, each naming the problem (a field, a limit, a file).

use thiserror::Error;

use crate::request_id::RequestId;

/// Everything the engine can refuse or fail on.
#[derive(Debug, Error)]
pub enum EngineError {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] model_qwen2::ModelError),
    /// A kernel or device check failed.
    #[error(transparent)]
    Kernel(#[from] cubecl_kernels::KernelError),
    /// A sampling parameter is out of its range.
    #[error("invalid sampling parameter `{field}`: {message}")]
    InvalidParam {
        /// The parameter's name, as in `SamplingParams`.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// An engine option is out of its range.
    #[error("invalid engine option `{field}`: {message}")]
    InvalidConfig {
        /// The option's name, as in `EngineConfig`.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token id is not in the vocabulary.
    #[error("prompt token id {id} is outside the vocabulary of {vocab_size}")]
    TokenOutOfVocab {
        /// The offending id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The prompt leaves no room for a generated token.
    #[error("the prompt has {len} tokens, not less than max_model_len = {max_model_len}")]
    PromptTooLong {
        /// Prompt length.
        len: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// The sequence needs more KV blocks than the whole pool holds.
    #[error(
        "out of KV blocks: {tokens} tokens need {needed} blocks of {block_size} tokens, the KV \
         pool has {available} (raise num_kv_blocks or gpu_memory_utilization, or shorten the \
         request)"
    )]
    OutOfKvBlocks {
        /// Tokens the sequence holds.
        tokens: usize,
        /// Blocks they need.
        needed: usize,
        /// Tokens per block.
        block_size: usize,
        /// Blocks in the pool.
        available: usize,
    },
    /// Text was given but the model has no tokenizer.
    #[error("the model folder has no tokenizer.json: pass token ids instead of text")]
    NoTokenizer,
    /// No request with this id is known.
    #[error("no request with id {0}")]
    UnknownRequest(RequestId),
    /// The device could not be used as asked.
    #[error("device: {0}")]
    Device(String),
    /// A step failed on the device (a kernel fault, a lost context, a failed read-back) or
    /// panicked: every request was ended by it, and the engine takes no more work (every later
    /// `step` and `add_request` answers this error again). Restart the process.
    #[error("the device failed, the engine is stopped: {0}")]
    DeviceFailed(String),
}

impl EngineError {
    pub(crate) fn param(field: &'static str, message: String) -> Self {
        Self::InvalidParam { field, message }
    }

    pub(crate) fn config(field: &'static str, message: String) -> Self {
        Self::InvalidConfig { field, message }
    }
}

/// Result alias of this crate.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// A panic's message (`String` or `&str` payloads; "(no message)" otherwise).
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(no message)".into())
}
