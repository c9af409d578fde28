//! The kernels compiled to PTX for sm_90a without a GPU: their products are warp-group MMAs,
//! and the TMA one's loads bulk tensor copies.

use std::ffi::CStr;
use std::sync::Arc;

use cubecl::Compiler;
use cubecl::ir::features::{WgmmaConfig, WgmmaElems};
use cubecl::ir::nvidia::SmArch;
use cubecl::prelude::*;
use cubecl_llvm::nvptx::ptx_version::PtxVersion;
use cubecl_llvm::{LlvmTarget, PlironArtifact, PlironCompiler, PlironOptions};
use cubecl_runtime::kernel::CubeKernel;
use hopper_prefill::{KEYS, UNITS, prefill_wgmma, prefill_wgmma_tma};

/// A Hopper as the compiler sees it: bf16 × bf16 → f32 warpgroup MMAs of `n` up to 256, TMA.
fn hopper() -> Arc<DeviceProperties> {
    use cubecl::ir::{OpaqueType, features::Tma};
    let mut props = cubecl_core::runtime_tests::offline::offline_device_properties(32);
    props.features.tma.insert(Tma::Base);
    props.register_opaque_type(OpaqueType::TensorMap);
    props.register_opaque_type(OpaqueType::Barrier);
    props.features.matmul.wgmma.insert(WgmmaConfig {
        elems: WgmmaElems {
            a: half::bf16::cube_type(),
            b: half::bf16::cube_type(),
            cd: f32::cube_type(),
        },
        m: 64,
        n_granularity: 8,
        n_max: 256,
        k: 16,
    });
    Arc::new(props)
}

fn settings() -> KernelSettings {
    KernelSettings::new(
        *CubeDim::new_1d(UNITS as u32),
        ExecutionMode::Unchecked,
        AddressType::U32,
    )
}

/// The PTX of the kernel that stages its tiles with its units, or of the TMA one (`tma`).
fn ptx(d: usize, p_shared: bool, tma: bool) -> String {
    let kernel: Box<dyn CubeKernel> = if tma {
        Box::new(prefill_wgmma_tma::PrefillWgmmaTma::<half::bf16>::new(
            settings(),
            hopper(),
            Arc::new(TargetProperties::default()),
            (),
            (),
            (),
            BufferCompilationArg { inplace: None },
            (),
            (),
            (),
            d,
            false,
            p_shared,
        ))
    } else {
        Box::new(prefill_wgmma::PrefillWgmma::<half::bf16>::new(
            settings(),
            hopper(),
            Arc::new(TargetProperties::default()),
            BufferCompilationArg { inplace: None },
            BufferCompilationArg { inplace: None },
            BufferCompilationArg { inplace: None },
            BufferCompilationArg { inplace: None },
            (),
            (),
            (),
            d,
            false,
            p_shared,
        ))
    };
    let options = PlironOptions {
        sm_arch: Some(SmArch::new(90, true)),
        ptx_version: PtxVersion::for_driver(12080),
        ..Default::default()
    };
    let mut compiler = PlironCompiler {
        target: LlvmTarget::Nvptx,
    };
    let PlironArtifact::NvptxCode(module) = compiler
        .compile(kernel.define(), &options)
        .expect("the kernel compiles for sm_90a")
    else {
        panic!("the NVPTX target produces PTX");
    };
    // SAFETY: the module's PTX is NUL-terminated.
    unsafe { CStr::from_ptr(module.ptx.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn both_products_are_warpgroup_mmas() {
    let forms = [false, true].into_iter().flat_map(|tma| {
        [
            (64, false, tma),
            (128, false, tma),
            (64, true, tma),
            (128, true, tma),
        ]
    });
    for (d, p_shared, tma) in forms {
        let ptx = ptx(d, p_shared, tma);
        // HOPPER_PREFILL_PTX_DIR=DIR keeps the PTX for reading.
        if let Ok(dir) = std::env::var("HOPPER_PREFILL_PTX_DIR") {
            let p = if p_shared { "-p-shared" } else { "" };
            let t = if tma { "-tma" } else { "" };
            std::fs::write(format!("{dir}/prefill_wgmma_d{d}{p}{t}.ptx"), &ptx).unwrap();
        }
        // S = Q·Kᵀ: D / 16 MMAs of n = KEYS; P·V: KEYS / 16 MMAs of n = D, A from registers.
        let s = ptx
            .matches(&format!("wgmma.mma_async.sync.aligned.m64n{KEYS}k16"))
            .count();
        let pv = ptx
            .matches(&format!("wgmma.mma_async.sync.aligned.m64n{d}k16"))
            .count();
        assert!(
            s >= d / 16,
            "D {d}, P shared {p_shared}: {s} MMAs for S:\n{ptx}"
        );
        assert!(
            pv >= KEYS / 16,
            "D {d}, P shared {p_shared}: {pv} MMAs for P·V:\n{ptx}"
        );
    }
}
