//! Device code of the RMSNorm + linear family (no host code here: see `launch.rs`).
//!
//! Memory layout: activations `x [M, K]` and weights `W [N, K]` (the Hugging Face `[out, in]`
//! layout) are row-major with a unit stride along `K` and any row pitch; the output `y [M, N]` is
//! row-major. Every product accumulates in f32 whatever the storage type `F`.
//!
//! On the skinny and tiled routes the RMSNorm is applied on the fly: `rms_stats` writes
//! `inv_rms [M]` (f32) once per row, and the product kernels multiply each `x` element by the norm
//! weight `g[k]` as it is loaded and each finished dot product by `inv_rms[m]`, so the normalised
//! activations never reach memory. The matmul routes (cuBLASLt, cubek) cannot scale their rows
//! that way: `rms_norm_rows` (or `rms_stats` with `write_normed` off plane devices) writes them.
//!
//! | kernel | grid | cube |
//! | --- | --- | --- |
//! | `rms_stats` | one cube per row `m` | `cube_dim` units striding over `K` |
//! | `rms_norm_rows` (matmul routes, plane devices) | one cube per `CUBE_DIM_Y` rows | one plane per row striding over `K` in vectors |
//! | `linear_skinny` (small `M`) | one cube per `rows` output features | `cube_dim` units striding over `K` in vectors; loops over `M` in tiles of `m_tile` rows |
//! | `linear_tiled` (large `M`, no tensor cores) | one cube per `bm × bn` output tile | `bm·bn/16` units |

use cubecl::prelude::*;

use crate::fp8_codes::load_codes;

/// Launch-time choices of [`linear_skinny`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SkinnyConfig {
    /// Output features per cube.
    pub rows: usize,
    /// Input rows per register tile.
    pub m_tile: usize,
    /// Units per cube.
    pub cube_dim: usize,
    /// Apply the RMSNorm (`g`, `inv_rms`).
    pub has_norm: bool,
    /// Add a bias.
    pub has_bias: bool,
    /// Add `add [M, N]` to the output.
    pub has_add: bool,
    /// Reduce with plane (warp) sums; otherwise through shared memory only.
    pub use_plane: bool,
    /// `x` and `W` hold E4M3 codes (`X` an FP8 type) quantised per row: each dot product is
    /// multiplied by `x_scales[m] · w_scales[n]` (`crate::fp8_linear`); no norm.
    pub fp8: bool,
    /// With `fp8`, the codes decoded by PTX's paired conversion (`crate::fp8_codes`).
    pub fp8_ptx: bool,
}

/// Launch-time choices of [`linear_tiled`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TiledConfig {
    /// Output rows per cube.
    pub bm: usize,
    /// Output features per cube.
    pub bn: usize,
    /// `K` per shared-memory stage.
    pub bk: usize,
    /// Units per cube.
    pub cube_dim: usize,
    /// Apply the RMSNorm (`g`, `inv_rms`).
    pub has_norm: bool,
    /// Add a bias.
    pub has_bias: bool,
    /// Add `add [M, N]` to the output.
    pub has_add: bool,
}

/// Partial results a cube reduction meets in shared memory: one per plane (a last, partial
/// plane included: `ceil(CUBE_DIM / PLANE_DIM)`) with plane operations, else one per unit.
#[cube]
pub fn reduction_parts(#[comptime] use_plane: bool) -> u32 {
    if comptime!(use_plane) {
        (CUBE_DIM_X - 1) / PLANE_DIM + 1
    } else {
        CUBE_DIM_X
    }
}

/// Sum of `value` over the whole cube, returned to every unit.
///
/// `scratch` needs `CUBE_DIM` slots. With `use_plane`, plane sums meet in shared memory (a
/// last, partial plane included: a cube need not be a whole number of planes); otherwise every
/// unit's value goes through shared memory.
#[cube]
pub fn cube_sum(value: f32, scratch: &mut Shared<[f32]>, #[comptime] use_plane: bool) -> f32 {
    let parts = reduction_parts(use_plane);
    if comptime!(use_plane) {
        let s = plane_sum(value);
        if UNIT_POS_PLANE == 0 {
            scratch[PLANE_POS as usize] = s;
        }
    } else {
        scratch[UNIT_POS_X as usize] = value;
    }
    sync_cube();
    let mut total = 0.0f32;
    for p in 0..parts {
        total += scratch[p as usize];
    }
    sync_cube();
    total
}

/// `inv_rms[m] = 1 / sqrt(mean_k(h[m, k]²) + eps)` with `h = x (+ residual)`; with a residual,
/// `h` is also written to `h_out` (rounded to `F` first, as the model's residual stream is); with
/// `write_normed`, `normed[m, k] = h[m, k]·inv_rms[m]·g[k]` (for products that are not fused).
///
/// Grid: one cube per row. `x`, `residual`, `h_out`, `normed`: `[M, K]`; `gamma`: `[K]`;
/// `inv_rms`: `[M]`. Each unit revisits in the second pass the elements it wrote in the first.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn rms_stats<F: Float>(
    x: &Tensor<F>,
    residual: &Tensor<F>,
    gamma: &Tensor<F>,
    h_out: &mut Tensor<F>,
    normed: &mut Tensor<F>,
    inv_rms: &mut Tensor<f32>,
    eps: f32,
    #[comptime] cube_dim: usize,
    #[comptime] has_residual: bool,
    #[comptime] write_normed: bool,
    #[comptime] use_plane: bool,
    #[define(F)] _dtype: ElemType,
) {
    let row = CUBE_POS_X as usize;
    let k = x.shape(1);
    let mut acc = 0.0f32;
    let mut i = UNIT_POS_X as usize;
    while i < k {
        let mut v = x[row * x.stride(0) + i];
        if comptime!(has_residual) {
            v += residual[row * residual.stride(0) + i];
            let at = row * h_out.stride(0) + i;
            h_out[at] = v;
        }
        let f = f32::cast_from(v);
        acc += f * f;
        i += CUBE_DIM_X as usize;
    }
    let mut scratch = Shared::<[f32]>::new_slice(cube_dim);
    let total = cube_sum(acc, &mut scratch, use_plane);
    let inv = f32::inverse_sqrt(total / f32::cast_from(k) + eps);
    if UNIT_POS_X == 0 {
        inv_rms[row] = inv;
    }
    if comptime!(write_normed) {
        let mut i = UNIT_POS_X as usize;
        while i < k {
            let v = if comptime!(has_residual) {
                h_out[row * h_out.stride(0) + i]
            } else {
                x[row * x.stride(0) + i]
            };
            let at = row * normed.stride(0) + i;
            normed[at] = F::cast_from(f32::cast_from(v) * inv * f32::cast_from(gamma[i]));
            i += CUBE_DIM_X as usize;
        }
    }
}

/// `h = x (+ residual)` (written to `h_out` with a residual) and `normed = h·inv_rms·g`: what the
/// matmul routes (cuBLASLt, cubek) multiply. The same arithmetic as [`rms_stats`] with
/// `write_normed`, laid out for plane devices: no shared memory and no cube barrier.
///
/// Grid: `ceil(M / CUBE_DIM_Y)` cubes; cube: `CUBE_DIM_Y` planes of `PLANE_DIM` units, one plane
/// per row. A plane walks its row in chunks of `held · PLANE_DIM` vectors of `NV` elements; each
/// unit issues the `held` loads of a chunk before using any (unrolled: the loads are in flight
/// together), sums the squares, and a plane sum gives the row's `inv_rms`. With `resident` (the
/// row is one chunk) the values stay in registers for the second pass; otherwise the second pass
/// reads the row again (cache-resident). `x`, `residual`, `h_out`, `normed`: `[M, K]`;
/// `gamma`: `[K]`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_rows<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    residual: &Tensor<Vector<F, NV>>,
    gamma: &Tensor<Vector<F, NV>>,
    h_out: &mut Tensor<Vector<F, NV>>,
    normed: &mut Tensor<Vector<F, NV>>,
    eps: f32,
    #[comptime] held: usize,
    #[comptime] resident: bool,
    #[comptime] has_residual: bool,
    #[define(F)] _dtype: ElemType,
) {
    let nv = x.vector_size();
    let row = (CUBE_POS_X * CUBE_DIM_Y + UNIT_POS_Y) as usize;
    if row < x.shape(0) {
        let k = x.shape(1);
        let k_vecs = k / nv;
        let lane = UNIT_POS_X as usize;
        let plane = PLANE_DIM as usize;
        let x_at = row * (x.stride(0) / nv);
        let r_at = row * (residual.stride(0) / nv);
        let h_at = row * (h_out.stride(0) / nv);
        let n_at = row * (normed.stride(0) / nv);
        let mut vals = Array::<Vector<F, NV>>::new(held);
        let mut acc = 0.0f32;
        let mut base = 0usize;
        while base < k_vecs {
            #[unroll]
            for j in 0..held {
                let i = base + lane + j * plane;
                let mut v = Vector::<F, NV>::new(F::new(0.0));
                if i < k_vecs {
                    v = x[x_at + i];
                    if comptime!(has_residual) {
                        v += residual[r_at + i];
                        h_out[h_at + i] = v;
                    }
                }
                vals[j] = v;
            }
            #[unroll]
            for j in 0..held {
                let f = Vector::<f32, NV>::cast_from(vals[j]);
                #[unroll]
                for e in 0..nv {
                    acc += f.extract(e) * f.extract(e);
                }
            }
            base += held * plane;
        }
        let inv =
            Vector::<f32, NV>::new(f32::inverse_sqrt(plane_sum(acc) / f32::cast_from(k) + eps));
        let mut base = 0usize;
        while base < k_vecs {
            if comptime!(!resident) {
                #[unroll]
                for j in 0..held {
                    let i = base + lane + j * plane;
                    if i < k_vecs {
                        vals[j] = if comptime!(has_residual) {
                            h_out[h_at + i]
                        } else {
                            x[x_at + i]
                        };
                    }
                }
            }
            #[unroll]
            for j in 0..held {
                let i = base + lane + j * plane;
                if i < k_vecs {
                    let scaled = Vector::<f32, NV>::cast_from(vals[j])
                        * inv
                        * Vector::<f32, NV>::cast_from(gamma[i]);
                    normed[n_at + i] = Vector::<F, NV>::cast_from(scaled);
                }
            }
            base += held * plane;
        }
    }
}

/// `y[m, n] = Σ_k x[m, k]·g[k]·W[n, k] · inv_rms[m] (+ b[n])` for small `M`: reads each weight
/// row once from memory (16-byte vectors), which is what bounds the op at decode sizes.
///
/// Grid: `ceil(N / rows)` cubes; cube: `cube_dim` units. Units stride over `K` in vectors of `NV`
/// elements; for each tile of `m_tile` input rows every unit keeps `m_tile × rows` f32 partial
/// sums in registers, which plane sums (or shared memory) reduce; the units then share the
/// `m_tile × rows` outputs, add the bias (and `add [M, N]`) and write. The weight rows of a cube
/// stay in L1 across the `M` tiles. `x` and `W` are stored as `X`: `F`, or with
/// [`SkinnyConfig::fp8`] E4M3 codes decoded exactly to f32 as they are loaded
/// (`crate::fp8_codes`), scaled by `x_scales [M]` and `w_scales [N]` at the end.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn linear_skinny<F: Float, X: Float, NV: Size>(
    x: &Tensor<Vector<X, NV>>,
    inv_rms: &Tensor<f32>,
    gamma: &Tensor<Vector<F, NV>>,
    w: &Tensor<Vector<X, NV>>,
    x_scales: &Tensor<f32>,
    w_scales: &Tensor<f32>,
    bias: &Tensor<F>,
    add: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] cfg: SkinnyConfig,
    #[define(F, X)] _dtypes: [ElemType; 2],
) {
    let nv = w.vector_size();
    let k_vecs = w.shape(1) / nv;
    let (x_pitch, w_pitch) = (x.stride(0) / nv, w.stride(0) / nv);
    let m_total = x.shape(0);
    let n_total = w.shape(0);
    let n0 = CUBE_POS_X as usize * cfg.rows;
    let tid = UNIT_POS_X as usize;
    let tile = comptime!(cfg.m_tile * cfg.rows);
    let mut scratch = Shared::<[f32]>::new_slice(comptime!(cfg.m_tile * cfg.rows * cfg.cube_dim));
    let parts = reduction_parts(cfg.use_plane);
    let slot = if comptime!(cfg.use_plane) {
        PLANE_POS as usize
    } else {
        tid
    };

    let mut m0 = 0usize;
    while m0 < m_total {
        let mut acc = Array::<f32>::new(tile);
        #[unroll]
        for i in 0..tile {
            acc[i] = 0.0;
        }
        let mut kv = tid;
        while kv < k_vecs {
            let g = if comptime!(cfg.has_norm) {
                Vector::<f32, NV>::cast_from(gamma[kv])
            } else {
                Vector::<f32, NV>::new(1.0)
            };
            // This unit's slice of the tile's input rows, loaded once for all weight rows.
            let mut xs = Array::<Vector<f32, NV>>::new(cfg.m_tile);
            #[unroll]
            for mi in 0..cfg.m_tile {
                let m = select(m0 + mi < m_total, m0 + mi, m_total - 1);
                // E4M3 codes decoded, others cast.
                xs[mi] =
                    load_codes::<X, f32, NV>(x[m * x_pitch + kv], cfg.fp8, cfg.fp8_ptx, false) * g;
            }
            #[unroll]
            for r in 0..cfg.rows {
                let n = select(n0 + r < n_total, n0 + r, n_total - 1);
                let wv = load_codes::<X, f32, NV>(w[n * w_pitch + kv], cfg.fp8, cfg.fp8_ptx, false);
                #[unroll]
                for mi in 0..cfg.m_tile {
                    let xv = xs[mi];
                    let mut s = 0.0f32;
                    #[unroll]
                    for e in 0..nv {
                        s += xv.extract(e) * wv.extract(e);
                    }
                    acc[mi * cfg.rows + r] += s;
                }
            }
            kv += CUBE_DIM_X as usize;
        }
        #[unroll]
        for i in 0..tile {
            if comptime!(cfg.use_plane) {
                let s = plane_sum(acc[i]);
                if UNIT_POS_PLANE == 0 {
                    scratch[i * cfg.cube_dim + slot] = s;
                }
            } else {
                scratch[i * cfg.cube_dim + slot] = acc[i];
            }
        }
        sync_cube();
        let mut o = tid;
        while o < tile {
            let mut s = 0.0f32;
            for p in 0..parts {
                s += scratch[o * cfg.cube_dim + p as usize];
            }
            let m = m0 + o / cfg.rows;
            let n = n0 + o % cfg.rows;
            if m < m_total && n < n_total {
                if comptime!(cfg.has_norm) {
                    s *= inv_rms[m];
                }
                if comptime!(cfg.fp8) {
                    s *= x_scales[m] * w_scales[n];
                }
                if comptime!(cfg.has_bias) {
                    s += f32::cast_from(bias[n]);
                }
                if comptime!(cfg.has_add) {
                    s += f32::cast_from(add[m * add.stride(0) + n]);
                }
                let at = m * out.stride(0) + n;
                out[at] = F::cast_from(s);
            }
            o += CUBE_DIM_X as usize;
        }
        sync_cube();
        m0 += cfg.m_tile;
    }
}

/// `y = (x·g·inv_rms) · Wᵀ (+ b)` by output tiles, for large `M` on devices without bf16/f16
/// tensor cores (CPU runtimes) and for f32.
///
/// Grid: `(ceil(N / bn), ceil(M / bm))`; cube: `cube_dim = bm·bn/16` units, each owning a 4×4
/// f32 register tile. For each `bk`-wide stage of `K` the cube stages the normalised `x` tile
/// (`[bm, bk]`, cast to `F`) and the weight tile (`[bn, bk]`) in shared memory with vector loads.
///
/// The accumulators go through shared memory (f32) to a bounds-checked epilogue that adds the
/// bias and casts to `F`. Out-of-range rows, features and `K` columns are staged as zeros.
#[cube(launch_unchecked)]
pub fn linear_tiled<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    inv_rms: &Tensor<f32>,
    gamma: &Tensor<Vector<F, NV>>,
    w: &Tensor<Vector<F, NV>>,
    bias: &Tensor<F>,
    add: &Tensor<F>,
    out: &mut Tensor<F>,
    #[comptime] cfg: TiledConfig,
    #[define(F)] _dtype: ElemType,
) {
    let (bm, bn, bk) = (cfg.bm, cfg.bn, cfg.bk);
    let m_total = x.shape(0);
    let n_total = w.shape(0);
    let k_total = w.shape(1);
    let m0 = CUBE_POS_Y as usize * bm;
    let n0 = CUBE_POS_X as usize * bn;
    let tid = UNIT_POS_X as usize;
    let nv = x.vector_size();
    let (x_pitch, w_pitch) = (x.stride(0) / nv, w.stride(0) / nv);

    let mut a_tile = Shared::<[F]>::new_slice(comptime!(bm * bk));
    let mut b_tile = Shared::<[F]>::new_slice(comptime!(bn * bk));
    let mut c_tile = Shared::<[f32]>::new_slice(comptime!(bm * bn));

    // FMA: unit `tid` owns rows `tm..tm+4`, features `tn..tn+4` of the tile.
    let cols = comptime!(bn / 4);
    let tm = (tid / cols) * 4;
    let tn = (tid % cols) * 4;
    let mut acc = Array::<f32>::new(16usize);
    #[unroll]
    for i in 0..16 {
        acc[i] = 0.0;
    }
    let mut k0 = 0usize;
    while k0 < k_total {
        stage_tiles::<F, NV>(
            x,
            inv_rms,
            gamma,
            w,
            &mut a_tile,
            &mut b_tile,
            m0,
            n0,
            k0,
            x_pitch,
            w_pitch,
            cfg,
        );
        sync_cube();
        for kk in 0..bk {
            let mut a = Array::<f32>::new(4usize);
            let mut b = Array::<f32>::new(4usize);
            #[unroll]
            for i in 0..4 {
                a[i] = f32::cast_from(a_tile[(tm + i) * bk + kk]);
                b[i] = f32::cast_from(b_tile[(tn + i) * bk + kk]);
            }
            #[unroll]
            for i in 0..4 {
                #[unroll]
                for j in 0..4 {
                    acc[i * 4 + j] += a[i] * b[j];
                }
            }
        }
        sync_cube();
        k0 += bk;
    }
    #[unroll]
    for i in 0..4 {
        #[unroll]
        for j in 0..4 {
            c_tile[(tm + i) * bn + tn + j] = acc[i * 4 + j];
        }
    }
    sync_cube();

    // Epilogue: bias, added matrix, cast, bounds.
    let mut e = tid;
    while e < comptime!(bm * bn) {
        let m = m0 + e / bn;
        let n = n0 + e % bn;
        if m < m_total && n < n_total {
            let mut v = c_tile[e];
            if comptime!(cfg.has_bias) {
                v += f32::cast_from(bias[n]);
            }
            if comptime!(cfg.has_add) {
                v += f32::cast_from(add[m * add.stride(0) + n]);
            }
            let at = m * out.stride(0) + n;
            out[at] = F::cast_from(v);
        }
        e += CUBE_DIM_X as usize;
    }
}

/// Stages `a_tile[r][c] = x[m0 + r, k0 + c] · g[k0 + c] · inv_rms[m0 + r]` (cast to `F`) and
/// `b_tile[r][c] = W[n0 + r, k0 + c]`, zero outside the matrices. Each unit first issues all its
/// vector loads (16 bytes each), then writes shared memory.
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_tiles<F: Float, NV: Size>(
    x: &Tensor<Vector<F, NV>>,
    inv_rms: &Tensor<f32>,
    gamma: &Tensor<Vector<F, NV>>,
    w: &Tensor<Vector<F, NV>>,
    a_tile: &mut Shared<[F]>,
    b_tile: &mut Shared<[F]>,
    m0: usize,
    n0: usize,
    k0: usize,
    x_pitch: usize,
    w_pitch: usize,
    #[comptime] cfg: TiledConfig,
) {
    let nv = x.vector_size();
    let row_vecs = comptime!(cfg.bk / nv);
    let a_vecs = comptime!(cfg.bm * cfg.bk / nv);
    let b_vecs = comptime!(cfg.bn * cfg.bk / nv);
    let a_per_unit = comptime!(a_vecs.div_ceil(cfg.cube_dim));
    let b_per_unit = comptime!(b_vecs.div_ceil(cfg.cube_dim));
    let m_total = x.shape(0);
    let n_total = w.shape(0);
    let k_vecs = w.shape(1) / nv;
    let kv0 = k0 / nv;
    let tid = UNIT_POS_X as usize;

    let mut a = Array::<Vector<f32, NV>>::new(a_per_unit);
    #[unroll]
    for i in 0..a_per_unit {
        let e = tid + i * cfg.cube_dim;
        let (r, c) = (e / row_vecs, e % row_vecs);
        let (m, kv) = (m0 + r, kv0 + c);
        let mut v = Vector::<f32, NV>::new(0.0);
        if e < a_vecs && m < m_total && kv < k_vecs {
            v = Vector::<f32, NV>::cast_from(x[m * x_pitch + kv]);
            if comptime!(cfg.has_norm) {
                v = v * Vector::<f32, NV>::cast_from(gamma[kv]) * Vector::new(inv_rms[m]);
            }
        }
        a[i] = v;
    }
    let mut b = Array::<Vector<F, NV>>::new(b_per_unit);
    #[unroll]
    for i in 0..b_per_unit {
        let e = tid + i * cfg.cube_dim;
        let (r, c) = (e / row_vecs, e % row_vecs);
        let (n, kv) = (n0 + r, kv0 + c);
        let mut v = Vector::<F, NV>::new(F::new(0.0));
        if e < b_vecs && n < n_total && kv < k_vecs {
            v = w[n * w_pitch + kv];
        }
        b[i] = v;
    }
    #[unroll]
    for i in 0..a_per_unit {
        let e = tid + i * cfg.cube_dim;
        if e < a_vecs {
            let v = a[i];
            #[unroll]
            for j in 0..nv {
                a_tile[e * nv + j] = F::cast_from(v.extract(j));
            }
        }
    }
    #[unroll]
    for i in 0..b_per_unit {
        let e = tid + i * cfg.cube_dim;
        if e < b_vecs {
            let v = b[i];
            #[unroll]
            for j in 0..nv {
                b_tile[e * nv + j] = v.extract(j);
            }
        }
    }
}
