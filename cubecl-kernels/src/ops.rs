//! The custom Burn backend ops: one extension trait, implemented for CubeCL backends (the
//! `Fusion` wrapper is generated: each op is an opaque deferred operation on the fusion stream).

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;

use crate::attention::{AttentionLaunch, AttentionPlan, QkvLayout, decode, prefill, store_kv};
use crate::device_read::{self, ReadSlot};
use crate::gpu_timeline::{self, MarkSlot};
use crate::host_write::{self, HostInts};
use crate::rms_norm_linear::{LinearOperands, launch as linear_launch};
use crate::sampling;
use crate::silu_mul::{self, SiluMulFlags};

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

    /// Attention of a step's tokens `q [T, heads, D]` over the caches → `[T, heads, D]`: rows
    /// `0..B` (`B` = `decode_context`'s length) one token per sequence through the decode
    /// kernel, and the prefill chunks (`cu_seqlens_q`, `tiles`) through the prefill kernel,
    /// into one output. Rows of context 0 and tiles of sequence −1 are padding: skipped, their
    /// rows left unwritten. Absent parts (`plan`) have placeholder tensors.
    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = paged_attention_meta)]
    fn paged_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        decode_tables: IntTensor<Self>,
        decode_context: IntTensor<Self>,
        prefill_tables: IntTensor<Self>,
        prefill_context: IntTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        tiles: IntTensor<Self>,
        plan: AttentionPlan,
    ) -> FloatTensor<Self>;

    /// Writes `values` into `dst` (`[n]` i32, contiguous) from `values.offset` on, in place, and
    /// returns it: the buffer keeps its address, so a captured graph that reads it sees them.
    #[fusion(meta = write_ints_meta)]
    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self>;

    /// `dst[pairs[2i]] = pairs[2i + 1]` for each pair of `pairs [2n]` (i32, indices below
    /// `dst`'s length), in place; returns `dst`, which keeps its address.
    #[fusion(meta = scatter_ints_meta)]
    fn scatter_ints(dst: IntTensor<Self>, pairs: IntTensor<Self>) -> IntTensor<Self>;

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

    /// [`KernelOps::sample`] writing its `[B]` tokens into `out[..B]` (`out [n ≥ B]` i32,
    /// contiguous) in place, and returning `out`: the buffer keeps its address, so a captured
    /// graph that reads it sees them.
    #[fusion(meta = sample_into_meta)]
    fn sample_into(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        out: IntTensor<Self>,
    ) -> IntTensor<Self>;

    /// Sets the tokens of `logits [B, V]` (f32) rows `rows [M]` (u32) whose bit is clear in
    /// `allowed [M, ⌈V/32⌉]` (u32) to −∞, in place when the buffer is not shared; returns the
    /// logits (see [`crate::sampling::mask_logits`]).
    #[fusion(meta = mask_logits_meta)]
    fn mask_logits(
        logits: FloatTensor<Self>,
        allowed: IntTensor<Self>,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self>;

    /// Starts copying `src` (`[n]` i32, contiguous) to the host: the copy is enqueued on the
    /// device's stream when the op runs and its future left in `read` (see
    /// [`crate::read_ints_async`]). Returns `src`.
    #[fusion(meta = read_ints_meta)]
    fn read_ints(src: IntTensor<Self>, read: ReadSlot) -> IntTensor<Self>;

    /// Records a CUDA event on the stream `anchor`'s work is ordered on, behind everything
    /// enqueued before, into `mark` (see [`crate::mark_stream`]; nothing off CUDA). Returns
    /// `anchor`.
    #[fusion(meta = mark_stream_meta)]
    fn mark_stream(anchor: IntTensor<Self>, mark: MarkSlot) -> IntTensor<Self>;
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

#[allow(clippy::too_many_arguments)]
fn paged_attention_meta(
    q: &TensorSpec,
    _k_cache: &TensorSpec,
    _v_cache: &TensorSpec,
    _decode_tables: &TensorSpec,
    _decode_context: &TensorSpec,
    _prefill_tables: &TensorSpec,
    _prefill_context: &TensorSpec,
    _cu_seqlens_q: &TensorSpec,
    _tiles: &TensorSpec,
    _plan: &AttentionPlan,
) -> TensorSpec {
    q.clone()
}

fn write_ints_meta(dst: &TensorSpec, _values: &HostInts) -> TensorSpec {
    dst.clone()
}

fn scatter_ints_meta(dst: &TensorSpec, _pairs: &TensorSpec) -> TensorSpec {
    dst.clone()
}

fn sample_into_meta(
    _logits: &TensorSpec,
    _params_f: &TensorSpec,
    _params_u: &TensorSpec,
    out: &TensorSpec,
) -> TensorSpec {
    out.clone()
}

fn mask_logits_meta(logits: &TensorSpec, _allowed: &TensorSpec, _rows: &TensorSpec) -> TensorSpec {
    logits.clone()
}

fn read_ints_meta(src: &TensorSpec, _read: &ReadSlot) -> TensorSpec {
    src.clone()
}

fn mark_stream_meta(anchor: &TensorSpec, _mark: &MarkSlot) -> TensorSpec {
    anchor.clone()
}

fn sample_meta(logits: &TensorSpec, _params_f: &TensorSpec, _params_u: &TensorSpec) -> TensorSpec {
    TensorSpec::new(Shape::new([logits.shape[0]]), burn::tensor::DType::I32)
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

    fn paged_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        decode_tables: IntTensor<Self>,
        decode_context: IntTensor<Self>,
        prefill_tables: IntTensor<Self>,
        prefill_context: IntTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        tiles: IntTensor<Self>,
        plan: AttentionPlan,
    ) -> FloatTensor<Self> {
        // The kernels index the caches contiguously; a pitched one (a 4-D CUDA tensor whose
        // head rows are not a power of two of bytes) is read through a contiguous copy
        // (`into_contiguous` returns a contiguous tensor itself).
        let (k_cache, v_cache) = (into_contiguous(k_cache), into_contiguous(v_cache));
        let launch = AttentionLaunch::new(q, &k_cache);
        if let Some(bound) = plan.decode_context_bound {
            decode::paged_decode(
                &launch,
                k_cache.clone(),
                v_cache.clone(),
                decode_tables,
                decode_context,
                bound,
                plan.scale,
            );
        }
        if let Some(rows) = plan.prefill_tile_rows {
            prefill::paged_prefill(
                &launch,
                k_cache,
                v_cache,
                prefill_tables,
                prefill_context,
                cu_seqlens_q,
                tiles,
                rows,
                plan.scale,
            );
        }
        launch.out
    }

    fn write_ints(dst: IntTensor<Self>, values: HostInts) -> IntTensor<Self> {
        host_write::write_cube(dst, values.offset, &values.values)
    }

    fn scatter_ints(dst: IntTensor<Self>, pairs: IntTensor<Self>) -> IntTensor<Self> {
        host_write::scatter_cube(dst, pairs)
    }

    fn sample(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
    ) -> IntTensor<Self> {
        sampling::launch::sample(logits, params_f, params_u, None)
    }

    fn sample_into(
        logits: FloatTensor<Self>,
        params_f: FloatTensor<Self>,
        params_u: IntTensor<Self>,
        out: IntTensor<Self>,
    ) -> IntTensor<Self> {
        sampling::launch::sample(logits, params_f, params_u, Some(out))
    }

    fn mask_logits(
        logits: FloatTensor<Self>,
        allowed: IntTensor<Self>,
        rows: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        sampling::launch::mask_logits(logits, allowed, rows)
    }

    fn read_ints(src: IntTensor<Self>, read: ReadSlot) -> IntTensor<Self> {
        device_read::start_cube(&src, &read);
        src
    }

    fn mark_stream(anchor: IntTensor<Self>, mark: MarkSlot) -> IntTensor<Self> {
        gpu_timeline::record(&anchor, &mark);
        anchor
    }
}
