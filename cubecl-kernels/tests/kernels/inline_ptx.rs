//! The kernels' inline PTX compiled for NVPTX without a GPU: the vendored cubecl-llvm lowers it to
//! the instructions themselves (the softmax's fast exponential, the FP8 caches' paired
//! conversions, the FP8 products' paired encoding). The values are checked on CUDA by the
//! attention, FP8 cache and FP8 product tests.

use std::ffi::CStr;
use std::sync::Arc;

use cubecl::Compiler;
use cubecl::ir::nvidia::SmArch;
use cubecl::ir::{DeviceIdentity, HardwareProperties, MemoryDeviceProperties, features::Features};
use cubecl::prelude::*;
use cubecl_kernels::fast_exp::{FAST_EXP_LOWERED, exp2_approx};
use cubecl_kernels::fp8_codes::{PTX_CVT_LOWERED, decode_ptx, encode_e4m3_word};
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
use cubecl_runtime::kernel::CubeKernel;

#[cube(launch)]
fn exp2_each(input: &[f32], output: &mut [f32]) {
    if ABSOLUTE_POS < input.len() {
        output[ABSOLUTE_POS] = exp2_approx(input[ABSOLUTE_POS]);
    }
}

/// Eight FP8 codes a unit (two words) decoded to f32: E5M2 with `e5m2`, else E4M3.
#[cube(launch)]
fn decode_eight(input: &[u32], output: &mut [f32], #[comptime] e5m2: bool) {
    if 2 * ABSOLUTE_POS + 1 < input.len() {
        let mut words = Vector::<u32, Const<2>>::empty();
        words.insert(0usize, input[2 * ABSOLUTE_POS]);
        words.insert(1usize, input[2 * ABSOLUTE_POS + 1]);
        let codes = Vector::<cubecl::e4m3, Const<8>>::reinterpret(words);
        let values = decode_ptx::<cubecl::e4m3, f32, Const<8>>(codes, e5m2);
        let at = 8 * ABSOLUTE_POS;
        output[at] = values.extract(0usize);
        output[at + 1] = values.extract(1usize);
        output[at + 2] = values.extract(2usize);
        output[at + 3] = values.extract(3usize);
        output[at + 4] = values.extract(4usize);
        output[at + 5] = values.extract(5usize);
        output[at + 6] = values.extract(6usize);
        output[at + 7] = values.extract(7usize);
    }
}

/// Four values a unit encoded to one word of E4M3 codes, by PTX.
#[cube(launch)]
fn encode_four(input: &[f32], output: &mut [u32]) {
    if 4 * ABSOLUTE_POS + 3 < input.len() {
        let at = 4 * ABSOLUTE_POS;
        // The cast's type: unused by the PTX form.
        output[ABSOLUTE_POS] =
            encode_e4m3_word::<f32>(input[at], input[at + 1], input[at + 2], input[at + 3], true);
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

fn settings() -> KernelSettings {
    KernelSettings::new(
        *CubeDim::new_1d(64),
        ExecutionMode::Checked,
        AddressType::U32,
    )
}

/// `kernel`'s PTX for sm_90 through the vendored cubecl-llvm.
fn ptx_for_sm90(kernel: impl CubeKernel) -> String {
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
    unsafe { CStr::from_ptr(module.ptx.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn fast_exponential_is_one_ptx_instruction() {
    // This workspace builds the vendored cubecl-llvm, which lowers inline PTX.
    const { assert!(FAST_EXP_LOWERED) };
    let kernel = exp2_each::Exp2Each::new(
        settings(),
        offline_device(),
        Arc::new(TargetProperties::default()),
        BufferCompilationArg { inplace: None },
        BufferCompilationArg { inplace: None },
    );
    let ptx = ptx_for_sm90(kernel);
    assert_eq!(ptx.matches("ex2.approx.ftz.f32").count(), 1, "{ptx}");
    assert!(!ptx.contains("__nv_"), "no libdevice call:\n{ptx}");
}

#[test]
fn fp8_codes_convert_two_an_instruction() {
    const { assert!(PTX_CVT_LOWERED) };
    for (e5m2, instruction) in [
        (false, "cvt.rn.f16x2.e4m3x2"),
        (true, "cvt.rn.f16x2.e5m2x2"),
    ] {
        let kernel = decode_eight::DecodeEight::new(
            settings(),
            offline_device(),
            Arc::new(TargetProperties::default()),
            BufferCompilationArg { inplace: None },
            BufferCompilationArg { inplace: None },
            e5m2,
        );
        let ptx = ptx_for_sm90(kernel);
        // Eight codes, two a conversion; then one widening to f32 a value.
        assert_eq!(ptx.matches(instruction).count(), 4, "{ptx}");
        assert_eq!(ptx.matches("cvt.f32.f16").count(), 8, "{ptx}");
    }
}

#[test]
fn fp8_codes_encode_two_an_instruction() {
    const { assert!(PTX_CVT_LOWERED) };
    let kernel = encode_four::EncodeFour::new(
        settings(),
        offline_device(),
        Arc::new(TargetProperties::default()),
        BufferCompilationArg { inplace: None },
        BufferCompilationArg { inplace: None },
    );
    let ptx = ptx_for_sm90(kernel);
    // Four values, two a conversion, packed into one word.
    assert_eq!(
        ptx.matches("cvt.rn.satfinite.e4m3x2.f32").count(),
        2,
        "{ptx}"
    );
}
