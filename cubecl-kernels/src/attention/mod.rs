//! Paged attention: the KV-cache write (with RoPE and Qwen3's q/k norm fused in) and attention
//! over a variable-length batch whose keys live in a block-paged cache — prefill (any number of
//! new tokens per sequence, over a cached prefix) and decode (one token per sequence, split
//! across cubes for long contexts).
//!
//! The cache's block size is a comptime parameter of every attention kernel: a key's block and
//! slot (`key / block_size`, `key % block_size`, per key or per 16-byte vector) are then shifts
//! and masks, where a runtime block size made them integer divisions (on the H100, decode at 256
//! × 16k with Qwen3's heads went from 8,060 to 5,607 µs, prefill 8–10 % faster). An engine has
//! one block size, so this compiles one variant.

pub(crate) mod decode;
pub(crate) mod kv_cache;
mod kv_read;
mod metadata;
mod mma_tile;
mod ops;
pub(crate) mod prefill;
pub mod reference;
pub(crate) mod store_kv;

use burn::backend::{Dispatch, DispatchDevice, DispatchTensor};
use burn::tensor::Shape;
use burn::tensor::{DType, Tensor};
use burn_cubecl::{kernel::into_contiguous, ops::numeric::empty_device_dtype, tensor::CubeTensor};
use cubecl::prelude::AddressType;

pub use kv_cache::{FP8_CARRIER, KvCacheDtype, KvQuant, LayerKvCache};
pub use metadata::{
    AttentionMetadata, DecodeTensors, MetadataTensors, PrefillTensors, TileCache, prefill_tiles,
};
pub use store_kv::QkvLayout;

pub use self::ops::AttentionOps;
use crate::KernelError;
use crate::device_caps::DeviceCaps;
use crate::row_scale::RowScale;

/// Rotary tables: `cos`, `sin` `[max_positions, head_dim / 2]`, f32.
#[derive(Clone, Copy, Debug)]
pub struct Rope<'a> {
    /// `cos(p · θ^(−2j/D))`.
    pub cos: &'a Tensor<2>,
    /// `sin(p · θ^(−2j/D))`.
    pub sin: &'a Tensor<2>,
}

/// Host-side facts an attention launch needs besides its tensors (from
/// [`crate::AttentionMetadata`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionPlan {
    /// Softmax scale.
    pub scale: f32,
    /// With decode rows: the longest context their launch geometry covers (the context split
    /// depends on it). `None`: no decode part (its tensors are placeholders).
    pub decode_context_bound: Option<usize>,
    /// With prefill chunks: queries per tile of the tile list. `None`: no prefill part.
    pub prefill_tile_rows: Option<usize>,
    /// How the kernels reduce ([`crate::ReductionOrder::BatchInvariant`]: decode splits from
    /// each row's own context only, prefill tiles shaped for one-query rows).
    pub order: crate::ReductionOrder,
    /// How the cache stores keys and values (FP8: dequantised by the scales as it is read).
    pub kv_dtype: KvCacheDtype,
}

/// Qwen3's per-head RMSNorm of queries and keys (weights `[head_dim]`).
#[derive(Clone, Copy, Debug)]
pub struct QkNorm<'a> {
    /// Query norm weight.
    pub q: &'a Tensor<1>,
    /// Key norm weight.
    pub k: &'a Tensor<1>,
    /// Epsilon.
    pub eps: f64,
}

/// Writes the new tokens' keys and values into the paged cache (`meta.slot_mapping`, −1 = skip).
///
/// `k`, `v`: `[num_tokens, num_kv_heads, head_dim]`, in the cache's dtype.
pub fn store_kv(cache: &mut LayerKvCache, k: Tensor<3>, v: Tensor<3>, meta: &AttentionMetadata) {
    let [t, kv_heads, d] = k.dims();
    check_cache(cache, kv_heads, d, k.dtype(), meta).unwrap_or_else(|e| panic!("store_kv: {e}"));
    if !crate::runs_kernels(&k) {
        return reference::store_kv(cache, k, v, meta);
    }
    let layout = QkvLayout {
        heads: 0,
        kv_heads,
        head_dim: d,
        offsets: [0; 3],
        rope: false,
        qk_norm: false,
        row_scale: false,
        row_bias: false,
        kv_dtype: cache.kv_dtype(),
    };
    let k = k.reshape([t, kv_heads * d]);
    let v = v.reshape([t, kv_heads * d]);
    launch_store(cache, k.clone(), k, v, None, None, None, layout, meta);
}

/// The KV write of a Qwen layer with its query/key preprocessing: splits the merged projection
/// `qkv [T, (heads + 2·kv_heads)·D]`, applies `qk_norm` (Qwen3) and RoPE at `meta.positions` to
/// q and k, stores k and v in `cache` at `meta.slot_mapping` and returns the queries
/// `[T, heads, D]`.
///
/// With `row_scale`, `qkv` is the unscaled product of the layer input (the input norm's gain
/// folded into the weight, no bias) and the projection is completed here first:
/// `inv_rms(x)·qkv (+ b)` (see [`crate::row_scale`]).
#[allow(clippy::too_many_arguments)]
pub fn rope_store_kv(
    qkv: Tensor<2>,
    heads: usize,
    row_scale: Option<RowScale<'_>>,
    qk_norm: Option<QkNorm<'_>>,
    rope: Rope<'_>,
    meta: &AttentionMetadata,
    cache: &mut LayerKvCache,
) -> Tensor<3> {
    let (kv_heads, d) = (cache.kv_heads(), cache.head_dim());
    let [t, width] = qkv.dims();
    let check = || -> Result<(), KernelError> {
        check_cache(cache, kv_heads, d, qkv.dtype(), meta)?;
        if width != (heads + 2 * kv_heads) * d || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::invalid(format!(
                "qkv has width {width}; expected ({heads} + 2·{kv_heads})·{d} with heads a multiple of kv heads"
            )));
        }
        if t != meta.num_tokens() {
            return Err(KernelError::invalid(format!(
                "qkv has {t} rows, the metadata {} tokens",
                meta.num_tokens()
            )));
        }
        for (name, table) in [("cos", rope.cos), ("sin", rope.sin)] {
            if table.dtype() != DType::F32 || table.dims() != rope.cos.dims() {
                return Err(KernelError::invalid(format!(
                    "RoPE table {name} has dtype {:?} and shape {:?}; expected f32 tables of one shape",
                    table.dtype(),
                    table.dims()
                )));
            }
        }
        if rope.cos.dims()[1] != d / 2 || rope.cos.dims()[0] <= meta.max_position {
            return Err(KernelError::invalid(format!(
                "RoPE tables of shape {:?} do not cover head_dim {d} and position {}",
                rope.cos.dims(),
                meta.max_position
            )));
        }
        Ok(())
    };
    check()
        .and_then(|()| match &row_scale {
            Some(s) => s.check(t, width, qkv.dtype()),
            None => Ok(()),
        })
        .unwrap_or_else(|e| panic!("rope_store_kv: {e}"));
    if !crate::runs_kernels(&qkv) {
        let qkv = match row_scale {
            Some(s) => s.apply(qkv),
            None => qkv,
        };
        return reference::rope_store_kv(qkv, heads, qk_norm, rope, meta, cache);
    }
    let layout = QkvLayout {
        heads,
        kv_heads,
        head_dim: d,
        offsets: [0, heads * d, (heads + kv_heads) * d],
        rope: true,
        qk_norm: qk_norm.is_some(),
        row_scale: row_scale.is_some(),
        row_bias: row_scale.is_some_and(|s| s.bias.is_some()),
        kv_dtype: cache.kv_dtype(),
    };
    let q = launch_store(
        cache,
        qkv.clone(),
        qkv.clone(),
        qkv,
        row_scale,
        qk_norm,
        Some(rope),
        layout,
        meta,
    );
    q.reshape([t, heads, d])
}

#[allow(clippy::too_many_arguments)]
fn launch_store(
    cache: &mut LayerKvCache,
    q: Tensor<2>,
    k: Tensor<2>,
    v: Tensor<2>,
    row_scale: Option<RowScale<'_>>,
    qk_norm: Option<QkNorm<'_>>,
    rope: Option<Rope<'_>>,
    layout: QkvLayout,
    meta: &AttentionMetadata,
) -> Tensor<2> {
    let placeholder = || k.clone().into_dispatch();
    let (x, row_bias, row_eps) = match row_scale {
        Some(s) => (
            s.input.clone().into_dispatch(),
            s.bias
                .map_or_else(placeholder, |b| b.clone().into_dispatch()),
            s.eps as f32,
        ),
        None => (placeholder(), placeholder(), 0.0),
    };
    let (qn, kn, eps) = match qk_norm {
        Some(n) => (
            n.q.clone().into_dispatch(),
            n.k.clone().into_dispatch(),
            n.eps as f32,
        ),
        None => (placeholder(), placeholder(), 0.0),
    };
    let (cos, sin) = match rope {
        Some(r) => (r.cos.clone().into_dispatch(), r.sin.clone().into_dispatch()),
        None => (placeholder(), placeholder()),
    };
    let scales = kv_scales_arg(cache, placeholder);
    // Moved out (not cloned) so that the kernel may write the buffers in place.
    let (kc, vc) = (cache.k.extract(), cache.v.extract());
    let (q_out, kc, vc) = Dispatch::rope_store_kv(
        q.into_dispatch(),
        k.clone().into_dispatch(),
        v.into_dispatch(),
        x,
        row_bias,
        qn,
        kn,
        cos,
        sin,
        meta.tensors.positions.clone().into_dispatch(),
        meta.tensors.slot_mapping.clone().into_dispatch(),
        kc.into_dispatch(),
        vc.into_dispatch(),
        scales,
        layout,
        [eps, row_eps],
    );
    cache.k = Tensor::from_dispatch(kc);
    cache.v = Tensor::from_dispatch(vc);
    Tensor::from_dispatch(q_out)
}

/// Causal attention of each sequence's new tokens over its cached context (the new keys
/// included: store them first), with grouped-query heads and softmax scale `scale`. The decode
/// rows (`0..meta.num_decodes`, one token each) take the split-context decode kernel, the
/// prefill chunks after them the prefill kernel; both write one output. For a
/// [`AttentionMetadata::padded`] layout, the padding rows of the output are left unwritten.
///
/// `q`: `[num_tokens, num_heads, head_dim]` → `[num_tokens, num_heads, head_dim]`.
pub fn paged_attention(
    q: Tensor<3>,
    cache: &LayerKvCache,
    meta: &AttentionMetadata,
    scale: f32,
) -> Tensor<3> {
    paged_attention_ordered(q, cache, meta, scale, crate::ReductionOrder::Fastest)
}

/// [`paged_attention`] in `order`: with [`crate::ReductionOrder::BatchInvariant`] the decode
/// rows' contexts are split by their own lengths alone, not by the batch's size.
pub fn paged_attention_ordered(
    q: Tensor<3>,
    cache: &LayerKvCache,
    meta: &AttentionMetadata,
    scale: f32,
    order: crate::ReductionOrder,
) -> Tensor<3> {
    let [t, heads, d] = q.dims();
    let check = || -> Result<(), KernelError> {
        let kv_heads = cache.kv_heads();
        check_cache(cache, kv_heads, d, q.dtype(), meta)?;
        if !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::invalid(format!(
                "{heads} query heads are not a multiple of {kv_heads} kv heads"
            )));
        }
        if t != meta.num_tokens() {
            return Err(KernelError::invalid(format!(
                "q has {t} tokens, the metadata {}",
                meta.num_tokens()
            )));
        }
        Ok(())
    };
    check().unwrap_or_else(|e| panic!("paged_attention: {e}"));
    if !crate::runs_kernels(&q) {
        return reference::paged_attention(q, cache, meta, scale);
    }
    let decode = meta.tensors.decode.as_ref();
    let prefill = meta.tensors.prefill.as_ref();
    let tile_rows = prefill
        .and_then(|_| prefill_tile_rows(&q.device(), q.dtype(), heads, cache.kv_heads(), d, order));
    let plan = AttentionPlan {
        scale,
        decode_context_bound: decode.map(|_| meta.context_bound),
        prefill_tile_rows: tile_rows,
        order,
        kv_dtype: cache.kv_dtype(),
    };
    // Absent parts get placeholders (never read).
    let placeholder = || meta.tensors.slot_mapping.clone().into_dispatch();
    // A float placeholder (the op takes the scales as a float tensor).
    let scales = kv_scales_arg(cache, || q.clone().into_dispatch());
    let (decode_tables, decode_context) = match decode {
        Some(part) => (
            part.block_tables.clone().into_dispatch(),
            part.context_lens.clone().into_dispatch(),
        ),
        None => (placeholder(), placeholder()),
    };
    let (prefill_tables, prefill_context, cu_seqlens_q, tiles) = match (prefill, tile_rows) {
        (Some(part), Some(rows)) => (
            part.block_tables.clone().into_dispatch(),
            part.context_lens.clone().into_dispatch(),
            part.cu_seqlens_q.clone().into_dispatch(),
            part.tiles
                .get(rows, &part.lens, &q.device())
                .into_dispatch(),
        ),
        _ => (placeholder(), placeholder(), placeholder(), placeholder()),
    };
    Tensor::from_dispatch(Dispatch::paged_attention(
        q.into_dispatch(),
        cache.k.clone().into_dispatch(),
        cache.v.clone().into_dispatch(),
        scales,
        decode_tables,
        decode_context,
        prefill_tables,
        prefill_context,
        cu_seqlens_q,
        tiles,
        plan,
    ))
}

/// Queries per tile of the prefill kernel that [`paged_attention_ordered`] launches on `device`
/// in `order` for queries of `dtype` with `heads` query heads, `kv_heads` key/value heads of
/// `head_dim`: what a caller building a step's tile list in advance ([`TileCache::fixed`])
/// steps by. `None` off CubeCL devices (no kernels, no tiles).
pub fn prefill_tile_rows(
    device: &burn::tensor::Device,
    dtype: DType,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    order: crate::ReductionOrder,
) -> Option<usize> {
    #[allow(unreachable_patterns)]
    match device.as_dispatch() {
        #[cfg(any(feature = "cpu", feature = "cuda"))]
        DispatchDevice::Cube(cube) => Some(prefill::tile_rows(
            &cube.client(),
            dtype,
            heads,
            kv_heads,
            head_dim,
            order,
        )),
        _ => None,
    }
}

/// The cache must match the heads and dtype of the tensors written into it, and every block id
/// of the metadata must exist.
fn check_cache(
    cache: &LayerKvCache,
    kv_heads: usize,
    d: usize,
    dtype: DType,
    meta: &AttentionMetadata,
) -> Result<(), KernelError> {
    let [nb, ckvh, bs, cd] = cache.dims();
    if (ckvh, cd) != (kv_heads, d) {
        return Err(KernelError::invalid(format!(
            "cache holds {ckvh} kv heads of width {cd}, the input {kv_heads} of width {d}"
        )));
    }
    let stored = if cache.kv_dtype().is_fp8() {
        kv_cache::FP8_CARRIER
    } else {
        dtype
    };
    if cache.k.dtype() != stored || cache.v.dtype() != stored {
        return Err(KernelError::invalid(format!(
            "cache dtype {:?} differs from the input's {dtype:?} (stored as {stored:?})",
            cache.k.dtype()
        )));
    }
    if let Some(q) = &cache.quant
        && (q.scales.dims() != [2 * kv_heads] || q.scales.dtype() != DType::F32)
    {
        return Err(KernelError::invalid(format!(
            "FP8 cache scales of shape {:?} and dtype {:?}; expected [{}] f32",
            q.scales.dims(),
            q.scales.dtype(),
            2 * kv_heads
        )));
    }
    if bs != meta.block_size {
        return Err(KernelError::invalid(format!(
            "cache block size {bs}, metadata block size {}",
            meta.block_size
        )));
    }
    if let Some(b) = meta.max_block_id.filter(|&b| b as usize >= nb) {
        return Err(KernelError::invalid(format!(
            "block id {b} is outside the cache's {nb} blocks"
        )));
    }
    Ok(())
}

/// The kernels' scales argument: an FP8 cache's scales, else `placeholder()` (never read).
fn kv_scales_arg(
    cache: &LayerKvCache,
    placeholder: impl FnOnce() -> DispatchTensor,
) -> DispatchTensor {
    match &cache.quant {
        Some(q) => q.scales.clone().into_dispatch(),
        None => placeholder(),
    }
}

/// What the attention launchers read off their operands: `q [rows, heads, D]` (made
/// unit-inner-stride), caches `[num_blocks, kv_heads, block_size, D]`, and the output
/// `[rows, heads, D]`, allocated in `q`'s dtype.
pub(crate) struct AttentionLaunch {
    pub q: CubeTensor,
    pub out: CubeTensor,
    pub heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub kv_heads: usize,
}

impl AttentionLaunch {
    pub(crate) fn new(q: CubeTensor, k_cache: &CubeTensor) -> Self {
        let q = crate::unit_inner_stride(q);
        let [rows, heads, head_dim] = [0, 1, 2].map(|i| q.meta.shape()[i]);
        let cache = k_cache.meta.shape();
        let out = empty_device_dtype(
            q.client.clone(),
            q.device.clone(),
            Shape::new([rows, heads, head_dim]),
            q.dtype,
        );
        Self {
            q,
            out,
            heads,
            head_dim,
            block_size: cache[2],
            kv_heads: cache[1],
        }
    }
}

/// A buffer the op may write in place: the cache itself when nothing else holds it, else a copy
/// (a whole layer's cache: a costly mistake of the caller, reported once per process).
pub(crate) fn writable(t: CubeTensor) -> CubeTensor {
    if t.can_mut() && t.is_contiguous() {
        t
    } else {
        static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
            eprintln!(
                "warning: a KV cache of shape {:?} was copied before a write: another tensor \
                 holds its buffer",
                t.meta.shape()
            );
        }
        into_contiguous(t.copy())
    }
}

/// True if the manual-MMA attention kernels (`mma.sync` 16×8×16, 16-byte `ldmatrix` rows) can
/// run `dtype` at `head_dim` with K/V vectors of `vec` elements on this device.
pub(crate) fn mma_fits(caps: &DeviceCaps, dtype: DType, head_dim: usize, vec: usize) -> bool {
    caps.mma_16x8x16(dtype) && head_dim.is_multiple_of(16) && vec * dtype.size() == 16
}

/// The index width the kernels need: 64-bit once any tensor holds 2³² elements or more.
pub(crate) fn address_type(tensors: &[&CubeTensor]) -> AddressType {
    tensors
        .iter()
        .map(|t| t.required_address_type())
        .max()
        .unwrap_or_default()
}
