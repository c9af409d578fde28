//! Compiler-runtime functions for kernels that CubeCL's CPU runtime JIT-compiles, built by
//! `build.rs` into a small shared library (`no_std`, no dependencies) that
//! `src/cpu_builtins.rs` loads into the process's global symbol scope at run time, where the
//! JIT resolves external calls. Not a module of the crate.

#![no_std]

/// `f32 → bf16`, rounding to nearest even; a NaN stays a (quiet) NaN of the same sign. LLVM
/// calls it for `fptrunc float to bfloat` on x86 CPUs without AVX512-BF16. The x86-64 ABI
/// returns `__bf16` in the low 16 bits of `xmm0`, where an `f32` return puts its bits.
#[unsafe(no_mangle)]
pub extern "C" fn __truncsfbf2(x: f32) -> f32 {
    let bits = x.to_bits();
    let bf16 = if x.is_nan() {
        (bits >> 16) | 0x40
    } else {
        bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16
    };
    f32::from_bits(bf16)
}

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    loop {}
}
