//! [`SamplingOps`]: the backend extension of the sampler and the token masks, and its CubeCL
//! dispatch.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;

use super::launch;

/// The sampler and the token masks as a Burn backend extension (the `Fusion` wrapper is generated:
/// each op is an opaque deferred operation on the fusion stream). Call it through this module's
/// functions, which check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait SamplingOps: Backend {
    /// One token per row of `logits [B, V]` (f32): greedy where `params_f[r, 0] ≤ 0`, else a
    /// seeded draw after min-p, top-k and top-p filtering (see [`crate::sampling`]).
    /// `params_f [B, 4]` f32 = (temperature, top_p, min_p, 0); `params_u [B, 4]` u32 =
    /// (top_k, seed_lo, seed_hi, counter). Returns `[B]` i32.
    #[fusion(meta = sample_meta)]
    fn sample(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
    ) -> IntTensor<Self>;

    /// [`SamplingOps::sample`] writing its `[B]` tokens into `out[..B]` (`out [n ≥ B]` i32,
    /// contiguous) in place, and returning `out`: the buffer keeps its address, so a captured
    /// graph that reads it sees them.
    #[fusion(meta = sample_into_meta)]
    fn sample_into(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        out: IntTensor<Self>,
    ) -> IntTensor<Self>;

    /// A vocabulary shard's part of [`SamplingOps::sample`] (rows without filters):
    /// `logits [B, V_shard]` are tokens `shard[0]..` (`shard [2]` u32 = (first token id,
    /// slot)); each row's best (score, global token) goes into slot `shard[1]` of
    /// `exchange [B, 2·S]` f32 (scores in columns `0..S`, tokens in `S..2S`; the caller zeroes
    /// it), in place when the buffer is not shared; returns `exchange`.
    #[fusion(meta = sample_shard_meta)]
    fn sample_shard(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        shard: IntTensor<Self>,
        exchange: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Each row's token of a group-summed `exchange [B, 2·S]` (see
    /// [`SamplingOps::sample_shard`]) into `out[..B]` (`out [n ≥ B]` i32, contiguous) in
    /// place; returns `out`.
    #[fusion(meta = pick_exchanged_meta)]
    fn pick_exchanged_into(exchange: FloatTensor<Self>, out: IntTensor<Self>) -> IntTensor<Self>;

    /// Sets the tokens of `logits [B, V]` (f32) rows `rows [M]` (u32) whose bit is clear in
    /// `allowed [M, ⌈V/32⌉]` (u32) to −∞, in place when the buffer is not shared; returns the
    /// logits (see [`crate::sampling::mask_logits`]).
    #[fusion(meta = mask_logits_meta)]
    fn mask_logits(
        logits: FloatTensor<Self>,
        allowed: IntTensor<Self>,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self>;
}

fn sample_meta(logits: &TensorSpec, _params_f: &TensorSpec, _params_u: &TensorSpec) -> TensorSpec {
    TensorSpec::new(Shape::new([logits.shape[0]]), burn::tensor::DType::I32)
}

fn sample_into_meta(
    _logits: &TensorSpec,
    _params_f: &TensorSpec,
    _params_u: &TensorSpec,
    out: &TensorSpec,
) -> TensorSpec {
    out.clone()
}

fn sample_shard_meta(
    _logits: &TensorSpec,
    _params_f: &TensorSpec,
    _params_u: &TensorSpec,
    _shard: &TensorSpec,
    exchange: &TensorSpec,
) -> TensorSpec {
    exchange.clone()
}

fn pick_exchanged_meta(_exchange: &TensorSpec, out: &TensorSpec) -> TensorSpec {
    out.clone()
}

fn mask_logits_meta(logits: &TensorSpec, _allowed: &TensorSpec, _rows: &TensorSpec) -> TensorSpec {
    logits.clone()
}

impl SamplingOps for CubeBackend {
    fn sample(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
    ) -> IntTensor<Self> {
        launch::sample(logits, params_f, params_u, None)
    }

    fn sample_into(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        out: IntTensor<Self>,
    ) -> IntTensor<Self> {
        launch::sample(logits, params_f, params_u, Some(out))
    }

    fn sample_shard(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        shard: IntTensor<Self>,
        exchange: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        launch::sample_shard(logits, params_f, params_u, shard, exchange)
    }

    fn pick_exchanged_into(exchange: FloatTensor<Self>, out: IntTensor<Self>) -> IntTensor<Self> {
        launch::pick_exchanged_into(exchange, out)
    }

    fn mask_logits(
        logits: FloatTensor<Self>,
        allowed: IntTensor<Self>,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        launch::mask_logits(logits, allowed, rows)
    }
}
