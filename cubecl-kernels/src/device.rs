//! Choosing a Burn device by name, probing GPU runtimes before Burn touches them (Burn's CUDA
//! device is lazy and panics on first use when no driver can be loaded).

use burn::tensor::Device;

use crate::KernelError;

/// The devices this crate is built and tested for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeviceKind {
    /// Burn's pure-Rust CPU backend (Flex): the reference path, no kernels.
    Cpu,
    /// CubeCL's CPU runtime (LLVM JIT): runs the CubeCL kernels on the host, without plane ops.
    CubeclCpu,
    /// A CUDA GPU: the CubeCL kernels with plane ops and tensor cores.
    Cuda(usize),
}

impl std::str::FromStr for DeviceKind {
    type Err = KernelError;

    /// `cpu`, `cubecl-cpu`, `cuda` or `cuda:N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cubecl-cpu" => Ok(Self::CubeclCpu),
            "cuda" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| {
                    KernelError::invalid(format!(
                        "unknown device `{s}` (expected cpu, cubecl-cpu, cuda or cuda:N)"
                    ))
                }),
        }
    }
}

impl DeviceKind {
    /// The Burn device, after checking that the runtime is built in and the hardware exists.
    pub fn device(self) -> Result<Device, KernelError> {
        match self {
            Self::Cpu => Ok(Device::flex()),
            #[cfg(feature = "cpu")]
            Self::CubeclCpu => {
                probe(cubecl::Device::cpu())?;
                Ok(Device::cpu())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(i) => {
                probe(cubecl::Device::cuda(i))?;
                Ok(Device::cuda(i))
            }
            #[allow(unreachable_patterns)]
            other => Err(KernelError::invalid(format!(
                "{other:?}: this build lacks the runtime (cargo feature)"
            ))),
        }
    }

    /// Whether this device computes in `dtype`, with the reason when not. bf16 on CubeCL's CPU
    /// runtime needs `__truncsfbf2` on CPUs without AVX512-BF16, loaded here
    /// ([`crate::load_cpu_builtins`]); a failure is refused here rather than at the first kernel.
    pub fn supports_dtype(self, dtype: burn::tensor::DType) -> Result<(), KernelError> {
        #[cfg(feature = "cpu")]
        if self == Self::CubeclCpu && dtype == burn::tensor::DType::BF16 {
            return crate::cpu_builtins::bf16_support();
        }
        let _ = dtype;
        Ok(())
    }
}

fn probe(
    device: Result<cubecl::Device, cubecl::device::DeviceUnavailable>,
) -> Result<(), KernelError> {
    device
        .map(|_| ())
        .map_err(|e| KernelError::invalid(format!("device unavailable: {e}")))
}

/// Runs `build` with `device`'s allocations in persistent memory: on CubeCL runtimes, one
/// buffer of its own per tensor, outside the dynamic pools (elsewhere `build` runs as is).
/// For what lives as long as a model — weights, the KV cache: in the dynamic pools the largest
/// of them sets the size of their pages, and so of every page a captured CUDA graph keeps
/// (one KV layer of Qwen3-0.6B made that 1.1 GB a graph on the H100, docs/BENCHMARKS.md).
pub fn persistent<I: Send, T: Send>(device: &Device, input: I, build: impl Fn(I) -> T + Send) -> T {
    use burn::backend::{Backend, Dispatch};
    Dispatch::memory_persistent_allocations(device.as_dispatch(), input, build)
}
