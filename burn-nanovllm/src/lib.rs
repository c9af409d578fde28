//! burn-nanovllm: LLM inference for Qwen2-family models on Burn, with CubeCL kernels.
//!
//! ```
//! use burn_nanovllm::{EngineConfig, LLM, Prompt, SamplingParams};
//!
//! // The default model (7 M parameters, committed) on the CPU; `EngineConfig { device:
//! // DeviceKind::Cuda(0), ..Default::default() }` and a Hugging Face folder for real models.
//! let mut llm = LLM::new(burn_nanovllm::default_model_dir(), EngineConfig::default())?;
//! let out = llm.generate(&[Prompt::from("Call me Ishmael.")], &SamplingParams::greedy(16))?;
//! let text = out[0].text.as_deref().unwrap_or_default();
//! println!("{text}");
//! assert!(!out[0].token_ids.is_empty() && !text.is_empty());
//! # Ok::<(), burn_nanovllm::LlmError>(())
//! ```
//!
//! The streaming API (`add_request`, `step`, `abort`) is the engine's: [`LLM::engine_mut`].

#![warn(missing_docs)]

mod chat;
mod error;
pub mod hub;
mod llm;
pub mod server;

pub use chat::chat_loop;
pub use cubecl_kernels::{DeviceKind, KvCacheDtype};
pub use engine::tensor_parallel::serve_if_worker;
pub use engine::{
    EngineConfig, EngineStats, FinishReason, GpuStep, LLMEngine, RequestId, RequestMetrics,
    RequestOutput, SamplingParams, StepRecord, StructuredOutput, TokenLogprobs,
};
pub use error::{LlmError, Result};
pub use llm::{Completion, LLM, ParamsFor, Prompt};
pub use model_qwen2::ChatMessage;
pub use model_qwen2::Quantization;

/// The default model: `models/tiny-english` of the source tree this crate was built from, a
/// 7 M-parameter Qwen2 trained by `scripts/tiny-model` on public-domain English (see its
/// README). Used where no model is named.
pub fn default_model_dir() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny-english")
}
