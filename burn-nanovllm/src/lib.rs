//! burn-nanovllm: LLM inference for Qwen2-family models on Burn, with CubeCL kernels.
//!
//! ```no_run
//! use burn_nanovllm::{LLM, LlmOptions, Prompt, SamplingParams};
//!
//! let llm = LLM::new("fixtures/qwen2-tiny-tied", LlmOptions::default())?;
//! let out = llm.generate(&[Prompt::from("Hello, my name is")], &SamplingParams::greedy(16))?;
//! println!("{}", out[0].text.as_deref().unwrap_or_default());
//! # Ok::<(), burn_nanovllm::LlmError>(())
//! ```

mod error;
mod llm;
mod sampling;

pub use cubecl_kernels::DeviceKind;
pub use error::{LlmError, Result};
pub use llm::{Completion, FinishReason, LLM, LlmOptions, Prompt};
pub use sampling::{Sampler, SamplingParams};
