//! Runs the model over a scheduled step: builds the flattened batch (token ids, positions,
//! slots, context lengths, block tables; decode rows first), runs the forward pass eagerly or
//! replays a captured decode graph, and returns the logits of the rows that sample.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{AttentionMetadata, DeviceKind};
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::cuda_graph::{DecodeGraphs, GraphTimings, bucket_sizes};
use crate::error::Result;

/// One sequence's part of a step, as the runner needs it.
#[derive(Clone, Copy, Debug)]
pub struct StepSeq<'a> {
    /// All its tokens.
    pub token_ids: &'a [u32],
    /// Tokens already in the cache; this step computes the next `num_new_tokens`.
    pub num_computed_tokens: usize,
    /// Tokens computed in this step.
    pub num_new_tokens: usize,
    /// Its blocks (covering every token computed after this step).
    pub block_table: &'a [u32],
    /// The step samples its next token.
    pub samples: bool,
}

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

/// The model, its KV cache and (on CUDA) its decode graphs.
pub struct ModelRunner {
    model: Arc<Qwen2Model>,
    cache: Arc<Mutex<KvCache>>,
    device: Device,
    block_size: usize,
    graphs: Option<DecodeGraphs>,
    stats: RunnerStats,
}

impl ModelRunner {
    /// Wraps a model and its allocated KV cache. With `graphs`, decode steps of up to
    /// `max_num_seqs` sequences are captured as CUDA graphs (on CUDA devices only).
    pub fn new(
        model: Arc<Qwen2Model>,
        cache: KvCache,
        device: Device,
        device_kind: DeviceKind,
        max_num_seqs: usize,
        max_model_len: usize,
        graphs: bool,
    ) -> Result<Self> {
        let block_size = cache.block_size();
        let cache = Arc::new(Mutex::new(cache));
        let graphs = if graphs && matches!(device_kind, DeviceKind::Cuda(_)) {
            Some(DecodeGraphs::capture(
                &model,
                &cache,
                &device,
                &bucket_sizes(max_num_seqs),
                block_size,
                max_model_len,
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
            stats: RunnerStats::default(),
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

    /// Batch sizes with a captured decode graph (empty when steps run eagerly).
    pub fn graph_sizes(&self) -> Vec<usize> {
        self.graphs
            .as_ref()
            .map(DecodeGraphs::sizes)
            .unwrap_or_default()
    }

    /// Decode-graph buckets that could not be captured, with the reason.
    pub fn graph_failures(&self) -> Vec<String> {
        self.graphs
            .as_ref()
            .map(|g| g.failures().to_vec())
            .unwrap_or_default()
    }

    /// Counters.
    pub fn stats(&self) -> RunnerStats {
        RunnerStats {
            graph_timings: self
                .graphs
                .as_ref()
                .map(DecodeGraphs::timings)
                .unwrap_or_default(),
            ..self.stats
        }
    }

    /// Runs one step. `seqs` lists the decode rows (one new token each) first, then the
    /// prefill chunks. Returns the f32 logits `[rows, V]` of the sequences that sample, in
    /// order, or `None` when none samples.
    pub fn forward(&mut self, seqs: &[StepSeq<'_>]) -> Result<Option<Tensor<2>>> {
        let start = Instant::now();
        let all_decode = seqs.iter().all(|s| s.num_new_tokens == 1 && s.samples);
        if all_decode
            && let Some(graphs) = self.graphs.as_mut()
            && let Some(logits) = graphs.run(seqs)?
        {
            self.stats.graph_steps += 1;
            self.stats.prepare_time += start.elapsed();
            return Ok(Some(logits));
        }
        let bs = self.block_size;
        let mut ids = Vec::with_capacity(seqs.iter().map(|s| s.num_new_tokens).sum());
        let mut sample_rows = Vec::new();
        for s in seqs {
            ids.extend_from_slice(
                &s.token_ids[s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens],
            );
            if s.samples {
                sample_rows.push(ids.len() as i64 - 1);
            }
        }
        let meta = AttentionMetadata::new(
            seqs.iter().map(|s| s.num_new_tokens).collect(),
            seqs.iter()
                .map(|s| s.num_computed_tokens + s.num_new_tokens)
                .collect(),
            seqs.iter().map(|s| s.block_table.to_vec()).collect(),
            bs,
            &self.device,
        )?;
        let input = self.model.input_ids(&ids, &self.device)?;
        let mut cache = self.cache.lock().expect("KV cache lock");
        let logits = if sample_rows.is_empty() {
            // Chunks that end inside their prompts: fill the cache, skip the LM head.
            let _ = self.model.forward_hidden(input, &meta, &mut cache);
            None
        } else if sample_rows.len() == ids.len() {
            Some(
                self.model
                    .forward(input, &meta, &mut cache, LogitsRows::All),
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
            Some(
                self.model
                    .forward(input, &meta, &mut cache, LogitsRows::Rows(Box::new(rows))),
            )
        };
        self.stats.eager_steps += 1;
        self.stats.prepare_time += start.elapsed();
        Ok(logits)
    }
}
