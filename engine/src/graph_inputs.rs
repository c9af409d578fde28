//! The inputs of the step graphs: what a graph of each token bucket holds ([`Capacity`]), the
//! host values of one step padded to it ([`StepInputs`]), and the stable device buffers a
//! captured graph reads by address, refreshed in place before each replay.
//!
//! Layout (all `i32`): per graph, one buffer ([`Buffers`]) of the small inputs, each at an
//! aligned offset: positions and cache slots `[T]`, the decode rows' contexts `[D]`, token ids
//! and draw rows `[T]`, sampled rows `[S]`, the prefill chunks' contexts `[P]`, row offsets
//! `[P + 1]` and query tiles `[tiles · 2]`. The block tables live in one buffer shared by every
//! graph ([`BlockTables`]): `[max decode rows, width]` then `[MAX_PREFILL_CHUNKS, width]`,
//! `width = ceil(max_model_len / block_size)`; a graph of `D` decode rows reads the first `D`
//! rows. Token rows are the step's decode rows, then its prefill chunks, then padding.
//!
//! A step's cost follows the tokens and blocks it has, not `max_model_len`: the small inputs
//! are written as one span of what changed, and the block tables only at the entries that
//! differ from what the buffer holds (a row's entries past its own blocks are never read, so
//! they are left as they are), by one scatter of `(index, value)` pairs. A decode step of 256
//! sequences used to rebuild, compare and upload `256 × width` entries (8 MiB at 131,072).

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use cubecl_kernels::{
    AttentionMetadata, DecodeTensors, MetadataTensors, PrefillTensors, TileCache, prefill_tiles,
    scatter_ints, write_ints,
};

use crate::error::{EngineError, Result};
use crate::step::StepSeq;

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
    /// Every sequence, one-token ones included, is a prefill chunk (batch-invariant steps:
    /// decode rows take the prefill kernel, `EngineConfig::batch_invariant`).
    pub chunks_only: bool,
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
            chunks_only: false,
        }
    }

    /// The capacity of bucket `tokens` when every sequence is a prefill chunk
    /// ([`Self::chunks_only`]): as many chunks as sequences, each ending at most one partial
    /// tile.
    pub(crate) fn chunks_only(tokens: usize, max_num_seqs: usize, tile_rows: usize) -> Self {
        let prefills = tokens.min(max_num_seqs);
        Self {
            tokens,
            decodes: 0,
            prefills,
            tiles: tokens.div_ceil(tile_rows) + prefills,
            samples: prefills,
            chunks_only: true,
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
            chunks_only: false,
        }
    }
}

/// Where the rows of the shared block tables sit ([`BlockTables`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TableLayout {
    /// Entries per row: `ceil(max_model_len / block_size)`.
    pub width: usize,
    /// Decode rows held.
    pub decodes: usize,
    /// Offset of the first prefill row (after the decode rows, aligned).
    pub prefill_at: usize,
    /// Entries in all.
    pub len: usize,
}

impl TableLayout {
    /// Rows for `decodes` decode rows and `chunks` prefill chunks ([`MAX_PREFILL_CHUNKS`], or
    /// a step's most sequences when every one is a chunk) of `width` entries. Fails when the
    /// indices would not fit an `i32`.
    pub(crate) fn new(decodes: usize, chunks: usize, width: usize) -> Result<Self> {
        let prefill_at = (decodes * width).next_multiple_of(PART_ALIGN);
        let len = (prefill_at + chunks * width).max(1);
        if len > i32::MAX as usize {
            return Err(EngineError::config(
                "max_model_len",
                format!(
                    "block tables of {decodes} + {chunks} rows of {width} blocks exceed 2^31 \
                     entries"
                ),
            ));
        }
        Ok(Self {
            width,
            decodes,
            prefill_at,
            len,
        })
    }

    /// Offset of decode row `r`.
    fn decode_row(&self, r: usize) -> usize {
        r * self.width
    }

    /// Offset of prefill row `p`.
    fn prefill_row(&self, p: usize) -> usize {
        self.prefill_at + p * self.width
    }
}

/// Indices of the small inputs in [`StepInputs::parts`].
pub(crate) const POSITIONS: usize = 0;
pub(crate) const SLOTS: usize = 1;
pub(crate) const DECODE_CONTEXT: usize = 2;
pub(crate) const IDS: usize = 3;
pub(crate) const DRAW_ROWS: usize = 4;
pub(crate) const SAMPLE_ROWS: usize = 5;
const PREFILL_CONTEXT: usize = 6;
const CU_SEQLENS: usize = 7;
const TILES: usize = 8;
const NUM_PARTS: usize = 9;

/// The host values of a graph's inputs for one step (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct StepInputs {
    pub ids: Vec<i32>,
    /// Per token row, the row of the previous step's draws that supplies its id, or −1.
    pub draw_rows: Vec<i32>,
    pub positions: Vec<i32>,
    pub slots: Vec<i32>,
    pub decode_context: Vec<i32>,
    pub prefill_context: Vec<i32>,
    pub cu_seqlens: Vec<i32>,
    pub tiles: Vec<i32>,
    pub sample_rows: Vec<i32>,
    /// The block ids of every row, flat; each row's offset in [`BlockTables`] and its range
    /// here in `table_rows`.
    pub table_ids: Vec<i32>,
    pub table_rows: Vec<(usize, Range<usize>)>,
    /// Rows of the logits that are real (the rest are padding).
    pub num_samples: usize,
}

impl StepInputs {
    /// The small inputs, in [`Buffers`]' order: those every decode step changes first
    /// (positions, slots, contexts), then the ids (a decode step with overlapped scheduling
    /// takes them all from the draws, leaving the host ids and draw rows as they were).
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
        ]
    }

    /// The padded inputs of `seqs` (decode rows first: one new token each; then prefill
    /// chunks) in a graph of capacity `cap`, or `None` when the step does not fit. Fails on a
    /// block table wider than the layout's rows.
    pub(crate) fn new(
        seqs: &[StepSeq<'_>],
        cap: Capacity,
        layout: &TableLayout,
        block_size: usize,
        tile_rows: usize,
    ) -> Result<Option<Self>> {
        let tokens: usize = seqs.iter().map(|s| s.num_new_tokens()).sum();
        let decodes = match cap.chunks_only {
            true => 0,
            false => seqs.iter().take_while(|s| s.num_new_tokens() == 1).count(),
        };
        let prefills = seqs.len() - decodes;
        let samples = seqs.iter().filter(|s| s.samples).count();
        let tiles: usize = seqs[decodes..]
            .iter()
            .map(|s| s.num_new_tokens().div_ceil(tile_rows))
            .sum();
        if tokens > cap.tokens
            || decodes > cap.decodes
            || prefills > cap.prefills
            || tiles > cap.tiles
            || samples > cap.samples
        {
            return Ok(None);
        }
        let blocks: usize = seqs.iter().map(|s| s.block_table.len()).sum();
        let mut x = Self {
            ids: vec![0; cap.tokens],
            draw_rows: vec![-1; cap.tokens],
            positions: vec![0; cap.tokens],
            slots: vec![-1; cap.tokens],
            decode_context: vec![0; cap.decodes],
            prefill_context: vec![0; cap.prefills],
            cu_seqlens: vec![tokens as i32; cap.prefills + 1],
            tiles: [-1, 0].repeat(cap.tiles),
            sample_rows: vec![0; cap.samples],
            table_ids: Vec::with_capacity(blocks),
            table_rows: Vec::with_capacity(seqs.len()),
            num_samples: samples,
        };
        let (mut row, mut sample) = (0, 0);
        for (i, s) in seqs.iter().enumerate() {
            if s.block_table.len() > layout.width {
                return Err(EngineError::Device(format!(
                    "a sequence holds {} blocks, more than the graphs' {}",
                    s.block_table.len(),
                    layout.width
                )));
            }
            let start = s.num_computed_tokens;
            for (p, id) in (start..start + s.num_new_tokens()).zip(s.new_ids()) {
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
            let context = (start + s.num_new_tokens()) as i32;
            let at = if i < decodes {
                x.decode_context[i] = context;
                layout.decode_row(i)
            } else {
                let p = i - decodes;
                x.prefill_context[p] = context;
                x.cu_seqlens[p] = (row - s.num_new_tokens()) as i32;
                layout.prefill_row(p)
            };
            let first = x.table_ids.len();
            x.table_ids.extend(s.block_table.iter().map(|&b| b as i32));
            x.table_rows.push((at, first..x.table_ids.len()));
        }
        let lens: Vec<(usize, usize)> = seqs[decodes..]
            .iter()
            .map(|s| {
                (
                    s.num_new_tokens(),
                    s.num_computed_tokens + s.num_new_tokens(),
                )
            })
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

/// The block tables every graph reads (module doc), with their host mirror.
pub(crate) struct BlockTables {
    all: Tensor<1, Int>,
    layout: TableLayout,
    mirror: Vec<i32>,
    /// The last write's changed entries (kept for its allocation).
    changed: Vec<[i32; 2]>,
}

impl BlockTables {
    /// Zeroed tables of `layout` on `device`.
    pub(crate) fn new(layout: TableLayout, device: &Device) -> Self {
        let mirror = vec![0; layout.len];
        let all = Tensor::<1, Int>::from_data(
            TensorData::new(mirror.clone(), [layout.len]),
            (device, DType::I32),
        );
        Self {
            all,
            layout,
            mirror,
            changed: Vec::new(),
        }
    }

    /// Writes the entries of `x`'s rows that differ from those held; returns the bytes sent
    /// to the device.
    pub(crate) fn write(&mut self, x: &StepInputs) -> Result<usize> {
        self.changed.clear();
        for (at, ids) in &x.table_rows {
            let ids = &x.table_ids[ids.clone()];
            let held = &mut self.mirror[*at..*at + ids.len()];
            for (j, (h, &id)) in held.iter_mut().zip(ids).enumerate() {
                if *h != id {
                    *h = id;
                    self.changed.push([(at + j) as i32, id]);
                }
            }
        }
        scatter_ints(&mut self.all, &self.changed)?;
        Ok(self.changed.len() * 2 * size_of::<i32>())
    }

    /// Where its rows sit.
    pub(crate) fn layout(&self) -> TableLayout {
        self.layout
    }

    /// The first `rows` decode rows, `[rows, width]`.
    fn decode(&self, rows: usize) -> Tensor<2, Int> {
        let w = self.layout.width;
        self.all.clone().slice(0..rows * w).reshape([rows, w])
    }

    /// The first `rows` prefill rows, `[rows, width]`.
    fn prefill(&self, rows: usize) -> Tensor<2, Int> {
        let (w, at) = (self.layout.width, self.layout.prefill_at);
        self.all.clone().slice(at..at + rows * w).reshape([rows, w])
    }
}

/// The stable device inputs of one graph but its block tables: every small input in one `i32`
/// buffer, each at an aligned offset, in [`StepInputs::parts`] order. A step writes the span
/// of the inputs that changed since the last one, in one transfer; the forward reads views of
/// the buffer.
pub(crate) struct Buffers {
    all: Tensor<1, Int>,
    /// Each input's range in `all`.
    ranges: [Range<usize>; NUM_PARTS],
    /// What `all` holds, on the host.
    mirror: Vec<i32>,
}

impl Buffers {
    /// Buffers holding `x` on `device`.
    pub(crate) fn new(x: &StepInputs, device: &Device) -> Self {
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

    /// Rewrites the span of the inputs whose values differ from those held, in one write;
    /// returns the bytes sent to the device.
    pub(crate) fn write(&mut self, x: &StepInputs) -> Result<usize> {
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
        let Some(span) = span else { return Ok(0) };
        let bytes = span.len() * size_of::<i32>();
        write_ints(&mut self.all, span.start, &self.mirror[span])?;
        Ok(bytes)
    }

    /// Input `i` ([`StepInputs::parts`] order) as a view of the buffer.
    pub(crate) fn part(&self, i: usize) -> Tensor<1, Int> {
        self.all.clone().slice(self.ranges[i].clone())
    }

    /// The padded layout the forward reads, over views of the buffers and `tables`.
    pub(crate) fn metadata(
        &self,
        tables: &BlockTables,
        cap: Capacity,
        block_size: usize,
        tile_rows: usize,
        max_model_len: usize,
    ) -> AttentionMetadata {
        let tensors = MetadataTensors {
            slot_mapping: self.part(SLOTS),
            positions: self.part(POSITIONS),
            decode: (cap.decodes > 0).then(|| DecodeTensors {
                block_tables: tables.decode(cap.decodes),
                context_lens: self.part(DECODE_CONTEXT),
            }),
            prefill: (cap.prefills > 0).then(|| PrefillTensors {
                block_tables: tables.prefill(cap.prefills),
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
