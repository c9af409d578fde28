//! Steps replayed as CUDA graphs, one per token-count bucket: decode steps and mixed steps
//! (decode rows with prefill chunks) alike, as vLLM V1's full graphs.
//!
//! A graph of bucket `T` serves any step of at most `T` tokens ([`Capacity`]): up to
//! `min(T, max_num_seqs)` decode rows, up to `min(T / 2, max_num_seqs)` prefill chunks (a chunk
//! has two tokens or more: a one-token chunk is a decode row) and up to `min(T, max_num_seqs)`
//! rows that sample. Its inputs are stable device buffers, rewritten in place before each
//! replay where they changed ([`crate::graph_inputs`]); a token row may take the previous
//! step's draw instead of its host id ([`crate::step`]).
//!
//! Padding never reaches anything a request sees: padding tokens (id 0, position 0) have slot
//! −1, so the KV write skips them; padding decode rows have context 0 and padding tiles
//! sequence −1, so the attention kernels neither read nor write for them; the products compute
//! garbage in padding rows (row by row: no other row reads it); the LM head reads only the
//! sampled rows, and padding sample rows (row 0) are sliced off before sampling. The decode
//! kernel plans its context split on the device from each row's own context (its grid is the
//! same for any `max_model_len` of at least 64 key steps), so a graph stays valid as contexts
//! grow.
//!
//! Off CUDA, [`StepGraphs`] can *emulate* the graphs: the same buffers and padded forward,
//! run eagerly instead of replayed (`EngineConfig::emulate_graphs`), so that CPU tests cover
//! the layout, the padding and the kernels' skips.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Backend, BackendGraph, Dispatch};
use burn::tensor::{Device, Int, Tensor};
use cubecl_kernels::ReductionOrder;
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::error::{EngineError, Result};
use crate::graph_inputs::{
    BlockTables, Buffers, Capacity, DRAW_ROWS, IDS, MAX_PREFILL_CHUNKS, SAMPLE_ROWS, StepInputs,
    TableLayout,
};
use crate::step::{StepSeq, feed_draws};

/// How a graph's step runs.
enum Replay {
    /// A captured hardware graph; its output buffer, rewritten by every replay.
    Captured(Box<(BackendGraph<Dispatch>, Tensor<2>)>),
    /// The padded forward run eagerly (emulation off CUDA).
    Eager,
}

/// One bucket.
struct StepGraph {
    cap: Capacity,
    buffers: Buffers,
    replay: Replay,
}

/// Records `forward` as a hardware graph: a few warm-up runs (autotuning, the products'
/// algorithm timing, fused-kernel compilation and every allocation happen there), then one run
/// under capture. Returns the graph and the output of the captured run, whose buffer every
/// replay rewrites.
fn capture(
    device: &Device,
    mut forward: impl FnMut() -> Tensor<2>,
) -> std::result::Result<(BackendGraph<Dispatch>, Tensor<2>), String> {
    let d = device.as_dispatch();
    let err = |what: &str, e: &dyn std::fmt::Debug| format!("{what}: {e:?}");
    Dispatch::graph_prepare(d).map_err(|e| err("prepare", &e))?;
    // The products' shapes will run at every replay: worth timing cuBLASLt's candidates for.
    cubecl_kernels::set_linear_tuning(true);
    let warm_up = (0..3).try_for_each(|_| {
        // Keep the output until the sync: a lazy backend skips work whose result is dropped.
        let out = forward();
        Dispatch::sync(d).map_err(|e| err("warm-up", &e))?;
        drop(out);
        Ok::<_, String>(())
    });
    cubecl_kernels::set_linear_tuning(false);
    warm_up?;
    Dispatch::graph_start_capture(d).map_err(|e| err("start", &e))?;
    let out = forward();
    let graph = Dispatch::graph_stop_capture(d).map_err(|e| err("stop", &e))?;
    Ok((graph, out))
}

/// A captured (or emulated) graph per token bucket.
pub(crate) struct StepGraphs {
    graphs: Vec<StepGraph>,
    model: Arc<Qwen2Model>,
    cache: Arc<Mutex<KvCache>>,
    device: Device,
    tables: BlockTables,
    block_size: usize,
    tile_rows: usize,
    max_model_len: usize,
    failures: Vec<String>,
    captured: Vec<GraphCapture>,
    timings: GraphTimings,
}

/// Host time of the graph steps, by phase.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GraphTimings {
    /// Building the input rows.
    pub build: Duration,
    /// Writing them into the graph's buffers.
    pub write: Duration,
    /// Launching the replay.
    pub replay: Duration,
    /// Bytes of inputs written to the device (the small inputs' changed span and the block
    /// tables' changed entries).
    pub bytes_written: u64,
}

/// What capturing one graph took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GraphCapture {
    /// The bucket's token count.
    pub tokens: usize,
    /// A decode-only graph (no prefill chunk; buckets of at most `max_num_seqs` tokens have
    /// one beside the mixed-step graph).
    pub decode_only: bool,
    /// Wall time of the warm-up runs and the capture.
    pub time: Duration,
    /// Device memory it took (free memory before − after, CUDA), bytes.
    pub bytes: Option<usize>,
}

/// Token counts of the default graphs for `max_num_seqs` and `max_num_batched_tokens`: decode
/// sizes 1, 8, 32, 128, then every doubling from 256 below `max_num_seqs`, and `max_num_seqs`
/// itself; mixed-step sizes 512 to 8192 by powers of two; none above `max_num_batched_tokens`.
/// A step replays the smallest graph that holds it, padded to its size: without the doublings,
/// a decode step of 199 rows under `max_num_seqs` = 512 ran the 512-row graph (bench.py's
/// decode steps 13 % dearer on the H200, docs/BENCHMARKS.md). Larger steps are cut to the
/// largest by the scheduler; each graph keeps the pages its forward touched (Qwen2-0.5B's 14
/// graphs 1.9 GiB together at 256 sequences, 7.6 GiB for its 16 at 1,024: H100 logs, measured
/// by the engine when it sizes the KV pool).
pub fn default_graph_sizes(max_num_seqs: usize, max_num_batched_tokens: usize) -> Vec<usize> {
    let decode = std::iter::successors(Some(256), |&s| Some(s * 2))
        .take_while(|&s| s < max_num_seqs)
        .chain([max_num_seqs]);
    let mut sizes: Vec<usize> = [1, 8, 32, 128]
        .into_iter()
        .chain(decode)
        .chain([512, 1024, 2048, 4096, 8192])
        .filter(|&s| s <= max_num_batched_tokens)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

impl StepGraphs {
    /// One graph per size in `sizes`: captured on CUDA (`emulate` false), else the padded
    /// forward run eagerly. Fails when no graph could be made.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        model: Arc<Qwen2Model>,
        cache: Arc<Mutex<KvCache>>,
        device: &Device,
        sizes: &[usize],
        max_num_seqs: usize,
        max_model_len: usize,
        emulate: bool,
        cuda_index: Option<usize>,
        draws: &Tensor<1, Int>,
    ) -> Result<Self> {
        let block_size = cache.lock().expect("KV cache lock").block_size();
        let width = max_model_len.div_ceil(block_size);
        // Batch-invariant steps send decode rows through the prefill kernel: their graphs hold
        // only prefill chunks, as many as sequences.
        let chunks_only = model.reduction_order() == ReductionOrder::BatchInvariant;
        let most_seqs = sizes.iter().max().map_or(0, |&t| t.min(max_num_seqs));
        let layout = match chunks_only {
            true => TableLayout::new(0, most_seqs, width)?,
            false => TableLayout::new(most_seqs, MAX_PREFILL_CHUNKS, width)?,
        };
        let c = &model.config;
        let tile_rows = cubecl_kernels::prefill_tile_rows(
            device,
            model.dtype(),
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            model.reduction_order(),
        )
        .ok_or_else(|| {
            EngineError::config(
                "emulate_graphs",
                "step graphs need a CubeCL device (cuda or cubecl-cpu)".into(),
            )
        })?;
        let mut this = Self {
            graphs: Vec::new(),
            model,
            cache,
            device: device.clone(),
            tables: BlockTables::new(layout, device),
            block_size,
            tile_rows,
            max_model_len,
            failures: Vec::new(),
            captured: Vec::new(),
            timings: GraphTimings::default(),
        };
        let mut sizes = sizes.to_vec();
        sizes.sort_unstable();
        sizes.dedup();
        // Largest first: its warm-up grows the pools the most. Buckets that can hold only
        // decode rows get a decode-only graph beside the mixed one.
        let mut caps = Vec::new();
        for &tokens in sizes.iter().rev() {
            if chunks_only {
                caps.push(Capacity::chunks_only(tokens, max_num_seqs, tile_rows));
                continue;
            }
            let mixed = Capacity::new(tokens, max_num_seqs, tile_rows);
            caps.push(mixed);
            if Capacity::has_decode_only(tokens, max_num_seqs) {
                caps.push(Capacity::decode_only(tokens, max_num_seqs));
            }
        }
        for cap in caps {
            let tokens = cap.tokens;
            let idle = StepInputs::new(&[], cap, &layout, block_size, tile_rows)?
                .expect("an empty step fits");
            let buffers = Buffers::new(&idle, device);
            let replay = if emulate {
                Replay::Eager
            } else {
                let before = cuda_index.and_then(crate::device_info::cuda_memory);
                let start = Instant::now();
                let captured = capture(device, || this.forward(&buffers, cap, draws));
                let after = cuda_index.and_then(crate::device_info::cuda_memory);
                match captured {
                    Ok((graph, logits)) => {
                        this.captured.push(GraphCapture {
                            tokens,
                            decode_only: cap.prefills == 0,
                            time: start.elapsed(),
                            bytes: before.zip(after).map(|(b, a)| b.0.saturating_sub(a.0)),
                        });
                        Replay::Captured(Box::new((graph, logits)))
                    }
                    Err(e) => {
                        this.failures.push(format!("{tokens} tokens: {e}"));
                        continue;
                    }
                }
            };
            this.graphs.push(StepGraph {
                cap,
                buffers,
                replay,
            });
        }
        if this.graphs.is_empty() {
            return Err(EngineError::Device(format!(
                "no step graph could be captured: {}",
                this.failures.join("; ")
            )));
        }
        // A step takes the first graph that holds it: decode-only before mixed.
        this.graphs.sort_by_key(|g| (g.cap.tokens, g.cap.prefills));
        this.captured.reverse();
        Ok(this)
    }

    /// The padded forward over a graph's buffers: logits `[S, V]` (the model's dtype) of its
    /// sample rows.
    /// The inputs' views are taken here, inside the captured run; rows with a draw row take
    /// their token from `draws` (the runner's standing buffer).
    fn forward(&self, buffers: &Buffers, cap: Capacity, draws: &Tensor<1, Int>) -> Tensor<2> {
        let (bs, rows) = (self.block_size, self.tile_rows);
        let meta = buffers.metadata(&self.tables, cap, bs, rows, self.max_model_len);
        let ids = feed_draws(buffers.part(IDS), buffers.part(DRAW_ROWS), draws.clone());
        let mut cache = self.cache.lock().expect("KV cache lock");
        self.model.forward_vocab_shard(
            ids,
            &meta,
            &mut cache,
            LogitsRows::Rows(Box::new(buffers.part(SAMPLE_ROWS))),
        )
    }

    /// Host time of the graph steps so far.
    pub(crate) fn timings(&self) -> GraphTimings {
        self.timings
    }

    /// Buckets that could not be captured, with the backend's reason.
    pub(crate) fn failures(&self) -> &[String] {
        &self.failures
    }

    /// Each captured graph's bucket, time and memory.
    pub(crate) fn captured(&self) -> &[GraphCapture] {
        &self.captured
    }

    /// The token counts served.
    pub(crate) fn sizes(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> = self.graphs.iter().map(|g| g.cap.tokens).collect();
        sizes.dedup();
        sizes
    }

    /// Runs the step `seqs` (decode rows first) through the smallest graph that holds it;
    /// returns the logits `[rows that sample, V]` (the model's dtype; all `S` rows, padding
    /// included, when none samples), or `None` when no graph holds it. `draws` is the runner's standing buffer
    /// of the last step's tokens (a captured graph reads it by address). With `mark`, a mark
    /// of the device's stream right before the replay goes there
    /// ([`crate::EngineConfig::gpu_timeline`]).
    pub(crate) fn run(
        &mut self,
        seqs: &[StepSeq<'_>],
        draws: &Tensor<1, Int>,
        mark: Option<&mut Option<cubecl_kernels::GpuMark>>,
    ) -> Result<Option<Tensor<2>>> {
        let start = Instant::now();
        let (bs, rows) = (self.block_size, self.tile_rows);
        let layout = self.tables.layout();
        let mut found = None;
        for (i, g) in self.graphs.iter().enumerate() {
            if let Some(x) = StepInputs::new(seqs, g.cap, &layout, bs, rows)? {
                found = Some((i, x));
                break;
            }
        }
        let Some((i, inputs)) = found else {
            return Ok(None);
        };
        let built = Instant::now();
        let n = inputs.num_samples;
        let bytes = self.graphs[i].buffers.write(&inputs)? + self.tables.write(&inputs)?;
        let written = Instant::now();
        if let Some(mark) = mark {
            // Behind the input write, right before the replay (or the emulated forward).
            *mark = cubecl_kernels::mark_stream(draws)?;
        }
        let g = &self.graphs[i];
        let logits = match &g.replay {
            Replay::Captured(captured) => {
                let (graph, logits) = &**captured;
                // SAFETY: the graph reads the buffers just written and the metadata views of
                // them (kept alive with it), the runner's draws buffer (written in place, kept
                // alive by the runner, which owns these graphs), the model's weights and the
                // KV cache (kept alive by `self`), and writes its pinned intermediates and
                // output; everything runs on the one device stream, and the logits are read
                // (by the sampler, enqueued next) before the next replay.
                unsafe { Dispatch::graph_replay(self.device.as_dispatch(), graph) }
                    .map_err(|e| EngineError::Device(format!("step graph replay: {e:?}")))?;
                logits.clone()
            }
            Replay::Eager => self.forward(&g.buffers, g.cap, draws),
        };
        let t = &mut self.timings;
        t.build += built - start;
        t.write += written - built;
        t.replay += written.elapsed();
        t.bytes_written += bytes as u64;
        Ok(Some(if n == g.cap.samples || n == 0 {
            logits
        } else {
            logits.slice_dim(0, 0..n)
        }))
    }
}
