//! What a CubeCL device offers the kernels, read from its properties: launch parameters come
//! from here, not from constants scattered through the kernels.

use burn::tensor::DType;
use cubecl::client::Client;
use cubecl::features::Plane;
use cubecl::ir::{ElemType, FloatKind, features::MmaConfig};

/// Capabilities of one device, as the launchers need them.
#[derive(Clone, Debug)]
pub(crate) struct DeviceCaps {
    /// Plane (warp) reductions and shuffles are available (false on CPU runtimes).
    pub plane_ops: bool,
    /// Units per plane (32 on NVIDIA, 1 on cubecl-cpu).
    pub plane_size: usize,
    /// Tensor-core shapes and types.
    pub cmma: Vec<MmaConfig>,
    /// Shapes and types of manual (register-level) MMA.
    pub mma: Vec<MmaConfig>,
    /// Units per cube for kernels that synchronise their cube: 4 planes on GPUs; on runtimes
    /// without planes (cubecl-cpu runs each unit of a synchronising cube on its own OS thread
    /// with a spin barrier) a cube no wider than the host's cores.
    pub cube_units: usize,
    /// Cubes that run at once, roughly: streaming multiprocessors, or CPU cores.
    pub multiprocessors: usize,
    /// Last-level cache (L2 on GPUs), bytes, where the runtime reports it.
    pub cache_bytes: Option<usize>,
    /// Shared memory one cube may use, bytes.
    pub shared_bytes: usize,
    /// Most units one cube may have.
    pub max_cube_units: usize,
    /// PTX's paired FP8 conversions (`cvt.rn.f16x2.e4m3x2`): a CUDA device of compute
    /// capability ≥ 8.9.
    pub fp8_convert: bool,
}

impl DeviceCaps {
    /// Reads the device behind `client`.
    pub(crate) fn of(client: &Client) -> Self {
        let props = client.properties();
        let plane_ops = props.features.plane.contains(Plane::Ops);
        let plane_size = if plane_ops {
            props.hardware.plane_size_max as usize
        } else {
            1
        };
        let cube_units = if plane_ops {
            4 * plane_size
        } else {
            let cores = props.hardware.num_cpu_cores.unwrap_or(1) as usize;
            if cores >= 2 { 2 } else { 1 }
        };
        let multiprocessors = props
            .hardware
            .num_streaming_multiprocessors
            .or(props.hardware.num_cpu_cores)
            .unwrap_or(1) as usize;
        Self {
            plane_ops,
            plane_size,
            cmma: props.features.matmul.cmma.iter().copied().collect(),
            mma: props.features.matmul.mma.iter().copied().collect(),
            cube_units,
            multiprocessors,
            cache_bytes: props.hardware.last_level_cache_size,
            shared_bytes: props.hardware.max_shared_memory_size,
            max_cube_units: props.hardware.max_units_per_cube as usize,
            fp8_convert: client.name() == "cuda"
                && compute_capability(&props.identity.fingerprint).is_some_and(|cc| cc >= 89),
        }
    }

    /// True if 16×16×16 cmma with `dtype` inputs and f32 accumulators is available.
    pub(crate) fn cmma_16x16x16(&self, dtype: DType) -> bool {
        self.plane_size == 32 && offers(&self.cmma, dtype, (16, 16, 16))
    }

    /// True if manual 16×8×16 MMA (`mma.sync`) with `dtype` inputs and f32 accumulators is
    /// available.
    pub(crate) fn mma_16x8x16(&self, dtype: DType) -> bool {
        self.plane_size == 32 && offers(&self.mma, dtype, (16, 8, 16))
    }
}

/// True if `configs` hold shape `mnk` with `dtype` inputs (bf16 or f16) and f32 accumulators.
fn offers(configs: &[MmaConfig], dtype: DType, mnk: (u32, u32, u32)) -> bool {
    let kind = match dtype {
        DType::BF16 => FloatKind::BF16,
        DType::F16 => FloatKind::F16,
        _ => return false,
    };
    configs.iter().any(|c| {
        c.a_type == ElemType::Float(kind)
            && c.b_type == ElemType::Float(kind)
            && c.cd_type == ElemType::Float(FloatKind::F32)
            && (c.m, c.n, c.k) == mnk
    })
}

/// The compute capability (`90` for 9.0) in a CUDA device's identity, `ptx_sm90`: what
/// cubecl-cuda compiles against. (The LLVM route's feature list drops the FP8 `mma` forms that
/// would otherwise tell an 8.9 device apart, so the identity is the one place that says it.)
fn compute_capability(fingerprint: &str) -> Option<u32> {
    fingerprint.strip_prefix("ptx_sm")?.parse().ok()
}
