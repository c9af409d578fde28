//! Prefill attention on tensor cores with registers managed by hand (`mma.sync.m16n8k16`, bf16 or
//! f16 inputs, f32 accumulators): the flash-attention-2 schedule of [`super::super::mma_tile`],
//! where scores, probabilities and output accumulators never leave registers.
//!
//! Launch geometry: one cube per (`16·R`-query tile, kv head, group of `H` of its query heads),
//! tile-major (see [`super`]),
//! with `H × R` planes of 32 lanes; plane `p` owns query rows `16·(p % R) .. + 16` of head
//! `p / R`, so the `H` heads share every K/V stage (`H` = the whole GQA group up to 8). Packed
//! (`packed`, for one-query tiles): the `H` heads share each plane's 16 MMA rows instead — row
//! `r` is head `r % H` of query `r / H`, `R` planes of `⌊16 / H⌋` queries each — so a decode
//! row scores all its group's heads in one MMA. A row's arithmetic is the same in both (it
//! depends on `block_k` alone). K/V stages
//! of `block_k` keys are double-buffered in shared memory: while a stage is computed on, every
//! unit's 16-byte global loads of the next one are in flight in registers; they are stored after
//! the compute, one barrier per stage. Keys past a row's causal position are masked.
//!
//! CUDA only (the fragment layout is NVIDIA's): the launcher takes it where the device offers
//! manual 16×8×16 MMA for the dtype and planes of 32.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::super::kv_read::{KvRead, head_scales};
use super::super::mma_tile::{
    KvStage, StageSoftmax, attend_kv_stream, finish_row_sums, load_q_fragments, start_rows,
};
use super::tile_and_group;

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaPrefillConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Keys per stage, a multiple of 16.
    pub block_k: usize,
    /// Query heads of one kv head that a cube serves (they share its K/V stages).
    pub heads_per_cube: usize,
    /// 16-row blocks of queries per head; planes = `heads_per_cube × row_blocks` (packed:
    /// `row_blocks`).
    pub row_blocks: usize,
    /// The cube's heads share each plane's MMA rows (module doc); `heads_per_cube ≤ 16`.
    pub packed: bool,
    /// How each K/V stage's softmax is computed.
    pub softmax: StageSoftmax,
}

impl MmaPrefillConfig {
    /// Queries a plane's 16 rows hold (per head).
    pub fn plane_queries(&self) -> usize {
        match self.packed {
            true => 16 / self.heads_per_cube,
            false => 16,
        }
    }

    /// Queries per cube and head.
    pub fn block_q(&self) -> usize {
        self.plane_queries() * self.row_blocks
    }

    /// Planes per cube.
    pub fn planes(&self) -> usize {
        match self.packed {
            true => self.row_blocks,
            false => self.heads_per_cube * self.row_blocks,
        }
    }

    /// Units per cube.
    pub fn units(&self) -> usize {
        32 * self.planes()
    }

    /// Cubes per (query tile, kv head).
    pub fn cubes_per_kv_head(&self) -> usize {
        self.heads / self.kv_heads / self.heads_per_cube
    }

    /// The K/V stage the cube's units fill together.
    pub fn stage(&self) -> KvStage {
        KvStage {
            keys: self.block_k,
            units: self.units(),
            head_dim: self.head_dim,
            kv_heads: self.kv_heads,
            softmax: self.softmax,
        }
    }

    /// Shared memory of one cube in bytes (two K and two V stages), for elements of
    /// `elem_bytes`.
    pub fn shared_bytes(&self, elem_bytes: usize) -> usize {
        4 * elem_bytes * self.block_k * (self.head_dim + 8)
    }
}

/// See the module documentation. `k_cache`, `v_cache` are read in vectors of `NV` elements.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_prefill_mma<F: Float, KV: Float, NV: Size>(
    q: &Tensor<F>,
    k_cache: &Tensor<Vector<KV, NV>>,
    v_cache: &Tensor<Vector<KV, NV>>,
    kv_scales: &Tensor<f32>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    cu_seqlens_q: &Tensor<i32>,
    tiles: &Tensor<i32>,
    out: &mut Tensor<F>,
    scale: f32,
    #[comptime] block_size: usize,
    #[comptime] cfg: MmaPrefillConfig,
    #[comptime] kv: KvRead,
    #[define(F, KV)] _dtypes: [ElemType; 2],
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NP) = def.vector_size(MatrixIdent::A);
    let hgroups = comptime!(cfg.cubes_per_kv_head());
    let (tile, group) = tile_and_group(comptime!(cfg.kv_heads * hgroups));
    let plane = PLANE_POS as usize;
    let unit = UNIT_POS_X as usize;
    let kvh = group / hgroups;
    let first_head =
        kvh * comptime!(cfg.heads / cfg.kv_heads) + (group % hgroups) * cfg.heads_per_cube;
    let g = UNIT_POS_PLANE as usize / 4;
    let t = UNIT_POS_PLANE as usize % 4;
    let st = comptime!(cfg.stage());
    // An FP8 cache's key scale rides in the scores' scale, its value scale in the output.
    let (ks, vs) = head_scales(kv_scales, kvh, cfg.kv_heads, comptime!(kv.is_fp8()));
    // A padding tile of a captured step (sequence −1): nothing to read or write.
    if tiles[tile * 2] < 0 {
        terminate!();
    }
    let seq = tiles[tile * 2] as usize;
    let q0 = tiles[tile * 2 + 1] as usize;
    let q_start = cu_seqlens_q[seq] as usize;
    let q_len = cu_seqlens_q[seq + 1] as usize - q_start;
    let ctx = context_lens[seq] as usize;
    let prefix = ctx - q_len;
    let rows = min(q_len - q0, comptime!(cfg.block_q()));
    let last_key = prefix + q0 + rows;
    let table_row = seq * block_tables.stride(0);

    // This lane's two MMA rows (g and g + 8) as (query of the tile, head); a row attends to
    // keys up to its own position.
    let (row_a, head_a, in_a) = plane_row(plane, g, first_head, cfg);
    let (row_b, head_b, in_b) = plane_row(plane, g + 8, first_head, cfg);
    let valid_a = in_a && row_a < rows;
    let valid_b = in_b && row_b < rows;
    let limit_a = select(valid_a, prefix + q0 + row_a + 1, 0usize);
    let limit_b = select(valid_b, prefix + q0 + row_b + 1, 0usize);

    let mut qa = Array::<Vector<F, NP>>::new(comptime!(4 * cfg.head_dim / 16));
    load_q_fragments::<F, F, NP>(
        q,
        (q_start + q0 + row_a) * q.stride(0) + head_a * q.stride(1),
        (q_start + q0 + row_b) * q.stride(0) + head_b * q.stride(1),
        valid_a,
        valid_b,
        &mut qa,
        cfg.head_dim,
    );
    let mut o = Array::<Vector<f32, NP>>::new(comptime!(2 * cfg.head_dim / 8));
    let mut state = Array::<f32>::new(4usize);
    start_rows(&mut o, &mut state, cfg.head_dim);

    // Two K and two V stages: stage `i + 1` is fetched while stage `i` is computed on.
    attend_kv_stream::<F, KV, NV, NP>(
        k_cache,
        v_cache,
        kv,
        block_tables,
        table_row,
        block_size,
        kvh,
        &qa,
        &mut o,
        &mut state,
        0,
        last_key,
        0,
        unit,
        limit_a,
        limit_b,
        scale * ks,
        st,
        cfg.block_k,
        comptime!(2 * st.len()),
        false,
    );

    // Normalise (one reciprocal a row: a division per element is a dozen instructions) and write.
    finish_row_sums(&mut state);
    let norm_a = vs / state[2];
    let norm_b = vs / state[3];
    let out_a = (q_start + q0 + row_a) * out.stride(0) + head_a * out.stride(1);
    let out_b = (q_start + q0 + row_b) * out.stride(0) + head_b * out.stride(1);
    #[unroll]
    for j in 0..comptime!(cfg.head_dim / 8) {
        #[unroll]
        for e in 0..2usize {
            let col = j * 8 + 2 * t + e;
            if valid_a {
                out[out_a + col] = F::cast_from(o[2 * j].extract(e) * norm_a);
            }
            if valid_b {
                out[out_b + col] = F::cast_from(o[2 * j + 1].extract(e) * norm_b);
            }
        }
    }
}

/// MMA row `r` (0..16) of plane `plane` as (query of the tile, head, whether the row holds
/// one): in the plain layout the plane's head and its `r`-th query; packed, head `r % H` of the
/// plane's `r / H`-th query (rows past `⌊16 / H⌋ · H` hold none).
#[cube]
fn plane_row(
    plane: usize,
    r: usize,
    first_head: usize,
    #[comptime] cfg: MmaPrefillConfig,
) -> (usize, usize, bool) {
    let mut query = (plane % cfg.row_blocks) * 16 + r;
    let mut head = first_head + plane / cfg.row_blocks;
    let mut holds = true;
    if comptime!(cfg.packed) {
        let heads = comptime!(cfg.heads_per_cube);
        query = plane * comptime!(cfg.plane_queries()) + r / heads;
        head = first_head + r % heads;
        holds = r / heads < comptime!(cfg.plane_queries());
    }
    (query, head, holds)
}
