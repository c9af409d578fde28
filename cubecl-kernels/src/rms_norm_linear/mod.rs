//! Fused RMSNorm + linear, its residual variant, the plain linear op and the linear op that
//! closes a residual connection.
//!
//! On CubeCL devices these run our kernels (`kernel.rs`, launched by `launch.rs`); elsewhere the
//! plain-Burn composition in `reference.rs`, which also defines what they compute.

#[cfg(feature = "cuda")]
pub(crate) mod cublas;
#[cfg(feature = "cuda")]
mod cublas_plan;
pub(crate) mod kernel;
pub(crate) mod launch;
mod module;
mod ops;
pub mod reference;

#[cfg(feature = "cuda")]
pub use cublas::{cublas_unavailable_reason, stream_ordered as cublas_stream_ordered};
pub use launch::LinearRoute;
pub use module::FusedRmsNormLinear;

use std::sync::atomic::{AtomicBool, Ordering};

use burn::backend::{Dispatch, DispatchDevice};
use burn::tensor::{DType, Tensor};

pub use self::ops::LinearOps;
use crate::{KernelError, ReductionOrder};

/// Whether new product shapes are tuned ([`set_linear_tuning`]).
static TUNING: AtomicBool = AtomicBool::new(false);

/// Turns on or off, for product shapes met from now on, the timing of cuBLASLt's candidate
/// algorithms on CUDA (the heuristic's top few, on the call's own operands; the fastest is
/// kept for the shape): on for the warm-up runs of shapes that will run many times (a captured
/// step's), off for one-off shapes, whose timing would cost more than it saves. Process-wide;
/// no effect elsewhere.
pub fn set_linear_tuning(on: bool) {
    TUNING.store(on, Ordering::Relaxed);
}

/// See [`set_linear_tuning`].
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn linear_tuning() -> bool {
    TUNING.load(Ordering::Relaxed)
}

/// Which optional operands of [`LinearOps::fused_linear`] are present.
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
    /// [`ReductionOrder::BatchInvariant`] (not an operand: the product's route).
    pub const BATCH_INVARIANT: u32 = 16;
}

/// RMSNorm over the last dimension (statistics in f32). `x [M, K]`, `weight [K]` → `[M, K]`.
pub fn rms_norm(x: Tensor<2>, weight: Tensor<1>, eps: f64) -> Tensor<2> {
    reference::rms_norm(x, weight, eps)
}

/// `y = rms_norm(x, norm_weight) · Wᵀ (+ b)`, without writing the normalised `x` to memory.
///
/// `x [M, K]`, `norm_weight [K]`, `weight [N, K]` (Hugging Face layout), `bias [N]` → `[M, N]`;
/// f32, f16 or bf16, all operands of one dtype; accumulation in f32.
///
/// # Panics
/// On mismatched shapes or dtypes, with a message naming the operand (see [`check_args`]).
pub fn rms_norm_linear(
    x: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> Tensor<2> {
    rms_norm_linear_ordered(x, norm_weight, weight, bias, eps, ReductionOrder::Fastest)
}

/// [`rms_norm_linear`] with the products' [`ReductionOrder`].
pub fn rms_norm_linear_ordered(
    x: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
    order: ReductionOrder,
) -> Tensor<2> {
    expect_valid(
        "rms_norm_linear",
        check_args(&x, None, Some(&norm_weight), &weight, bias.as_ref()),
    );
    if !crate::runs_kernels(&x) {
        return reference::rms_norm_linear(x, norm_weight, weight, bias, eps);
    }
    dispatch(x, None, Some(norm_weight), weight, bias, eps, false, order).0
}

/// `h = x + residual; y = rms_norm(h, norm_weight) · Wᵀ (+ b)`; returns `(y, h)`.
///
/// `x`, `residual [M, K]`, `norm_weight [K]`, `weight [N, K]`, `bias [N]` →
/// `(y [M, N], h [M, K])`. This is the pre-attention / pre-MLP step of Qwen2 and Llama blocks.
///
/// # Panics
/// On mismatched shapes or dtypes, with a message naming the operand (see [`check_args`]).
pub fn add_rms_norm_linear(
    x: Tensor<2>,
    residual: Tensor<2>,
    norm_weight: Tensor<1>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
) -> (Tensor<2>, Tensor<2>) {
    expect_valid(
        "add_rms_norm_linear",
        check_args(
            &x,
            Some(&residual),
            Some(&norm_weight),
            &weight,
            bias.as_ref(),
        ),
    );
    if !crate::runs_kernels(&x) {
        return reference::add_rms_norm_linear(x, residual, norm_weight, weight, bias, eps);
    }
    dispatch(
        x,
        Some(residual),
        Some(norm_weight),
        weight,
        bias,
        eps,
        false,
        ReductionOrder::Fastest,
    )
}

/// `y = x · Wᵀ (+ b)`. `x [M, K]`, `weight [N, K]`, `bias [N]` → `[M, N]`.
///
/// # Panics
/// On mismatched shapes or dtypes, with a message naming the operand (see [`check_args`]).
pub fn linear(x: Tensor<2>, weight: Tensor<2>, bias: Option<Tensor<1>>) -> Tensor<2> {
    linear_ordered(x, weight, bias, ReductionOrder::Fastest)
}

/// [`linear`] with the product's [`ReductionOrder`].
pub fn linear_ordered(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    order: ReductionOrder,
) -> Tensor<2> {
    expect_valid("linear", check_args(&x, None, None, &weight, bias.as_ref()));
    if !crate::runs_kernels(&x) {
        return reference::linear(x, weight, bias);
    }
    dispatch(x, None, None, weight, bias, 0.0, false, order).0
}

/// `y = x · Wᵀ (+ b) + residual`: a product that also closes a residual connection (a Qwen
/// block's o_proj and down_proj), the sum in f32 before the single rounding. On cuBLASLt the
/// residual rides in the GEMM (`beta = 1`), elsewhere in the kernels' epilogues.
///
/// `x [M, K]`, `weight [N, K]`, `bias [N]`, `residual [M, N]` → `[M, N]`.
///
/// # Panics
/// On mismatched shapes or dtypes, with a message naming the operand (see [`check_args`]).
pub fn linear_add(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    residual: Tensor<2>,
) -> Tensor<2> {
    linear_add_ordered(x, weight, bias, residual, ReductionOrder::Fastest)
}

/// [`linear_add`] with the product's [`ReductionOrder`].
pub fn linear_add_ordered(
    x: Tensor<2>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    residual: Tensor<2>,
    order: ReductionOrder,
) -> Tensor<2> {
    expect_valid(
        "linear_add",
        check_args(&x, None, None, &weight, bias.as_ref()).and_then(|()| {
            let want = [x.dims()[0], weight.dims()[0]];
            if residual.dims() != want {
                Err(KernelError::invalid(format!(
                    "residual has shape {:?}; expected {want:?}",
                    residual.dims()
                )))
            } else if residual.dtype() != x.dtype() {
                Err(KernelError::invalid(format!(
                    "residual has dtype {:?}, x has {:?}",
                    residual.dtype(),
                    x.dtype()
                )))
            } else {
                Ok(())
            }
        }),
    );
    if !crate::runs_kernels(&x) {
        return reference::linear(x, weight, bias) + residual;
    }
    dispatch(x, Some(residual), None, weight, bias, 0.0, true, order).0
}

/// The implementation [`linear`] and the fused ops take for `x [M, K]` (its device, dtype and
/// `M`) and a weight `[N, K]` in `order`; `None` off CubeCL devices (the plain-Burn reference).
pub fn linear_route(x: &Tensor<2>, n: usize, order: ReductionOrder) -> Option<LinearRoute> {
    #[allow(unreachable_patterns)]
    match x.device().as_dispatch() {
        #[cfg(any(feature = "cpu", feature = "cuda"))]
        DispatchDevice::Cube(device) => {
            let [m, k] = x.dims();
            let client = device.client();
            let caps = crate::device_caps::DeviceCaps::of(&client);
            Some(launch::route(
                m,
                n,
                k,
                x.dtype(),
                device,
                &client,
                &caps,
                order,
            ))
        }
        _ => None,
    }
}

/// `add_out`: `residual` is added to the output (`[M, N]`), not to the input.
#[allow(clippy::too_many_arguments)]
fn dispatch(
    x: Tensor<2>,
    residual: Option<Tensor<2>>,
    gamma: Option<Tensor<1>>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    eps: f64,
    add_out: bool,
    order: ReductionOrder,
) -> (Tensor<2>, Tensor<2>) {
    let mut operands = 0;
    if order == ReductionOrder::BatchInvariant {
        operands |= LinearOperands::BATCH_INVARIANT;
    }
    let residual_bit = if add_out {
        LinearOperands::ADD_OUT
    } else {
        LinearOperands::RESIDUAL
    };
    for (present, bit) in [
        (residual.is_some(), residual_bit),
        (gamma.is_some(), LinearOperands::NORM),
        (bias.is_some(), LinearOperands::BIAS),
    ] {
        if present {
            operands |= bit;
        }
    }
    // Absent operands are placeholders the kernels never read.
    let placeholder = || x.clone().into_dispatch();
    let (y, h) = Dispatch::fused_linear(
        x.clone().into_dispatch(),
        residual
            .map(Tensor::into_dispatch)
            .unwrap_or_else(placeholder),
        gamma.map(|g| g.into_dispatch()).unwrap_or_else(placeholder),
        weight.into_dispatch(),
        bias.map(|b| b.into_dispatch()).unwrap_or_else(placeholder),
        eps as f32,
        operands,
    );
    (Tensor::from_dispatch(y), Tensor::from_dispatch(h))
}

/// Checks the operands of the linear family: `x [M, K]`, `residual [M, K]`, `norm_weight [K]`,
/// `weight [N, K]`, `bias [N]`, one float dtype among f32, f16 and bf16.
pub fn check_args(
    x: &Tensor<2>,
    residual: Option<&Tensor<2>>,
    norm_weight: Option<&Tensor<1>>,
    weight: &Tensor<2>,
    bias: Option<&Tensor<1>>,
) -> Result<(), KernelError> {
    let [_, k] = x.dims();
    let n = weight.dims()[0];
    let dtype = x.dtype();
    check_x_and_weight(x, weight.dims())?;
    let same = |name: &str, d: DType| {
        if d == dtype {
            Ok(())
        } else {
            Err(KernelError::invalid(format!(
                "{name} has dtype {d:?}, x has {dtype:?}"
            )))
        }
    };
    same("weight", weight.dtype())?;
    if let Some(r) = residual {
        if r.dims() != x.dims() {
            return Err(KernelError::invalid(format!(
                "residual has shape {:?}, x has {:?}",
                r.dims(),
                x.dims()
            )));
        }
        same("residual", r.dtype())?;
    }
    if let Some(g) = norm_weight {
        if g.dims() != [k] {
            return Err(KernelError::invalid(format!(
                "norm_weight has shape {:?}; expected [{k}]",
                g.dims()
            )));
        }
        same("norm_weight", g.dtype())?;
    }
    if let Some(b) = bias {
        if b.dims() != [n] {
            return Err(KernelError::invalid(format!(
                "bias has shape {:?}; expected [{n}]",
                b.dims()
            )));
        }
        same("bias", b.dtype())?;
    }
    Ok(())
}

/// Checks `x [M, K]` (f32, f16 or bf16) against a weight of shape `weight [N, K]`.
pub(crate) fn check_x_and_weight(x: &Tensor<2>, weight: [usize; 2]) -> Result<(), KernelError> {
    let [_, k] = x.dims();
    let dtype = x.dtype();
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(KernelError::invalid(format!(
            "x has dtype {dtype:?}; expected f32, f16 or bf16"
        )));
    }
    if weight[1] != k {
        return Err(KernelError::invalid(format!(
            "weight has shape {weight:?}; expected [N, {k}] for x of shape {:?}",
            x.dims()
        )));
    }
    Ok(())
}

#[track_caller]
fn expect_valid(op: &str, result: Result<(), KernelError>) {
    if let Err(e) = result {
        panic!("{op}: {e}");
    }
}
