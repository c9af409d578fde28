//! The inference engine: continuous batching over a paged KV cache with prefix caching, chunked
//! prefill mixed with decodes, preemption by recompute, CUDA-graph decode steps and sampling on
//! the device — nano-vLLM's design in Rust, over the Qwen2 model of `model-qwen2` and the
//! kernels of `cubecl-kernels`. It knows nothing of command lines or HTTP.
//!
//! | file | idea |
//! | --- | --- |
//! | [`config`] | [`EngineConfig`]: limits, device, pool size, graphs |
//! | [`sampling_params`] | [`SamplingParams`]: per-request sampling and stop conditions |
//! | [`sequence`] | [`Sequence`]: a request's tokens, computed count and block table |
//! | [`block_manager`] | [`BlockManager`]: reference-counted KV blocks and the prefix cache |
//! | [`scheduler`] | [`Scheduler`]: which tokens of which sequences a step computes |
//! | [`step`] | [`StepSeq`]: one sequence's part of a step; tokens fed from the last step's draws |
//! | `graph_inputs` | the step graphs' input buffers: what changed is written, block tables by entry |
//! | [`device_info`] | the CUDA driver's free memory and device name |
//! | [`memory`] | the KV pool's size: free memory less the graphs' and the warm-up's |
//! | [`model_runner`] | [`ModelRunner`]: the flattened batch, the forward pass, step graphs |
//! | [`sampler`] | penalties, the sampling kernel and log-probabilities |
//! | [`structured_output`] | JSON schema, regex, choice and grammar constraints: token masks per row |
//! | [`detokenizer`] | incremental text and stop strings |
//! | `output_processor` | stop conditions and text of drawn tokens (one step behind, when overlapped) |
//! | `generation_config` | a checkpoint's EOS ids and recommended sampling defaults |
//! | `warm_up` | a forward at every step size before the KV pool is sized |
//! | `start_up` | loading, warm-up, KV-pool sizing, graph capture: what an engine starts with |
//! | [`engine`] | [`LLMEngine`]: `add_request`, `step` (the step loop), `abort` |

#![warn(missing_docs)]

pub mod block_manager;
pub mod config;
mod cuda_graph;
pub mod detokenizer;
pub mod device_info;
pub mod engine;
pub mod error;
mod generation_config;
mod graph_inputs;
mod knobs;
mod kv_calibration;
pub mod memory;
pub mod model_runner;
pub mod output;
mod output_processor;
mod request_id;
pub mod sampler;
pub mod sampling_params;
pub mod scheduler;
pub mod sequence;
mod start_up;
pub mod step;
pub mod structured_output;
pub mod tensor_parallel;
mod warm_up;

pub use block_manager::BlockManager;
pub use config::{
    EngineConfig, TOKENS_PER_DEFAULT_SEQ, default_max_num_seqs, seqs_the_pool_serves,
};
pub use cubecl_kernels::{DeviceKind, KvCacheDtype};
pub use cuda_graph::{GraphCapture, GraphTimings, default_graph_sizes};
pub use engine::{EngineLimits, LLMEngine};
pub use error::{EngineError, Result};
pub use model_qwen2::Quantization;
pub use model_runner::{FaultHook, ModelRunner, RunnerStats};
pub use output::{EngineStats, GpuStep, RequestMetrics, RequestOutput, StepRecord};
pub use sampler::TokenLogprobs;
pub use sampling_params::SamplingParams;
pub use scheduler::{Admission, Scheduler, SchedulerLimits, SchedulerOutput};
pub use sequence::{FinishReason, RequestId, Sequence};
pub use step::StepSeq;
pub use structured_output::{GrammarCompiler, GrammarMatcher, StructuredOutput};
