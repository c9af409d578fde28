//! Steps replayed as CUDA graphs, one per token-count bucket: decode steps and mixed steps
//! (decode rows with prefill chunks) alike, as vLLM V1's full graphs.
//!
//! A graph of bucket `T` serves any step of at most `T` tokens (the [`Capacity`] below): up to
//! `min(T, max_num_seqs)` decode rows, up to `min(T / 2, max_num_seqs)` prefill chunks (a chunk
//! has two tokens or more: a one-token chunk is a decode row) and up to `min(T, max_num_seqs)`
//! rows that sample. Its inputs are stable device buffers (`i32`), rewritten before each
//! replay: token ids, positions and cache slots `[T]`, the draw rows `[T]` (where a token row
//! takes the previous step's draw instead of its host id, [`crate::step`]); the decode rows'
//! block tables
//! `[D · width]` and contexts `[D]`; the prefill chunks' block tables `[P · width]`, contexts
//! `[P]`, row offsets `[P + 1]` and query tiles `[tiles · 2]`; the sampled rows `[S]`. Token rows
//! are the step's decode rows, then its prefill chunks, then padding; `width =
//! ceil(max_model_len / block_size)`.
//!
//! Padding never reaches anything a request sees: padding tokens (id 0, position 0) have slot
//! −1, so the KV write skips them; padding decode rows have context 0 and padding tiles
//! sequence −1, so the attention kernels neither read nor write for them; the products compute
//! garbage in padding rows (row by row: no other row reads it); the LM head reads only the
//! sampled rows, and padding sample rows (row 0) are sliced off before sampling. The decode
//! kernel's context split is captured for `max_model_len`, so a graph stays valid as contexts
//! grow.
//!
//! Off CUDA, [`StepGraphs`] can *emulate* the graphs: the same buffers and padded forward,
//! run eagerly instead of replayed (`EngineConfig::emulate_graphs`), so that CPU tests cover
//! the layout, the padding and the kernels' skips.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::backend::{Backend, BackendGraph, Dispatch};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{
    AttentionMetadata, DecodeTensors, MetadataTensors, PrefillTensors, TileCache, prefill_tiles,
    write_ints,
};
use model_qwen2::{KvCache, LogitsRows, Qwen2Model};

use crate::error::{EngineError, Result};
use crate::step::{StepSeq, feed_draws};

/// What one graph holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Capacity {
    /// Token rows `T`.
    pub tokens: usize,
    /// Decode rows `D`.
    pub decodes: usize,
    /// Prefill chunks `P`.
    pub prefills: usize,
    /// Query tiles of the prefill kernel.
    pub tiles: usize,
    /// Rows that sample `S`.
    pub samples: usize,
}

/// Most prefill chunks in one step when steps replay graphs (the scheduler keeps to it): the
/// prefill kernel's grid covers a graph's most tiles, padding ones included, and each chunk
/// adds up to one; more chunks than this rarely fit a step's tokens anyway.
pub const MAX_PREFILL_CHUNKS: usize = 32;

impl Capacity {
    /// The capacity of bucket `tokens` with `tile_rows`-query prefill tiles.
    pub(crate) fn new(tokens: usize, max_num_seqs: usize, tile_rows: usize) -> Self {
        let prefills = (tokens / 2).min(max_num_seqs).min(MAX_PREFILL_CHUNKS);
        Self {
            tokens,
            decodes: tokens.min(max_num_seqs),
            prefills,
            // Each chunk ends at most one partial tile.
            tiles: if prefills == 0 {
                0
            } else {
                tokens.div_ceil(tile_rows) + prefills
            },
            samples: tokens.min(max_num_seqs),
        }
    }

    /// True if bucket `tokens` has a decode-only graph beside its mixed one: it holds a
    /// prefill chunk (two tokens or more) and no more tokens than decode rows.
    pub(crate) fn has_decode_only(tokens: usize, max_num_seqs: usize) -> bool {
        (2..=max_num_seqs).contains(&tokens)
    }

    /// The capacity of a decode-only graph of bucket `tokens`: no prefill chunk, so its
    /// forward launches no prefill kernel (whose grid of padding tiles costs each layer a
    /// launch even when no chunk is there).
    pub(crate) fn decode_only(tokens: usize, max_num_seqs: usize) -> Self {
        Self {
            tokens,
            decodes: tokens.min(max_num_seqs),
            prefills: 0,
            tiles: 0,
            samples: tokens.min(max_num_seqs),
        }
    }
}

/// Indices of the inputs in [`StepInputs::parts`].
const POSITIONS: usize = 0;
const SLOTS: usize = 1;
const DECODE_CONTEXT: usize = 2;
const IDS: usize = 3;
const DRAW_ROWS: usize = 4;
const SAMPLE_ROWS: usize = 5;
const PREFILL_CONTEXT: usize = 6;
const CU_SEQLENS: usize = 7;
const TILES: usize = 8;
const DECODE_TABLES: usize = 9;
const PREFILL_TABLES: usize = 10;
const NUM_PARTS: usize = 11;

/// The host values of a graph's input buffers for one step (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepInputs {
    pub ids: Vec<i32>,
    /// Per token row, the row of the previous step's draws that supplies its id, or −1.
    pub draw_rows: Vec<i32>,
    pub positions: Vec<i32>,
    pub slots: Vec<i32>,
    pub decode_tables: Vec<i32>,
    pub decode_context: Vec<i32>,
    pub prefill_tables: Vec<i32>,
    pub prefill_context: Vec<i32>,
    pub cu_seqlens: Vec<i32>,
    pub tiles: Vec<i32>,
    pub sample_rows: Vec<i32>,
    /// Rows of the logits that are real (the rest are padding).
    pub num_samples: usize,
}

impl StepInputs {
    /// The inputs, in [`Buffers`]' order: those every decode step changes first (positions,
    /// slots, contexts), then the ids (a decode step with overlapped scheduling takes them all
    /// from the draws, leaving the host ids and draw rows as they were).
    fn parts(&self) -> [&[i32]; NUM_PARTS] {
        [
            &self.positions,
            &self.slots,
            &self.decode_context,
            &self.ids,
            &self.draw_rows,
            &self.sample_rows,
            &self.prefill_context,
            &self.cu_seqlens,
            &self.tiles,
            &self.decode_tables,
            &self.prefill_tables,
        ]
    }

    /// The padded inputs of `seqs` (decode rows first: one new token each; then prefill chunks)
    /// in a graph of capacity `cap`, or `None` when the step does not fit. Fails on a block
    /// table wider than `width`.
    pub(crate) fn new(
        seqs: &[StepSeq<'_>],
        cap: Capacity,
        width: usize,
        block_size: usize,
        tile_rows: usize,
    ) -> Result<Option<Self>> {
        let tokens: usize = seqs.iter().map(|s| s.num_new_tokens).sum();
        let decodes = seqs.iter().take_while(|s| s.num_new_tokens == 1).count();
        let prefills = seqs.len() - decodes;
        let samples = seqs.iter().filter(|s| s.samples).count();
        let tiles: usize = seqs[decodes..]
            .iter()
            .map(|s| s.num_new_tokens.div_ceil(tile_rows))
            .sum();
        if tokens > cap.tokens
            || decodes > cap.decodes
            || prefills > cap.prefills
            || tiles > cap.tiles
            || samples > cap.samples
        {
            return Ok(None);
        }
        let mut x = Self {
            ids: vec![0; cap.tokens],
            draw_rows: vec![-1; cap.tokens],
            positions: vec![0; cap.tokens],
            slots: vec![-1; cap.tokens],
            decode_tables: vec![0; cap.decodes * width],
            decode_context: vec![0; cap.decodes],
            prefill_tables: vec![0; cap.prefills * width],
            prefill_context: vec![0; cap.prefills],
            cu_seqlens: vec![tokens as i32; cap.prefills + 1],
            tiles: [-1, 0].repeat(cap.tiles),
            sample_rows: vec![0; cap.samples],
            num_samples: samples,
        };
        let (mut row, mut sample) = (0, 0);
        for (i, s) in seqs.iter().enumerate() {
            if s.block_table.len() > width {
                return Err(EngineError::Device(format!(
                    "a sequence holds {} blocks, more than the graphs' {width}",
                    s.block_table.len()
                )));
            }
            let start = s.num_computed_tokens;
            for (p, id) in (start..start + s.num_new_tokens).zip(s.new_ids()) {
                x.ids[row] = id as i32;
                x.positions[row] = p as i32;
                x.slots[row] =
                    (s.block_table[p / block_size] as usize * block_size + p % block_size) as i32;
                row += 1;
            }
            if let Some(r) = s.pending_row {
                x.draw_rows[row - 1] = r as i32;
            }
            if s.samples {
                x.sample_rows[sample] = row as i32 - 1;
                sample += 1;
            }
            let context = (start + s.num_new_tokens) as i32;
            let (tables, r) = if i < decodes {
                x.decode_context[i] = context;
                (&mut x.decode_tables, i)
            } else {
                let p = i - decodes;
                x.prefill_context[p] = context;
                x.cu_seqlens[p] = (row - s.num_new_tokens) as i32;
                (&mut x.prefill_tables, p)
            };
            for (j, &b) in s.block_table.iter().enumerate() {
                tables[r * width + j] = b as i32;
            }
        }
        let lens: Vec<(usize, usize)> = seqs[decodes..]
            .iter()
            .map(|s| (s.num_new_tokens, s.num_computed_tokens + s.num_new_tokens))
            .collect();
        for (i, tile) in prefill_tiles(&lens, tile_rows).into_iter().enumerate() {
            x.tiles[2 * i..2 * i + 2].copy_from_slice(&tile);
        }
        Ok(Some(x))
    }
}

/// Elements each input starts at a multiple of in [`Buffers`]: 512 bytes, CUDA's memory
/// alignment in CubeCL, at which Burn's CubeCL slice is a view (elsewhere it copies; the
/// views are taken inside the captured forward, so a copy would only cost a kernel).
const PART_ALIGN: usize = 128;

/// The stable device inputs of one graph: every input in one `i32` buffer, each at an aligned
/// offset, in [`StepInputs::parts`] order (the inputs a decode step changes first, the block
/// tables last). A step writes the span of the inputs that changed since the last one, in one
/// transfer; the forward reads views of the buffer.
struct Buffers {
    all: Tensor<1, Int>,
    /// Each input's range in `all`.
    ranges: [Range<usize>; NUM_PARTS],
    /// What `all` holds, on the host.
    mirror: Vec<i32>,
}

impl Buffers {
    fn new(x: &StepInputs, device: &Device) -> Self {
        let mut end = 0;
        let ranges = x.parts().map(|v| {
            // An empty part (no prefill slots in a one-token graph) is never read.
            let start = end;
            end = (start + v.len().max(1)).next_multiple_of(PART_ALIGN);
            start..start + v.len().max(1)
        });
        let mut mirror = vec![0; end];
        for (r, v) in ranges.iter().zip(x.parts()) {
            mirror[r.start..r.start + v.len()].copy_from_slice(v);
        }
        let all = Tensor::<1, Int>::from_data(
            TensorData::new(mirror.clone(), [mirror.len()]),
            (device, DType::I32),
        );
        Self {
            all,
            ranges,
            mirror,
        }
    }

    /// Rewrites the span of the inputs whose values differ from those held, in one write.
    fn write(&mut self, x: &StepInputs) -> Result<()> {
        let mut span: Option<Range<usize>> = None;
        for (r, v) in self.ranges.iter().zip(x.parts()) {
            let held = &mut self.mirror[r.start..r.start + v.len()];
            if held != v {
                held.copy_from_slice(v);
                span = Some(match span {
                    None => r.start..r.start + v.len(),
                    Some(s) => s.start.min(r.start)..s.end.max(r.start + v.len()),
                });
            }
        }
        if let Some(span) = span {
            write_ints(&mut self.all, span.start, &self.mirror[span])?;
        }
        Ok(())
    }

    /// Input `i` ([`StepInputs::parts`] order) as a view of the buffer.
    fn part(&self, i: usize) -> Tensor<1, Int> {
        self.all.clone().slice(self.ranges[i].clone())
    }

    /// The padded layout the forward reads, over views of the buffer.
    fn metadata(
        &self,
        cap: Capacity,
        width: usize,
        block_size: usize,
        tile_rows: usize,
        max_model_len: usize,
    ) -> AttentionMetadata {
        let tensors = MetadataTensors {
            slot_mapping: self.part(SLOTS),
            positions: self.part(POSITIONS),
            decode: (cap.decodes > 0).then(|| DecodeTensors {
                block_tables: self.part(DECODE_TABLES).reshape([cap.decodes, width]),
                context_lens: self.part(DECODE_CONTEXT),
            }),
            prefill: (cap.prefills > 0).then(|| PrefillTensors {
                block_tables: self.part(PREFILL_TABLES).reshape([cap.prefills, width]),
                context_lens: self.part(PREFILL_CONTEXT),
                cu_seqlens_q: self.part(CU_SEQLENS),
                lens: Arc::new(Vec::new()),
                tiles: Arc::new(TileCache::fixed(
                    tile_rows,
                    self.part(TILES).reshape([cap.tiles, 2]),
                )),
            }),
        };
        // The positions bound the RoPE-table check: cover every future one.
        AttentionMetadata::padded(
            cap.tokens,
            block_size,
            max_model_len,
            max_model_len - 1,
            tensors,
        )
    }
}

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
    width: usize,
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
        let c = &model.config;
        let tile_rows = cubecl_kernels::prefill_tile_rows(
            device,
            model.dtype(),
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
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
            width,
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
            let mixed = Capacity::new(tokens, max_num_seqs, tile_rows);
            caps.push(mixed);
            if Capacity::has_decode_only(tokens, max_num_seqs) {
                caps.push(Capacity::decode_only(tokens, max_num_seqs));
            }
        }
        for cap in caps {
            let tokens = cap.tokens;
            let idle = StepInputs::new(&[], cap, width, block_size, tile_rows)?
                .expect("an empty step fits");
            let buffers = Buffers::new(&idle, device);
            let replay = if emulate {
                Replay::Eager
            } else {
                let before = cuda_index.and_then(crate::memory::cuda_memory);
                let start = Instant::now();
                let captured = capture(device, || this.forward(&buffers, cap, draws));
                let after = cuda_index.and_then(crate::memory::cuda_memory);
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
        let (width, bs, rows) = (self.width, self.block_size, self.tile_rows);
        let meta = buffers.metadata(cap, width, bs, rows, self.max_model_len);
        let ids = feed_draws(buffers.part(IDS), buffers.part(DRAW_ROWS), draws.clone());
        let mut cache = self.cache.lock().expect("KV cache lock");
        self.model.forward_model_dtype(
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
        let (width, bs, rows) = (self.width, self.block_size, self.tile_rows);
        let mut found = None;
        for (i, g) in self.graphs.iter().enumerate() {
            if let Some(x) = StepInputs::new(seqs, g.cap, width, bs, rows)? {
                found = Some((i, x));
                break;
            }
        }
        let Some((i, inputs)) = found else {
            return Ok(None);
        };
        let built = Instant::now();
        let n = inputs.num_samples;
        self.graphs[i].buffers.write(&inputs)?;
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
        Ok(Some(if n == g.cap.samples || n == 0 {
            logits
        } else {
            logits.slice_dim(0, 0..n)
        }))
    }
}
