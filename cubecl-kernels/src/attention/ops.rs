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
                plan.order,
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
                plan.order,
            );
        }
        launch.out
    }
}
