//! Paged attention: the KV-cache write and attention over a variable-length batch whose keys
//! live in a block-paged cache.

mod kv_cache;
mod metadata;
pub mod reference;

pub use kv_cache::LayerKvCache;
pub use metadata::{AttentionMetadata, MetadataTensors};
