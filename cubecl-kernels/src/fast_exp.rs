//! The exponential of the attention kernels' softmax on CUDA: PTX `ex2.approx.ftz.f32`, one
//! multi-function-unit instruction (FlashAttention's choice), where libdevice's accurate `expf`
//! (what CubeCL's LLVM route lowers `exp` to) takes eight: range reduction on the FMA pipe around
//! the same instruction. It is approximate (about two units in the last place); results below
//! 2⁻¹²⁶ flush to zero.
//!
//! The instruction is written as inline PTX (`gpu_asm!`), which CubeCL 0.11.3's LLVM route lowers
//! only with the vendored cubecl-llvm (vendor/README.md): its build script announces the lowering,
//! and `build.rs` turns that into `cfg(cubecl_llvm_asm)`. Built against the published crate,
//! [`FAST_EXP_LOWERED`] is false and the kernels keep `exp`.

/// Whether [`exp2_approx()`] can be compiled by this build's CubeCL (CUDA kernels only).
pub const FAST_EXP_LOWERED: bool = cfg!(cubecl_llvm_asm);

/// `log₂ e`: `eˣ = 2^(x·log₂ e)`.
pub const LOG2_E: f32 = std::f32::consts::LOG2_E;

pub use ptx::exp2_approx;

// `#[cube]` generates an undocumented module beside the function.
#[allow(missing_docs)]
mod ptx {
    use cubecl::prelude::*;

    /// `2ˣ` by PTX `ex2.approx.ftz.f32` (`2^−∞ = 0`). Only in CUDA kernels, and only where
    /// [`FAST_EXP_LOWERED`](crate::fast_exp::FAST_EXP_LOWERED).
    #[cube]
    pub fn exp2_approx(x: f32) -> f32 {
        let y: f32;
        gpu_asm!("ex2.approx.ftz.f32 {}, {};", out(_) y, in(_) x, options(pure, nomem));
        y
    }
}
