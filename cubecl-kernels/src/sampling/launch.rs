//! Host side of the sampler: argument checks, output allocation and launch geometry.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::{ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::{CubeCount, CubeDim};

use super::combine::{pick_exchanged, sample_combine, sample_shard_combine};
use super::kernel::{SampleConfig, mask_disallowed, sample_rows};
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
    let client = logits.client.clone();
    let (partial_v, partial_i, parts) = draw_rows(logits, &params_f, &params_u, &out, None);
    if parts > 1 {
        // SAFETY: the partials hold `parts` pairs of each of the `b` rows, the parameters `b`
        // rows (checked above), the output a slot for every row.
        unsafe {
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

/// Launches [`sample_rows`] over `logits [B ≥ 1, V ≥ 1]` (checked by the caller, as the
/// parameters' rows): the tokens into `out` when one part per row (and no `shard`), else
/// each part's best into the returned partials `[B, P]` (scores f32, tokens u32) and `P`.
/// `shard [2]` u32 = (first token id, slot): the logits are one vocabulary shard.
fn draw_rows(
    logits: CubeTensor,
    params_f: &CubeTensor,
    params_u: &CubeTensor,
    out: &CubeTensor,
    shard: Option<&CubeTensor>,
) -> (CubeTensor, CubeTensor, usize) {
    let [b, v] = [0, 1].map(|i| logits.meta.shape()[i]);
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
        shard: shard.is_some(),
    };
    let client = logits.client.clone();
    let partial = |dt: DType| {
        // Unused (never read or written) when the launch writes tokens.
        let rows = if parts > 1 || cfg.shard { b } else { 1 };
        empty_device_dtype(
            client.clone(),
            logits.device.clone(),
            Shape::new([rows, parts]),
            dt,
        )
    };
    let (partial_v, partial_i) = (partial(DType::F32), partial(DType::U32));
    // SAFETY: every index is below the row's vocabulary (`logits.shape(1)`), the parameter rows
    // were checked by the caller, the output has a slot for every row (`n ≥ b`), with parts or
    // a shard the partials have one for every cube (`[b, parts]`), and `shard` holds 2 words
    // (only read with `cfg.shard`).
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
            shard.unwrap_or(params_u).clone().into_tensor_arg(),
            cfg,
            dtype,
        );
    }
    (partial_v, partial_i, parts)
}

/// Launches a vocabulary shard's draw: [`sample_rows`] over `logits [B, V_shard]` (f32, f16
/// or bf16; rows without filters) with `shard [2]` u32 = (first token id, slot), then
/// [`sample_shard_combine`] into `exchange [B, 2·S]` f32 (zeroed by the caller; in place when
/// not shared, else on a copy), which it returns.
pub(crate) fn sample_shard(
    logits: CubeTensor,
    params_f: CubeTensor,
    params_u: CubeTensor,
    shard: CubeTensor,
    exchange: CubeTensor,
) -> CubeTensor {
    let logits = crate::unit_inner_stride(logits);
    let (params_f, params_u, shard) = (
        crate::unit_inner_stride(params_f),
        crate::unit_inner_stride(params_u),
        crate::unit_inner_stride(shard),
    );
    let exchange = crate::unit_inner_stride(exchange);
    let exchange = if exchange.can_mut() {
        exchange
    } else {
        exchange.copy()
    };
    let [b, v] = [0, 1].map(|i| logits.meta.shape()[i]);
    assert!(
        is_logits_dtype(logits.dtype)
            && params_f.dtype == DType::F32
            && params_u.dtype == DType::U32
            && shard.dtype == DType::U32
            && exchange.dtype == DType::F32,
        "sample_shard: logits must be f32, f16 or bf16, params_f and exchange f32, params_u \
         and shard u32 (got {:?}, {:?}, {:?}, {:?}, {:?})",
        logits.dtype,
        params_f.dtype,
        params_u.dtype,
        shard.dtype,
        exchange.dtype
    );
    assert!(
        params_f.meta.shape()[0] == b
            && params_u.meta.shape()[0] == b
            && shard.meta.shape()[0] == 2
            && exchange.meta.shape()[0] == b
            && exchange.meta.shape()[1] % 2 == 0,
        "sample_shard: {b} rows need [{b}, 4] parameters, a [2] shard and a [{b}, 2·S] \
         exchange (got {:?}, {:?}, {:?}, {:?})",
        params_f.meta.shape(),
        params_u.meta.shape(),
        shard.meta.shape(),
        exchange.meta.shape()
    );
    if b == 0 || v == 0 {
        return exchange;
    }
    let client = logits.client.clone();
    // Never written in shard mode (the pairs go to the partials).
    let unused = empty_device_dtype(
        client.clone(),
        logits.device.clone(),
        Shape::new([1]),
        DType::I32,
    );
    let (partial_v, partial_i, _) = draw_rows(logits, &params_f, &params_u, &unused, Some(&shard));
    // SAFETY: the partials hold a pair for every part of each of the `b` rows; `exchange` has
    // `b` rows of `2·S` columns and the caller's slot `shard[1]` is below `S`.
    unsafe {
        sample_shard_combine::launch_unchecked(
            &client,
            CubeCount::Static(b.div_ceil(COMBINE_UNITS) as u32, 1, 1),
            CubeDim::new_1d(COMBINE_UNITS as u32),
            partial_v.into_tensor_arg(),
            partial_i.into_tensor_arg(),
            shard.into_tensor_arg(),
            exchange.clone().into_tensor_arg(),
        );
    }
    exchange
}

/// Launches [`pick_exchanged`]: `exchange [B, 2·S]` f32 (summed over the group) → each row's
/// token into `out[..B]` (`out [n ≥ B]` i32, contiguous) in place, which it returns.
pub(crate) fn pick_exchanged_into(exchange: CubeTensor, out: CubeTensor) -> CubeTensor {
    let exchange = crate::unit_inner_stride(exchange);
    let [b, w] = [0, 1].map(|i| exchange.meta.shape()[i]);
    assert!(
        exchange.dtype == DType::F32
            && w >= 2
            && w % 2 == 0
            && out.dtype == DType::I32
            && out.is_contiguous()
            && out.meta.shape().num_dims() == 1
            && out.meta.shape()[0] >= b,
        "pick_exchanged: a [{b}, 2·S ≥ 2] f32 exchange into a contiguous [n ≥ {b}] i32 buffer \
         (got {:?} {:?}, {:?} {:?})",
        exchange.meta.shape(),
        exchange.dtype,
        out.meta.shape(),
        out.dtype
    );
    if b == 0 {
        return out;
    }
    let client = exchange.client.clone();
    // SAFETY: one unit per row below `b`, each reading its row's `w` columns and writing its
    // slot of `out` (`n ≥ b`).
    unsafe {
        pick_exchanged::launch_unchecked(
            &client,
            CubeCount::Static(b.div_ceil(COMBINE_UNITS) as u32, 1, 1),
            CubeDim::new_1d(COMBINE_UNITS as u32),
            exchange.into_tensor_arg(),
            out.clone().into_tensor_arg(),
        );
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
