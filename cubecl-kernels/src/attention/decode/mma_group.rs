//! Decode kernel on tensor cores for wide query groups (Qwen2-0.5B: 7 query heads per kv head):
//! the group's heads are the rows of a 16-row `mma.sync.m16n8k16` tile (rows past `G` are
//! padding), so scoring a key against all of them is part of one MMA instead of `G` dot products
//! on CUDA cores (FlashInfer's choice for GQA decode).
//!
//! Launch geometry: one cube of `P` planes per (kv head, sequence, split). Plane `p` is an
//! independent key stream: it takes the 16-key chunks `start + 16·(p + P·i)` of the split, stages
//! each chunk's K and V rows in its own double-buffered shared region (`[16][D + 8]`, 16-byte
//! vectors, one vector of padding per row against bank conflicts; the next chunk's global loads
//! are in flight in registers while the current one is computed on, and only plane barriers are
//! needed), computes `S = Q·Kᵀ` (two 16×8 tiles; K fragments by `ldmatrix`), the online softmax
//! on the accumulators (rows `g`, `g + 8` of lane `l`, `g = l / 4`, reduced over the 4 lanes of a
//! row by shuffles) and `O += P·V` (P re-packed from the S accumulators, V fragments by
//! `ldmatrix.trans`). The planes' states merge through shared memory at the end.
//!
//! Memory layout: see [`super`]. CUDA only (NVIDIA's fragment layouts), bf16/f16.

use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;

use super::write_merged;

/// Comptime part of the launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MmaGroupConfig {
    /// Query heads per kv head, at most 16.
    pub group: usize,
    pub head_dim: usize,
    pub kv_heads: usize,
    /// Planes (key streams) per cube.
    pub planes: usize,
    /// The context is split across cubes (their number is the grid's z extent).
    pub split: bool,
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

    /// Shared memory of one cube in bytes: two K and two V stages of 16 padded rows per plane
    /// (elements of `elem_bytes`), then the f32 merge buffers.
    pub fn shared_bytes(&self, elem_bytes: usize) -> usize {
        let stages = 4 * self.planes * 16 * (self.head_dim + 8) * elem_bytes;
        stages + 4 * self.planes * self.group * (self.head_dim + 2)
    }
}

/// Loads this lane's share of 16 keys' K and V rows from `k0` (zeros from `end` on).
#[cube]
#[allow(clippy::too_many_arguments)]
fn fetch_chunk<F: Float, NV: Size>(
    k_cache: &Tensor<Vector<F, NV>>,
    v_cache: &Tensor<Vector<F, NV>>,
    block_tables: &Tensor<i32>,
    table_row: usize,
    block_size: usize,
    kvh: usize,
    k0: usize,
    end: usize,
    kr: &mut Array<Vector<F, NV>>,
    vr: &mut Array<Vector<F, NV>>,
    #[comptime] cfg: MmaGroupConfig,
) {
    let dv = comptime!(cfg.head_dim / 8);
    #[unroll]
    for i in 0..comptime!(cfg.head_dim / 16) {
        let idx = i * 32 + UNIT_POS_PLANE as usize;
        let key = k0 + idx / dv;
        let mut kv = Vector::<F, NV>::new(F::new(0.0));
        let mut vv = Vector::<F, NV>::new(F::new(0.0));
        if key < end {
            let block = block_tables[table_row + key / block_size] as usize;
            let at = ((block * block_size + key % block_size) * cfg.kv_heads + kvh) * dv + idx % dv;
            kv = k_cache[at];
            vv = v_cache[at];
        }
        kr[i] = kv;
        vr[i] = vv;
    }
}

/// See the module documentation. Caches are read in 16-byte vectors (`NV` = 8).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_mma<F: Float, NV: Size>(
    q: &Tensor<F>,
    k_cache: &Tensor<Vector<F, NV>>,
    v_cache: &Tensor<Vector<F, NV>>,
    block_tables: &Tensor<i32>,
    context_lens: &Tensor<i32>,
    out: &mut Tensor<F>,
    part_acc: &mut Tensor<f32>,
    part_stats: &mut Tensor<f32>,
    scale: f32,
    block_size: usize,
    split_len: usize,
    #[comptime] cfg: MmaGroupConfig,
    #[define(F)] _dtype: ElemType,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    let size!(NP) = def.vector_size(MatrixIdent::A);
    let kvh = CUBE_POS_X as usize;
    let seq = CUBE_POS_Y as usize;
    let split = CUBE_POS_Z as usize;
    let plane = PLANE_POS as usize;
    let lane = UNIT_POS_PLANE as usize;
    let g = lane / 4;
    let t = lane % 4;
    let lrow = lane % 8; // ldmatrix: the row this lane addresses
    let lmat = lane / 8; // and of which matrix
    let group = cfg.group;
    let dtiles = comptime!(cfg.head_dim / 8);
    let rs = comptime!(cfg.head_dim / 8 + 1); // stage row stride in vectors
    let chunk = comptime!(16 * (cfg.head_dim / 8 + 1)); // one stage, in vectors
    let ctx = context_lens[seq] as usize;
    let start = split * split_len;
    let end = min(ctx, start + split_len);
    let table_row = seq * block_tables.stride(0);
    let neg_inf = f32::new(f32::NEG_INFINITY);

    // Per plane: two K and two V stages.
    let stages = comptime!(2 * cfg.planes * 16 * (cfg.head_dim / 8 + 1));
    let mut k_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(stages, 16usize);
    let mut v_s = Shared::<[Vector<F, NV>]>::new_aligned_slice(stages, 16usize);
    let mut kr = Array::<Vector<F, NV>>::new(comptime!(cfg.head_dim / 16));
    let mut vr = Array::<Vector<F, NV>>::new(comptime!(cfg.head_dim / 16));

    // Q as A fragments: rows are the group's heads (g and g + 8; zeros past the group).
    let valid_a = g < group;
    let valid_b = g + 8 < group;
    let at_a = seq * q.stride(0) + (kvh * group + g) * q.stride(1);
    let at_b = seq * q.stride(0) + (kvh * group + g + 8) * q.stride(1);
    let mut qa = Array::<Vector<F, NP>>::new(comptime!(4 * cfg.head_dim / 16));
    #[unroll]
    for s in 0..comptime!(cfg.head_dim / 16) {
        #[unroll]
        for e in 0..4usize {
            let col = s * 16 + 2 * t + 8 * (e / 2);
            let mut pair = Vector::<F, NP>::new(F::new(0.0));
            if e % 2 == 0 {
                if valid_a {
                    pair.insert(0usize, q[at_a + col]);
                    pair.insert(1usize, q[at_a + col + 1]);
                }
            } else if valid_b {
                pair.insert(0usize, q[at_b + col]);
                pair.insert(1usize, q[at_b + col + 1]);
            }
            qa[s * 4 + e] = pair;
        }
    }
    let mut o = Array::<Vector<f32, NP>>::new(comptime!(2 * cfg.head_dim / 8));
    #[unroll]
    for i in 0..comptime!(2 * cfg.head_dim / 8) {
        o[i] = Vector::new(0.0);
    }
    let mut s_acc = Array::<Vector<f32, NP>>::new(4usize);
    let mut m_a = neg_inf;
    let mut m_b = neg_inf;
    let mut l_a = 0.0f32;
    let mut l_b = 0.0f32;

    let step = comptime!(16 * cfg.planes);
    let mut base = start + plane * 16;
    let mut buf = 0usize;
    fetch_chunk(
        k_cache,
        v_cache,
        block_tables,
        table_row,
        block_size,
        kvh,
        base,
        end,
        &mut kr,
        &mut vr,
        cfg,
    );
    let dv = comptime!(cfg.head_dim / 8);
    let own = plane * 2 * chunk;
    #[unroll]
    for i in 0..comptime!(cfg.head_dim / 16) {
        let idx = i * 32 + lane;
        k_s[own + (idx / dv) * rs + idx % dv] = kr[i];
        v_s[own + (idx / dv) * rs + idx % dv] = vr[i];
    }
    sync_plane();
    while base < end {
        let next = base + step;
        let has_next = next < end;
        if has_next {
            fetch_chunk(
                k_cache,
                v_cache,
                block_tables,
                table_row,
                block_size,
                kvh,
                next,
                end,
                &mut kr,
                &mut vr,
                cfg,
            );
        }
        let off = own + buf * chunk;

        // S = Q·Kᵀ: two tiles of 8 keys; one ldmatrix.x4 gives two k-steps' B fragments.
        #[unroll]
        for j in 0..2usize {
            let mut c = Array::<Vector<f32, NP>>::new(2usize);
            c[0] = Vector::new(0.0);
            c[1] = Vector::new(0.0);
            #[unroll]
            for s2 in 0..comptime!(cfg.head_dim / 32) {
                let at = off + (j * 8 + lrow) * rs + 4 * s2 + lmat;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..stages],
                    MatrixIdent::B,
                    4usize,
                    false,
                );
                #[unroll]
                for h2 in 0..2usize {
                    let s = 2 * s2 + h2;
                    let mut a = Array::<Vector<F, NP>>::new(4usize);
                    #[unroll]
                    for e in 0..4usize {
                        a[e] = qa[s * 4 + e];
                    }
                    let mut b = Array::<Vector<F, NP>>::new(2usize);
                    b[0] = frags[2 * h2];
                    b[1] = frags[2 * h2 + 1];
                    def.execute_inplace(&a, &b, &mut c);
                }
            }
            if comptime!(!cfg.head_dim.is_multiple_of(32)) {
                let s = comptime!(cfg.head_dim / 16 - 1);
                let at = off + (j * 8 + lrow) * rs + 2 * s + lmat % 2;
                let frags = def.load_matrix::<Vector<F, NV>, NP>(
                    &k_s[at..stages],
                    MatrixIdent::B,
                    2usize,
                    false,
                );
                let mut a = Array::<Vector<F, NP>>::new(4usize);
                #[unroll]
                for e in 0..4usize {
                    a[e] = qa[s * 4 + e];
                }
                let mut b = Array::<Vector<F, NP>>::new(2usize);
                b[0] = frags[0];
                b[1] = frags[1];
                def.execute_inplace(&a, &b, &mut c);
            }
            s_acc[2 * j] = c[0];
            s_acc[2 * j + 1] = c[1];
        }

        // Online softmax over the chunk (keys past the split's end and padding rows masked).
        let mut mx_a = neg_inf;
        let mut mx_b = neg_inf;
        #[unroll]
        for j in 0..2usize {
            let mut va = s_acc[2 * j];
            let mut vb = s_acc[2 * j + 1];
            #[unroll]
            for e in 0..2usize {
                let key = base + j * 8 + 2 * t + e;
                let sa = select(key >= end || !valid_a, neg_inf, va.extract(e) * scale);
                let sb = select(key >= end || !valid_b, neg_inf, vb.extract(e) * scale);
                va.insert(e, sa);
                vb.insert(e, sb);
                mx_a = max(mx_a, sa);
                mx_b = max(mx_b, sb);
            }
            s_acc[2 * j] = va;
            s_acc[2 * j + 1] = vb;
        }
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 1u32));
        mx_a = max(mx_a, plane_shuffle_xor(mx_a, 2u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 1u32));
        mx_b = max(mx_b, plane_shuffle_xor(mx_b, 2u32));
        let new_a = max(m_a, mx_a);
        let new_b = max(m_b, mx_b);
        let live_a = new_a != neg_inf;
        let live_b = new_b != neg_inf;
        let corr_a = select(m_a == neg_inf, 0.0, f32::exp(m_a - new_a));
        let corr_b = select(m_b == neg_inf, 0.0, f32::exp(m_b - new_b));
        m_a = new_a;
        m_b = new_b;
        let mut sum_a = 0.0f32;
        let mut sum_b = 0.0f32;
        #[unroll]
        for j in 0..2usize {
            let mut va = s_acc[2 * j];
            let mut vb = s_acc[2 * j + 1];
            #[unroll]
            for e in 0..2usize {
                let pa = select(live_a, f32::exp(va.extract(e) - new_a), 0.0);
                let pb = select(live_b, f32::exp(vb.extract(e) - new_b), 0.0);
                sum_a += pa;
                sum_b += pb;
                va.insert(e, pa);
                vb.insert(e, pb);
            }
            s_acc[2 * j] = va;
            s_acc[2 * j + 1] = vb;
        }
        l_a = l_a * corr_a + sum_a;
        l_b = l_b * corr_b + sum_b;
        #[unroll]
        for j in 0..dtiles {
            o[2 * j] *= Vector::new(corr_a);
            o[2 * j + 1] *= Vector::new(corr_b);
        }

        // O += P·V over the chunk's 16 keys.
        let mut a = Array::<Vector<F, NP>>::new(4usize);
        #[unroll]
        for e in 0..4usize {
            a[e] = Vector::<F, NP>::cast_from(s_acc[e]);
        }
        let vkey = (lmat % 2) * 8 + lrow;
        #[unroll]
        for j2 in 0..comptime!(cfg.head_dim / 16) {
            let at = off + vkey * rs + 2 * j2 + lmat / 2;
            let frags = def.load_matrix::<Vector<F, NV>, NP>(
                &v_s[at..stages],
                MatrixIdent::B,
                4usize,
                true,
            );
            #[unroll]
            for h2 in 0..2usize {
                let j = 2 * j2 + h2;
                let mut b = Array::<Vector<F, NP>>::new(2usize);
                b[0] = frags[2 * h2];
                b[1] = frags[2 * h2 + 1];
                let mut c = Array::<Vector<f32, NP>>::new(2usize);
                c[0] = o[2 * j];
                c[1] = o[2 * j + 1];
                def.execute_inplace(&a, &b, &mut c);
                o[2 * j] = c[0];
                o[2 * j + 1] = c[1];
            }
        }

        if has_next {
            let dst = own + (1 - buf) * chunk;
            #[unroll]
            for i in 0..comptime!(cfg.head_dim / 16) {
                let idx = i * 32 + lane;
                k_s[dst + (idx / dv) * rs + idx % dv] = kr[i];
                v_s[dst + (idx / dv) * rs + idx % dv] = vr[i];
            }
        }
        sync_plane();
        buf = 1 - buf;
        base = next;
    }

    // Merge the planes: [planes][group][D] accumulators and [planes][group] (m, l).
    l_a += plane_shuffle_xor(l_a, 1u32);
    l_a += plane_shuffle_xor(l_a, 2u32);
    l_b += plane_shuffle_xor(l_b, 1u32);
    l_b += plane_shuffle_xor(l_b, 2u32);
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
                acc_s[(plane * group + g) * d + col] = o[2 * j].extract(e);
            }
            if valid_b {
                acc_s[(plane * group + g + 8) * d + col] = o[2 * j + 1].extract(e);
            }
        }
    }
    if t == 0 {
        if valid_a {
            m_s[plane * group + g] = m_a;
            l_s[plane * group + g] = l_a;
        }
        if valid_b {
            m_s[plane * group + g + 8] = m_b;
            l_s[plane * group + g + 8] = l_b;
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
        cfg.planes,
        cfg.group,
        cfg.head_dim,
        cfg.kv_heads,
        cfg.split,
    );
}
