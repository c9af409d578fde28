//! Every kernel the engine runs on CubeCL's CPU runtime compiles for every kind of x86-64 CPU,
//! whatever CPU runs the test.
//!
//! The CPU runtime JIT-compiles each kernel for the host it runs on (LLVM's host CPU and all its
//! features). LLVM's x86 code generator cannot lower everything its optimizer produces for every
//! feature set: on CPUs with AVX512-BF16 (AMD Zen 4, Intel Sapphire Rapids) a pair of bf16
//! stores at a small constant distance became a gapped masked vector store
//! (`llvm.masked.store.v33bf16`) that instruction selection refused, aborting the process
//! ("LLVM ERROR: Cannot select"). A test that only runs the kernels catches that on such a host
//! alone. This one also compiles the LLVM IR of every kernel the engine ran (dumped by CubeCL,
//! `CUBECL_DEBUG_PLIRON`) through the JIT's pipeline (`default<O3>`, then code generation) for
//! each CPU in [`TARGETS`], without running the code. LLVM aborts the process on such a
//! failure, so the work runs in a child process, which names each kernel and CPU before
//! compiling it.
//!
//! Every function the compiled code calls outside itself must also resolve in this process's
//! global scope, as the JIT resolves it: on CPUs without AVX512-BF16 LLVM converts f32 to bf16
//! through `__truncsfbf2`, which only the builtins library cubecl-kernels loads provides
//! (`cubecl-kernels/src/cpu_builtins.rs`); a kernel calling anything else unresolvable would
//! fail to link on such a host.

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;

use burn::tensor::DType;
use engine::{DeviceKind, EngineConfig, LLMEngine};
use llvm_sys::core::{
    LLVMContextCreate, LLVMContextDispose, LLVMCreateMemoryBufferWithMemoryRangeCopy,
    LLVMDisposeMemoryBuffer, LLVMDisposeMessage, LLVMDisposeModule, LLVMGetBufferSize,
    LLVMGetBufferStart, LLVMSetTarget,
};
use llvm_sys::error::{LLVMDisposeErrorMessage, LLVMGetErrorMessage};
use llvm_sys::ir_reader::LLVMParseIRInContext2;
use llvm_sys::target::{
    LLVMDisposeTargetData, LLVMInitializeX86AsmParser, LLVMInitializeX86AsmPrinter,
    LLVMInitializeX86Target, LLVMInitializeX86TargetInfo, LLVMInitializeX86TargetMC,
    LLVMSetModuleDataLayout,
};
use llvm_sys::target_machine::{
    LLVMCodeGenFileType, LLVMCodeGenOptLevel, LLVMCodeModel, LLVMCreateTargetDataLayout,
    LLVMCreateTargetMachine, LLVMDisposeTargetMachine, LLVMGetTargetFromTriple, LLVMRelocMode,
    LLVMTargetMachineEmitToMemoryBuffer,
};
use llvm_sys::transforms::pass_builder::{
    LLVMCreatePassBuilderOptions, LLVMDisposePassBuilderOptions, LLVMRunPasses,
};
use model_qwen2::{Qwen2Config, Qwen2Model};

use super::common::greedy;

/// x86-64 CPUs whose feature sets the kernels must compile for (LLVM CPU names).
const TARGETS: [(&str, &str); 5] = [
    ("znver4", "AVX-512 with BF16, without FP16 (AMD EPYC Genoa)"),
    ("sapphirerapids", "AVX-512 with BF16 and FP16"),
    ("skylake-avx512", "AVX-512 without BF16"),
    ("haswell", "AVX2 only"),
    ("x86-64", "SSE2 baseline"),
];

/// Set in the child process: the folder of the kernels' IR dumps.
const CHILD_ENV: &str = "ENGINE_TEST_CPU_TARGETS_DUMP";

const TEST_NAME: &str = "engine::cpu_targets::kernels_compile_for_every_x86_cpu";

#[test]
fn kernels_compile_for_every_x86_cpu() {
    if !cfg!(target_arch = "x86_64") {
        eprintln!("skipped: the CPU targets checked are x86-64 ones");
        return;
    }
    if let Ok(dir) = std::env::var(CHILD_ENV) {
        return child(Path::new(&dir));
    }
    let dir =
        std::env::temp_dir().join(format!("burn-nanovllm-cpu-targets-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", TEST_NAME, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, &dir)
        .env("CUBECL_DEBUG_PLIRON", &dir)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let log = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    assert!(
        out.status.success(),
        "the kernel check process failed ({}); its last lines:\n{}",
        out.status,
        tail.join("\n")
    );
    assert!(
        log.contains("compiled"),
        "the child compiled nothing:\n{}",
        tail.join("\n")
    );
}

/// The child: runs the engine on CubeCL's CPU runtime over small random-weight models of the
/// shapes that matter to the kernels' code (head dims 16 to 128, grouped and multi-head
/// attention, Qwen3's q/k norm) in bf16 and f16, then compiles each kernel's IR for every CPU.
fn child(dir: &Path) {
    for (arch, heads, kv_heads, head_dim, dtype) in [
        ("Qwen2ForCausalLM", 4, 2, 16, DType::BF16),
        ("Qwen2ForCausalLM", 2, 1, 64, DType::BF16),
        ("Qwen3ForCausalLM", 4, 2, 32, DType::BF16),
        ("Qwen2ForCausalLM", 2, 2, 128, DType::BF16),
        ("Qwen2ForCausalLM", 2, 1, 64, DType::F16),
    ] {
        eprintln!("running {arch} heads {heads}/{kv_heads} × {head_dim} {dtype:?} on cubecl-cpu");
        run_engine(arch, heads, kv_heads, head_dim, dtype);
    }
    let kernels = dumped_kernels(dir);
    assert!(!kernels.is_empty(), "CubeCL dumped no kernel IR");
    // SAFETY: LLVM's target initialisation is idempotent.
    unsafe {
        LLVMInitializeX86TargetInfo();
        LLVMInitializeX86Target();
        LLVMInitializeX86TargetMC();
        LLVMInitializeX86AsmPrinter();
        LLVMInitializeX86AsmParser();
    }
    cubecl_kernels::load_cpu_builtins().unwrap();
    let mut called = std::collections::BTreeSet::new();
    for (cpu, what) in TARGETS {
        for (name, ir) in &kernels {
            eprintln!("compiling {name} for {cpu} ({what})");
            let object =
                compile(ir, cpu).unwrap_or_else(|e| panic!("{name} for {cpu} ({what}): {e}"));
            for symbol in undefined_symbols(&object) {
                let c = CString::new(symbol.as_str()).unwrap();
                // SAFETY: a lookup of a NUL-terminated name in the global scope.
                let found = unsafe { !libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr()).is_null() };
                assert!(
                    found,
                    "{name} for {cpu} ({what}) calls `{symbol}`, unresolvable here"
                );
                called.insert(symbol);
            }
        }
        eprintln!("compiled {} kernels for {cpu}", kernels.len());
    }
    // bf16 kernels compiled for a CPU without AVX512-BF16 call the conversion routine: if none
    // did, this check would have checked nothing.
    assert!(
        called.contains("__truncsfbf2"),
        "no kernel called __truncsfbf2 (external calls: {called:?})"
    );
    eprintln!("external calls, all resolved: {called:?}");
}

/// The names an ELF object file uses without defining them.
fn undefined_symbols(elf: &[u8]) -> Vec<String> {
    use object::{Object, ObjectSymbol};
    let file = object::File::parse(elf).expect("an ELF object");
    file.symbols()
        .filter(|s| s.is_undefined() && !s.name().unwrap_or_default().is_empty())
        .map(|s| s.name().unwrap().to_string())
        .collect()
}

/// A two-layer random-weight model of the given attention shape through a few engine steps: a
/// 48-token prefill chunk (the tiled products), chunks mixed with decodes (the skinny ones),
/// then decodes alone.
fn run_engine(arch: &str, heads: usize, kv_heads: usize, head_dim: usize, dtype: DType) {
    let hidden = heads * head_dim;
    let json = format!(
        r#"{{"architectures": ["{arch}"], "vocab_size": 512, "hidden_size": {hidden},
        "intermediate_size": {}, "num_hidden_layers": 2, "num_attention_heads": {heads},
        "num_key_value_heads": {kv_heads}, "head_dim": {head_dim}, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 256, "tie_word_embeddings": true,
        "eos_token_id": 0}}"#,
        2 * hidden
    );
    let config = Qwen2Config::from_json(&json).unwrap();
    let device = DeviceKind::CubeclCpu.device().unwrap();
    let model = Qwen2Model::dummy(config, dtype, &device);
    let mut engine = LLMEngine::with_model(
        model,
        None,
        device,
        EngineConfig {
            device: DeviceKind::CubeclCpu,
            dtype: Some(dtype),
            max_num_seqs: Some(4),
            max_num_batched_tokens: 48,
            num_kv_blocks: Some(64),
            max_model_len: Some(128),
            ..EngineConfig::default()
        },
    )
    .unwrap();
    let out = super::common::run_all(
        &mut engine,
        vec![
            ((1..62).collect(), greedy(4)),
            ((100..112).collect(), greedy(6)),
        ],
    );
    assert_eq!(out[0].tokens.len(), 4);
    assert_eq!(out[1].tokens.len(), 6);
}

/// The `llvm.ll` of every kernel under `dir` (one folder per kernel), by kernel name.
fn dumped_kernels(dir: &Path) -> Vec<(String, String)> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("llvm.ll").is_file())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .map(|d| {
            let name = d.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(d.join("llvm.ll")).unwrap())
        })
        .collect()
}

/// Runs the JIT's pipeline over `ir` for x86-64 CPU `cpu` (its default features): `default<O3>`
/// with the CPU's target machine, then code generation to an object file, returned.
fn compile(ir: &str, cpu: &str) -> Result<Vec<u8>, String> {
    let triple = c"x86_64-unknown-linux-gnu";
    let cpu = CString::new(cpu).unwrap();
    // SAFETY: every LLVM object is created and disposed here, messages are read once and
    // freed, and the strings outlive the calls.
    unsafe {
        let ctx = LLVMContextCreate();
        let buffer = LLVMCreateMemoryBufferWithMemoryRangeCopy(
            ir.as_ptr().cast(),
            ir.len(),
            c"kernel".as_ptr(),
        );
        let mut module = std::ptr::null_mut();
        let mut message = std::ptr::null_mut();
        let parsed = LLVMParseIRInContext2(ctx, buffer, &mut module, &mut message);
        LLVMDisposeMemoryBuffer(buffer);
        if parsed != 0 {
            let e = take(message);
            LLVMContextDispose(ctx);
            return Err(format!("parse: {e}"));
        }
        let mut target = std::ptr::null_mut();
        if LLVMGetTargetFromTriple(triple.as_ptr(), &mut target, &mut message) != 0 {
            let e = take(message);
            LLVMDisposeModule(module);
            LLVMContextDispose(ctx);
            return Err(format!("target: {e}"));
        }
        let machine = LLVMCreateTargetMachine(
            target,
            triple.as_ptr(),
            cpu.as_ptr(),
            c"".as_ptr(),
            LLVMCodeGenOptLevel::LLVMCodeGenLevelAggressive,
            LLVMRelocMode::LLVMRelocDefault,
            LLVMCodeModel::LLVMCodeModelDefault,
        );
        LLVMSetTarget(module, triple.as_ptr());
        let layout = LLVMCreateTargetDataLayout(machine);
        LLVMSetModuleDataLayout(module, layout);
        LLVMDisposeTargetData(layout);
        let options = LLVMCreatePassBuilderOptions();
        let error = LLVMRunPasses(module, c"default<O3>".as_ptr(), machine, options);
        LLVMDisposePassBuilderOptions(options);
        let result;
        if !error.is_null() {
            let m = LLVMGetErrorMessage(error);
            result = Err(format!(
                "optimisation: {}",
                CStr::from_ptr(m).to_string_lossy()
            ));
            LLVMDisposeErrorMessage(m);
        } else {
            let mut object = std::ptr::null_mut();
            if LLVMTargetMachineEmitToMemoryBuffer(
                machine,
                module,
                LLVMCodeGenFileType::LLVMObjectFile,
                &mut message,
                &mut object,
            ) != 0
            {
                result = Err(format!("code generation: {}", take(message)));
            } else {
                let start = LLVMGetBufferStart(object).cast::<u8>();
                result = Ok(std::slice::from_raw_parts(start, LLVMGetBufferSize(object)).to_vec());
                LLVMDisposeMemoryBuffer(object);
            }
        }
        LLVMDisposeTargetMachine(machine);
        LLVMDisposeModule(module);
        LLVMContextDispose(ctx);
        result
    }
}

/// An LLVM message as a `String`, freed.
///
/// # Safety
/// `message` is null or a message LLVM allocated for the caller.
unsafe fn take(message: *mut std::ffi::c_char) -> String {
    if message.is_null() {
        return String::new();
    }
    // SAFETY: the caller's contract.
    unsafe {
        let s = CStr::from_ptr(message).to_string_lossy().into_owned();
        LLVMDisposeMessage(message);
        s
    }
}
