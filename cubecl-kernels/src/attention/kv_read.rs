//! How the attention kernels read a [`LayerKvCache`](super::LayerKvCache)'s values: the cache's
//! format and, for FP8, which decoder ([`crate::fp8_codes`]) and the kv head's scales.

use cubecl::prelude::*;

use super::kv_cache::KvCacheDtype;
use crate::device_caps::DeviceCaps;
use crate::fp8_codes::{load_codes, ptx_decodes};

/// A kernel's comptime view of the cache it reads: its format and whether FP8 codes are decoded
/// by PTX's paired conversion (`fp8_codes::decode_ptx`: CUDA devices of compute capability ≥
/// 8.9, with the vendored cubecl-llvm) instead of by bit placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KvRead {
    /// The cache's storage format.
    pub dtype: KvCacheDtype,
    /// FP8 codes through `cvt.rn.f16x2.{e4m3x2, e5m2x2}`.
    pub ptx_cvt: bool,
}

impl KvRead {
    /// How kernels on the device of `caps` read a cache of `dtype` (`fp8_codes::ptx_decodes`).
    pub(crate) fn new(dtype: KvCacheDtype, caps: &DeviceCaps) -> Self {
        let ptx_cvt = dtype.is_fp8() && ptx_decodes(caps);
        Self { dtype, ptx_cvt }
    }

    /// True for the FP8 formats.
    pub(crate) fn is_fp8(self) -> bool {
        self.dtype.is_fp8()
    }

    /// True for E5M2 codes.
    pub(crate) fn e5m2(self) -> bool {
        self.dtype == KvCacheDtype::Fp8E5M2
    }
}

/// A cube's kv head scales `(key, value)` from `scales [2 · kv_heads]` (see
/// [`KvQuant`](super::KvQuant)); 1 when the cache is not FP8 (`fp8` false: then `scales` is a
/// placeholder and is not read).
#[cube]
pub(crate) fn head_scales(
    scales: &cubecl::prelude::Tensor<f32>,
    kvh: usize,
    #[comptime] kv_heads: usize,
    #[comptime] fp8: bool,
) -> (f32, f32) {
    let mut ks = 1.0f32;
    let mut vs = 1.0f32;
    if comptime!(fp8) {
        ks = scales[kvh];
        vs = scales[kv_heads + kvh];
    }
    (ks, vs)
}

/// A cache vector as `O`: FP8 codes decoded exactly (unscaled), others cast
/// ([`load_codes`]).
#[cube]
pub(crate) fn load_as<KV: Float, O: Float, NV: Size>(
    x: Vector<KV, NV>,
    #[comptime] kv: KvRead,
) -> Vector<O, NV> {
    load_codes::<KV, O, NV>(
        x,
        comptime!(kv.is_fp8()),
        comptime!(kv.ptx_cvt),
        comptime!(kv.e5m2()),
    )
}

/// A cache vector as f32 ([`load_as`]).
#[cube]
pub(crate) fn load_f32<KV: Float, NV: Size>(
    x: Vector<KV, NV>,
    #[comptime] kv: KvRead,
) -> Vector<f32, NV> {
    load_as::<KV, f32, NV>(x, kv)
}

/// A cache vector as `F`: FP8 codes decoded ([`load_as`]) and multiplied by `scale`, others
/// as they are (the cache already holds `F`).
#[cube]
pub(crate) fn dequantise<KV: Float, F: Float, NV: Size>(
    x: Vector<KV, NV>,
    scale: f32,
    #[comptime] kv: KvRead,
) -> Vector<F, NV> {
    if comptime!(kv.is_fp8()) {
        Vector::<F, NV>::cast_from(load_f32(x, kv) * Vector::new(scale))
    } else {
        Vector::<F, NV>::cast_from(x)
    }
}
