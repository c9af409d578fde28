//! `LLMEngine`: the generation loop. `add_request` queues a prompt, `step` runs one scheduled
//! batch (mixed decode rows and prefill chunks) and returns each request's new tokens, `abort`
//! drops a request. Everything that generates text in this workspace goes through `step`.
//!
//! With overlapped scheduling ([`EngineConfig::async_scheduling`]) a step enqueues its batch
//! and then finishes the previous one, whose draws are on their way back meanwhile: the new
//! batch's decode rows take those tokens on the device (a placeholder stands in the sequence
//! until they arrive), and stop conditions, text and outputs follow one step behind. A token
//! drawn after its request stopped (or was aborted) is dropped, never emitted.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{Device, Tensor};
use model_qwen2::{Qwen2Config, Qwen2Model, Qwen2Tokenizer};
use rand::{SeedableRng, rngs::StdRng};

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::model_runner::{FaultHook, ModelRunner};
use crate::output::{EngineStats, GpuStep, RequestOutput, StepRecord};
use crate::output_processor::OutputProcessor;
use crate::sampler;
use crate::sampling_params::SamplingParams;
use crate::scheduler::Scheduler;
pub use crate::start_up::EngineLimits;

mod intake;
mod sampler_inputs;
mod step_loop;
use crate::sequence::RequestId;
use crate::start_up::{self, StartUp};
use crate::structured_output::{GrammarCompiler, StructuredOutputs};
use crate::tensor_parallel::{self, ModelSource, Workers, load_rank};

/// The inference engine over one model on one device.
pub struct LLMEngine {
    config: EngineConfig,
    limits: EngineLimits,
    model_config: Qwen2Config,
    generation_defaults: SamplingParams,
    scheduler: Scheduler,
    runner: ModelRunner,
    outputs: OutputProcessor,
    pending: Vec<RequestOutput>,
    stream_text: bool,
    next_id: RequestId,
    rng: StdRng,
    stats: EngineStats,
    records: Vec<StepRecord>,
    failure: Option<String>,
    /// The step enqueued last, whose draws are not processed yet (overlapped scheduling).
    in_flight: Option<InFlight>,
    /// Time the current step spent waiting for draws.
    waited: Duration,
    /// With `gpu_timeline`: each recorded step's marks on the device's stream (start, end).
    gpu_marks: Vec<Option<(cubecl_kernels::GpuMark, cubecl_kernels::GpuMark)>>,
    /// The other tensor-parallel ranks (`tensor_parallel_size` > 1).
    workers: Option<Workers>,
    /// The constrained requests' grammars.
    structured: StructuredOutputs,
}

/// A step enqueued on the device whose draws the host has not processed yet.
struct InFlight {
    /// The requests whose rows sampled, in row order, with the position of the drawn token.
    rows: Vec<(RequestId, usize)>,
    /// Each of those requests' row.
    row_of: HashMap<RequestId, usize>,
    /// The draws, on their way back.
    draws: sampler::Draws,
}

/// A step's forward pass, enqueued.
struct Forward {
    /// Logits of the rows that sample (`None` when none does).
    logits: Option<Tensor<2>>,
    /// The requests whose rows sample, in row order, with the position of the drawn token.
    rows: Vec<(RequestId, usize)>,
    /// The forward replayed a step graph.
    graph: bool,
    forwarded_at: Instant,
}

/// What the model part of a step enqueued.
struct ModelRun {
    /// The step's draws, still on the device.
    in_flight: InFlight,
    /// The forward replayed a step graph.
    graph: bool,
    forwarded_at: Instant,
}

impl LLMEngine {
    /// Loads a Hugging Face checkpoint folder (config, weights, tokenizer and
    /// `generation_config.json` when present) and sizes the KV pool. With
    /// `tensor_parallel_size` > 1 each rank loads its share ([`crate::tensor_parallel`]): on
    /// CUDA, worker processes of this executable on the GPUs after `device`'s, whose `main`
    /// must call [`crate::tensor_parallel::serve_if_worker`] first.
    pub fn new(dir: impl AsRef<Path>, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let (dir, device) = (dir.as_ref(), config.device.device()?);
        if config.tensor_parallel_size > 1 {
            return Self::parallel(ModelSource::Checkpoint(dir.to_path_buf()), device, config);
        }
        let model = Qwen2Model::from_pretrained(dir, config.dtype(), &device)?;
        Self::with_model(model, Some(dir), device, config)
    }

    /// An engine over random weights of `model_config` (like vLLM's `load_format=dummy`:
    /// benchmarks), split over `tensor_parallel_size` ranks as [`LLMEngine::new`] splits a
    /// checkpoint; `dir`, when given, is searched for the tokenizer and
    /// `generation_config.json`.
    pub fn with_random_weights(
        model_config: Qwen2Config,
        dir: Option<&Path>,
        config: EngineConfig,
    ) -> Result<Self> {
        config.validate()?;
        let device = config.device.device()?;
        if config.tensor_parallel_size > 1 {
            let source = ModelSource::Random(model_config, dir.map(Path::to_path_buf));
            return Self::parallel(source, device, config);
        }
        let model = Qwen2Model::dummy(model_config, config.dtype(), &device);
        Self::with_model(model, dir, device, config)
    }

    /// Rank 0 of a tensor-parallel group over `source`: starts the other ranks, loads its
    /// share, starts up with them.
    fn parallel(source: ModelSource, device: Device, config: EngineConfig) -> Result<Self> {
        if tensor_parallel::processes::is_worker() {
            return Err(EngineError::config(
                "tensor_parallel_size",
                "this process is a tensor-parallel worker: its main must call \
                 engine::tensor_parallel::serve_if_worker() first"
                    .into(),
            ));
        }
        let (all_reduce, workers) = match config.device {
            #[cfg(feature = "cuda")]
            cubecl_kernels::DeviceKind::Cuda(index) => {
                tensor_parallel::processes::spawn(&source, &config, index, &device)?
            }
            _ => {
                let group = model_qwen2::HostAllReduce::group(config.tensor_parallel_size);
                let workers = tensor_parallel::threads::spawn(&source, &config, &group)?;
                (group[0].clone(), workers)
            }
        };
        let model = load_rank(&source, &config, 0, all_reduce, &device);
        // A worker that fails aborts the group, and rank 0's next collective panics with its
        // reason: an error here, not a panic.
        let engine = model.and_then(|m| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                Self::start(m, source.dir(), device, config)
            }))
            .unwrap_or_else(|panic| {
                Err(EngineError::Device(crate::error::panic_text(
                    panic.as_ref(),
                )))
            })
        });
        if let Err(e) = &engine {
            workers.abort(&e.to_string());
        }
        let mut engine = engine?;
        engine.workers = Some(workers);
        Ok(engine)
    }

    /// Wraps an already built model (e.g. [`Qwen2Model::dummy`]); `dir`, when given, is searched
    /// for the tokenizer and `generation_config.json`. One rank only: a tensor-parallel engine
    /// loads its ranks' shares itself ([`LLMEngine::new`]).
    pub fn with_model(
        model: Qwen2Model,
        dir: Option<&Path>,
        device: Device,
        config: EngineConfig,
    ) -> Result<Self> {
        if config.tensor_parallel_size > 1 {
            return Err(EngineError::config(
                "tensor_parallel_size",
                "an engine over a built model has one rank; LLMEngine::new loads each rank's \
                 share of a checkpoint"
                    .into(),
            ));
        }
        Self::start(model, dir, device, config)
    }

    fn start(
        model: Qwen2Model,
        dir: Option<&Path>,
        device: Device,
        config: EngineConfig,
    ) -> Result<Self> {
        let StartUp {
            config,
            limits,
            model_config,
            generation_defaults,
            tokenizer,
            eos_token_ids,
            scheduler,
            runner,
            structured,
        } = start_up::start(model, dir, device, config)?;
        Ok(Self {
            structured,
            rng: StdRng::seed_from_u64(config.seed),
            generation_defaults,
            outputs: OutputProcessor::new(tokenizer, eos_token_ids, limits.max_model_len),
            config,
            limits,
            model_config,
            scheduler,
            runner,
            pending: Vec::new(),
            stream_text: false,
            next_id: 0,
            stats: EngineStats::default(),
            records: Vec::new(),
            failure: None,
            in_flight: None,
            waited: Duration::ZERO,
            gpu_marks: Vec::new(),
            workers: None,
        })
    }

    /// The options the engine was built with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The resolved limits (KV pool size, `max_model_len`, graphs).
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// The model's configuration.
    pub fn model_config(&self) -> &Qwen2Config {
        &self.model_config
    }

    /// The model.
    pub fn model(&self) -> &Qwen2Model {
        self.runner.model()
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        self.runner.device()
    }

    /// The tokenizer, when the model folder has one.
    pub fn tokenizer(&self) -> Option<&Arc<Qwen2Tokenizer>> {
        self.outputs.tokenizer()
    }

    /// End-of-sequence ids (config and `generation_config.json`).
    pub fn eos_token_ids(&self) -> &[u32] {
        self.outputs.eos_token_ids()
    }

    /// Sampling defaults from `generation_config.json` (temperature, top-p, top-k,
    /// repetition penalty), over [`SamplingParams::default`].
    pub fn default_sampling_params(&self) -> SamplingParams {
        self.generation_defaults.clone()
    }

    /// Track every request's text and hand out text deltas in [`RequestOutput::new_text`]
    /// (streaming front ends). Off by default: text is then tracked only for requests with
    /// stop strings.
    pub fn set_stream_text(&mut self, on: bool) {
        self.stream_text = on;
    }

    /// The compiler of structured outputs over this model's vocabulary (built on first use,
    /// then shared): front ends compile a request's constraint with it before submitting, so an
    /// invalid one is refused early and the engine's own compile is a cache hit. Fails when
    /// the model folder has no `tokenizer.json`.
    pub fn grammar_compiler(&mut self) -> Result<Arc<GrammarCompiler>> {
        self.structured.compiler()
    }

    /// Runs `hook` before every forward (see [`FaultHook`]): tests inject device failures here.
    pub fn set_fault_hook(&mut self, hook: FaultHook) {
        self.runner.set_fault_hook(hook);
    }

    /// Makes tensor-parallel worker `rank` (`1..tensor_parallel_size`) do nothing for
    /// `duration` before its next step: tests inject a hung rank here, which the watchdog
    /// ends after [`EngineConfig::tensor_parallel_step_timeout`].
    pub fn stall_worker(&mut self, rank: usize, duration: std::time::Duration) -> Result<()> {
        match &mut self.workers {
            Some(workers) => workers.stall(rank, duration),
            None => Err(EngineError::config(
                "tensor_parallel_size",
                "no tensor-parallel workers to stall".into(),
            )),
        }
    }

    /// Counters since the engine started.
    pub fn stats(&self) -> EngineStats {
        let mut s = self.stats;
        let bm = self.scheduler.block_manager().stats();
        s.prefix_queried_tokens = bm.queried_tokens;
        s.prefix_hit_tokens = bm.hit_tokens;
        s.preemptions = self.scheduler.num_preemptions();
        let r = self.runner.stats();
        s.graph_steps = r.graph_steps;
        s.prepare_time = r.prepare_time;
        s.graph_timings = r.graph_timings;
        s
    }

    /// The steps recorded so far (with `EngineConfig::record_steps`).
    pub fn step_records(&self) -> &[StepRecord] {
        &self.records
    }

    /// The device time of each recorded step, aligned with [`LLMEngine::step_records`] (with
    /// `EngineConfig::gpu_timeline` on CUDA; `None` where no marks were recorded). Waits for
    /// the device to reach the last mark.
    pub fn gpu_timeline(&self) -> Result<Vec<Option<GpuStep>>> {
        let ms = |v: f32| Duration::from_secs_f64(v.max(0.0) as f64 / 1e3);
        let err = |e: cubecl_kernels::KernelError| EngineError::Device(e.to_string());
        let mut out = Vec::with_capacity(self.gpu_marks.len());
        for (i, marks) in self.gpu_marks.iter().enumerate() {
            let Some((start, end)) = marks else {
                out.push(None);
                continue;
            };
            let idle_before = match i.checked_sub(1).and_then(|j| self.gpu_marks[j].as_ref()) {
                Some((_, previous_end)) => ms(start.ms_since(previous_end).map_err(err)?),
                None => Duration::ZERO,
            };
            out.push(Some(GpuStep {
                busy: ms(end.ms_since(start).map_err(err)?),
                idle_before,
            }));
        }
        Ok(out)
    }

    /// Requests waiting to be scheduled.
    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    /// Requests running.
    pub fn num_running(&self) -> usize {
        self.scheduler.num_running()
    }

    /// Fraction of the KV pool held by requests.
    pub fn kv_usage(&self) -> f64 {
        self.scheduler.block_manager().usage()
    }

    /// True while any request is unfinished (or an output is pending).
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished() || !self.pending.is_empty() || self.in_flight.is_some()
    }
}
