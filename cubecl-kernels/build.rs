//! Build script of cubecl-kernels.
//!
//! - `cfg(cubecl_cuda_stream)` when the cubecl-cuda in the build is the vendored one that hands out
//!   CubeCL's CUDA stream (vendor/README.md; its build script says so through `links` metadata,
//!   which reaches this script as `DEP_CUBECL_CUDA_STREAM_STREAM`): cuBLASLt then runs on that
//!   stream, inside CUDA graphs too. With the published crate it runs fenced on a stream of its own
//!   (`src/rms_norm_linear/cublas.rs`).
//! - `cfg(cubecl_llvm_asm)` when the cubecl-llvm in the build is the vendored one that lowers inline
//!   PTX on NVPTX (`DEP_CUBECL_LLVM_ASM_NVPTX_ASM`, vendor/README.md): the attention kernels'
//!   softmax then takes PTX's fast exponential (`src/fast_exp.rs`).
//! - With the `cpu` feature on x86-64 Linux: `builtins/cpu_builtins.rs` compiled (by the same
//!   `rustc`, for the same target) into a small shared library that `src/cpu_builtins.rs` embeds
//!   and loads at run time for CubeCL's CPU JIT, and `cfg(cpu_builtins_library)`. Should that
//!   compilation fail, the crate builds without it and the engine refuses bf16 on CPUs that
//!   would need it, saying why.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(cubecl_cuda_stream)");
    println!("cargo::rustc-check-cfg=cfg(cpu_builtins_library)");
    println!("cargo::rustc-check-cfg=cfg(cubecl_llvm_asm)");
    println!("cargo::rerun-if-env-changed=DEP_CUBECL_LLVM_ASM_NVPTX_ASM");
    if std::env::var_os("DEP_CUBECL_LLVM_ASM_NVPTX_ASM").is_some() {
        println!("cargo::rustc-cfg=cubecl_llvm_asm");
    }
    println!("cargo::rerun-if-env-changed=DEP_CUBECL_CUDA_STREAM_STREAM");
    println!("cargo::rerun-if-changed=builtins/cpu_builtins.rs");
    if std::env::var_os("DEP_CUBECL_CUDA_STREAM_STREAM").is_some() {
        println!("cargo::rustc-cfg=cubecl_cuda_stream");
    }
    let target = std::env::var("TARGET").unwrap_or_default();
    let cpu = std::env::var_os("CARGO_FEATURE_CPU").is_some();
    if cpu && target.starts_with("x86_64") && target.contains("linux") {
        match build_builtins(&target) {
            Ok(()) => println!("cargo::rustc-cfg=cpu_builtins_library"),
            Err(e) => println!(
                "cargo::warning=cubecl-kernels: the CPU runtime's builtins library was not built \
                 ({e}); bf16 on cubecl-cpu will need AVX512-BF16"
            ),
        }
    }
}

/// `rustc --crate-type cdylib builtins/cpu_builtins.rs` into `$OUT_DIR/libcpu_builtins.so`.
fn build_builtins(target: &str) -> Result<(), String> {
    let out = PathBuf::from(std::env::var("OUT_DIR").map_err(|e| e.to_string())?);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let mut cmd = Command::new(rustc);
    cmd.args([
        "--edition=2024",
        "--crate-type=cdylib",
        "--crate-name=cpu_builtins",
        "-Copt-level=2",
        "-Cpanic=abort",
        "-Cstrip=symbols",
        "--target",
        target,
        "builtins/cpu_builtins.rs",
        "-o",
    ])
    .arg(out.join("libcpu_builtins.so"));
    if let Ok(linker) = std::env::var("RUSTC_LINKER") {
        cmd.arg(format!("-Clinker={linker}"));
    }
    let result = cmd.output().map_err(|e| format!("running rustc: {e}"))?;
    if result.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&result.stderr)
            .trim()
            .replace('\n', " "))
    }
}
