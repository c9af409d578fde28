//! The custom Burn backend ops: one extension trait, implemented for CubeCL backends (the
//! `Fusion` wrapper is generated: each op is an opaque deferred operation on the fusion stream).

use std::sync::Arc;

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;

use crate::attention::{QkvLayout, TileCache, decode, prefill, store_kv};
use crate::host_write;
use crate::rms_norm_linear::launch as linear_launch;
use crate::sampling;
use crate::silu_mul::{self, SiluMulFlags};

/// Host-side facts the decode kernel is launched from (from [`crate::AttentionMetadata`]).
#[derive(Clone, Debug)]
pub struct DecodePlan {
    /// Longest context the launch geometry covers (the context split depends on it).
    pub context_bound: usize,
    /// Softmax scale.
    pub scale: f32,
}

/// Host-side facts the prefill kernel is launched from (from [`crate::AttentionMetadata`]).
#[derive(Clone, Debug)]
pub struct PrefillPlan {
    /// New tokens per (prefill) sequence: they define the query tiles.
    pub query_lens: Arc<Vec<usize>>,
    /// The step's tile list, built by the first launch.
    pub tiles: Arc<TileCache>,
    /// Softmax scale.
    pub scale: f32,
}

/// Host values to write into a device buffer in place (see [`crate::write_ints`]).
#[derive(Clone, Debug)]
pub struct HostInts(pub Arc<Vec<i32>>);

/// Our fused ops as a Burn backend extension. Call them through the functions of this crate
/// (which check arguments and fall back to plain Burn off CubeCL devices), not directly.
#[backend_extension(Cube, Fusion)]
pub trait KernelOps: Backend {
    /// `h = x (+ residual)`, `y = rms_norm(h, gamma)·Wᵀ (+ b)`; returns `(y [M, N], h [M, K])`.
    /// `operands` ([`LinearOperands`] bits) says which of `residual`, `gamma` and `bias` are
    /// real; the others are placeholders (any tensor) and are never read. With
    /// [`LinearOperands::ADD_OUT`], `residual [M, N]` is added to `y` instead.
    #[fusion(meta = fused_linear_meta)]
    fn fused_linear(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        operands: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>);

    /// `silu(gate)·up` of `gate_up [T, 2·I]` → `[T, I]`, its rows first scaled by `inv_rms(x)`
    /// (`x [T, K]`) and biased (`bias [2·I]`) as `flags` says; absent operands are placeholders.
    #[fusion(meta = silu_mul_meta)]
    fn silu_mul(
        gate_up: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        flags: SiluMulFlags,
    ) -> FloatTensor<Self>;

    #[allow(clippy::too_many_arguments)]
    /// Norm + RoPE of q and k, and the KV write (see `attention::store_kv`): returns
    /// `(q_out [T, heads·D], k_cache, v_cache)`, the caches written in place. `x` and
    /// `row_bias` carry the deferred row scale (`layout.row_scale`); `eps` = (q/k norm, row
    /// scale).
    #[fusion(meta = rope_store_kv_meta)]
    fn rope_store_kv(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        x: FloatTensor<Self>,
        row_bias: FloatTensor<Self>,
        q_norm: FloatTensor<Self>,
        k_norm: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
        slots: IntTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        layout: QkvLayout,
        eps: [f32; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Decode attention of `q [B, heads, D]` (one token per sequence) over the caches →
    /// `[B, heads, D]`.
    #[fusion(meta = paged_decode_meta)]
    fn paged_decode(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        block_tables: IntTensor<Self>,
        context_lens: IntTensor<Self>,
        plan: DecodePlan,
    ) -> FloatTensor<Self>;

    /// Prefill attention of `q [T, heads, D]` (sequences' runs at `cu_seqlens_q`) over the
    /// caches → `[T, heads, D]`.
    #[fusion(meta = paged_prefill_meta)]
    fn paged_prefill(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        block_tables: IntTensor<Self>,
        context_lens: IntTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        plan: PrefillPlan,
    ) -> FloatTensor<Self>;

    /// Writes `values` into `dst` (`[n]` i32, contiguous) in place and returns it: the buffer
    /// keeps its address, so a captured graph that reads it sees the new values.
    #[fusion(meta = write_ints_meta)]
    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self>;

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
}

#[allow(clippy::too_many_arguments)]
fn rope_store_kv_meta(
    _q: &TensorSpec,
    _k: &TensorSpec,
    _v: &TensorSpec,
    _x: &TensorSpec,
    _row_bias: &TensorSpec,
    _q_norm: &TensorSpec,
    _k_norm: &TensorSpec,
    _cos: &TensorSpec,
    _sin: &TensorSpec,
    _positions: &TensorSpec,
    slots: &TensorSpec,
    k_cache: &TensorSpec,
    v_cache: &TensorSpec,
    layout: &QkvLayout,
    _eps: &[f32; 2],
) -> (TensorSpec, TensorSpec, TensorSpec) {
    let q_out = TensorSpec::new(
        Shape::new([slots.shape[0], layout.heads * layout.head_dim]),
        k_cache.dtype,
    );
    (q_out, k_cache.clone(), v_cache.clone())
}

fn silu_mul_meta(
    gate_up: &TensorSpec,
    _x: &TensorSpec,
    _bias: &TensorSpec,
    _eps: &f32,
    _flags: &SiluMulFlags,
) -> TensorSpec {
    TensorSpec::new(
        Shape::new([gate_up.shape[0], gate_up.shape[1] / 2]),
        gate_up.dtype,
    )
}

fn paged_decode_meta(
    q: &TensorSpec,
    _k_cache: &TensorSpec,
    _v_cache: &TensorSpec,
    _block_tables: &TensorSpec,
    _context_lens: &TensorSpec,
    _plan: &DecodePlan,
) -> TensorSpec {
    q.clone()
}

fn paged_prefill_meta(
    q: &TensorSpec,
    _k_cache: &TensorSpec,
    _v_cache: &TensorSpec,
    _block_tables: &TensorSpec,
    _context_lens: &TensorSpec,
    _cu_seqlens_q: &TensorSpec,
    _plan: &PrefillPlan,
) -> TensorSpec {
    q.clone()
}

fn write_ints_meta(dst: &TensorSpec, _values: &HostInts) -> TensorSpec {
    dst.clone()
}

fn sample_meta(logits: &TensorSpec, _params_f: &TensorSpec, _params_u: &TensorSpec) -> TensorSpec {
    TensorSpec::new(Shape::new([logits.shape[0]]), burn::tensor::DType::I32)
}

/// Which optional operands of [`KernelOps::fused_linear`] are present.
pub struct LinearOperands;

impl LinearOperands {
    /// `residual` is added to `x`.
    pub const RESIDUAL: u32 = 1;
    /// `gamma` is an RMSNorm weight.
    pub const NORM: u32 = 2;
    /// `bias` is added.
    pub const BIAS: u32 = 4;
    /// `residual` (`[M, N]`) is added to the output (exclusive with `RESIDUAL`).
    pub const ADD_OUT: u32 = 8;
}

fn fused_linear_meta(
    x: &TensorSpec,
    _residual: &TensorSpec,
    _gamma: &TensorSpec,
    weight: &TensorSpec,
    _bias: &TensorSpec,
    _eps: &f32,
    _operands: &u32,
) -> (TensorSpec, TensorSpec) {
    let y = TensorSpec::new(Shape::new([x.shape[0], weight.shape[0]]), x.dtype);
    (y, x.clone())
}

impl KernelOps for CubeBackend {
    fn fused_linear(
        x: FloatTensor<Self>,
        residual: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        operands: u32,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let has = |bit: u32| operands & bit != 0;
        let (residual, add) = if has(LinearOperands::ADD_OUT) {
            (None, Some(residual))
        } else {
            (has(LinearOperands::RESIDUAL).then_some(residual), None)
        };
        linear_launch::fused_linear(
            x,
            residual,
            has(LinearOperands::NORM).then_some(gamma),
            weight,
            has(LinearOperands::BIAS).then_some(bias),
            add,
            eps,
        )
    }

    fn silu_mul(
        gate_up: FloatTensor<Self>,
        x: FloatTensor<Self>,
        bias: FloatTensor<Self>,
        eps: f32,
        flags: SiluMulFlags,
    ) -> FloatTensor<Self> {
        silu_mul::launch(gate_up, x, bias, eps, flags)
    }

    fn rope_store_kv(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        x: FloatTensor<Self>,
        row_bias: FloatTensor<Self>,
        q_norm: FloatTensor<Self>,
        k_norm: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        positions: IntTensor<Self>,
        slots: IntTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        layout: QkvLayout,
        eps: [f32; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        store_kv::rope_store_kv(
            q, k, v, x, row_bias, q_norm, k_norm, cos, sin, positions, slots, k_cache, v_cache,
            layout, eps,
        )
    }

    fn paged_decode(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        block_tables: IntTensor<Self>,
        context_lens: IntTensor<Self>,
        plan: DecodePlan,
    ) -> FloatTensor<Self> {
        decode::paged_decode(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            plan.context_bound,
            plan.scale,
        )
    }

    fn paged_prefill(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        block_tables: IntTensor<Self>,
        context_lens: IntTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        plan: PrefillPlan,
    ) -> FloatTensor<Self> {
        prefill::paged_prefill(
            q,
            k_cache,
            v_cache,
            block_tables,
            context_lens,
            cu_seqlens_q,
            plan,
        )
    }

    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self> {
        host_write::write_cube(dst, &values.0)
    }

    fn sample(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
    ) -> IntTensor<Self> {
        sampling::launch::sample(logits, params_f, params_u)
    }
}
