//! CPU target.

pub mod abi;
pub mod entrypoint;
pub mod f16_evaluation;
pub mod jit;
pub mod ordered_atomic;
pub mod shared_memory;
pub mod synchronization;
pub mod to_llvm;
