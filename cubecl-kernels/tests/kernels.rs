//! CubeCL kernels against their plain-Burn references, on the CubeCL CPU runtime (no plane ops,
//! no tensor cores: the shared-memory paths). One test binary for link time.

mod kernels {
    mod attention;
    mod batch_invariance;
    #[cfg(feature = "cuda")]
    mod collective;
    pub mod common;
    mod cpu_builtins;
    mod fp8_kv;
    mod fp8_linear;
    mod host_io;
    #[cfg(feature = "cuda")]
    mod inline_ptx;
    mod linear;
    mod model_shapes;
    mod sampling;
    mod store_kv;
}
