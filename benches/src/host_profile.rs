//! `--host-profile`: where the host threads spend their time during a timed run, from a
//! sampling profile (pprof-rs: a SIGPROF timer at ~1 kHz of CPU time, stacks unwound and
//! symbolised in process; the GPU machine has no `perf`). Printed as a table: the share of
//! each thread's samples whose stack holds a frame of each category (inclusive; a sample counts
//! in every category it touches), then the crates where the samples were taken (self), then the
//! hottest functions. Needs the `host-profile` feature and an unstripped binary (symbols).

use std::collections::HashMap;

/// What the host profile attributes samples to: `(label, substrings of a frame's symbol)`.
const CATEGORIES: [(&str, &[&str]); 12] = [
    (
        "engine step loop (engine::)",
        &["engine::engine::LLMEngine::step"],
    ),
    (
        "scheduling (engine scheduler, block manager)",
        &["engine::scheduler::", "engine::block_manager::"],
    ),
    (
        "model forward (model_qwen2::)",
        &["model_qwen2::model::Qwen2Model::forward"],
    ),
    (
        "attention metadata (host tables, uploads)",
        &["AttentionMetadata::new"],
    ),
    (
        "Burn fusion (queueing, optimisation, execution)",
        &["burn_fusion::"],
    ),
    (
        "cuBLASLt route (operand resolution, plans, enqueue)",
        &["rms_norm_linear::cublas::"],
    ),
    (
        "our kernel launchers (cubecl_kernels)",
        &["cubecl_kernels::"],
    ),
    (
        "CubeCL launch path (cubecl_runtime/server)",
        &["cubecl_runtime::", "cubecl_server::"],
    ),
    (
        "autotune (cubecl_runtime::tune)",
        &["cubecl_runtime::tune::"],
    ),
    (
        "memory management (pools, allocations)",
        &["memory_management::", "MemoryManagement"],
    ),
    (
        "kernel compilation (cubecl_llvm, pliron, LLVM)",
        &["cubecl_llvm::", "pliron", "llvm"],
    ),
    (
        "CUDA driver calls (libcuda, cudarc)",
        &[
            "cudarc::", "libcuda", "cuLaunch", "cuMemcpy", "cuStream", "cuEvent",
        ],
    ),
];

/// Runs `f` under the profiler when `on`, then prints the tables.
pub fn profile<T>(on: bool, f: impl FnOnce() -> T) -> T {
    if !on {
        return f();
    }
    imp::profile(f)
}

#[cfg(feature = "host-profile")]
mod imp {
    use super::*;

    pub fn profile<T>(f: impl FnOnce() -> T) -> T {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(997)
            .blocklist(&["libc", "libgcc", "pthread", "vdso"])
            .build()
            .expect("start the profiler");
        let out = f();
        match guard.report().build() {
            Ok(report) => {
                let samples: Vec<(String, Vec<String>, usize)> = report
                    .data
                    .iter()
                    .map(|(frames, &n)| {
                        // Leaf first; each frame's symbols innermost first.
                        let names = frames
                            .frames
                            .iter()
                            .flat_map(|f| f.iter().map(|s| s.name()))
                            .collect();
                        (frames.thread_name_or_id(), names, n.max(0) as usize)
                    })
                    .collect();
                print(&samples);
            }
            Err(e) => eprintln!("host profile: no report ({e})"),
        }
        out
    }
}

#[cfg(not(feature = "host-profile"))]
mod imp {
    pub fn profile<T>(f: impl FnOnce() -> T) -> T {
        eprintln!("host profile: this build lacks the `host-profile` feature; running unprofiled");
        f()
    }
}

/// The crate of a demangled symbol (`<burn_fusion::X as Y>::f` → `burn_fusion`), or the
/// symbol itself for one without a path (C libraries, the driver).
#[cfg_attr(not(feature = "host-profile"), allow(dead_code))]
fn crate_of(symbol: &str) -> String {
    let s = symbol.trim_start_matches('<').trim_start_matches('&');
    match s.find("::") {
        Some(i) => s[..i].to_string(),
        None => format!("(no path) {}", &s[..s.len().min(40)]),
    }
}

/// `(thread, stack leaf first, samples)` as the three tables.
#[cfg_attr(not(feature = "host-profile"), allow(dead_code))]
fn print(samples: &[(String, Vec<String>, usize)]) {
    let mut threads: HashMap<&str, usize> = HashMap::new();
    for (t, _, n) in samples {
        *threads.entry(t).or_default() += n;
    }
    let mut threads: Vec<_> = threads.into_iter().collect();
    threads.sort_by_key(|b| std::cmp::Reverse(b.1));
    let total: usize = threads.iter().map(|t| t.1).sum();
    eprintln!("host profile: {total} samples (~1 ms of CPU each)");
    for (thread, n) in threads.iter().take(4) {
        eprintln!("\nthread {thread}: {n} samples, inclusive share by category");
        let of_thread: Vec<_> = samples.iter().filter(|s| s.0 == *thread).collect();
        for (label, keys) in CATEGORIES {
            let hit: usize = of_thread
                .iter()
                .filter(|(_, stack, _)| stack.iter().any(|f| keys.iter().any(|k| f.contains(k))))
                .map(|s| s.2)
                .sum();
            eprintln!("  {:5.1} %  {label}", 100.0 * hit as f64 / *n as f64);
        }
        let mut leaf: HashMap<String, usize> = HashMap::new();
        let mut inclusive: HashMap<&str, usize> = HashMap::new();
        for (_, stack, k) in &of_thread {
            *leaf
                .entry(crate_of(stack.first().map_or("?", |s| s)))
                .or_default() += k;
            let mut seen = std::collections::HashSet::new();
            for f in stack.iter() {
                if seen.insert(f.as_str()) {
                    *inclusive.entry(f.as_str()).or_default() += k;
                }
            }
        }
        let mut leaf: Vec<_> = leaf.into_iter().collect();
        leaf.sort_by_key(|b| std::cmp::Reverse(b.1));
        eprintln!("  self, by crate:");
        for (c, k) in leaf.iter().take(12) {
            eprintln!("  {:5.1} %  {c}", 100.0 * *k as f64 / *n as f64);
        }
        let mut inclusive: Vec<_> = inclusive.into_iter().collect();
        inclusive.sort_by_key(|b| std::cmp::Reverse(b.1));
        eprintln!("  hottest functions (inclusive):");
        for (f, k) in inclusive.iter().take(40) {
            let short: String = f.chars().take(150).collect();
            eprintln!("  {:5.1} %  {short}", 100.0 * *k as f64 / *n as f64);
        }
    }
}
