use thiserror::Error;

/// Errors of the public API.
#[derive(Debug, Error)]
pub enum LlmError {
    /// The engine refused or failed.
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] model_qwen2::ModelError),
    /// A kernel or device check failed.
    #[error(transparent)]
    Kernel(#[from] cubecl_kernels::KernelError),
    /// Text was given but the checkpoint has no `tokenizer.json`.
    #[error("the checkpoint folder has no tokenizer.json: pass token ids instead of text")]
    NoTokenizer,
    /// A model named by Hugging Face repo id is not in the cache and could not be downloaded.
    #[error("{0}")]
    Hub(String),
    /// Any other invalid argument.
    #[error("{0}")]
    Invalid(String),
}

/// Result alias of this crate.
pub type Result<T, E = LlmError> = std::result::Result<T, E>;
