//! Decode steps replayed as CUDA graphs, one per batch-size bucket.
//!
//! Each bucket owns stable input buffers (token ids, positions, slots, context lengths and the
//! block tables as one flat `[bucket · width]` buffer, `width = ceil(max_model_len /
//! block_size)`) and a graph captured over a whole decode forward that reads them; a step
//! writes its rows into the smallest bucket that holds them (padding rows: token 0, position 0,
//! no KV write, a one-key context in block 0), replays it and reads the logits of its rows. The
//! decode kernel's context split is captured for `max_model_len` (`with_context_bound`), so a
//! graph captured at short contexts stays valid as they grow.

use std::sync::{Arc, Mutex};

use burn::backend::{Backend, BackendGraph, Dispatch};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{AttentionMetadata, DecodeTensors, MetadataTensors, write_ints};
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::error::{EngineError, Result};
use crate::model_runner::StepSeq;

/// One bucket: its input buffers, the captured graph, its output and what the graph reads
/// (kept alive as long as the graph: a replay uses their buffers).
struct DecodeGraph {
    batch: usize,
    input_ids: Tensor<1, Int>,
    positions: Tensor<1, Int>,
    slots: Tensor<1, Int>,
    context_lens: Tensor<1, Int>,
    tables: Tensor<1, Int>,
    graph: BackendGraph<Dispatch>,
    logits: Tensor<2>,
    _meta: AttentionMetadata,
}

/// Records `forward` as a hardware graph: a few warm-up runs (autotuning, fused-kernel
/// compilation and every allocation happen there), then one run under capture. Returns the
/// graph and the output of the captured run, whose buffer every replay rewrites.
fn capture(
    device: &Device,
    mut forward: impl FnMut() -> Tensor<2>,
) -> Result<(BackendGraph<Dispatch>, Tensor<2>), String> {
    let d = device.as_dispatch();
    let err = |what: &str, e: &dyn std::fmt::Debug| format!("{what}: {e:?}");
    Dispatch::graph_prepare(d).map_err(|e| err("prepare", &e))?;
    for _ in 0..3 {
        // Keep the output until the sync: a lazy backend skips work whose result is dropped.
        let out = forward();
        Dispatch::sync(d).map_err(|e| err("warm-up", &e))?;
        drop(out);
    }
    Dispatch::graph_start_capture(d).map_err(|e| err("start", &e))?;
    let out = forward();
    let graph = Dispatch::graph_stop_capture(d).map_err(|e| err("stop", &e))?;
    Ok((graph, out))
}

/// The captured decode graphs of a model, by batch size.
pub(crate) struct DecodeGraphs {
    graphs: Vec<DecodeGraph>,
    device: Device,
    width: usize,
    block_size: usize,
    failures: Vec<String>,
    timings: GraphTimings,
}

/// Host time of the graph steps, by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphTimings {
    /// Building the input rows.
    pub build: std::time::Duration,
    /// Writing them into the graph's buffers.
    pub write: std::time::Duration,
    /// Launching the replay.
    pub replay: std::time::Duration,
}

/// Batch sizes to capture up to `max_num_seqs`: 1, 8, 32, then four steps up to
/// `max_num_seqs` (64, 128, 192, 256 for 256). Seven graphs: on the H100 CubeCL 0.11 refused
/// every capture after the seventh of a process (its pools could not serve the recorded run:
/// "no page may be added"), in either order; a padded row costs little next to that.
pub(crate) fn bucket_sizes(max_num_seqs: usize) -> Vec<usize> {
    let step = (max_num_seqs / 4).next_multiple_of(32).max(64);
    let mut sizes: Vec<usize> = [1, 8, 32]
        .into_iter()
        .chain((1..).map(|k| k * step).take_while(|&b| b < max_num_seqs))
        .filter(|&b| b < max_num_seqs)
        .collect();
    sizes.push(max_num_seqs);
    sizes
}

fn ints(values: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::I32))
}

impl DecodeGraphs {
    /// Captures one graph per size in `sizes`. Fails with the backend's reason when a capture
    /// is refused.
    pub(crate) fn capture(
        model: &Arc<Qwen2Model>,
        cache: &Arc<Mutex<KvCache>>,
        device: &Device,
        sizes: &[usize],
        block_size: usize,
        max_model_len: usize,
    ) -> Result<Self> {
        let width = max_model_len.div_ceil(block_size);
        let mut graphs = Vec::with_capacity(sizes.len());
        let mut failures = Vec::new();
        // Largest first: its warm-up grows the pools the most.
        for &b in sizes.iter().rev() {
            let input_ids = ints(vec![0; b], device);
            let positions = ints(vec![0; b], device);
            let slots = ints(vec![-1; b], device);
            let context_lens = ints(vec![1; b], device);
            let tables = ints(vec![0; b * width], device);
            let meta = AttentionMetadata::from_parts(
                vec![1; b],
                vec![1; b],
                vec![vec![0]; b],
                block_size,
                vec![-1; b],
                // The host positions only bound the RoPE-table check: cover every future one.
                vec![max_model_len as i64 - 1; b],
                MetadataTensors {
                    slot_mapping: slots.clone(),
                    positions: positions.clone(),
                    decode: Some(DecodeTensors {
                        block_tables: tables.clone().reshape([b, width]),
                        context_lens: context_lens.clone(),
                    }),
                    prefill: None,
                },
            )
            .with_context_bound(max_model_len);
            let captured = capture(device, || {
                let mut cache = cache.lock().expect("KV cache lock");
                model.forward(input_ids.clone(), &meta, &mut cache, LogitsRows::All)
            });
            if let Err(e) = &captured {
                failures.push(format!("batch {b}: {e}"));
            }
            if let Ok((graph, logits)) = captured {
                graphs.push(DecodeGraph {
                    batch: b,
                    input_ids,
                    positions,
                    slots,
                    context_lens,
                    tables,
                    graph,
                    logits,
                    _meta: meta,
                });
            }
        }
        if graphs.is_empty() {
            return Err(EngineError::Device(format!(
                "no decode graph could be captured: {}",
                failures.join("; ")
            )));
        }
        graphs.sort_by_key(|g| g.batch);
        Ok(Self {
            graphs,
            device: device.clone(),
            width,
            block_size,
            failures,
            timings: GraphTimings::default(),
        })
    }

    /// Host time of the graph steps so far.
    pub(crate) fn timings(&self) -> GraphTimings {
        self.timings
    }

    /// Buckets that could not be captured, with the backend's reason (their steps take the
    /// next larger graph, or run eagerly).
    pub(crate) fn failures(&self) -> &[String] {
        &self.failures
    }

    /// The captured sizes.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        self.graphs.iter().map(|g| g.batch).collect()
    }

    /// Runs a decode step of `seqs` (one new token each) through the smallest graph that holds
    /// it; returns the logits `[seqs.len(), V]` (f32), or `None` when no graph is large enough.
    pub(crate) fn run(&mut self, seqs: &[StepSeq<'_>]) -> Result<Option<Tensor<2>>> {
        let n = seqs.len();
        let Some(g) = self.graphs.iter_mut().find(|g| g.batch >= n) else {
            return Ok(None);
        };
        let (b, width, bs) = (g.batch, self.width, self.block_size);
        let start = std::time::Instant::now();
        let mut ids = vec![0i32; b];
        let mut positions = vec![0i32; b];
        let mut slots = vec![-1i32; b];
        let mut context = vec![1i32; b];
        let mut tables = vec![0i32; b * width];
        for (r, s) in seqs.iter().enumerate() {
            let pos = s.num_computed_tokens;
            if s.block_table.len() > width {
                return Err(EngineError::Device(format!(
                    "a sequence holds {} blocks, more than the graphs' {width}",
                    s.block_table.len()
                )));
            }
            ids[r] = s.token_ids[pos] as i32;
            positions[r] = pos as i32;
            slots[r] = (s.block_table[pos / bs] as usize * bs + pos % bs) as i32;
            context[r] = (pos + 1) as i32;
            for (j, &blk) in s.block_table.iter().enumerate() {
                tables[r * width + j] = blk as i32;
            }
        }
        let built = std::time::Instant::now();
        write_ints(&mut g.input_ids, &ids)?;
        write_ints(&mut g.positions, &positions)?;
        write_ints(&mut g.slots, &slots)?;
        write_ints(&mut g.context_lens, &context)?;
        write_ints(&mut g.tables, &tables)?;
        let written = std::time::Instant::now();
        // SAFETY: the graph reads the buffers above and the metadata (kept alive with it), the
        // model's weights and the KV cache (kept alive by the runner that owns these graphs),
        // and writes its pinned intermediates and output; everything runs on the one device
        // stream, and the logits are read (by the sampler) before the next replay.
        unsafe { Dispatch::graph_replay(self.device.as_dispatch(), &g.graph) }
            .map_err(|e| EngineError::Device(format!("decode graph replay: {e:?}")))?;
        let logits = g.logits.clone();
        let t = &mut self.timings;
        t.build += built - start;
        t.write += written - built;
        t.replay += written.elapsed();
        Ok(Some(if n == b {
            logits
        } else {
            logits.slice_dim(0, 0..n)
        }))
    }
}
