//! The description of a flattened batch that every attention op reads: which tokens belong to
//! which sequence, how many keys each sequence sees and where those keys live in the paged cache.
//!
//! A batch may mix decode rows (one new token) and prefill chunks (several): sequences
//! `0..num_decodes` each have one new token and take the decode kernel; the others take the
//! prefill kernel. Everything the kernels need per step (device copies, per-part tables, the
//! bounds the launchers check) is built once here, not once per layer.

use std::sync::{Arc, Mutex};

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use crate::KernelError;

/// Where the tokens of a flattened batch of sequences come from and where their keys and values
/// live in the paged KV cache.
///
/// The batch holds `B` sequences; sequence `s` contributes `query_lens[s]` new tokens, which are
/// the last tokens of its `context_lens[s]` tokens (the ones before are already cached: a prefix
/// cache hit, an earlier chunk, or earlier decode steps). Token `i` of sequence `s` (logical
/// position `p`) is stored in slot `block_tables[s][p / block_size] * block_size + p % block_size`.
///
/// The host copies drive the reference path, the checks and the launch geometry; the device
/// copies (`i32`) are what the kernels read.
#[derive(Clone, Debug)]
pub struct AttentionMetadata {
    /// New tokens per sequence, `[B]`.
    pub query_lens: Vec<usize>,
    /// Keys each sequence attends to after this step (cached + new), `[B]`.
    pub context_lens: Vec<usize>,
    /// Physical block ids of each sequence in logical order, `B` rows of at least
    /// `ceil(context_lens[s] / block_size)` ids.
    pub block_tables: Vec<Vec<u32>>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Cache slot of each new token, `[num_tokens]`; −1 means "do not store".
    pub slot_mapping: Vec<i64>,
    /// Logical position of each new token, `[num_tokens]` (the RoPE position).
    pub positions: Vec<i64>,
    /// Sequences `0..num_decodes` have one new token each and take the decode kernel (for a
    /// [`Self::padded`] layout: the decode part's rows).
    pub num_decodes: usize,
    /// Longest context the decode launch geometry must cover (at least the batch's longest).
    /// A graph replayed at later steps is captured with `max_model_len` here, so that its
    /// context split stays valid as the contexts grow.
    pub context_bound: usize,
    /// Largest block id of any table (checked against the cache once per layer, in O(1)).
    pub max_block_id: Option<u32>,
    /// Largest position (checked against the RoPE tables).
    pub max_position: usize,
    /// Device copies of the above, `i32`.
    pub tensors: MetadataTensors,
}

/// Device-side (`i32`) copies of [`AttentionMetadata`], built once per step and shared by all
/// layers.
#[derive(Clone, Debug)]
pub struct MetadataTensors {
    /// `[num_tokens]`, −1 = skip.
    pub slot_mapping: Tensor<1, Int>,
    /// `[num_tokens]`.
    pub positions: Tensor<1, Int>,
    /// Sequences `0..num_decodes`, when there are any.
    pub decode: Option<DecodeTensors>,
    /// Sequences `num_decodes..B`, when there are any.
    pub prefill: Option<PrefillTensors>,
}

/// The decode rows' tables: `block_tables [n, max_blocks]` (padded with 0), `context_lens [n]`.
#[derive(Clone, Debug)]
pub struct DecodeTensors {
    /// `[n, max_blocks]`.
    pub block_tables: Tensor<2, Int>,
    /// `[n]`.
    pub context_lens: Tensor<1, Int>,
}

/// The prefill rows' tables. `cu_seqlens_q` are row offsets into the step's tokens: the first
/// prefill chunk starts after the decode rows.
#[derive(Clone, Debug)]
pub struct PrefillTensors {
    /// `[n, max_blocks]`.
    pub block_tables: Tensor<2, Int>,
    /// `[n]`.
    pub context_lens: Tensor<1, Int>,
    /// `[n + 1]`: sequence `s`'s tokens are rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]`.
    pub cu_seqlens_q: Tensor<1, Int>,
    /// Host copy of the prefill rows' `(query length, context length)` (they define the
    /// kernel's query tiles and their order).
    pub lens: Arc<Vec<(usize, usize)>>,
    /// The query-tile list, built by the first layer's launch and reused by the others.
    pub tiles: Arc<TileCache>,
}

/// The prefill kernel's tile list of one step, `[num_tiles, 2]` i32 = (sequence, first query),
/// for tiles of `rows` queries: built from the host query lengths by the first layer that
/// needs it, or fixed in advance (a captured step's stable buffer, rewritten before each
/// replay; its padding tiles have sequence −1).
#[derive(Debug, Default)]
pub struct TileCache(Mutex<Option<Tiles>>);

#[derive(Debug)]
struct Tiles {
    rows: usize,
    list: Tensor<2, Int>,
    fixed: bool,
}

impl TileCache {
    /// A tile list given in advance, of `rows`-query tiles (contiguous: a view of a 1-D buffer;
    /// a 2-D device tensor of two `i32` per row is row-pitched on CUDA).
    pub fn fixed(rows: usize, list: Tensor<2, Int>) -> Self {
        Self(Mutex::new(Some(Tiles {
            rows,
            list,
            fixed: true,
        })))
    }

    /// The list for tiles of `rows` queries over sequences of `lens` = (new tokens, context),
    /// in [`prefill_tiles`]' order.
    ///
    /// # Panics
    /// If the list was fixed for tiles of another height.
    pub(crate) fn get(
        &self,
        rows: usize,
        lens: &[(usize, usize)],
        device: &Device,
    ) -> Tensor<2, Int> {
        let mut cached = self.0.lock().expect("tile cache");
        match &*cached {
            Some(t) if t.rows == rows => return t.list.clone(),
            Some(t) if t.fixed => panic!(
                "the step's tile list was fixed for {}-query tiles, the prefill kernel takes {rows}",
                t.rows
            ),
            _ => {}
        }
        let flat: Vec<i32> = prefill_tiles(lens, rows).into_iter().flatten().collect();
        let n = flat.len() / 2;
        // Built 1-D and viewed as `[n, 2]`: a 2-D device tensor of 8-byte rows would be
        // row-pitched (CubeCL pads rows to 16 bytes on CUDA), and the kernels read it flat.
        let list =
            Tensor::<1, Int>::from_data(TensorData::new(flat, [2 * n]), (device, DType::I32))
                .reshape([n, 2]);
        *cached = Some(Tiles {
            rows,
            list: list.clone(),
            fixed: false,
        });
        list
    }
}

/// The prefill kernel's query tiles of `rows` queries over sequences of `lens` = (new tokens,
/// context), as (sequence, first query), heaviest first: a tile's work is the keys its last
/// row attends to (the cached prefix, the chunk's earlier queries and its own), and the
/// device deals cubes out in launch order, so the longest tiles start in the first wave and
/// the short ones fill the gaps at the end (FlashAttention's reversed causal order, across
/// sequences). Ties keep sequence order.
pub fn prefill_tiles(lens: &[(usize, usize)], rows: usize) -> Vec<[i32; 2]> {
    let mut tiles: Vec<(usize, [i32; 2])> = lens
        .iter()
        .enumerate()
        .flat_map(|(s, &(q_len, ctx))| {
            (0..q_len)
                .step_by(rows.max(1))
                .map(move |q0| (ctx - q_len + (q0 + rows).min(q_len), [s as i32, q0 as i32]))
        })
        .collect();
    tiles.sort_by_key(|&(keys, _)| std::cmp::Reverse(keys));
    tiles.into_iter().map(|(_, tile)| tile).collect()
}

impl AttentionMetadata {
    /// Builds the metadata of a batch, computing slots and positions from the block tables.
    ///
    /// Fails if a sequence has no new token, more new tokens than context, or a block table
    /// too short for its context.
    pub fn new(
        query_lens: Vec<usize>,
        context_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        device: &Device,
    ) -> Result<Self, KernelError> {
        Self::build(
            query_lens,
            context_lens,
            block_tables,
            block_size,
            device,
            true,
        )
    }

    /// [`Self::new`] with every sequence taking the prefill kernel, one-token ones included:
    /// the decode kernel reduces in another order than the prefill kernel, so a
    /// batch-invariant step (whose decode rows must equal the same tokens recomputed in a
    /// prefill chunk after a preemption) takes this layout.
    pub fn prefill_only(
        query_lens: Vec<usize>,
        context_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        device: &Device,
    ) -> Result<Self, KernelError> {
        Self::build(
            query_lens,
            context_lens,
            block_tables,
            block_size,
            device,
            false,
        )
    }

    fn build(
        query_lens: Vec<usize>,
        context_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        device: &Device,
        decode_rows: bool,
    ) -> Result<Self, KernelError> {
        let batch = query_lens.len();
        if batch == 0 {
            return Err(KernelError::invalid("attention metadata: empty batch"));
        }
        if block_size == 0 {
            return Err(KernelError::invalid("attention metadata: block_size is 0"));
        }
        if context_lens.len() != batch || block_tables.len() != batch {
            return Err(KernelError::invalid(format!(
                "attention metadata: {batch} query_lens, {} context_lens, {} block tables",
                context_lens.len(),
                block_tables.len()
            )));
        }
        let mut slot_mapping = Vec::new();
        let mut positions = Vec::new();
        for s in 0..batch {
            let (q, c, table) = (query_lens[s], context_lens[s], &block_tables[s]);
            if q == 0 || q > c {
                return Err(KernelError::invalid(format!(
                    "attention metadata: sequence {s} has {q} new tokens and a context of {c}"
                )));
            }
            if table.len() * block_size < c {
                return Err(KernelError::invalid(format!(
                    "attention metadata: sequence {s} has a context of {c} tokens but only {} \
                     blocks of {block_size}",
                    table.len()
                )));
            }
            for p in c - q..c {
                positions.push(p as i64);
                slot_mapping.push(
                    table[p / block_size] as i64 * block_size as i64 + (p % block_size) as i64,
                );
            }
        }
        let num_decodes = match decode_rows {
            true => query_lens.iter().take_while(|&&q| q == 1).count(),
            false => 0,
        };
        let max_blocks = block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let tensors = MetadataTensors {
            slot_mapping: int_tensor(slot_mapping.iter().map(|&v| v as i32).collect(), device),
            positions: int_tensor(positions.iter().map(|&v| v as i32).collect(), device),
            decode: (num_decodes > 0).then(|| DecodeTensors {
                block_tables: table_tensor(&block_tables[..num_decodes], max_blocks, device),
                context_lens: usize_tensor(&context_lens[..num_decodes], device),
            }),
            prefill: (num_decodes < batch).then(|| {
                PrefillTensors::new(
                    num_decodes,
                    &query_lens[num_decodes..],
                    &context_lens[num_decodes..],
                    &block_tables[num_decodes..],
                    max_blocks,
                    device,
                )
            }),
        };
        let mut meta = Self::from_parts(
            query_lens,
            context_lens,
            block_tables,
            block_size,
            slot_mapping,
            positions,
            tensors,
        );
        meta.num_decodes = num_decodes;
        Ok(meta)
    }

    /// Assembles metadata from host copies and device tensors that already hold the same
    /// values (e.g. stable buffers a captured graph reads, refreshed in place); computes the
    /// derived fields. The caller guarantees the two agree.
    pub fn from_parts(
        query_lens: Vec<usize>,
        context_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        slot_mapping: Vec<i64>,
        positions: Vec<i64>,
        tensors: MetadataTensors,
    ) -> Self {
        let num_decodes = query_lens.iter().take_while(|&&q| q == 1).count();
        let context_bound = context_lens.iter().copied().max().unwrap_or(0);
        let max_block_id = block_tables.iter().flatten().copied().max();
        let max_position = positions.iter().copied().max().unwrap_or(0).max(0) as usize;
        Self {
            query_lens,
            context_lens,
            block_tables,
            block_size,
            slot_mapping,
            positions,
            num_decodes,
            context_bound,
            max_block_id,
            max_position,
            tensors,
        }
    }

    /// The layout of a step captured as a graph and replayed with new values: `num_tokens`
    /// token rows (decode rows first, then prefill chunks, then padding), the device tensors
    /// sized for the most rows and sequences the step may hold and rewritten in place before
    /// each replay (padding: slot −1, decode context 0, prefill tile sequence −1). The host
    /// copies describe no batch (empty; `slot_mapping` and `positions` are `num_tokens`
    /// placeholders): the kernels read the device tensors, the launch geometry comes from
    /// their sizes, `context_bound` and the prefill part's fixed tile list, and the checks
    /// from `max_position` (the caller checks block ids before writing them).
    pub fn padded(
        num_tokens: usize,
        block_size: usize,
        context_bound: usize,
        max_position: usize,
        tensors: MetadataTensors,
    ) -> Self {
        let num_decodes = tensors
            .decode
            .as_ref()
            .map_or(0, |d| d.context_lens.dims()[0]);
        Self {
            query_lens: Vec::new(),
            context_lens: Vec::new(),
            block_tables: Vec::new(),
            block_size,
            slot_mapping: vec![-1; num_tokens],
            positions: vec![0; num_tokens],
            num_decodes,
            context_bound,
            max_block_id: None,
            max_position,
            tensors,
        }
    }

    /// A prefill batch with no cached prefix: each prompt's tokens are all new.
    pub fn prefill(
        prompt_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        device: &Device,
    ) -> Result<Self, KernelError> {
        Self::new(
            prompt_lens.clone(),
            prompt_lens,
            block_tables,
            block_size,
            device,
        )
    }

    /// A decode batch: one new token per sequence, `context_lens` counting it.
    pub fn decode(
        context_lens: Vec<usize>,
        block_tables: Vec<Vec<u32>>,
        block_size: usize,
        device: &Device,
    ) -> Result<Self, KernelError> {
        Self::new(
            vec![1; context_lens.len()],
            context_lens,
            block_tables,
            block_size,
            device,
        )
    }

    /// The same batch with the decode geometry sized for contexts up to `bound` (never below
    /// the batch's longest context).
    pub fn with_context_bound(mut self, bound: usize) -> Self {
        self.context_bound = self.context_bound.max(bound);
        self
    }

    /// Number of sequences `B`.
    pub fn num_seqs(&self) -> usize {
        self.query_lens.len()
    }

    /// Number of new tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }

    /// True when every sequence contributes exactly one token (a decode step).
    pub fn is_decode(&self) -> bool {
        self.num_decodes == self.num_seqs()
    }

    /// Longest context in the batch.
    pub fn max_context_len(&self) -> usize {
        self.context_lens.iter().copied().max().unwrap_or(0)
    }

    /// Longest query run in the batch.
    pub fn max_query_len(&self) -> usize {
        self.query_lens.iter().copied().max().unwrap_or(0)
    }

    /// Start offset of each sequence's tokens in the flattened batch, `[B + 1]`.
    pub fn cu_seqlens_q(&self) -> Vec<usize> {
        prefix_sums(&self.query_lens)
    }

    /// Cache slots of the first `len` logical positions of sequence `s`.
    pub fn context_slots(&self, s: usize, len: usize) -> Vec<i64> {
        let table = &self.block_tables[s];
        let bs = self.block_size;
        (0..len)
            .map(|p| (table[p / bs] as usize * bs + p % bs) as i64)
            .collect()
    }
}

impl PrefillTensors {
    /// The tables of prefill sequences whose tokens start at row `first_row` of the step.
    fn new(
        first_row: usize,
        query_lens: &[usize],
        context_lens: &[usize],
        block_tables: &[Vec<u32>],
        max_blocks: usize,
        device: &Device,
    ) -> Self {
        let cu: Vec<i32> = prefix_sums(query_lens)
            .into_iter()
            .map(|v| (first_row + v) as i32)
            .collect();
        Self {
            block_tables: table_tensor(block_tables, max_blocks, device),
            context_lens: usize_tensor(context_lens, device),
            cu_seqlens_q: int_tensor(cu, device),
            lens: Arc::new(
                query_lens
                    .iter()
                    .copied()
                    .zip(context_lens.iter().copied())
                    .collect(),
            ),
            tiles: Arc::new(TileCache::default()),
        }
    }
}

/// Block tables as one `[rows, width]` i32 tensor, padded with 0.
fn table_tensor(tables: &[Vec<u32>], width: usize, device: &Device) -> Tensor<2, Int> {
    let mut flat = vec![0i32; tables.len() * width];
    for (row, table) in tables.iter().enumerate() {
        for (j, &b) in table.iter().enumerate() {
            flat[row * width + j] = b as i32;
        }
    }
    Tensor::from_data(
        TensorData::new(flat, [tables.len(), width]),
        (device, DType::I32),
    )
}

fn usize_tensor(values: &[usize], device: &Device) -> Tensor<1, Int> {
    int_tensor(values.iter().map(|&v| v as i32).collect(), device)
}

fn int_tensor(values: Vec<i32>, device: &Device) -> Tensor<1, Int> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), (device, DType::I32))
}

fn prefix_sums(lens: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(lens.len() + 1);
    let mut acc = 0;
    out.push(0);
    for &l in lens {
        acc += l;
        out.push(acc);
    }
    out
}
