//! Qwen2 / Qwen2.5 / Qwen3 as a Burn [`Module`](burn::module::Module), loading Hugging Face
//! checkpoint folders.
//!
//! The forward pass takes a flattened batch of several sequences (`input_ids [num_tokens]`)
//! with an [`AttentionMetadata`] describing each sequence's new tokens and cached context in a
//! paged [`KvCache`]; attention, the KV write and the fused RMSNorm + linear products are the
//! ops of `cubecl-kernels`, which pick CubeCL kernels on CubeCL devices and plain Burn
//! elsewhere.
//!
//! ```no_run
//! use burn::tensor::{DType, Device};
//! use model_qwen2::{AttentionMetadata, KvCache, LogitsRows, Qwen2Model, Qwen2Tokenizer};
//!
//! let device = Device::flex();
//! let model = Qwen2Model::from_pretrained("fixtures/qwen2-tiny-tied", DType::F32, &device)?;
//! let tokenizer = Qwen2Tokenizer::from_dir("fixtures/qwen2-tiny-tied")?;
//! let ids = tokenizer.encode("Hello world")?;
//! let mut cache = KvCache::new(&model.config, 4, 16, DType::F32, &device)?;
//! let meta = AttentionMetadata::prefill(vec![ids.len()], vec![vec![0, 1, 2, 3]], 16, &device)?;
//! let logits = model.forward(model.input_ids(&ids, &device)?, &meta, &mut cache, LogitsRows::LastPerSequence);
//! # Ok::<(), model_qwen2::ModelError>(())
//! ```

#![warn(missing_docs)]

mod config;
mod error;
mod kv_cache;
mod kv_scales;
pub mod layers;
mod model;
mod quantization;
pub mod tensor_parallel;
mod tokenizer;
mod weights;

pub use config::{Architecture, Qwen2Config};
pub use cubecl_kernels::AttentionMetadata;
pub use cubecl_kernels::KvCacheDtype;
pub use error::{ModelError, Result};
pub use kv_cache::{KvCache, KvScales};
pub use kv_scales::KV_SCALE_HEADROOM;
pub use model::{LogitsRows, Qwen2Model};
pub use quantization::Quantization;
#[cfg(feature = "cuda")]
pub use tensor_parallel::NcclAllReduce;
pub use tensor_parallel::{AllReduce, HostAllReduce, Parallel, TpRank};
pub use tokenizer::{ChatMessage, Qwen2Tokenizer};
pub use weights::{Checkpoint, RawTensor};
