//! The paged key/value storage of one attention layer.

use burn::tensor::{DType, Device, Tensor};
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::zspace::metadata::Metadata;

use crate::KernelError;

/// Paged key/value storage of one attention layer, allocated once and written in place.
///
/// `k`, `v`: `[num_blocks, num_kv_heads, block_size, head_dim]`, head-major (FlashInfer's `HND`).
/// A token's slot is `block * block_size + offset`; one kv head's keys of a block are one
/// contiguous `block_size × head_dim` run, which is what a decode cube streams (one cube per kv
/// head). Against the token-major `[num_blocks, block_size, num_kv_heads, head_dim]` (vLLM's
/// flash layout), measured on the H100: our decode of Qwen2-0.5B's heads (2 × 64: 128-byte
/// rows) 4 % faster at 256 × 4k and 16k contexts, Qwen3-0.6B's (8 × 128) unchanged; a plain
/// Triton read of a decode step's cache 2–11 % faster at 78–256 sequences, 30 % at 32
/// (`scripts/baselines/kv_layout_read.py`, docs/BENCHMARKS.md). `cache_row` (private) is the
/// layout's one address formula.
///
/// With [`KvQuant`] the caches hold FP8 bytes: the KV write divides by the kv head's scale and
/// rounds (saturating), the attention kernels multiply by it as they load. Burn has no 8-bit
/// float dtype and a float tensor cannot hold `U8`, so an FP8 cache is carried by an f16 tensor
/// of half the head width (`[num_blocks, num_kv_heads, block_size, head_dim / 2]`, the same
/// bytes), which the kernels view as FP8 bytes; [`LayerKvCache::dims`] reports the logical
/// shape.
#[derive(Clone, Debug)]
pub struct LayerKvCache {
    /// Keys, `[num_blocks, num_kv_heads, block_size, head_dim]` (an FP8 cache's carrier: `head_dim
    /// / 2` f16).
    pub k: Tensor<4>,
    /// Values, same shape as `k`.
    pub v: Tensor<4>,
    /// FP8 storage and its scales; `None`: keys and values in the model's dtype.
    pub quant: Option<KvQuant>,
}

/// The storage format of a KV cache (vLLM's `kv_cache_dtype`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum KvCacheDtype {
    /// The model's dtype.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// FP8 E4M3 (OCP, largest finite 448): 3 mantissa bits.
    #[serde(rename = "fp8_e4m3", alias = "fp8")]
    Fp8E4M3,
    /// FP8 E5M2 (largest finite 57,344): 2 mantissa bits, more range.
    #[serde(rename = "fp8_e5m2")]
    Fp8E5M2,
}

impl std::str::FromStr for KvCacheDtype {
    type Err = KernelError;

    /// vLLM's names: `auto`, `fp8` (= `fp8_e4m3`), `fp8_e4m3`, `fp8_e5m2`.
    fn from_str(name: &str) -> Result<Self, KernelError> {
        match name {
            "auto" => Ok(Self::Auto),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4M3),
            "fp8_e5m2" => Ok(Self::Fp8E5M2),
            _ => Err(KernelError::invalid(format!(
                "kv_cache_dtype `{name}` is not one of auto, fp8, fp8_e4m3, fp8_e5m2"
            ))),
        }
    }
}

impl KvCacheDtype {
    /// vLLM's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Fp8E4M3 => "fp8_e4m3",
            Self::Fp8E5M2 => "fp8_e5m2",
        }
    }

    /// True for the FP8 formats.
    pub fn is_fp8(self) -> bool {
        self != Self::Auto
    }

    /// Bytes of one stored element for a model of `dtype`.
    pub fn element_bytes(self, dtype: DType) -> usize {
        if self.is_fp8() { 1 } else { dtype.size() }
    }

    /// The largest finite value of the FP8 format (`None` for `Auto`).
    pub fn max_finite(self) -> Option<f32> {
        match self {
            Self::Auto => None,
            Self::Fp8E4M3 => Some(448.0),
            Self::Fp8E5M2 => Some(57344.0),
        }
    }

    /// The CubeCL element the kernels read and write for a model of `dtype`.
    pub(crate) fn storage(self, dtype: DType) -> ElemType {
        match self {
            Self::Auto => burn::backend::cubecl::dtype_to_storage_type(dtype),
            Self::Fp8E4M3 => ElemType::Float(FloatKind::E4M3),
            Self::Fp8E5M2 => ElemType::Float(FloatKind::E5M2),
        }
    }

    /// Rounds `x` to the format as the KV write does (round to nearest even, saturating at the
    /// largest finite value): the host reference of a stored element, already divided by its
    /// scale. `Auto` returns `x`.
    pub fn round(self, x: f32) -> f32 {
        match self {
            Self::Auto => x,
            Self::Fp8E4M3 => cubecl::e4m3::from_f32(x).to_f32(),
            Self::Fp8E5M2 => cubecl::e5m2::from_f32(x).to_f32(),
        }
    }

    /// The value of stored byte `bits` (`Auto`: not a byte format, NaN).
    pub fn decode(self, bits: u8) -> f32 {
        match self {
            Self::Auto => f32::NAN,
            Self::Fp8E4M3 => cubecl::e4m3::from_bits(bits).to_f32(),
            Self::Fp8E5M2 => cubecl::e5m2::from_bits(bits).to_f32(),
        }
    }
}

/// An FP8 cache's format and scales: stored = round(x / scale), read = stored · scale.
#[derive(Clone, Debug)]
pub struct KvQuant {
    /// The FP8 format (never `Auto`).
    pub dtype: KvCacheDtype,
    /// `[2 · num_kv_heads]` f32: the keys' scale of each kv head, then the values'.
    pub scales: Tensor<1>,
}

/// The dtype of the tensors that carry an FP8 cache's bytes (two to an element).
pub const FP8_CARRIER: DType = DType::F16;

/// The kernels' view of a cache tensor: an FP8 cache's carrier ([`FP8_CARRIER`], `[…, D / 2]`)
/// as the `U8` bytes it holds (`[…, D]`); any other cache as it is.
pub(crate) fn fp8_bytes(t: CubeTensor, kv_dtype: KvCacheDtype) -> CubeTensor {
    match kv_dtype.is_fp8() {
        true => carrier_as_bytes(t),
        false => t,
    }
}

/// The inverse of [`fp8_bytes`]: the carrier of a `U8` view.
pub(crate) fn fp8_carrier(t: CubeTensor, kv_dtype: KvCacheDtype) -> CubeTensor {
    match kv_dtype.is_fp8() {
        true => bytes_as_carrier(t),
        false => t,
    }
}

/// An [`FP8_CARRIER`] tensor of unit inner stride (`[…, W]`) as the `U8` bytes it holds
/// (`[…, 2·W]`, the same row pitches in bytes).
pub(crate) fn carrier_as_bytes(t: CubeTensor) -> CubeTensor {
    relabel(t, 2, 1, DType::U8)
}

/// A `U8` tensor of unit inner stride, an even last dimension and even row pitches (`[…, W]`)
/// as its carrier ([`FP8_CARRIER`], `[…, W / 2]`).
pub(crate) fn bytes_as_carrier(t: CubeTensor) -> CubeTensor {
    relabel(t, 1, 2, FP8_CARRIER)
}

/// `t`'s buffer seen as `dtype`: the last dimension and the outer strides multiplied by `num`
/// and divided by `den` (CUDA pitches the rows of 2-D and larger allocations: the strides keep
/// the pitch).
pub(crate) fn relabel(mut t: CubeTensor, num: usize, den: usize, dtype: DType) -> CubeTensor {
    let mut shape = t.meta.shape().clone();
    let dim = shape.num_dims() - 1;
    shape[dim] = shape[dim] * num / den;
    let mut strides: Vec<usize> = t.meta.strides().to_vec();
    for s in &mut strides[..dim] {
        *s = *s * num / den;
    }
    strides[dim] = 1;
    t.meta = Box::new(Metadata::new(shape, strides));
    t.dtype = dtype;
    t
}

impl LayerKvCache {
    /// An unquantised cache of `k` and `v` (`[num_blocks, num_kv_heads, block_size, head_dim]`).
    pub fn new(k: Tensor<4>, v: Tensor<4>) -> Self {
        Self { k, v, quant: None }
    }

    /// Allocates a zeroed cache (zeroing also makes the allocation real on lazy allocators)
    /// for a model of `dtype`, stored as `kv_dtype`; an FP8 cache starts with scales of 1.
    #[allow(clippy::too_many_arguments)]
    pub fn zeros(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
        dtype: DType,
        kv_dtype: KvCacheDtype,
        device: &Device,
    ) -> Result<Self, KernelError> {
        if !(1..=1024).contains(&block_size) {
            return Err(KernelError::invalid(format!(
                "KV cache: block_size {block_size} is outside 1..=1024"
            )));
        }
        let shape = [num_blocks, num_kv_heads, block_size, head_dim];
        // Made 1-D and viewed as 4-D: the kernels index the cache contiguously, and a 4-D CUDA
        // tensor is row-pitched when a head's row is not a power of two of bytes (head_dim 24,
        // 40, 48, 80, 96, …), which would make every write copy the whole layer.
        let (shape, stored) = if kv_dtype.is_fp8() {
            if !head_dim.is_multiple_of(2) {
                return Err(KernelError::invalid(format!(
                    "an FP8 KV cache needs an even head_dim, got {head_dim}"
                )));
            }
            (
                [num_blocks, num_kv_heads, block_size, head_dim / 2],
                FP8_CARRIER,
            )
        } else {
            (shape, dtype)
        };
        let zeros = || {
            Tensor::<1>::zeros([shape.iter().product::<usize>()], (device, stored)).reshape(shape)
        };
        let quant = kv_dtype.is_fp8().then(|| KvQuant {
            dtype: kv_dtype,
            scales: Tensor::ones([2 * num_kv_heads], (device, DType::F32)),
        });
        Ok(Self {
            k: zeros(),
            v: zeros(),
            quant,
        })
    }

    /// The storage format.
    pub fn kv_dtype(&self) -> KvCacheDtype {
        self.quant.as_ref().map_or(KvCacheDtype::Auto, |q| q.dtype)
    }

    /// Sets an FP8 cache's scales: `k_scales`, `v_scales` one per kv head, finite and positive.
    /// Errors on an unquantised cache or bad values.
    pub fn set_scales(&mut self, k_scales: &[f32], v_scales: &[f32]) -> Result<(), KernelError> {
        let heads = self.kv_heads();
        let Some(quant) = self.quant.as_mut() else {
            return Err(KernelError::invalid(
                "KV cache scales given for an unquantised cache".to_string(),
            ));
        };
        if k_scales.len() != heads || v_scales.len() != heads {
            return Err(KernelError::invalid(format!(
                "KV cache scales: {} key and {} value scales for {heads} kv heads",
                k_scales.len(),
                v_scales.len()
            )));
        }
        let all: Vec<f32> = k_scales.iter().chain(v_scales).copied().collect();
        if let Some(bad) = all.iter().find(|s| !(s.is_finite() && **s > 0.0)) {
            return Err(KernelError::invalid(format!(
                "KV cache scale {bad} is not finite and positive"
            )));
        }
        let device = quant.scales.device();
        quant.scales = Tensor::from_data(
            burn::tensor::TensorData::new(all, [2 * heads]),
            (&device, DType::F32),
        );
        Ok(())
    }

    /// `[num_blocks, num_kv_heads, block_size, head_dim]` (the logical shape: an FP8 cache's
    /// carrier tensors are half as wide).
    pub fn dims(&self) -> [usize; 4] {
        let [nb, kvh, bs, w] = self.k.dims();
        [nb, kvh, bs, if self.quant.is_some() { 2 * w } else { w }]
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.dims()[2]
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.dims()[1]
    }

    /// Elements per head.
    pub fn head_dim(&self) -> usize {
        self.dims()[3]
    }

    /// Number of blocks.
    pub fn num_blocks(&self) -> usize {
        self.dims()[0]
    }
}

/// The row of key `offset` of block `block`, kv head `kvh`, in a [`LayerKvCache`] of `kv_heads`
/// heads and `block_size`-token blocks, counted in rows of one head (`head_dim` elements, or
/// `head_dim / N` vectors of `N`): every kernel addresses the cache through it.
#[cube]
pub(crate) fn cache_row(
    block: usize,
    offset: usize,
    kvh: usize,
    #[comptime] kv_heads: usize,
    #[comptime] block_size: usize,
) -> usize {
    (block * kv_heads + kvh) * block_size + offset
}
