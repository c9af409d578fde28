use std::path::PathBuf;

use thiserror::Error;

/// Everything that can go wrong while reading a checkpoint folder or running the model.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A file the checkpoint needs is not there.
    #[error("missing model file {0}")]
    MissingFile(PathBuf),
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `config.json` (or another JSON file) is malformed.
    #[error("cannot parse {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// The config asks for something this implementation does not do.
    #[error("unsupported config: {field} = {value} ({reason})")]
    Unsupported {
        /// The config field, e.g. `architectures` or `rope_scaling.type`.
        field: String,
        /// Its value.
        value: String,
        /// What is supported instead.
        reason: String,
    },
    /// A safetensors file is truncated or corrupt.
    #[error("invalid safetensors file {path}: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// The checkpoint lacks a tensor the model needs.
    #[error("checkpoint is missing tensor `{0}`")]
    MissingTensor(String),
    /// The checkpoint holds tensors the model does not use.
    #[error("checkpoint has unexpected tensor(s): {}", .0.join(", "))]
    UnexpectedTensors(Vec<String>),
    /// A tensor has the wrong shape.
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Shape in the file.
        actual: Vec<usize>,
        /// Shape the config implies.
        expected: Vec<usize>,
    },
    /// A tensor is stored in a dtype we cannot convert.
    #[error("tensor `{name}` has unsupported dtype {dtype}")]
    UnsupportedDtype {
        /// Tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// The tokenizer or chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Invalid input to the model (e.g. a token id outside the vocabulary).
    #[error("invalid input: {0}")]
    Input(String),
    /// A kernel-level argument check failed.
    #[error(transparent)]
    Kernel(#[from] cubecl_kernels::KernelError),
}

impl ModelError {
    pub(crate) fn unsupported(
        field: impl Into<String>,
        value: impl std::fmt::Display,
        reason: impl Into<String>,
    ) -> Self {
        Self::Unsupported {
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

/// Result alias of this crate.
pub type Result<T, E = ModelError> = std::result::Result<T, E>;
