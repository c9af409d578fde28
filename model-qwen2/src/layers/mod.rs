//! The building blocks of a Qwen2 decoder.

mod attention;
mod decoder;
mod linear;
mod mlp;
mod norm;
mod rotary;

pub use attention::Qwen2Attention;
pub use decoder::Qwen2DecoderLayer;
pub use linear::Linear;
pub use mlp::Qwen2Mlp;
pub use norm::RmsNorm;
pub use rotary::RotaryEmbedding;
