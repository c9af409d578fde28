//! [`AttentionOps`]: the backend extension of the KV write and paged attention, and its CubeCL
//! dispatch.

use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    Backend, backend_extension,
    tensor::{FloatTensor, IntTensor},
};
use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;

use super::kv_cache::{fp8_bytes, fp8_carrier};
use super::{AttentionLaunch, AttentionPlan, QkvLayout, decode, prefill, store_kv};

/// The KV write and paged attention as a Burn backend extension (the `Fusion` wrapper is generated:
/// each op is an opaque deferred operation on the fusion stream). Call it through this module's
/// functions, which check arguments and fall back to plain Burn off CubeCL devices.
#[backend_extension(Cube, Fusion)]
pub trait AttentionOps: Backend {
    #[allow(clippy::too_many_arguments)]
    /// Norm + RoPE of q and k, and the KV write (see `attention::store_kv`): returns
    /// `(q_out [T, heads·D], k_cache, v_cache)`, the caches written in place. `x` and
    /// `row_bias` carry the deferred row scale (`layout.row_scale`); `eps` = (q/k norm, row
    /// scale). `kv_scales [2·kv_heads]` f32: an FP8 cache's scales (`layout.kv_dtype`), else a
    /// placeholder.
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
        kv_scales: FloatTensor<Self>,
        layout: QkvLayout,
        eps: [f32; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>);

    /// Attention of a step's tokens `q [T, heads, D]` over the caches → `[T, heads, D]`: rows
    /// `0..B` (`B` = `decode_context`'s length) one token per sequence through the decode
    /// kernel, and the prefill chunks (`cu_seqlens_q`, `tiles`) through the prefill kernel,
    /// into one output. Rows of context 0 and tiles of sequence −1 are padding: skipped, their
    /// rows left unwritten. Absent parts (`plan`) have placeholder tensors, and so has
    /// `kv_scales` without an FP8 cache (`plan.kv_dtype`).
    #[allow(clippy::too_many_arguments)]
    #[fusion(meta = paged_attention_meta)]
    fn paged_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        kv_scales: FloatTensor<Self>,
        decode_tables: IntTensor<Self>,
        decode_context: IntTensor<Self>,
        prefill_tables: IntTensor<Self>,
        prefill_context: IntTensor<Self>,
        cu_seqlens_q: IntTensor<Self>,
        tiles: IntTensor<Self>,
        plan: AttentionPlan,
    ) -> FloatTensor<Self>;
}

#[allow(clippy::too_many_arguments)]
fn rope_store_kv_meta(
    _q: &TensorSpec,
    k: &TensorSpec,
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
    _kv_scales: &TensorSpec,
    layout: &QkvLayout,
    _eps: &[f32; 2],
) -> (TensorSpec, TensorSpec, TensorSpec) {
    let q_out = TensorSpec::new(
        Shape::new([slots.shape[0], layout.heads * layout.head_dim]),
        k.dtype,
    );
    (q_out, k_cache.clone(), v_cache.clone())
}

#[allow(clippy::too_many_arguments)]
fn paged_attention_meta(
    q: &TensorSpec,
    _k_cache: &TensorSpec,
    _v_cache: &TensorSpec,
    _kv_scales: &TensorSpec,
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

impl AttentionOps for CubeBackend {
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
        kv_scales: FloatTensor<Self>,
        layout: QkvLayout,
        eps: [f32; 2],
    ) -> (FloatTensor<Self>, FloatTensor<Self>, FloatTensor<Self>) {
        let kv = layout.kv_dtype;
        let (q_out, k_cache, v_cache) = store_kv::rope_store_kv(
            q,
            k,
            v,
            x,
            row_bias,
            q_norm,
            k_norm,
            cos,
            sin,
            positions,
            slots,
            fp8_bytes(k_cache, kv),
            fp8_bytes(v_cache, kv),
            kv_scales,
            layout,
            eps,
        );
        (q_out, fp8_carrier(k_cache, kv), fp8_carrier(v_cache, kv))
    }

    fn paged_attention(
        q: FloatTensor<Self>,
        k_cache: FloatTensor<Self>,
        v_cache: FloatTensor<Self>,
        kv_scales: FloatTensor<Self>,
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
        let kv = plan.kv_dtype;
        let k_cache = fp8_bytes(into_contiguous(k_cache), kv);
        let v_cache = fp8_bytes(into_contiguous(v_cache), kv);
        let launch = AttentionLaunch::new(q, &k_cache);
        if let Some(bound) = plan.decode_context_bound {
            decode::paged_decode(
                &launch,
                k_cache.clone(),
                v_cache.clone(),
                kv_scales.clone(),
                decode_tables,
                decode_context,
                bound,
                &plan,
            );
        }
        if let Some(rows) = plan.prefill_tile_rows {
            prefill::paged_prefill(
                &launch,
                k_cache,
                v_cache,
                kv_scales,
                prefill_tables,
                prefill_context,
                cu_seqlens_q,
                tiles,
                rows,
                &plan,
            );
        }
        launch.out
    }
}
