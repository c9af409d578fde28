//! Build script shared by the packages whose executables run CubeCL's CPU runtime (tests, the
//! CLI, the benchmarks): exports the compiler-runtime functions of
//! `cubecl-kernels/src/cpu_builtins.rs` in the executable's dynamic symbol table, where the
//! runtime's JIT looks them up.

fn main() {
    let target = std::env::var("TARGET").unwrap_or_default();
    if target.contains("linux") {
        println!("cargo:rustc-link-arg=-Wl,--export-dynamic-symbol=__truncsfbf2");
    }
}
