//! Compiler-runtime functions that kernels JIT-compiled by CubeCL's CPU runtime may call.
//!
//! LLVM lowers `fptrunc float to bfloat` to a call of `__truncsfbf2` on x86 hosts without
//! AVX512-BF16. The JIT resolves such calls against the process's dynamic symbols, where
//! neither Rust's compiler-builtins nor GCC 12's libgcc provide it, so every bf16 kernel would
//! fail to link on such hosts ("Symbols not found: [ __truncsfbf2 ]"). We define it here; the
//! packages whose executables run the CPU runtime export it dynamically
//! (`build/export_builtins.rs`), and [`register`] keeps it linked.

/// `f32 → bf16`, rounding to nearest even (NaN stays NaN). The x86-64 ABI returns `__bf16`
/// in the low 16 bits of `xmm0`, where an `f32` return puts its bits.
#[unsafe(no_mangle)]
pub extern "C" fn __truncsfbf2(x: f32) -> f32 {
    f32::from_bits(u32::from(half::bf16::from_f32(x).to_bits()))
}

/// Keeps the functions above in every executable that creates a CubeCL CPU device.
pub(crate) fn register() {
    std::hint::black_box(__truncsfbf2 as extern "C" fn(f32) -> f32);
}
