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
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Tensor};
use cubecl_kernels::{AttentionMetadata, DeviceKind};
use model_qwen2::{KvCache, LogitsRows, Qwen2Config, Qwen2Model, Qwen2Tokenizer};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::block_manager::BlockManager;
use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::generation_config::{generation_defaults, json_ids, read_generation_config};
use crate::memory;
use crate::model_runner::{FaultHook, ModelRunner};
use crate::output::{EngineStats, GpuStep, RequestOutput, StepRecord};
use crate::output_processor::OutputProcessor;
use crate::sampler::{self, SamplerRow, TokenMasks};
use crate::sampling_params::SamplingParams;
use crate::scheduler::{Scheduler, SchedulerLimits, SchedulerOutput};
use crate::sequence::{FinishReason, RequestId, Sequence};
use crate::step::StepSeq;
use crate::structured_output::{GrammarCompiler, StructuredOutputs};
use crate::warm_up::warm_up;
use cubecl_kernels::UploadBuffer;

/// The engine's resolved limits.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineLimits {
    /// Most sequences running at once: `max_num_seqs`, or the device's default as far as the
    /// KV pool serves it ([`EngineConfig::max_num_seqs`]).
    pub max_num_seqs: usize,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// KV blocks in the pool.
    pub num_kv_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Compute dtype.
    pub dtype: DType,
    /// Token counts with a step graph (empty: eager).
    pub graph_sizes: Vec<usize>,
    /// Buckets whose capture the backend refused, with its reason.
    pub graph_failures: Vec<String>,
    /// Each captured graph's bucket, capture time and device memory.
    pub graph_captures: Vec<crate::GraphCapture>,
    /// Device bytes the step graphs took when they were captured to size the KV pool
    /// (0 when `num_kv_blocks` was given, or off CUDA).
    pub graph_memory: usize,
}

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
    /// `generation_config.json` when present) and sizes the KV pool.
    pub fn new(dir: impl AsRef<Path>, config: EngineConfig) -> Result<Self> {
        config.validate()?;
        let device = config.device.device()?;
        let model = Qwen2Model::from_pretrained(dir.as_ref(), config.dtype(), &device)?;
        Self::with_model(model, Some(dir.as_ref()), device, config)
    }

    /// Wraps an already built model (e.g. [`Qwen2Model::dummy`]); `dir`, when given, is searched
    /// for the tokenizer and `generation_config.json`.
    pub fn with_model(
        model: Qwen2Model,
        dir: Option<&Path>,
        device: Device,
        mut config: EngineConfig,
    ) -> Result<Self> {
        // The device's default batch limit is read once (the pool may lower it below), then the
        // options are checked with it.
        let default_seqs = config.max_num_seqs.is_none();
        config.max_num_seqs = Some(config.max_num_seqs());
        config.validate()?;
        let tokenizer = match dir {
            Some(d) if d.join("tokenizer.json").exists() => {
                Some(Arc::new(Qwen2Tokenizer::from_dir(d)?))
            }
            _ => None,
        };
        let generation = match dir {
            Some(d) => read_generation_config(&d.join("generation_config.json"))?,
            None => serde_json::Value::Null,
        };
        let mut eos_token_ids = model.config.eos_token_ids.clone();
        for id in json_ids(&generation["eos_token_id"]) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let model_config = model.config.clone();
        let limit = model_config.max_position_embeddings;
        let max_model_len = config.max_model_len.unwrap_or(limit);
        if max_model_len > limit || max_model_len < 2 {
            return Err(EngineError::config(
                "max_model_len",
                format!(
                    "{max_model_len} is outside 2..={limit} (the model's max_position_embeddings)"
                ),
            ));
        }
        let dtype = model.dtype();
        let model = Arc::new(model);
        // The memory the warm-up's activations take (kept by the pools): the eager steps need
        // as much again once the decode graphs have pinned pages of their own.
        let mut working_set = 0;
        if let DeviceKind::Cuda(index) = config.device {
            let before = memory::cuda_memory(index).map_or(0, |(free, _)| free);
            warm_up(&model, &device, &config, max_model_len)?;
            let after = memory::cuda_memory(index).map_or(0, |(free, _)| free);
            working_set = before.saturating_sub(after);
        }
        let (num_kv_blocks, graph_memory) = match config.num_kv_blocks {
            Some(n) => (n, 0),
            None => memory::size_kv_pool(&model, &device, &config, max_model_len, working_set)?,
        };
        // The warm-ups and the graphs' probe served the device's default, and the graphs are
        // captured for it as probed; the scheduler keeps to what the pool can hold.
        let (graph_sizes, graph_seqs) = (config.graph_sizes(), config.max_num_seqs());
        if default_seqs {
            config.max_num_seqs = Some(crate::config::seqs_the_pool_serves(
                config.max_num_seqs(),
                num_kv_blocks * config.block_size,
            ));
        }
        // The pool lives as long as the engine: in persistent memory, its layers do not size
        // the dynamic pools' pages, which every step graph keeps some of.
        let cache = cubecl_kernels::persistent(&device, (), |()| {
            KvCache::new(
                &model_config,
                num_kv_blocks,
                config.block_size,
                dtype,
                &device,
            )
        })?;
        let mut runner = ModelRunner::new(
            model,
            cache,
            device,
            config.device,
            graph_seqs,
            max_model_len,
            &graph_sizes,
            config.emulate_graphs,
        )?;
        runner.set_mark_steps(config.gpu_timeline && config.record_steps);
        let graph_sizes = runner.graph_sizes();
        let scheduler = Scheduler::new(
            SchedulerLimits {
                max_num_seqs: config.max_num_seqs(),
                max_num_batched_tokens: config.max_num_batched_tokens,
            },
            BlockManager::new(
                num_kv_blocks,
                config.block_size,
                config.enable_prefix_caching,
            ),
        )
        .with_admission(config.admission())
        // Steps shaped to the graphs that were captured.
        .with_step_sizes(
            graph_sizes.clone(),
            if graph_sizes.is_empty() {
                usize::MAX
            } else {
                crate::cuda_graph::MAX_PREFILL_CHUNKS
            },
        );
        let limits = EngineLimits {
            max_num_seqs: config.max_num_seqs(),
            max_model_len,
            num_kv_blocks,
            block_size: config.block_size,
            dtype,
            graph_sizes,
            graph_failures: runner.graph_failures(),
            graph_captures: runner.graph_captures(),
            graph_memory,
        };
        let structured = StructuredOutputs::new(
            dir.map(|d| d.join("tokenizer.json")).filter(|p| p.exists()),
            eos_token_ids.clone(),
            model_config.vocab_size,
        );
        Ok(Self {
            structured,
            rng: StdRng::seed_from_u64(config.seed),
            generation_defaults: generation_defaults(&generation),
            config,
            limits,
            model_config,
            outputs: OutputProcessor::new(tokenizer, eos_token_ids, max_model_len),
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

    /// Text of `prompt` as token ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .tokenizer()
            .ok_or(EngineError::NoTokenizer)?
            .encode(text)?)
    }

    /// Queues a request for `prompt` (token ids). Fails, without queueing, on an empty
    /// prompt, an id outside the vocabulary, a prompt of `max_model_len` tokens or more, a
    /// prompt larger than the whole KV pool, or invalid parameters.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        self.check_alive()?;
        params.validate()?;
        if self.tokenizer().is_none() && !params.stop.is_empty() {
            return Err(EngineError::param(
                "stop",
                "stop strings need the model's tokenizer.json, which this model folder lacks"
                    .into(),
            ));
        }
        self.check_prompt(&prompt)?;
        let matcher = match &params.structured_output {
            Some(constraint) => Some(self.structured.compiler()?.compile(constraint)?),
            None => None,
        };
        let bm = self.scheduler.block_manager();
        let needed = bm.blocks_for(prompt.len() + 1);
        if needed > bm.num_blocks() {
            return Err(EngineError::OutOfKvBlocks {
                tokens: prompt.len() + 1,
                needed,
                block_size: bm.block_size(),
                available: bm.num_blocks(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        if let Some(matcher) = matcher {
            self.structured.insert(id, matcher);
        }
        let seed = params.seed.unwrap_or_else(|| self.rng.random());
        // Text is tracked only where there is a tokenizer (stop strings without one were
        // refused above): token-id requests on such models stream ids alone.
        if self.tokenizer().is_some() && (self.stream_text || !params.stop.is_empty()) {
            self.outputs.track_text(id, &params);
        }
        self.scheduler
            .add(Sequence::new(id, prompt, Arc::new(params), seed));
        Ok(id)
    }

    /// The logits of every position of `prompt` (token ids), `[prompt.len(), vocab]` row-major
    /// f32 on the host: one scoring forward in a KV cache of its own, outside the engine's pool
    /// and schedule (parity checks, prompt scoring). Fails as `add_request` does on a bad prompt.
    pub fn prompt_logits(&self, prompt: &[u32]) -> Result<Vec<f32>> {
        self.check_prompt(prompt)?;
        let (model, device) = (self.runner.model(), self.runner.device());
        let bs = self.limits.block_size;
        let blocks = prompt.len().div_ceil(bs);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut cache = KvCache::new(&self.model_config, blocks, bs, model.dtype(), device)?;
        let meta = AttentionMetadata::prefill(vec![prompt.len()], vec![table], bs, device)?;
        let logits = model.forward(
            model.input_ids(prompt, device)?,
            &meta,
            &mut cache,
            LogitsRows::All,
        );
        sampler::read(logits.try_into_data(), "prompt logits")?
            .try_into_vec_as::<f32>()
            .map_err(|e| EngineError::Device(format!("prompt logits: {e:?}")))
    }

    /// [`EngineError::DeviceFailed`] once a step has failed.
    fn check_alive(&self) -> Result<()> {
        match &self.failure {
            Some(cause) => Err(EngineError::DeviceFailed(cause.clone())),
            None => Ok(()),
        }
    }

    /// An empty prompt, an id outside the vocabulary or a prompt of `max_model_len` tokens or
    /// more, as an error naming it.
    fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab_size = self.model_config.vocab_size;
        if let Some(&id) = prompt.iter().find(|&&t| t as usize >= vocab_size) {
            return Err(EngineError::TokenOutOfVocab { id, vocab_size });
        }
        let max_model_len = self.limits.max_model_len;
        if prompt.len() >= max_model_len {
            return Err(EngineError::PromptTooLong {
                len: prompt.len(),
                max_model_len,
            });
        }
        Ok(())
    }

    /// Ends a request; its output (finish reason `abort`) comes with the next step.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        match self.scheduler.get(id) {
            Some(seq) if !seq.is_finished() => {}
            _ => return Err(EngineError::UnknownRequest(id)),
        }
        let out = self.end_request(id, FinishReason::Abort);
        self.pending.extend(out);
        Ok(())
    }

    /// Ends `id` for `reason` (its blocks freed, its grammar dropped, draws in flight for it
    /// dropped): its final output.
    fn end_request(&mut self, id: RequestId, reason: FinishReason) -> Option<RequestOutput> {
        self.scheduler.finish(id, reason);
        self.structured.remove(id);
        self.outputs
            .finished_output(&mut self.scheduler, id, Vec::new(), Vec::new())
    }

    /// Runs one step: schedules, runs the model, samples, applies stop conditions. Returns an
    /// output for every request that got a token, finished, failed or was aborted since the
    /// last step; with overlapped scheduling the tokens are those of the step before (the one
    /// enqueued here is finished by the next call, or by this one when nothing is left to
    /// schedule). An error is [`EngineError::DeviceFailed`]: the forward or the sampling
    /// failed (or panicked), every running and waiting request has ended with it, and the
    /// engine takes no more work.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        self.check_alive()?;
        let start = Instant::now();
        let mut outputs = std::mem::take(&mut self.pending);
        // Penalties count the tokens drawn so far: their rows need the last one on the host.
        if self
            .in_flight
            .as_ref()
            .is_some_and(|f| f.rows.iter().any(|&(id, _)| self.needs_host_tokens(id)))
        {
            outputs.extend(self.finish_in_flight()?);
        }
        let sched = self.scheduler.schedule();
        for &id in &sched.failed {
            outputs.extend(self.outputs.finished_output(
                &mut self.scheduler,
                id,
                Vec::new(),
                Vec::new(),
            ));
        }
        if sched.is_empty() {
            // Nothing to overlap with: finish the step in flight.
            outputs.extend(self.finish_in_flight()?);
            self.stats.host_time += start.elapsed();
            self.stats.step_time += start.elapsed();
            return Ok(outputs);
        }
        let scheduled_at = Instant::now();
        self.waited = Duration::ZERO;
        // A failure here leaves the device (and the KV cache) in an unknown state: it ends
        // every request and the engine. A panicking backend counts as such a failure.
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_forward(&sched)));
        let forward = self.device_result(run)?;
        let mut masks = TokenMasks::none(self.model_config.vocab_size);
        let constrained: Vec<u32> = (0..forward.rows.len() as u32)
            .filter(|&r| self.structured.contains(forward.rows[r as usize].0))
            .collect();
        if !constrained.is_empty() {
            // Constrained rows' grammars must have seen the previous step's tokens: finish that
            // step now, while the device runs this one's forward pass, then compute the masks
            // into upload memory taken before the wait.
            let words = cubecl_kernels::mask_words(self.model_config.vocab_size);
            let upload = UploadBuffer::new(self.device(), constrained.len() * words);
            outputs.extend(self.finish_in_flight()?);
            masks = self.token_masks(&forward.rows, constrained, upload, &mut outputs);
        }
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| self.run_sampler(forward, masks)));
        let ModelRun {
            in_flight,
            graph,
            forwarded_at,
        } = self.device_result(run)?;
        let enqueued_at = Instant::now();
        let flushed = self.waited;
        let mut prefill = false;
        for s in &sched.seqs {
            if s.num_new_tokens > 1 || !s.samples || self.is_prompt_token(s.id) {
                prefill = true;
                self.stats.prefill_tokens += s.num_new_tokens as u64;
            } else {
                self.stats.decode_tokens += 1;
            }
        }
        self.hold_places(&in_flight);
        // Finish the previous step (its draws were copied behind it, while this one was
        // being built), then record what this one computes: every token it computes is known
        // on the host by now, so the prefix cache hashes real tokens only.
        let previous = self.in_flight.replace(in_flight);
        if let Some(previous) = previous {
            outputs.extend(self.finish(previous)?);
        }
        for s in &sched.seqs {
            self.scheduler.on_computed(s);
        }
        if !self.config.overlap() {
            outputs.extend(self.finish_in_flight()?);
        }
        for o in outputs.iter().filter(|o| o.finish_reason.is_some()) {
            self.structured.remove(o.id);
        }
        let waited = self.waited;
        let end = Instant::now();
        self.stats.sample_time += (enqueued_at - forwarded_at) + (waited - flushed);
        self.stats.steps += 1;
        self.stats.generated_tokens += outputs
            .iter()
            .map(|o| o.new_token_ids.len() as u64)
            .sum::<u64>();
        self.stats.host_time +=
            (scheduled_at - start) + (end - enqueued_at).saturating_sub(waited - flushed);
        self.stats.step_time += end - start;
        if prefill {
            self.stats.prefill_steps += 1;
            self.stats.prefill_time += end - start;
        } else {
            self.stats.decode_time += end - start;
        }
        if self.config.record_steps {
            self.records.push(StepRecord {
                num_seqs: sched.seqs.len(),
                num_decodes: sched.num_decodes,
                num_tokens: sched.num_tokens(),
                graph,
                schedule: scheduled_at - start,
                forward: forwarded_at - scheduled_at,
                sample: (enqueued_at - forwarded_at).saturating_sub(flushed),
                wait: waited,
                post: (end - enqueued_at).saturating_sub(waited - flushed),
            });
        }
        Ok(outputs)
    }

    /// True if `id` is scheduled and has not finished (stopped, failed or aborted).
    fn is_running(&self, id: RequestId) -> bool {
        self.scheduler.get(id).is_some_and(|s| !s.is_finished())
    }

    /// True if `id`'s penalties need its drawn tokens on the host.
    fn needs_host_tokens(&self, id: RequestId) -> bool {
        self.scheduler.get(id).is_some_and(|s| {
            let p = &s.params;
            p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
        })
    }

    /// Places the step's draws in their sequences as placeholders (the next step reads them
    /// on the device); a sequence whose placeholder is its last token is scheduled no more.
    fn hold_places(&mut self, in_flight: &InFlight) {
        let max_model_len = self.limits.max_model_len;
        for &(id, _) in &in_flight.rows {
            // A request that ended while its step's forward ran gets no placeholder.
            let Some(seq) = self.scheduler.get_mut(id) else {
                continue;
            };
            seq.token_ids.push(0);
            seq.num_pending_tokens += 1;
            seq.final_token_pending = seq.num_output_tokens() >= seq.params.max_tokens
                || seq.num_tokens() >= max_model_len;
        }
    }

    /// Finishes the step in flight, if any: its outputs.
    fn finish_in_flight(&mut self) -> Result<Vec<RequestOutput>> {
        match self.in_flight.take() {
            Some(step) => self.finish(step),
            None => Ok(Vec::new()),
        }
    }

    /// Waits for a step's draws and applies them: each replaces its placeholder and goes
    /// through the stop conditions. Draws of requests that ended meanwhile are dropped.
    fn finish(&mut self, step: InFlight) -> Result<Vec<RequestOutput>> {
        let wait_start = Instant::now();
        let sampled = std::panic::catch_unwind(AssertUnwindSafe(|| step.draws.wait()));
        self.waited += wait_start.elapsed();
        let sampled = self.device_result(sampled)?;
        // Constrained requests' grammars take their tokens first, all at once (in parallel).
        let grammar_start = Instant::now();
        let drawn: Vec<(RequestId, u32)> = step
            .rows
            .iter()
            .zip(&sampled)
            .filter(|((id, _), _)| self.structured.contains(*id))
            .filter(|((id, _), _)| self.is_running(*id))
            .map(|(&(id, _), s)| (id, s.token_id))
            .collect();
        let mut advanced = match drawn.is_empty() {
            true => HashMap::new(),
            false => self.structured.advance(&drawn),
        };
        self.stats.mask_time += grammar_start.elapsed();
        let mut outputs = Vec::new();
        for ((id, position), sample) in step.rows.into_iter().zip(sampled) {
            let Some(seq) = self.scheduler.get_mut(id) else {
                continue; // aborted or stopped: its output is out already
            };
            if seq.is_finished() {
                continue;
            }
            seq.token_ids[position] = sample.token_id;
            seq.num_pending_tokens -= 1;
            let grammar_complete = match advanced.remove(&id) {
                None => false,
                Some(advance) => match advance {
                    Ok(complete) => complete,
                    Err(e) => {
                        let reason = FinishReason::Error(format!(
                            "structured output: token {} breaks the constraint: {e}",
                            sample.token_id
                        ));
                        outputs.extend(self.end_request(id, reason));
                        continue;
                    }
                },
            };
            outputs.extend(self.outputs.accept_token(
                &mut self.scheduler,
                id,
                position,
                sample.logprobs,
                grammar_complete,
            )?);
        }
        Ok(outputs)
    }

    /// The step's forward pass, enqueued.
    fn run_forward(&mut self, sched: &SchedulerOutput) -> Result<Forward> {
        let prev = self.in_flight.as_ref();
        let seqs: Vec<StepSeq<'_>> = sched
            .seqs
            .iter()
            .map(|s| {
                let seq = self.scheduler.get(s.id).expect("scheduled sequence");
                let pending_row = match seq.num_pending_tokens {
                    0 => None,
                    _ => Some(*prev.and_then(|p| p.row_of.get(&s.id)).ok_or_else(|| {
                        EngineError::Device(format!(
                            "request {} waits for a draw no step made",
                            s.id
                        ))
                    })?),
                };
                Ok(StepSeq {
                    token_ids: &seq.token_ids,
                    num_computed_tokens: seq.num_computed_tokens,
                    num_new_tokens: s.num_new_tokens,
                    block_table: &seq.block_table,
                    samples: s.samples,
                    pending_row,
                })
            })
            .collect::<Result<_>>()?;
        let graph_steps = self.runner.stats().graph_steps;
        let logits = self.runner.forward(&seqs)?;
        let forwarded_at = Instant::now();
        let graph = self.runner.stats().graph_steps > graph_steps;
        drop(seqs);
        let rows: Vec<(RequestId, usize)> = sched
            .seqs
            .iter()
            .filter(|s| s.samples)
            .map(|s| {
                (
                    s.id,
                    self.scheduler.get(s.id).expect("sampled").num_tokens(),
                )
            })
            .collect();
        Ok(Forward {
            logits,
            rows,
            graph,
            forwarded_at,
        })
    }

    /// The token masks of this step's `constrained` rows (of `rows`), written into `upload`
    /// (their grammars have seen every drawn token). A request whose grammar fails ends with
    /// the error (in `outputs`); its row then allows every token, as does the row of a request
    /// that ended meanwhile, and their draws are dropped.
    fn token_masks(
        &mut self,
        rows: &[(RequestId, usize)],
        constrained: Vec<u32>,
        mut upload: UploadBuffer,
        outputs: &mut Vec<RequestOutput>,
    ) -> TokenMasks {
        let start = Instant::now();
        let live: Vec<Option<RequestId>> = constrained
            .iter()
            .map(|&r| rows[r as usize].0)
            .map(|id| self.is_running(id).then_some(id))
            .collect();
        let allowed = upload.as_mut_slice();
        let failed = self.structured.masks(&live, allowed);
        // End-of-sequence and stop tokens before `min_tokens` leave the mask, unless nothing
        // else is left in it.
        let words = cubecl_kernels::mask_words(self.model_config.vocab_size);
        for (k, id) in live.iter().enumerate() {
            let Some(seq) = id.and_then(|id| self.scheduler.get(id)) else {
                continue;
            };
            let banned = self.banned_tokens(seq);
            if banned.is_empty() {
                continue;
            }
            let mask = &mut allowed[k * words..(k + 1) * words];
            let before: Vec<u32> = banned.iter().map(|&t| mask[t as usize / 32]).collect();
            for &t in &banned {
                mask[t as usize / 32] &= !(1u32 << (t % 32));
            }
            if mask.iter().all(|&w| w == 0) {
                // Nothing else is left: the bans give way.
                for (&t, w) in banned.iter().zip(before) {
                    mask[t as usize / 32] = w;
                }
            }
        }
        for (id, e) in failed {
            let reason = FinishReason::Error(format!("structured output: {e}"));
            outputs.extend(self.end_request(id, reason));
        }
        self.stats.mask_steps += 1;
        self.stats.masked_rows += live.iter().flatten().count() as u64;
        self.stats.mask_time += start.elapsed();
        TokenMasks {
            allowed: upload.into_data([constrained.len(), words]),
            rows: constrained,
        }
    }

    /// The step's sampling (constrained rows under `masks`), enqueued behind its forward.
    fn run_sampler(&mut self, forward: Forward, masks: TokenMasks) -> Result<ModelRun> {
        let Forward {
            logits,
            rows,
            graph,
            forwarded_at,
        } = forward;
        let draws = match logits {
            Some(logits) => {
                // Requests that ended while the forward ran (the previous step finished early
                // for structured outputs) draw a greedy token nobody reads.
                let stand_in = SamplingParams::greedy(1);
                // A constrained row's bans are in its mask already.
                let mut masked = vec![false; rows.len()];
                for &r in &masks.rows {
                    masked[r as usize] = true;
                }
                let banned: Vec<Vec<u32>> = (0..rows.len())
                    .map(|r| match self.scheduler.get(rows[r].0) {
                        Some(seq) if !masked[r] => self.banned_tokens(seq),
                        _ => Vec::new(),
                    })
                    .collect();
                let seqs: Vec<Option<&Sequence>> =
                    rows.iter().map(|&(id, _)| self.scheduler.get(id)).collect();
                let sampler_rows: Vec<SamplerRow<'_>> = seqs
                    .iter()
                    .zip(banned)
                    .map(|(seq, banned)| match seq {
                        Some(seq) => SamplerRow {
                            params: &seq.params,
                            seed: seq.seed,
                            prompt: &seq.token_ids[..seq.num_prompt_tokens],
                            output: seq.output_token_ids(),
                            banned,
                        },
                        None => SamplerRow {
                            params: &stand_in,
                            seed: 0,
                            prompt: &[],
                            output: &[],
                            banned,
                        },
                    })
                    .collect();
                let counters: Vec<u32> = rows.iter().map(|&(_, pos)| pos as u32).collect();
                let (draws, flush) =
                    sampler::sample(logits, &sampler_rows, masks, &counters, self.runner.draws())?;
                // Flushing the sampling to the device waits for it while the previous step's
                // copy of the draws buffer (which this sampling rewrites) is pending.
                self.waited += flush;
                draws
            }
            None => sampler::Draws::Ready(Vec::new()),
        };
        let row_of = rows
            .iter()
            .enumerate()
            .map(|(r, &(id, _))| (id, r))
            .collect();
        if self.config.gpu_timeline && self.config.record_steps {
            let start = self.runner.take_start_mark();
            let end = cubecl_kernels::mark_stream(self.runner.draws())?;
            self.gpu_marks.push(start.zip(end));
        }
        Ok(ModelRun {
            in_flight: InFlight {
                rows,
                row_of,
                draws,
            },
            graph,
            forwarded_at,
        })
    }

    /// The value of device work run under `catch_unwind`; an error or a panic there ends
    /// every request and the engine ([`LLMEngine::fail`]).
    fn device_result<T>(&mut self, run: std::thread::Result<Result<T>>) -> Result<T> {
        match run {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(self.fail(e.to_string())),
            Err(panic) => Err(self.fail(panic_message(panic.as_ref()))),
        }
    }

    /// Ends every request and the engine after a failed step; returns the error to report.
    fn fail(&mut self, cause: String) -> EngineError {
        let reason = FinishReason::Error(format!("the device failed: {cause}"));
        for id in self.scheduler.unfinished() {
            self.scheduler.finish(id, reason.clone());
            self.scheduler.take_finished(id);
        }
        self.pending.clear();
        self.outputs.clear();
        self.structured.clear();
        self.in_flight = None;
        self.failure = Some(cause.clone());
        EngineError::DeviceFailed(cause)
    }

    /// The cause of the device failure that stopped the engine, if one did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.as_deref()
    }

    /// True if `id`'s next computed token is still part of its prompt.
    fn is_prompt_token(&self, id: RequestId) -> bool {
        self.scheduler
            .get(id)
            .is_some_and(|s| s.num_computed_tokens < s.num_prompt_tokens)
    }

    /// End-of-sequence and stop tokens may not be drawn before `min_tokens`.
    fn banned_tokens(&self, seq: &Sequence) -> Vec<u32> {
        let p = &seq.params;
        if seq.num_output_tokens() >= p.min_tokens {
            return Vec::new();
        }
        let mut banned = p.stop_token_ids.clone();
        if !p.ignore_eos {
            banned.extend(self.outputs.eos_token_ids());
        }
        banned.retain(|&t| (t as usize) < self.model_config.vocab_size);
        banned
    }
}

/// The text a panic carried.
fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let text = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    format!("a step panicked: {text}")
}
