//! Host side of the RMSNorm + linear family on CubeCL runtimes: argument checks, output
//! allocation, kernel choice and launch geometry (the device code is in `kernel.rs`).
//!
//! Routes ([`LinearRoute`]), by the number of rows `M` (crossovers measured on an H100,
//! docs/BENCHMARKS.md):
//! - with cuBLASLt `M ≤ 4`, without it `M ≤ 8` or `M ≤ 32` with a weight that fits a quarter of
//!   the last-level cache: `linear_skinny`, which streams each weight row once per 8 rows
//!   (decode sizes; at M = 8, 16 and 32 cuBLASLt was 1.0–4.5× faster on every Qwen product on
//!   the H100, at M = 1 the skinny kernel matches PyTorch);
//! - larger `M` on CUDA devices where libcublasLt loads: `rms_norm_rows` writes the normalised rows
//!   (`[M, K]`: 0.5 MB at M = 256 against 1–136 MB of weights), then cuBLASLt does the product
//!   with the bias as its epilogue (`cublas.rs`). cuBLASLt's per-row scale vector applies to
//!   rows of its column-major output, which are our output features, not our tokens, so the
//!   RMSNorm row scale cannot ride in its epilogue;
//! - larger `M` elsewhere on devices with bf16/f16 tensor cores: the same normalised rows, then
//!   cubek's autotuned tensor-core matmul (Burn's `float_matmul`), split along K into one batched
//!   matmul when the output alone gives too few cubes (`split_k`);
//! - elsewhere (f32 without cuBLASLt, CPU runtimes): `linear_tiled` with FMA register tiles.
//!
//! [`ReductionOrder::BatchInvariant`] takes one route whatever `M`: cuBLASLt where it runs on
//! CubeCL's stream (graphs and eager steps alike; one algorithm per weight shape, no split-K:
//! `cublas.rs`), else `linear_tiled`; the skinny kernel only for `K < 16`, where every `M`
//! takes it.
//!
//! Benchmark knobs (`knobs.rs`): `BURN_NANOVLLM_SKINNY_MAX_M` overrides the skinny bound,
//! `BURN_NANOVLLM_SPLIT_K=0` turns the K split off, `BURN_NANOVLLM_CUBLAS=0` leaves cuBLASLt out.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::matmul::{self, MatmulStrategy};
use burn_cubecl::{CubeBackend, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::client::Client;
use cubecl::prelude::{CubeCount, CubeDim};
use cubecl::zspace::metadata::Metadata;

use super::kernel::{
    SkinnyConfig, TiledConfig, linear_skinny, linear_tiled, rms_norm_rows, rms_stats,
};
use crate::ReductionOrder;
use crate::device_caps::DeviceCaps;
use crate::knobs::Knobs;
use crate::{unit_inner_stride, vector_size};

/// Rows per register tile of the skinny kernel: up to this `M` the weight is read once.
const SKINNY_TILE_M: usize = 8;

/// Largest `M` for the skinny kernel when the weight stays cache-resident across row tiles.
const SKINNY_CACHED_MAX_M: usize = 32;

/// Largest `M` for the skinny kernel where cuBLASLt serves the device.
const SKINNY_MAX_M_WITH_CUBLAS: usize = 4;

/// Most 16-byte vectors per unit for which `rms_norm_rows` keeps a whole row in registers
/// (`K` up to 16 · 32 · 8 = 4,096 in bf16/f16).
const NORM_ROWS_MAX_HELD: usize = 16;

/// Vectors per unit per chunk of `rms_norm_rows` for longer rows.
const NORM_ROWS_CHUNK: usize = 8;

/// Last-level cache assumed where the runtime does not report one (CUDA does not, today):
/// 48 MiB, about an H100's L2 (an H200 has 60 MB).
const CACHE_FALLBACK_BYTES: usize = 48 << 20;

/// Which implementation computes a product of the linear family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearRoute {
    /// `linear_skinny`: few rows, each weight row streamed once per 8 rows.
    Skinny,
    /// cuBLASLt (on CubeCL's stream, or fenced on its own: `rms_norm_linear/cublas.rs`).
    CublasLt,
    /// cubek's autotuned tensor-core matmul (Burn's `float_matmul`).
    Cubek,
    /// `linear_tiled`: FMA register tiles (f32, CPU runtimes).
    Tiled,
}

/// The route for `x [M, K] · W [N, K]ᵀ` on `device` in `order`, by the rules of the module doc.
#[allow(clippy::too_many_arguments)]
pub(crate) fn route(
    m: usize,
    n: usize,
    k: usize,
    dtype: DType,
    device: &cubecl::Device,
    client: &Client,
    caps: &DeviceCaps,
    order: ReductionOrder,
) -> LinearRoute {
    if order == ReductionOrder::BatchInvariant {
        return if k < 16 {
            LinearRoute::Skinny
        } else if cublas_device(device, client).is_some() && cublas_on_stream() {
            LinearRoute::CublasLt
        } else {
            LinearRoute::Tiled
        };
    }
    let cached = n * k * dtype.size() <= caps.cache_bytes.unwrap_or(CACHE_FALLBACK_BYTES) / 4;
    let cublas = cublas_device(device, client).is_some();
    let skinny = k < 16
        || match Knobs::get().skinny_max_m {
            Some(max) => m <= max,
            None if cublas => m <= SKINNY_MAX_M_WITH_CUBLAS,
            None => m <= SKINNY_TILE_M || (cached && m <= SKINNY_CACHED_MAX_M),
        };
    if skinny {
        LinearRoute::Skinny
    } else if cublas {
        LinearRoute::CublasLt
    } else if caps.cmma_16x16x16(dtype) {
        LinearRoute::Cubek
    } else {
        LinearRoute::Tiled
    }
}

/// Whether cuBLASLt runs on CubeCL's stream (and so inside captured graphs as in eager steps).
fn cublas_on_stream() -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cublas::stream_ordered()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The CUDA device index if cuBLASLt may serve `device` now (`client`: its client, whose
/// capture state matters).
pub(crate) fn cublas_device(device: &cubecl::Device, client: &Client) -> Option<usize> {
    #[cfg(feature = "cuda")]
    {
        super::cublas::usable(device, client)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, client);
        None
    }
}

/// The fused op on CubeCL tensors: `h = x (+ residual)`, `y = rms_norm(h)·Wᵀ (+ b) (+ add)`
/// (without `gamma`, a plain linear). Returns `(y [M, N], h [M, K])`. Arguments were checked by
/// [`super::check_args`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_linear(
    x: CubeTensor,
    residual: Option<CubeTensor>,
    gamma: Option<CubeTensor>,
    w: CubeTensor,
    bias: Option<CubeTensor>,
    add: Option<CubeTensor>,
    eps: f32,
    order: ReductionOrder,
) -> (CubeTensor, CubeTensor) {
    let x = unit_inner_stride(x);
    let w = unit_inner_stride(w);
    let [m, k] = dims2(&x);
    let n = w.meta.shape()[0];
    let caps = DeviceCaps::of(&x.client);
    let dtype = x.dtype;
    let route = route(m, n, k, dtype, &x.device, &x.client, &caps, order);
    let matmul = matches!(route, LinearRoute::CublasLt | LinearRoute::Cubek);

    // Row statistics (and the residual sum, and for the matmul path the normalised rows) once
    // per row.
    let client = x.client.clone();
    let alloc = |shape: [usize; 2], dt: DType| {
        empty_device_dtype(client.clone(), x.device.clone(), Shape::new(shape), dt)
    };
    let mut normed = None;
    let (h, inv_rms) = if gamma.is_some() || residual.is_some() {
        let inv_rms = alloc([m.max(1), 1], DType::F32);
        let h = match &residual {
            Some(_) => alloc([m, k], dtype),
            None => x.clone(),
        };
        let write_normed = matmul && gamma.is_some();
        let out_normed = if write_normed {
            alloc([m, k], dtype)
        } else {
            h.clone()
        };
        let r = residual
            .clone()
            .map(unit_inner_stride)
            .unwrap_or_else(|| x.clone());
        let g = gamma.clone().unwrap_or_else(|| x.clone());
        if m > 0 && write_normed && caps.plane_ops {
            let vec = vector_size(
                dtype,
                &[
                    k,
                    x.meta.strides()[0],
                    r.meta.strides()[0],
                    h.meta.strides()[0],
                    out_normed.meta.strides()[0],
                ],
            );
            let rows = (caps.cube_units / caps.plane_size).max(1);
            // Vectors per unit per chunk: the whole row when it fits in registers.
            let per_unit = (k / vec).div_ceil(caps.plane_size).max(1);
            let resident = per_unit <= NORM_ROWS_MAX_HELD;
            let held = if resident { per_unit } else { NORM_ROWS_CHUNK };
            // SAFETY: one plane per row, rows past `M` do nothing; `K` and the row pitches are
            // multiples of the vector, so every vector index is below the row's `K / vec`.
            unsafe {
                rms_norm_rows::launch_unchecked(
                    &client,
                    CubeCount::Static(m.div_ceil(rows) as u32, 1, 1),
                    CubeDim::new_2d(caps.plane_size as u32, rows as u32),
                    vec,
                    x.clone().into_tensor_arg(),
                    r.into_tensor_arg(),
                    g.into_tensor_arg(),
                    h.clone().into_tensor_arg(),
                    out_normed.clone().into_tensor_arg(),
                    eps,
                    held,
                    resident,
                    residual.is_some(),
                    dtype_to_storage_type(dtype),
                );
            }
        } else if m > 0 {
            // SAFETY: one cube per row; every index is below the row's `K` (checked shapes).
            unsafe {
                rms_stats::launch_unchecked(
                    &client,
                    CubeCount::Static(m as u32, 1, 1),
                    CubeDim::new_1d(caps.cube_units as u32),
                    x.clone().into_tensor_arg(),
                    r.into_tensor_arg(),
                    g.into_tensor_arg(),
                    h.clone().into_tensor_arg(),
                    out_normed.clone().into_tensor_arg(),
                    inv_rms.clone().into_tensor_arg(),
                    eps,
                    caps.cube_units,
                    residual.is_some(),
                    write_normed,
                    caps.plane_ops,
                    dtype_to_storage_type(dtype),
                );
            }
        }
        if write_normed {
            normed = Some(out_normed);
        }
        (h, inv_rms)
    } else {
        (x.clone(), alloc([1, 1], DType::F32))
    };

    if matmul {
        let lhs = normed.unwrap_or_else(|| h.clone());
        #[cfg(feature = "cuda")]
        if route == LinearRoute::CublasLt {
            let y = alloc([m, n], dtype);
            let index = cublas_device(&x.device, &x.client);
            // On failure (reported once, cuBLASLt then off for the device) the cubek path below
            // computes the product instead.
            if m == 0
                || n == 0
                || index.is_some_and(|i| {
                    let bias = bias.clone().map(unit_inner_stride);
                    let add = add.clone().map(unit_inner_stride);
                    let invariant = order == ReductionOrder::BatchInvariant;
                    super::cublas::gemm(
                        i,
                        &lhs,
                        &w,
                        bias.as_ref(),
                        add.as_ref(),
                        &y,
                        invariant,
                        None,
                    )
                    .is_ok()
                })
            {
                return (y, h);
            }
        }
        let y = match split_k(m, n, k, &caps) {
            Some(splits) => split_k_matmul(lhs, w, splits),
            None => CubeBackend::float_matmul(lhs, CubeBackend::float_transpose(w)),
        };
        let y = match bias {
            Some(b) => CubeBackend::float_add(y, CubeBackend::float_reshape(b, Shape::new([1, n]))),
            None => y,
        };
        let y = match add {
            Some(a) => CubeBackend::float_add(y, a),
            None => y,
        };
        return (y, h);
    }

    let out = alloc([m, n], dtype);
    if m == 0 || n == 0 {
        return (out, h);
    }
    let has_norm = gamma.is_some();
    let has_bias = bias.is_some();
    let has_add = add.is_some();
    // Absent optional operands are bound to `h` and never read (comptime flags).
    let gamma = gamma.unwrap_or_else(|| h.clone());
    let bias = bias.unwrap_or_else(|| h.clone());
    let add = add.map(unit_inner_stride).unwrap_or_else(|| h.clone());

    if route == LinearRoute::Skinny {
        let vec = vector_size(dtype, &[k, h.meta.strides()[0], w.meta.strides()[0]]);
        let cfg = SkinnyConfig {
            has_norm,
            has_bias,
            has_add,
            ..skinny_config(m, &caps)
        };
        // The FP8 scales are placeholders, never read (`cfg.fp8` off).
        let scales = [inv_rms.clone(), inv_rms.clone()];
        let operands = SkinnyOperands {
            x: h.clone(),
            inv_rms,
            gamma,
            w,
            scales,
            bias,
            add: add.clone(),
            out: out.clone(),
        };
        launch_skinny(operands, cfg, vec, [dtype_to_storage_type(dtype); 2]);
    } else {
        // Each unit owns a 4×4 register tile: 8 × 16 units on GPUs, a 1 × units row on CPUs.
        let (bm, bn) = if caps.cube_units >= 128 {
            (32, 64)
        } else {
            (4, 4 * caps.cube_units)
        };
        let cfg = TiledConfig {
            bm,
            bn,
            bk: 32,
            cube_dim: bm * bn / 16,
            has_norm,
            has_bias,
            has_add,
        };
        // K, the row pitches and the stage width must be multiples of the vector.
        let vec = vector_size(
            dtype,
            &[k, cfg.bk, h.meta.strides()[0], w.meta.strides()[0]],
        );
        // SAFETY: staging loads and epilogue stores are bounds-checked against M, N, K.
        unsafe {
            linear_tiled::launch_unchecked(
                &client,
                CubeCount::Static(n.div_ceil(cfg.bn) as u32, m.div_ceil(cfg.bm) as u32, 1),
                CubeDim::new_1d(cfg.cube_dim as u32),
                vec,
                h.clone().into_tensor_arg(),
                inv_rms.into_tensor_arg(),
                gamma.into_tensor_arg(),
                w.into_tensor_arg(),
                bias.into_tensor_arg(),
                add.clone().into_tensor_arg(),
                out.clone().into_tensor_arg(),
                cfg,
                dtype_to_storage_type(dtype),
            );
        }
    }
    (out, h)
}

/// [`linear_skinny`]'s settings for `m` input rows on a device of `caps`: no optional operand,
/// 16-bit operands (the caller sets its flags).
pub(crate) fn skinny_config(m: usize, caps: &DeviceCaps) -> SkinnyConfig {
    SkinnyConfig {
        rows: 4,
        m_tile: m.min(SKINNY_TILE_M),
        cube_dim: caps.cube_units,
        has_norm: false,
        has_bias: false,
        has_add: false,
        use_plane: caps.plane_ops,
        fp8: false,
        fp8_ptx: false,
    }
}

/// The tensors of a [`linear_skinny`] launch; those `cfg` leaves off are placeholders (any
/// tensor of the right element type), never read.
pub(crate) struct SkinnyOperands {
    pub(crate) x: CubeTensor,
    pub(crate) inv_rms: CubeTensor,
    pub(crate) gamma: CubeTensor,
    pub(crate) w: CubeTensor,
    /// `x`'s and `W`'s FP8 scales (`[M]`, `[N]` f32).
    pub(crate) scales: [CubeTensor; 2],
    pub(crate) bias: CubeTensor,
    pub(crate) add: CubeTensor,
    pub(crate) out: CubeTensor,
}

/// Launches [`linear_skinny`]: one cube of `cfg.cube_dim` units per `cfg.rows` output features,
/// vectors of `vec` operand elements; `dtypes`: the output's and the operands' storage.
pub(crate) fn launch_skinny(
    t: SkinnyOperands,
    cfg: SkinnyConfig,
    vec: usize,
    dtypes: [cubecl::ir::ElemType; 2],
) {
    let n = t.w.meta.shape()[0];
    let [x_scales, w_scales] = t.scales;
    // SAFETY: weight rows are clamped to `N - 1` and input rows to `M - 1` for loads; writes
    // are bounds-checked; `K` and the row pitches are multiples of the vector (callers' `vec`).
    unsafe {
        linear_skinny::launch_unchecked(
            &t.out.client,
            CubeCount::Static(n.div_ceil(cfg.rows) as u32, 1, 1),
            CubeDim::new_1d(cfg.cube_dim as u32),
            vec,
            t.x.into_tensor_arg(),
            t.inv_rms.into_tensor_arg(),
            t.gamma.into_tensor_arg(),
            t.w.into_tensor_arg(),
            x_scales.into_tensor_arg(),
            w_scales.into_tensor_arg(),
            t.bias.into_tensor_arg(),
            t.add.into_tensor_arg(),
            t.out.clone().into_tensor_arg(),
            cfg,
            dtypes,
        );
    }
}

/// Output tile of cubek's matmul assumed when counting cubes (its autotuned picks at decode
/// sizes covered 16 × 128 to 64 × 128 of the output per cube on an H100).
const MATMUL_TILE: [usize; 2] = [64, 128];

/// Largest `M` split along K: measured on an H100 at M = 64 only (down_proj 72 → 45 µs).
const SPLIT_K_MAX_M: usize = 64;

/// Number of K slices for the tensor-core path when the output alone gives too few cubes to fill
/// the device and K is long (`K ≥ 4N`: down_proj at decode sizes ran on 28 cubes of 132 SMs,
/// docs/BENCHMARKS.md): the smallest power of two that reaches one cube per multiprocessor, at
/// most 8, with each slice a multiple of 32 and at least 256 long. `None`: no split. Splitting
/// the square or wide projections (o_proj, qkv, gate/up) measured slower, so they are not split.
/// `BURN_NANOVLLM_SPLIT_K=0` switches it off, for benchmarks.
fn split_k(m: usize, n: usize, k: usize, caps: &DeviceCaps) -> Option<usize> {
    if Knobs::get().split_k_off || m > SPLIT_K_MAX_M || k < 4 * n {
        return None;
    }
    let cubes = m.div_ceil(MATMUL_TILE[0]) * n.div_ceil(MATMUL_TILE[1]);
    let mut splits = 1;
    while splits < 8 && cubes * splits < caps.multiprocessors {
        splits *= 2;
    }
    while splits > 1 && !(k.is_multiple_of(splits * 32) && k / splits >= 256) {
        splits /= 2;
    }
    (splits > 1).then_some(splits)
}

/// `y [M, N] = x [M, K] · w [N, K]ᵀ` as one batched matmul over `splits` K slices (views of the
/// same buffers: `x` as `[S, M, K/S]`, `wᵀ` as `[S, K/S, N]`) with f32 partial products, summed
/// over the slices in f32 and cast back to `x`'s dtype.
fn split_k_matmul(x: CubeTensor, w: CubeTensor, splits: usize) -> CubeTensor {
    let [m, k] = dims2(&x);
    let n = w.meta.shape()[0];
    let ks = k / splits;
    let dtype = x.dtype;
    let (x_row, w_row) = (x.meta.strides()[0], w.meta.strides()[0]);
    let mut lhs = x;
    lhs.meta = Box::new(Metadata::new(Shape::new([splits, m, ks]), [ks, x_row, 1]));
    let mut rhs = w;
    rhs.meta = Box::new(Metadata::new(Shape::new([splits, ks, n]), [ks, 1, w_row]));
    let partial = matmul::matmul(lhs, rhs, None, MatmulStrategy::default(), DType::F32)
        .expect("split-K matmul: cubek refused the strided operands");
    let total = CubeBackend::float_sum_dim(partial, 0);
    let y = CubeBackend::float_reshape(total, Shape::new([m, n]));
    if dtype == DType::F32 {
        y
    } else {
        CubeBackend::float_cast(y, dtype.into())
    }
}

fn dims2(t: &CubeTensor) -> [usize; 2] {
    let s = t.meta.shape();
    [s[0], s[1]]
}
