use thiserror::Error;

/// An op was called with arguments it cannot run on.
#[derive(Debug, Error)]
pub enum KernelError {
    /// Shapes, strides, dtypes or metadata that do not fit the op; the message names the tensor.
    #[error("{0}")]
    Invalid(String),
}

impl KernelError {
    pub(crate) fn invalid(msg: impl Into<String>) -> Self {
        Self::Invalid(msg.into())
    }
}
