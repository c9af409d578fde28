//! The softmax's fast exponential compiled for NVPTX without a GPU: the vendored cubecl-llvm lowers
//! the inline PTX to the instruction itself (the values are checked on CUDA by the attention tests).

use std::ffi::CStr;
use std::sync::Arc;

use cubecl::Compiler;
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{DeviceIdentity, HardwareProperties, MemoryDeviceProperties, features::Features};
use cubecl::prelude::*;
use cubecl_kernels::fast_exp::{FAST_EXP_LOWERED, exp2_approx};
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
use cubecl_runtime::kernel::CubeKernel;

#[cube(launch)]
fn exp2_each(input: &[f32], output: &mut [f32]) {
    if ABSOLUTE_POS < input.len() {
        output[ABSOLUTE_POS] = exp2_approx(input[ABSOLUTE_POS]);
    }
}

/// A device that only the compiler sees.
fn offline_device() -> Arc<DeviceProperties> {
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 32,
        max_shared_memory_size: 65536,
        max_cube_count: (u32::MAX, u16::MAX as u32, u16::MAX as u32),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 1024),
        num_streaming_multiprocessors: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    Arc::new(DeviceProperties::new(
        Features::default(),
        MemoryDeviceProperties::new(u64::MAX, 256),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: "offline".to_string(),
            fingerprint: "offline".to_string(),
            physical: None,
        },
    ))
}

#[test]
fn fast_exponential_is_one_ptx_instruction() {
    // This workspace builds the vendored cubecl-llvm, which lowers inline PTX.
    const { assert!(FAST_EXP_LOWERED) };
    let settings = KernelSettings::new(
        *CubeDim::new_1d(64),
        ExecutionMode::Checked,
        AddressType::U32,
    );
    let kernel = exp2_each::Exp2Each::new(
        settings,
        offline_device(),
        Arc::new(TargetProperties::default()),
        BufferCompilationArg { inplace: None },
        BufferCompilationArg { inplace: None },
    );
    let options = PlironOptions {
        sm_arch: Some(SmArch::new(90, false)),
        ptx_version: PtxVersion::for_driver(12080),
        ..Default::default()
    };
    let mut compiler = PlironCompiler {
        target: LlvmTarget::Nvptx,
    };
    let PlironArtifact::NvptxCode(module) = compiler
        .compile(kernel.define(), &options)
        .expect("the kernel compiles for sm_90")
    else {
        panic!("the NVPTX target produces PTX");
    };
    // SAFETY: the module's PTX is NUL-terminated.
    let ptx = unsafe { CStr::from_ptr(module.ptx.as_ptr()) }.to_string_lossy();
    assert_eq!(ptx.matches("ex2.approx.ftz.f32").count(), 1, "{ptx}");
    assert!(!ptx.contains("__nv_"), "no libdevice call:\n{ptx}");
}
