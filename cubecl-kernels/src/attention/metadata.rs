//! The description of a flattened batch that every attention op reads: which tokens belong to
//! which sequence, how many keys each sequence sees and where those keys live in the paged cache.

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
/// The host copies drive the reference path and the launch geometry; the device copies (`i32`)
/// are what the kernels read.
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
    /// Prefix sums of `query_lens`, `[B + 1]`.
    pub cu_seqlens_q: Tensor<1, Int>,
    /// `[B]`.
    pub context_lens: Tensor<1, Int>,
    /// `[B, max_blocks_per_seq]`, padded with 0.
    pub block_tables: Tensor<2, Int>,
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
        let tensors = MetadataTensors::new(
            &query_lens,
            &context_lens,
            &block_tables,
            &slot_mapping,
            &positions,
            device,
        );
        Ok(Self {
            query_lens,
            context_lens,
            block_tables,
            block_size,
            slot_mapping,
            positions,
            tensors,
        })
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
        self.query_lens.iter().all(|&q| q == 1)
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

impl MetadataTensors {
    fn new(
        query_lens: &[usize],
        context_lens: &[usize],
        block_tables: &[Vec<u32>],
        slot_mapping: &[i64],
        positions: &[i64],
        device: &Device,
    ) -> Self {
        let max_blocks = block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut tables = vec![0i32; block_tables.len() * max_blocks];
        for (row, table) in block_tables.iter().enumerate() {
            for (j, &b) in table.iter().enumerate() {
                tables[row * max_blocks + j] = b as i32;
            }
        }
        let cu: Vec<i32> = prefix_sums(query_lens)
            .into_iter()
            .map(|v| v as i32)
            .collect();
        let ctx: Vec<i32> = context_lens.iter().map(|&v| v as i32).collect();
        Self {
            slot_mapping: int_tensor(slot_mapping.iter().map(|&v| v as i32).collect(), device),
            positions: int_tensor(positions.iter().map(|&v| v as i32).collect(), device),
            cu_seqlens_q: int_tensor(cu, device),
            context_lens: int_tensor(ctx, device),
            block_tables: Tensor::from_data(
                TensorData::new(tables, [block_tables.len(), max_blocks]),
                (device, DType::I32),
            ),
        }
    }
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
