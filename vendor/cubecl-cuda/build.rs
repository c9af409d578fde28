use cudarc::driver::sys::CUDA_VERSION;

fn main() {
    // burn-nanovllm patch: `GpuResource` carries the CUDA stream (`links` metadata, see Cargo.toml).
    println!("cargo::metadata=stream=1");
    println!("cargo::rustc-check-cfg=cfg(cuda_12050)");
    println!("cargo::rustc-check-cfg=cfg(cuda_12080)");

    if CUDA_VERSION >= 12050 {
        println!("cargo:rustc-cfg=cuda_12050");
    }
    if CUDA_VERSION >= 12080 {
        println!("cargo:rustc-cfg=cuda_12080");
    }
}
