use thiserror::Error;

/// Errors of the public API.
#[derive(Debug, Error)]
pub enum LlmError {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] model_qwen2::ModelError),
    /// A kernel or device check failed.
    #[error(transparent)]
    Kernel(#[from] cubecl_kernels::KernelError),
    /// A prompt does not leave room for a single generated token.
    #[error("prompt {index} has {len} tokens, not less than max_model_len = {max_model_len}")]
    PromptTooLong {
        /// Position of the prompt in the request.
        index: usize,
        /// Its length in tokens.
        len: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// Text was given but the checkpoint has no `tokenizer.json`.
    #[error("the checkpoint folder has no tokenizer.json: pass token ids instead of text")]
    NoTokenizer,
    /// Any other invalid argument.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias of this crate.
pub type Result<T, E = LlmError> = std::result::Result<T, E>;
