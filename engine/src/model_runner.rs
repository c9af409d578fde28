//! Runs the model over a scheduled step: builds the flattened batch (token ids, positions,
//! slots, context lengths, block tables; decode rows first), replays the captured step graph of
//! the smallest token bucket that holds it (decode and mixed steps alike) or runs the forward
//! pass eagerly, and returns the logits of the rows that sample. It holds the standing buffer
//! the sampler writes each step's tokens into ([`ModelRunner::draws`]), from which the next
//! step's forward takes the tokens the host has not seen yet ([`crate::step`]).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{AttentionMetadata, DeviceKind, ReductionOrder};
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::cuda_graph::{GraphCapture, GraphTimings, StepGraphs};
use crate::error::{EngineError, Result};
use crate::step::{StepSeq, feed_draws};

/// Counters of the runner's work.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunnerStats {
    /// Steps replayed as graphs.
    pub graph_steps: u64,
    /// Steps run eagerly.
    pub eager_steps: u64,
    /// Host time spent building inputs and enqueueing work (not waiting for the device).
    pub prepare_time: Duration,
    /// Of the graph steps' host time: building rows, writing buffers, launching replays.
    pub graph_timings: GraphTimings,
}

/// Called before every forward with its index (0, 1, …); an `Err` fails that forward the way a
/// device error does, and a panic propagates as a panicking backend's would. Tests inject device
/// failures through it ([`ModelRunner::set_fault_hook`]).
pub type FaultHook = Box<dyn FnMut(u64) -> std::result::Result<(), String> + Send>;

/// The model, its KV cache and (on CUDA) its decode graphs.
pub struct ModelRunner {
    model: Arc<Qwen2Model>,
    cache: Arc<Mutex<KvCache>>,
    device: Device,
    block_size: usize,
    graphs: Option<StepGraphs>,
    /// The last step's tokens, `[max_num_seqs]` i32 (row `r`: the step's `r`-th sampled row).
    draws: Tensor<1, Int>,
    stats: RunnerStats,
    /// Mark the device's stream where each step's work starts ([`ModelRunner::take_start_mark`]).
    mark_steps: bool,
    start_mark: Option<cubecl_kernels::GpuMark>,
    forwards: u64,
    fault_hook: Option<FaultHook>,
}

impl ModelRunner {
    /// Wraps a model and its allocated KV cache. With `graph_sizes`, steps of up to the
    /// largest of those token counts run as CUDA graphs (on CUDA devices; elsewhere only with
    /// `emulate_graphs`, which runs the graphs' padded forward eagerly).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Arc<Qwen2Model>,
        cache: KvCache,
        device: Device,
        device_kind: DeviceKind,
        max_num_seqs: usize,
        max_model_len: usize,
        graph_sizes: &[usize],
        emulate_graphs: bool,
    ) -> Result<Self> {
        let block_size = cache.block_size();
        let cache = Arc::new(Mutex::new(cache));
        let draws = Tensor::<1, Int>::from_data(
            TensorData::new(vec![0i32; max_num_seqs], [max_num_seqs]),
            (&device, DType::I32),
        );
        let cuda = match device_kind {
            DeviceKind::Cuda(i) => Some(i),
            _ => None,
        };
        let graphs = if !graph_sizes.is_empty() && (cuda.is_some() || emulate_graphs) {
            Some(StepGraphs::new(
                model.clone(),
                cache.clone(),
                &device,
                graph_sizes,
                max_num_seqs,
                max_model_len,
                emulate_graphs,
                cuda,
                &draws,
            )?)
        } else {
            None
        };
        Ok(Self {
            model,
            cache,
            device,
            block_size,
            graphs,
            draws,
            stats: RunnerStats::default(),
            mark_steps: false,
            start_mark: None,
            forwards: 0,
            fault_hook: None,
        })
    }

    /// The model.
    pub fn model(&self) -> &Qwen2Model {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Token counts with a step graph (empty when steps run eagerly).
    pub fn graph_sizes(&self) -> Vec<usize> {
        self.graphs
            .as_ref()
            .map(StepGraphs::sizes)
            .unwrap_or_default()
    }

    /// Step-graph buckets that could not be captured, with the reason.
    pub fn graph_failures(&self) -> Vec<String> {
        self.graphs
            .as_ref()
            .map(|g| g.failures().to_vec())
            .unwrap_or_default()
    }

    /// Each captured graph's bucket, capture time and memory.
    pub fn graph_captures(&self) -> Vec<GraphCapture> {
        self.graphs
            .as_ref()
            .map(|g| g.captured().to_vec())
            .unwrap_or_default()
    }

    /// The standing buffer of the last step's tokens (`[max_num_seqs]` i32): the sampler writes
    /// into it in place ([`cubecl_kernels::sample_into`]) and the next forward reads it.
    pub fn draws(&mut self) -> &mut Tensor<1, Int> {
        &mut self.draws
    }

    /// Records a mark on the device's stream where each step's device work starts: right before
    /// a graph replay, or before an eager forward (`EngineConfig::gpu_timeline`).
    pub fn set_mark_steps(&mut self, on: bool) {
        self.mark_steps = on;
    }

    /// The mark where the last step's device work started, if marks are on and CUDA records
    /// them.
    pub fn take_start_mark(&mut self) -> Option<cubecl_kernels::GpuMark> {
        self.start_mark.take()
    }

    /// Installs a hook that runs before every forward (device-failure injection in tests).
    pub fn set_fault_hook(&mut self, hook: FaultHook) {
        self.fault_hook = Some(hook);
    }

    /// Counters.
    pub fn stats(&self) -> RunnerStats {
        RunnerStats {
            graph_timings: self
                .graphs
                .as_ref()
                .map(StepGraphs::timings)
                .unwrap_or_default(),
            ..self.stats
        }
    }

    /// Runs one step. `seqs` lists the decode rows (one new token each) first, then the
    /// prefill chunks; a row with [`StepSeq::pending_row`] takes its token from the last
    /// step's draws. Returns the logits `[rows, V]` (this rank's columns `[rows, V_shard]` under
    /// tensor parallelism) of the sequences that sample, in order, in
    /// the model's dtype (the sampler reads them as they are), or `None` when none samples.
    pub fn forward(&mut self, seqs: &[StepSeq<'_>]) -> Result<Option<Tensor<2>>> {
        let start = Instant::now();
        let index = self.forwards;
        self.forwards += 1;
        if let Some(hook) = self.fault_hook.as_mut() {
            hook(index).map_err(EngineError::Device)?;
        }
        if let Some(graphs) = self.graphs.as_mut()
            && let Some(logits) = graphs.run(
                seqs,
                &self.draws,
                self.mark_steps.then_some(&mut self.start_mark),
            )?
        {
            self.stats.graph_steps += 1;
            self.stats.prepare_time += start.elapsed();
            return Ok(seqs.iter().any(|s| s.samples).then_some(logits));
        }
        let bs = self.block_size;
        let mut ids = Vec::with_capacity(seqs.iter().map(|s| s.num_new_tokens()).sum());
        let mut sample_rows = Vec::new();
        let mut draw_rows = Vec::new();
        for s in seqs {
            ids.extend(s.new_ids());
            if let Some(r) = s.pending_row {
                draw_rows.resize(ids.len(), -1);
                *draw_rows.last_mut().expect("a row") = r as i32;
            }
            if s.samples {
                sample_rows.push(ids.len() as i64 - 1);
            }
        }
        // Batch-invariant steps take the prefill kernel for decode rows too (EngineConfig).
        let layout = match self.model.reduction_order() {
            ReductionOrder::BatchInvariant => AttentionMetadata::prefill_only,
            ReductionOrder::Fastest => AttentionMetadata::new,
        };
        let meta = layout(
            seqs.iter().map(|s| s.num_new_tokens()).collect(),
            seqs.iter()
                .map(|s| s.num_computed_tokens + s.num_new_tokens())
                .collect(),
            seqs.iter().map(|s| s.block_table.to_vec()).collect(),
            bs,
            &self.device,
        )?;
        let mut input = self.model.input_ids(&ids, &self.device)?;
        if !draw_rows.is_empty() {
            draw_rows.resize(ids.len(), -1);
            let n = ids.len();
            let rows = Tensor::<1, Int>::from_data(
                TensorData::new(draw_rows, [n]),
                (&self.device, DType::I32),
            );
            input = feed_draws(input, rows, self.draws.clone());
        }
        if self.mark_steps {
            self.start_mark = cubecl_kernels::mark_stream(&self.draws)?;
        }
        let mut cache = self.cache.lock().expect("KV cache lock");
        let logits = if sample_rows.is_empty() {
            // Chunks that end inside their prompts: fill the cache, skip the LM head.
            let _ = self.model.forward_hidden(input, &meta, &mut cache);
            None
        } else if sample_rows.len() == ids.len() {
            Some(
                self.model
                    .forward_vocab_shard(input, &meta, &mut cache, LogitsRows::All),
            )
        } else {
            let n = sample_rows.len();
            let rows = Tensor::<1, Int>::from_data(
                TensorData::new(
                    sample_rows
                        .into_iter()
                        .map(|r| r as i32)
                        .collect::<Vec<_>>(),
                    [n],
                ),
                (&self.device, DType::I32),
            );
            Some(self.model.forward_vocab_shard(
                input,
                &meta,
                &mut cache,
                LogitsRows::Rows(Box::new(rows)),
            ))
        };
        self.stats.eager_steps += 1;
        self.stats.prepare_time += start.elapsed();
        Ok(logits)
    }
}
