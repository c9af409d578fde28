//! CubeCL kernels for LLM inference, registered as custom Burn backend ops.
//!
//! ```
//! use burn::tensor::{Distribution, Tensor};
//! use cubecl_kernels::{DeviceKind, rms_norm_linear::reference};
//!
//! // CubeCL's CPU runtime runs the kernels here; `DeviceKind::Cuda(0)` runs them on a GPU, and
//! // any other Burn device takes the plain-Burn reference path.
//! let device = DeviceKind::CubeclCpu.device()?;
//! let x = Tensor::<2>::random([5, 64], Distribution::Default, &device); // [M, K]
//! let gain = Tensor::<1>::random([64], Distribution::Uniform(0.5, 1.5), &device); // [K]
//! let w = Tensor::<2>::random([48, 64], Distribution::Default, &device); // [N, K] (HF layout)
//! let bias = Tensor::<1>::random([48], Distribution::Default, &device); // [N]
//!
//! // RMSNorm and the product in one op: the normalised rows never reach memory.
//! let y = cubecl_kernels::rms_norm_linear(x.clone(), gain.clone(), w.clone(), Some(bias.clone()), 1e-6);
//! let expected = reference::rms_norm_linear(x, gain, w, Some(bias), 1e-6);
//! assert_eq!(y.dims(), [5, 48]);
//! let error: f32 = (y - expected.clone()).abs().max().into_scalar();
//! assert!(error < 1e-4 * expected.abs().max().into_scalar::<f32>());
//! # Ok::<(), cubecl_kernels::KernelError>(())
//! ```
//!
//! Every op has a plain-Burn reference path (the `reference` modules) that runs on any backend,
//! defines what the op computes and is the test oracle.
//!
//! | op | shapes |
//! | --- | --- |
//! | [`rms_norm_linear()`] | `x [M, K]`, `g [K]`, `W [N, K]`, `b [N]` → `[M, N]` |
//! | [`add_rms_norm_linear`] | as above plus `residual [M, K]`; also returns `h = x + residual` |
//! | [`linear`] | `x [M, K]`, `W [N, K]`, `b [N]` → `[M, N]` |
//! | [`store_kv`] | `k, v [T, kv_heads, d]` into the paged cache at `slot_mapping` |
//! | [`rope_store_kv`] | `qkv [T, (heads + 2·kv_heads)·d]`: deferred row scale, q/k norm + RoPE, k/v into the cache → `q [T, heads, d]` |
//! | [`silu_mul()`] | `gate_up [T, 2·I]` → `silu(gate)·up [T, I]`, optionally completing a deferred RMSNorm row scale |
//! | [`linear_add`] | `x [M, K]`, `W [N, K]`, `b [N]`, `residual [M, N]` → `x·Wᵀ + b + residual` |
//! | [`Fp8Rows::quantize`] | `x [R, C]` → E4M3 codes `[R, C]` (carried as `[R, C/2]` f16) and scales `[R]`, per tensor or per row |
//! | [`fp8_linear()`] | `x [M, K]`, FP8 `W [N, K]`, `b [N]`, `residual [M, N]` → `x·Wᵀ + b + residual`, `x` quantised as `W` is |
//! | [`paged_attention`] | `q [T, heads, d]` over each sequence's cached context → `[T, heads, d]` |
//! | [`sample`] | `logits [B, V]` (f32) → next tokens `[B]` (greedy, or seeded min-p/top-k/top-p draws) |
//! | [`mask_logits`] | `logits [B, V]` (f32), `M` token bitmasks `[M, ⌈V/32⌉]` (u32) of rows `[M]` → disallowed tokens −∞, in place |
//! | [`sample_into`] | as [`sample`], into the first `B` slots of an existing `i32` buffer, in place (the next step's graph reads them) |
//! | [`write_ints`] | host `i32` values into a span of an existing device buffer, in place (graph inputs) |
//! | [`scatter_ints`] | host `(index, value)` pairs into an existing device buffer, in place (block tables) |
//! | [`mark_stream`] | a CUDA event on the device's stream behind everything enqueued (device timelines) |
//! | [`UploadBuffer`] | host memory for an upload, filled in place: pinned on CUDA, so the upload makes no host copy |
//! | [`read_ints_async`] | starts copying an `i32` buffer to the host behind the work that writes it; wait later |
//!
//! [`linear_ordered`], [`linear_add_ordered`], [`rms_norm_linear_ordered`] and
//! [`paged_attention_ordered`] take a [`ReductionOrder`]: with `BatchInvariant` a row's result does
//! not depend on the other rows of the call (batch-invariant inference).
//!
//! Each op family declares its Burn backend extension beside its kernels and implements it for
//! CubeCL backends there ([`attention::AttentionOps`], [`rms_norm_linear::LinearOps`],
//! [`silu_mul::SiluMulOps`], [`sampling::SamplingOps`], [`fp8_linear::Fp8LinearOps`], and the crate-private host-write,
//! device-read and stream-mark ops); the functions above check arguments and call them.

#![warn(missing_docs)]

pub mod attention;
#[cfg(feature = "cuda")]
mod collective;
#[cfg(feature = "cpu")]
mod cpu_builtins;
mod device;
mod device_caps;
mod device_read;
mod error;
pub mod fast_exp;
pub mod fp8_codes;
pub mod fp8_linear;
mod gpu_timeline;
mod host_upload;
mod host_write;
mod knobs;
mod reduction_order;
pub mod rms_norm_linear;
pub mod row_scale;
pub mod sampling;
pub mod silu_mul;

pub use attention::{
    AttentionMetadata, DecodeTensors, FP8_CARRIER, KvCacheDtype, KvQuant, LayerKvCache,
    MetadataTensors, PrefillTensors, QkNorm, Rope, TileCache, paged_attention,
    paged_attention_ordered, prefill_tile_rows, prefill_tiles, rope_store_kv, store_kv,
};
#[cfg(feature = "cuda")]
pub use collective::{
    AllReduceKernel, CollectiveOps, CommSlot, NcclComm, NcclId, Reduction, all_reduce,
    all_reduce_sum,
};
#[cfg(feature = "cpu")]
pub use cpu_builtins::load as load_cpu_builtins;
pub use device::{DeviceKind, persistent};
pub use device_read::{PendingInts, ReadSlot, read_ints_async};
pub use error::KernelError;
pub use fp8_linear::{Fp8Rows, Fp8Scaling, fp8_linear, fp8_linear_support};
pub use gpu_timeline::{GpuMark, MarkSlot, mark_stream};
pub use host_upload::UploadBuffer;
pub use host_write::{HostInts, scatter_ints, write_ints};
pub use reduction_order::ReductionOrder;
pub use rms_norm_linear::{
    FusedRmsNormLinear, LinearRoute, add_rms_norm_linear, check_args, linear, linear_add,
    linear_add_ordered, linear_ordered, linear_route, rms_norm, rms_norm_linear,
    rms_norm_linear_ordered, set_linear_tuning,
};
#[cfg(feature = "cuda")]
pub use rms_norm_linear::{cublas_stream_ordered, cublas_unavailable_reason};
pub use row_scale::{RowScale, fold_norm_gain};
pub use sampling::{
    SamplingRow, VocabShard, mask_logits, mask_words, pick_exchanged_into, sample, sample_into,
    sample_shard,
};
pub use silu_mul::silu_mul;

use burn::backend::DispatchDevice;
use burn::tensor::Tensor;

/// Kernels index the last dimension with unit stride; anything else is copied first.
pub(crate) fn unit_inner_stride(
    t: burn_cubecl::tensor::CubeTensor,
) -> burn_cubecl::tensor::CubeTensor {
    let strides = t.meta.strides();
    if strides[strides.len() - 1] == 1 && !t.meta.shape().contains(&0) {
        t
    } else {
        burn_cubecl::kernel::into_contiguous(t)
    }
}

/// Widest vector (at most 16 bytes) whose length divides every extent and row pitch given.
pub(crate) fn vector_size(dtype: burn::tensor::DType, extents: &[usize]) -> usize {
    let max = (16 / dtype.size()).max(1);
    let mut v = max;
    while v > 1 && extents.iter().any(|&e| e % v != 0) {
        v /= 2;
    }
    v
}

/// True if `t` lives on a CubeCL device, where the ops run our kernels.
pub(crate) fn runs_kernels<const D: usize>(t: &Tensor<D>) -> bool {
    #[allow(unreachable_patterns)]
    match t.device().as_dispatch() {
        #[cfg(any(feature = "cpu", feature = "cuda"))]
        DispatchDevice::Cube(device) => {
            // bf16 kernels on the CPU runtime may call `__truncsfbf2` (`cpu_builtins`).
            #[cfg(feature = "cpu")]
            if device.runtime() == cubecl::RuntimeId::Cpu && t.dtype() == burn::tensor::DType::BF16
            {
                crate::cpu_builtins::bf16_support().unwrap_or_else(|e| panic!("{e}"));
            }
            let _ = device;
            true
        }
        _ => false,
    }
}
