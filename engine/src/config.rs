//! Engine options, fixed when the engine is built (vLLM's engine arguments).

use burn::tensor::DType;
use cubecl_kernels::{DeviceKind, KvCacheDtype};
use model_qwen2::Quantization;

use crate::error::{EngineError, Result};
use crate::scheduler::Admission;

/// How the engine runs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct EngineConfig {
    /// Where the model runs.
    pub device: DeviceKind,
    /// Compute dtype; default f32 on CPUs, bf16 on CUDA.
    pub dtype: Option<DType>,
    /// Most sequences running at once (and in one step). `None`: vLLM's default for the
    /// device ([`default_max_num_seqs`]: 1,024 on GPUs of at least 70 GiB, else 256), of which
    /// the engine keeps no more than its KV pool can give [`TOKENS_PER_DEFAULT_SEQ`] tokens
    /// each (never below 256): more would only be preempted. The engine's
    /// [`config`](crate::LLMEngine::config) holds the number in force.
    pub max_num_seqs: Option<usize>,
    /// Most tokens computed in one step (decode tokens plus prefill chunks).
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output; default the model's `max_position_embeddings`.
    pub max_model_len: Option<usize>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool; default sized from free device memory (CUDA) or from
    /// `max_num_seqs` full-length sequences within `cpu_kv_cache_bytes` (CPUs).
    pub num_kv_blocks: Option<usize>,
    /// Fraction of the GPU's memory the engine may use (weights, activations, KV pool).
    pub gpu_memory_utilization: f32,
    /// KV pool budget on CPU devices, bytes, when `num_kv_blocks` is not given.
    pub cpu_kv_cache_bytes: usize,
    /// Run every step eagerly (no CUDA graphs).
    pub enforce_eager: bool,
    /// Token counts of the steps captured as CUDA graphs (vLLM's `cudagraph_capture_sizes`):
    /// a step — decodes, prefill chunks or both — replays the smallest graph that holds it,
    /// and the scheduler shapes steps to these sizes, cutting prefill chunks so that steps
    /// fill a graph and never exceed the largest. Default
    /// [`default_graph_sizes`](crate::default_graph_sizes). Each graph keeps the activations
    /// of a forward of its size on the device.
    pub cuda_graph_sizes: Option<Vec<usize>>,
    /// Off CUDA, run steps through the graphs' padded layout, eagerly (tests of the graph path
    /// on CPUs; `cubecl-cpu` only).
    pub emulate_graphs: bool,
    /// Admission batching while at least half of `max_num_seqs` sequences decode
    /// ([`crate::scheduler::Admission`]): waiting prompts are admitted once the free places'
    /// prompts fill this many tokens, so that prefill runs in fewer, larger mixed steps.
    /// `None`: `max_num_batched_tokens` (a step's worth); `Some(0)`: admit as soon as a place is
    /// free (vLLM's policy).
    pub admission_min_tokens: Option<usize>,
    /// Most consecutive steps the waiting prompts are held back for `admission_min_tokens`.
    pub admission_max_wait_steps: usize,
    /// Reuse the KV blocks of shared prompt prefixes.
    pub enable_prefix_caching: bool,
    /// Seed from which requests without their own seed get one.
    pub seed: u64,
    /// Keep a [`crate::StepRecord`] of every step (benchmarks, profiling).
    pub record_steps: bool,
    /// Overlapped (asynchronous) scheduling, vLLM V1's: a step is scheduled, built and
    /// enqueued while the previous one runs on the device; its decode rows take the tokens
    /// the previous step drew on the device, and stop conditions, text and outputs follow one
    /// step behind. `None`: on for CUDA, off elsewhere; `Some(false)`: synchronous steps
    /// (debugging).
    pub async_scheduling: Option<bool>,
    /// With `record_steps`, mark each step's device work on the CUDA stream (events where it
    /// starts and ends) for [`crate::LLMEngine::gpu_timeline`]: the device's busy and idle
    /// time per step. Benchmarks only: each mark costs the host a round trip to the device
    /// thread.
    pub gpu_timeline: bool,
    /// Ranks the model is split over (tensor parallelism, Megatron's split; 1: the whole model
    /// on `device`). Each rank holds its share of every layer and of the KV cache; rank 0 (this
    /// engine) schedules and samples for all ([`crate::tensor_parallel`]).
    pub tensor_parallel_size: usize,
    /// Under tensor parallelism, split the embedding and the LM head by vocabulary rows
    /// (vLLM's layout: each rank holds `1/size` of them, and the ranks exchange each row's best
    /// draw of their shard instead of each computing the whole logits). Off: both are whole on
    /// every rank, which measured faster at bench.py's batches on 2 × H200 (`docs/BENCHMARKS.md`).
    pub vocab_parallel: bool,
    /// Longest a tensor-parallel worker may take over one step message (enqueueing its part
    /// of a step, which waits for its device when the device falls behind) before rank 0
    /// declares it hung, ends it and fails the engine naming it.
    pub tensor_parallel_step_timeout: std::time::Duration,
    /// Batch-invariant inference: a request's logits (and so its tokens) do not depend on the
    /// other requests of its steps. Every product keeps one reduction order whatever the number
    /// of rows (one cuBLASLt algorithm per weight shape, no split-K; the FMA-tiled kernel
    /// elsewhere) and decode attention splits each context by its own length alone
    /// ([`cubecl_kernels::ReductionOrder::BatchInvariant`]); decode rows take the prefill
    /// kernel (on CUDA in a tile shaped for one query per sequence), so that a token recomputed
    /// after a preemption equals its first computation (the step graphs hold prefill chunks
    /// only). Costs speed (`docs/BENCHMARKS.md`).
    pub batch_invariant: bool,
    /// How the KV cache stores keys and values (vLLM's `kv_cache_dtype`): `Auto`, the model's
    /// dtype, or FP8 (`Fp8E4M3`, `Fp8E5M2`: half the bytes of bf16, so twice the blocks in the
    /// same memory and half the bytes a decode step reads), with a scale per layer and kv head
    /// measured at start-up on the model itself (`model_qwen2::Qwen2Model::calibrate_kv_scales`).
    /// FP8 needs a CubeCL device (`cubecl-cpu` or CUDA).
    pub kv_cache_dtype: KvCacheDtype,
    /// How the layers' products store their weights (vLLM's `quantization`): `None`, the
    /// checkpoint's dtype, or `Fp8`: E4M3 weights with one scale per weight tensor (vLLM's
    /// online FP8), quantised from the 16-bit checkpoint at start-up (half the bytes a step
    /// reads), activations quantised on the fly, the products on cuBLASLt's FP8 GEMM. FP8 needs
    /// a CUDA device of compute capability 8.9 or later (emulated on `cubecl-cpu`, for tests).
    #[serde(default)]
    pub quantization: Quantization,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            device: DeviceKind::Cpu,
            dtype: None,
            max_num_seqs: None,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            block_size: 16,
            num_kv_blocks: None,
            gpu_memory_utilization: 0.9,
            cpu_kv_cache_bytes: 256 << 20,
            enforce_eager: false,
            cuda_graph_sizes: None,
            emulate_graphs: false,
            admission_min_tokens: None,
            admission_max_wait_steps: 16,
            tensor_parallel_size: 1,
            vocab_parallel: false,
            tensor_parallel_step_timeout: std::time::Duration::from_secs(120),
            batch_invariant: false,
            kv_cache_dtype: KvCacheDtype::Auto,
            quantization: Quantization::None,
            enable_prefix_caching: true,
            seed: 0,
            record_steps: false,
            async_scheduling: None,
            gpu_timeline: false,
        }
    }
}

/// KV tokens a sequence of a default-sized batch may count on: a default `max_num_seqs` larger
/// than 256 shrinks to what the pool holds at this many tokens a sequence.
pub const TOKENS_PER_DEFAULT_SEQ: usize = 1024;

/// vLLM's default `max_num_seqs` for `device` (`get_batch_defaults` in its `arg_utils.py`):
/// 1,024 on a CUDA GPU of at least 70 GiB that is not an A100 (its note: larger batches made
/// A100s slower), 256 elsewhere. vLLM also raises its offline step budget to 16,384 tokens
/// there; ours stays at 8,192 (vLLM's server value), since a 16,384-token warm-up and its graphs
/// left a 7B model's KV pool 2.5 times smaller on an H100 (docs/BENCHMARKS.md).
pub fn default_max_num_seqs(device: DeviceKind) -> usize {
    const LARGE_GPU: usize = 70 << 30;
    let DeviceKind::Cuda(index) = device else {
        return 256;
    };
    let large = crate::device_info::cuda_memory(index).is_some_and(|(_, total)| total >= LARGE_GPU);
    let a100 = crate::device_info::cuda_device_name(index)
        .is_some_and(|name| name.to_lowercase().contains("a100"));
    if large && !a100 { 1024 } else { 256 }
}

/// The default batch's `max_num_seqs` once the KV pool holds `pool_tokens`: `default`, but no
/// more sequences than get [`TOKENS_PER_DEFAULT_SEQ`] tokens each, and never fewer than 256.
pub fn seqs_the_pool_serves(default: usize, pool_tokens: usize) -> usize {
    default.min((pool_tokens / TOKENS_PER_DEFAULT_SEQ).max(256))
}

impl EngineConfig {
    /// `max_num_seqs`, or when unset the device's default ([`default_max_num_seqs`]) within
    /// `max_num_batched_tokens` (every running sequence needs a token of the step).
    pub fn max_num_seqs(&self) -> usize {
        self.max_num_seqs.unwrap_or_else(|| {
            default_max_num_seqs(self.device).min(self.max_num_batched_tokens.max(1))
        })
    }

    /// The compute dtype for this device.
    pub fn dtype(&self) -> DType {
        self.dtype.unwrap_or(match self.device {
            DeviceKind::Cuda(_) => DType::BF16,
            _ => DType::F32,
        })
    }

    /// True if steps overlap ([`EngineConfig::async_scheduling`]).
    pub fn overlap(&self) -> bool {
        self.async_scheduling
            .unwrap_or(matches!(self.device, DeviceKind::Cuda(_)))
    }

    /// The scheduler's admission policy (`admission_min_tokens`, `admission_max_wait_steps`).
    pub fn admission(&self) -> Admission {
        Admission {
            min_tokens: self
                .admission_min_tokens
                .unwrap_or(self.max_num_batched_tokens),
            max_wait_steps: self.admission_max_wait_steps,
        }
    }

    /// The step-graph token counts: none with `enforce_eager`, none off CUDA unless
    /// `emulate_graphs`, else `cuda_graph_sizes` or the default for the batch limits.
    pub fn graph_sizes(&self) -> Vec<usize> {
        let graphs = matches!(self.device, DeviceKind::Cuda(_)) || self.emulate_graphs;
        if self.enforce_eager || !graphs {
            return Vec::new();
        }
        match &self.cuda_graph_sizes {
            Some(sizes) => sizes.clone(),
            None => crate::cuda_graph::default_graph_sizes(
                self.max_num_seqs(),
                self.max_num_batched_tokens,
            ),
        }
    }

    /// Checks the options' ranges; the error names the option.
    pub fn validate(&self) -> Result<()> {
        let c = EngineError::config;
        if self.max_num_seqs == Some(0) {
            return Err(c("max_num_seqs", "must be at least 1".to_string()));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(c(
                "max_num_batched_tokens",
                "must be at least 1".to_string(),
            ));
        }
        let max_num_seqs = self.max_num_seqs();
        if self.max_num_batched_tokens < max_num_seqs {
            return Err(c(
                "max_num_batched_tokens",
                format!(
                    "{} is less than max_num_seqs = {max_num_seqs} (every running sequence \
                     needs a token)",
                    self.max_num_batched_tokens
                ),
            ));
        }
        if self.batch_invariant && self.device == DeviceKind::Cpu {
            return Err(c(
                "batch_invariant",
                "needs a CubeCL device (cubecl-cpu or cuda): Burn's CPU backend's matrix \
                 products change their blocking with the number of rows"
                    .to_string(),
            ));
        }
        if self.kv_cache_dtype.is_fp8() && self.device == DeviceKind::Cpu {
            return Err(c(
                "kv_cache_dtype",
                format!(
                    "{} needs a CubeCL device (cubecl-cpu or cuda): Burn's CPU backend has no \
                     FP8 kernels",
                    self.kv_cache_dtype.name()
                ),
            ));
        }
        if self.quantization == Quantization::Fp8 && self.device == DeviceKind::Cpu {
            return Err(c(
                "quantization",
                "fp8 needs a CUDA device with FP8 tensor cores (compute capability 8.9 or \
                 later), or cubecl-cpu (emulated): Burn's CPU backend has no FP8 kernels"
                    .to_string(),
            ));
        }
        if !(1..=1024).contains(&self.block_size) {
            return Err(c(
                "block_size",
                format!("{} is outside 1..=1024", self.block_size),
            ));
        }
        if !(self.gpu_memory_utilization > 0.0 && self.gpu_memory_utilization <= 1.0) {
            return Err(c(
                "gpu_memory_utilization",
                format!("must be in (0, 1], got {}", self.gpu_memory_utilization),
            ));
        }
        if !(1..=64).contains(&self.tensor_parallel_size) {
            return Err(c(
                "tensor_parallel_size",
                format!("{} is outside 1..=64", self.tensor_parallel_size),
            ));
        }
        if self.tensor_parallel_step_timeout.is_zero() {
            return Err(c(
                "tensor_parallel_step_timeout",
                "must be longer than 0".to_string(),
            ));
        }
        if self.num_kv_blocks == Some(0) {
            return Err(c("num_kv_blocks", "must be at least 1".to_string()));
        }
        if let Some(sizes) = &self.cuda_graph_sizes
            && let Some(&bad) = sizes
                .iter()
                .find(|&&s| s == 0 || s > self.max_num_batched_tokens)
        {
            return Err(c(
                "cuda_graph_sizes",
                format!(
                    "{bad} is outside 1..=max_num_batched_tokens ({})",
                    self.max_num_batched_tokens
                ),
            ));
        }
        if self.emulate_graphs && self.device != DeviceKind::CubeclCpu {
            return Err(c(
                "emulate_graphs",
                format!(
                    "emulates CUDA graphs on cubecl-cpu only (device {:?})",
                    self.device
                ),
            ));
        }
        self.device
            .supports_dtype(self.dtype())
            .map_err(|e| c("dtype", e.to_string()))
    }
}
