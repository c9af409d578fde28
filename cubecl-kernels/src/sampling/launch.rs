//! Host side of the sampler: argument checks, output allocation and launch geometry.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use super::kernel::{SampleConfig, mask_disallowed, sample_combine, sample_rows};
use crate::device_caps::DeviceCaps;

/// Units per cube (a row, or a part of one) on plane devices, or the device's most if fewer:
/// each unit draws ~150 tokens of a 152k vocabulary, two logarithms each, so a row needs many
/// units in flight. On the H100, 1,024 against 256 made bench.py 9 % faster (`docs/BENCHMARKS.md`).
const MAX_UNITS: usize = 1024;

/// Launches [`sample_rows`] (and [`sample_combine`] when rows are split): `logits [B, V]` f32,
/// f16 or bf16, `params_f [B, 4]` f32, `params_u [B, 4]` u32 → `tokens [B]` i32, or into
/// `out[..B]` (`out [n ≥ B]` i32, contiguous) in place.
pub(crate) fn sample(
    logits: CubeTensor,
    params_f: CubeTensor,
    params_u: CubeTensor,
    out: Option<CubeTensor>,
) -> CubeTensor {
    let logits = crate::unit_inner_stride(logits);
    let (params_f, params_u) = (
        crate::unit_inner_stride(params_f),
        crate::unit_inner_stride(params_u),
    );
    let [b, _] = [0, 1].map(|i| logits.meta.shape()[i]);
    assert!(
        is_logits_dtype(logits.dtype)
            && params_f.dtype == DType::F32
            && params_u.dtype == DType::U32,
        "sample: logits must be f32, f16 or bf16, params_f f32, params_u u32 (got {:?}, {:?}, {:?})",
        logits.dtype,
        params_f.dtype,
        params_u.dtype
    );
    assert!(
        params_f.meta.shape()[0] == b && params_u.meta.shape()[0] == b,
        "sample: {b} rows of logits but {} and {} rows of parameters",
        params_f.meta.shape()[0],
        params_u.meta.shape()[0]
    );
    let out = match out {
        Some(out) => {
            assert!(
                out.dtype == DType::I32
                    && out.is_contiguous()
                    && out.meta.shape().num_dims() == 1
                    && out.meta.shape()[0] >= b,
                "sample: the output must be a contiguous [n >= {b}] i32 buffer (got {:?} {:?})",
                out.meta.shape(),
                out.dtype
            );
            out
        }
        None => empty_device_dtype(
            logits.client.clone(),
            logits.device.clone(),
            Shape::new([b]),
            DType::I32,
        ),
    };
    let v = logits.meta.shape()[1];
    assert!(v > 0, "sample: logits of an empty vocabulary");
    if b == 0 {
        return out;
    }
    let caps = DeviceCaps::of(&logits.client);
    let units = if caps.plane_ops {
        let wanted = crate::knobs::Knobs::get().sample_units.unwrap_or(MAX_UNITS);
        wanted.next_power_of_two().min(caps.max_cube_units)
    } else {
        caps.cube_units
    };
    // Parts per row: enough cubes for `FILL` per multiprocessor, each part at least
    // `MIN_PART_UNIT_TOKENS` tokens per unit.
    let parts = match crate::knobs::Knobs::get().sample_fill.unwrap_or(FILL) {
        0 => 1,
        fill => (fill * caps.multiprocessors)
            .div_ceil(b)
            .min(v / (MIN_PART_UNIT_TOKENS * units))
            .clamp(1, MAX_PARTS),
    };
    let cfg = SampleConfig {
        units,
        use_plane: caps.plane_ops,
    };
    let client = logits.client.clone();
    let partial = |dt: DType| {
        // Unused (never read or written) when the launch has one part per row.
        let rows = if parts > 1 { b } else { 1 };
        empty_device_dtype(
            client.clone(),
            logits.device.clone(),
            Shape::new([rows, parts]),
            dt,
        )
    };
    let (partial_v, partial_i) = (partial(DType::F32), partial(DType::U32));
    // SAFETY: every index is below the row's vocabulary (`logits.shape(1)`), the parameter rows
    // were checked above, the output has a slot for every row (`n ≥ b`), and with parts the
    // partials have one for every cube (`[b, parts]`).
    let dtype = dtype_to_storage_type(logits.dtype);
    unsafe {
        sample_rows::launch_unchecked(
            &client,
            CubeCount::Static(b as u32, parts as u32, 1),
            CubeDim::new_1d(units as u32),
            logits.into_tensor_arg(),
            params_f.clone().into_tensor_arg(),
            params_u.clone().into_tensor_arg(),
            out.clone().into_tensor_arg(),
            partial_v.clone().into_tensor_arg(),
            partial_i.clone().into_tensor_arg(),
            cfg,
            dtype,
        );
        if parts > 1 {
            sample_combine::launch_unchecked(
                &client,
                CubeCount::Static(b.div_ceil(COMBINE_UNITS) as u32, 1, 1),
                CubeDim::new_1d(COMBINE_UNITS as u32),
                partial_v.into_tensor_arg(),
                partial_i.into_tensor_arg(),
                params_f.into_tensor_arg(),
                params_u.into_tensor_arg(),
                out.clone().into_tensor_arg(),
                v,
            );
        }
    }
    out
}

/// Cubes per multiprocessor the row splits aim for (`BURN_NANOVLLM_SAMPLE_FILL`).
const FILL: usize = 1;

/// Most parts a row's draw is split into.
const MAX_PARTS: usize = 32;

/// Fewest tokens per unit in a part: below it the cube's reductions outweigh its share.
const MIN_PART_UNIT_TOKENS: usize = 8;

/// Units per cube of [`sample_combine`]: one per row.
const COMBINE_UNITS: usize = 64;

/// Units per cube of [`mask_disallowed`]: one per token.
const MASK_UNITS: u32 = 256;

/// Launches [`mask_disallowed`] over `logits [B, V]` f32, f16 or bf16 (in place when the buffer
/// is not shared, else on a copy): `allowed [M, ⌈V/32⌉]` u32 bitmasks of rows `rows [M]` u32
/// (each below `B`, checked by the caller).
pub(crate) fn mask_logits(logits: CubeTensor, allowed: CubeTensor, rows: CubeTensor) -> CubeTensor {
    let logits = crate::unit_inner_stride(logits);
    let logits = if logits.can_mut() {
        logits
    } else {
        logits.copy()
    };
    let (allowed, rows) = (
        crate::unit_inner_stride(allowed),
        crate::unit_inner_stride(rows),
    );
    let v = logits.meta.shape()[1];
    let m = rows.meta.shape()[0];
    assert!(
        is_logits_dtype(logits.dtype) && allowed.dtype == DType::U32 && rows.dtype == DType::U32,
        "mask_logits: logits must be f32, f16 or bf16, allowed and rows u32 (got {:?}, {:?}, {:?})",
        logits.dtype,
        allowed.dtype,
        rows.dtype
    );
    assert!(
        allowed.meta.shape()[0] == m && allowed.meta.shape()[1] == super::mask_words(v),
        "mask_logits: {m} rows of a {v}-token vocabulary need [{m}, {}] words, got {:?}",
        super::mask_words(v),
        allowed.meta.shape()
    );
    if m == 0 || v == 0 {
        return logits;
    }
    // SAFETY: every unit checks its token against `V`; `allowed` has a word for every token
    // of each of its `M` rows (checked above); `rows` holds `M` row indices below `B`.
    let client = logits.client.clone();
    let dtype = dtype_to_storage_type(logits.dtype);
    unsafe {
        mask_disallowed::launch_unchecked(
            &client,
            CubeCount::Static(v.div_ceil(MASK_UNITS as usize) as u32, m as u32, 1),
            CubeDim::new_1d(MASK_UNITS),
            logits.clone().into_tensor_arg(),
            allowed.into_tensor_arg(),
            rows.into_tensor_arg(),
            dtype,
        );
    }
    logits
}

/// The dtypes the sampler and the masks read logits in: a model's float dtypes.
pub(super) fn is_logits_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
}
