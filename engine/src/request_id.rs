//! The engine's handle of a request, on its own so that errors can name one without
//! depending on the sequence it belongs to.

/// The engine's handle of a request: unique for the engine's life, in arrival order.
pub type RequestId = u64;
