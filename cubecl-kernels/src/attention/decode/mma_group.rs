//! Decode kernel on tensor cores for wide query groups (Qwen2-0.5B: 7 query heads per kv head):
//! the group's heads are the rows of a 16-row `mma.sync.m16n8k16` tile (rows past `G` are
//! padding), so scoring a key against all of them is part of one MMA instead of `G` dot products
//! on CUDA cores (FlashInfer's choice for GQA decode).
//!
//! Launch geometry: one cube of `P` planes per (kv head, sequence, piece of its context). Plane `p` is an
//! independent key stream: it takes the 16-key chunks `start + 16·(p + P·i)` of the split, stages
//! each chunk's K and V rows in its own double-buffered shared region (`[16][D + 8]`, 16-byte
//! vectors, one vector of padding per row against bank conflicts; the next chunk's global loads
//! are in flight in registers while the current one is computed on, and only plane barriers are
//! needed) and attends to it as [`super::super::mma_tile`] describes (S, P and O in registers).
//! The planes' states merge through shared memory at the end.
//!
//! FP8 caches decoded by PTX's paired conversion ([`MmaGroupConfig::f16_stage`]) are staged as
//! the f16 halves that conversion yields, and Q and the probabilities as f16 too, so that the
//! MMA runs on f16: no code is widened to f32 or repacked to bf16 (the kernel's issue slots, not
//! its bytes, bounded it). E4M3 and E5M2 codes are exact in f16; Q rounds to f16 (its 10-bit
//! mantissa holds every bf16 value in f16's range) and the probabilities lose less than in
//! bf16.
//!
//! Memory layout: see [`super`]. CUDA only (NVIDIA's fragment layouts), bf16/f16.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::super::kv_read::{KvRead, head_scales};
use super::super::mma_tile::{
    KvStage, StageSoftmax, attend_kv_stream, finish_row_sums, load_q_fragments, start_rows,
};
use super::{split_keys, write_merged};

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaGroupConfig {
    /// Query heads per kv head, at most 16.
    pub group: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Planes (key streams) per cube.
    pub planes: usize,
    /// How each K/V chunk's softmax is computed.
    pub softmax: StageSoftmax,
    /// The MMA's inputs are f16 whatever the activations' dtype (FP8 codes decoded by PTX's
    /// paired conversion straight into the stages; see the module documentation).
    pub f16_stage: bool,
}

impl MmaGroupConfig {
    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes
    }

    /// Keys per cube and step.
    pub fn step(&self) -> usize {
        16 * self.planes
    }

    /// The K/V chunk one plane fills.
    pub fn stage(&self) -> KvStage {
        KvStage {
            keys: 16,
            units: 32,
            head_dim: self.head_dim,
            kv_heads: self.kv_heads,
            softmax: self.softmax,
        }
    }

    /// Shared memory of one cube in bytes: two K and two V stages of 16 padded rows per plane
    /// (elements of `elem_bytes`), then the f32 merge buffers.
    pub fn shared_bytes(&self, elem_bytes: usize) -> usize {
        let stages = 4 * self.planes * 16 * (self.head_dim + 8) * elem_bytes;
        stages + 4 * self.planes * self.group * (self.head_dim + 2)
    }
}

/// See the module documentation. Caches are read in 16-byte vectors (`NV` = 8); the MMA's
/// inputs are `M` (`F`, or f16 with [`MmaGroupConfig::f16_stage`]).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_mma<F: Float, KV: Float, M: Float, NV: Size>(
    q: &Tensor<F>,
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    kv_scales: &Tensor<f32>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    scale: f32,
    #[comptime] block_size: usize,
    min_keys: usize,
    #[comptime] cfg: MmaGroupConfig,
    #[comptime] kv: KvRead,
    #[define(F, KV, M)] _dtypes: [ElemType; 3],
) {
    let def = MmaDefinition::<M, M, f32>::new(16usize, 8usize, 16usize);
    let size!(NP) = def.vector_size(MatrixIdent::A);
    let kvh = CUBE_POS_X as usize;
    // An FP8 cache's key scale rides in the scores' scale, its value scale in the output.
    let (ks, vs) = head_scales(kv_scales, kvh, cfg.kv_heads, comptime!(kv.is_fp8()));
    let keys = split_keys(context_lens, min_keys, comptime!(cfg.step()));
    let (seq, start, end) = (keys.seq, keys.start, keys.end);
    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let t = lane % 4;
    let group = cfg.group;
    let dtiles = comptime!(cfg.head_dim / 8);
    let st = comptime!(cfg.stage());

    // Q as A fragments: rows are the group's heads (g and g + 8; zeros past the group).
    let valid_a = g < group;
    let valid_b = g + 8 < group;
    let q_a = seq * q.stride(0) + (kvh * group + g) * q.stride(1);
    let q_b = seq * q.stride(0) + (kvh * group + g + 8) * q.stride(1);
    let mut qa = Array::<Vector<M, NP>>::new(comptime!(4 * cfg.head_dim / 16));
    load_q_fragments::<F, M, NP>(q, q_a, q_b, valid_a, valid_b, &mut qa, cfg.head_dim);
    let mut o = Array::<Vector<f32, NP>>::new(comptime!(2 * cfg.head_dim / 8));
    let mut state = Array::<f32>::new(4usize);
    start_rows(&mut o, &mut state, cfg.head_dim);
    // Per plane: its own two K and two V stages.
    attend_kv_stream::<M, KV, NV, NP>(
        k_cache,
        v_cache,
        kv,
        block_tables,
        seq * block_tables.stride(0),
        block_size,
        kvh,
        &qa,
        &mut o,
        &mut state,
        start + plane * 16,
        end,
        plane * comptime!(2 * st.len()),
        lane,
        select(valid_a, end, 0usize),
        select(valid_b, end, 0usize),
        scale * ks,
        st,
        comptime!(cfg.step()),
        comptime!(2 * cfg.planes * st.len()),
        true,
    );

    // Merge the planes: [planes][group][D] accumulators and [planes][group] (m, l).
    finish_row_sums(&mut state);
    let mut acc_s = Shared::<[f32]>::new_slice(comptime!(cfg.planes * cfg.group * cfg.head_dim));
    let mut m_s = Shared::<[f32]>::new_slice(comptime!(cfg.planes * cfg.group));
    let mut l_s = Shared::<[f32]>::new_slice(comptime!(cfg.planes * cfg.group));
    let d = cfg.head_dim;
    #[unroll]
    for j in 0..dtiles {
        #[unroll]
        for e in 0..2usize {
            let col = j * 8 + 2 * t + e;
            if valid_a {
                acc_s[(plane * group + g) * d + col] = o[2 * j].extract(e) * vs;
            }
            if valid_b {
                acc_s[(plane * group + g + 8) * d + col] = o[2 * j + 1].extract(e) * vs;
            }
        }
    }
    if t == 0 {
        if valid_a {
            m_s[plane * group + g] = state[0];
            l_s[plane * group + g] = state[2];
        }
        if valid_b {
            m_s[plane * group + g + 8] = state[1];
            l_s[plane * group + g + 8] = state[3];
        }
    }
    sync_cube();
    write_merged(
        &acc_s,
        &m_s,
        &l_s,
        out,
        part_acc,
        part_stats,
        keys,
        cfg.planes,
        cfg.group,
        cfg.head_dim,
        cfg.kv_heads,
    );
}
