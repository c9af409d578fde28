mod base;

#[cfg(any(feature = "amdgpu", feature = "nvptx"))]
pub(crate) mod bitcode;
pub mod branch;
#[cfg(any(feature = "amdgpu", feature = "nvptx"))]
pub(crate) mod buffer_params;
pub(crate) mod builtin_values;
#[cfg(any(feature = "amdgpu", feature = "nvptx"))]
pub mod builtins;
pub mod intrinsic;
pub(crate) mod llvm_module;
#[cfg(feature = "nvptx")]
pub(crate) mod llvm_options;
#[cfg(feature = "nvptx")]
pub(crate) mod loop_hints;
#[cfg(any(feature = "amdgpu", feature = "nvptx"))]
pub mod lowered_features;
pub mod lowering;
pub mod math_library;
pub mod matrix;
pub mod metadata;
#[cfg(all(test, any(feature = "amdgpu", feature = "nvptx")))]
pub(crate) mod offline_kernels;
pub mod plane;
pub mod plane_reduce;
pub mod polyfill;
pub mod shared_memory;
pub mod to_llvm;

pub use base::*;
#[cfg(any(feature = "amdgpu", feature = "nvptx"))]
pub use buffer_params::AtomicReads;
