//! CubeCL kernels against their plain-Burn references, on the CubeCL CPU runtime (no plane ops,
//! no tensor cores: the shared-memory paths). One test binary for link time.

mod kernels {
    mod attention;
    mod batch_invariance;
    #[cfg(feature = "cuda")]
    mod collective;
    pub mod common;
    mod cpu_builtins;
    #[cfg(feature = "cuda")]
    mod fast_exp;
    mod fp8_kv;
    mod fp8_linear;
    mod host_io;
    mod linear;
    mod model_shapes;
    mod sampling;
    mod store_kv;
}
