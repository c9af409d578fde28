//! burn-nanovllm: LLM inference for Qwen2-family models on Burn, with CubeCL kernels.
//!
//! ```no_run
//! use burn_nanovllm::{EngineConfig, LLM, Prompt, SamplingParams};
//!
//! let mut llm = LLM::new("fixtures/qwen2-tiny-tied", EngineConfig::default())?;
//! let out = llm.generate(&[Prompt::from("Hello, my name is")], &SamplingParams::greedy(16))?;
//! println!("{}", out[0].text.as_deref().unwrap_or_default());
//! # Ok::<(), burn_nanovllm::LlmError>(())
//! ```
//!
//! The streaming API (`add_request`, `step`, `abort`) is the engine's: [`LLM::engine_mut`].

mod error;
mod llm;

pub use cubecl_kernels::DeviceKind;
pub use engine::{
    EngineConfig, EngineStats, FinishReason, LLMEngine, RequestId, RequestMetrics, RequestOutput,
    SamplingParams, StepRecord, TokenLogprobs,
};
pub use error::{LlmError, Result};
pub use llm::{Completion, LLM, ParamsFor, Prompt};
pub use model_qwen2::ChatMessage;
