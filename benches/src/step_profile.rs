//! What an engine benchmark prints about its run on stderr: the step graphs it captured, and
//! its steps by class (host phases, the device's idle share, the device timeline).

/// The engine's step graphs: sizes, their memory as measured to size the KV pool, refusals,
/// and each capture's time and device memory.
pub(crate) fn print_graphs(limits: &engine::EngineLimits) {
    eprintln!(
        "max_model_len {}; step graphs (tokens) {:?}: {} MiB measured when the KV pool was \
         sized ({} blocks, {} sequences at most)",
        limits.max_model_len,
        limits.graph_sizes,
        limits.graph_memory >> 20,
        limits.num_kv_blocks,
        limits.max_num_seqs
    );
    for f in &limits.graph_failures {
        eprintln!("graph capture refused: {f}");
    }
    for c in &limits.graph_captures {
        eprintln!(
            "graph {} tokens{}: captured in {:.2} s, {} MiB of device memory",
            c.tokens,
            if c.decode_only { " (decode only)" } else { "" },
            c.time.as_secs_f64(),
            c.bytes.map_or("?".into(), |b| (b >> 20).to_string())
        );
    }
}

/// Steps by class with their host phases and the device's idle share. Synchronous steps: the
/// device has nothing queued from the moment a step's draws are back until the next step's
/// forward is enqueued, so its idle share is (step − wait) / step. Overlapped steps: a step
/// that waited for the device (flushing its sampling, or for the previous step's draws) after
/// enqueueing its own forward left the device no gap — the forward was queued behind the work
/// it waited for; one that did not wait (under 20 µs) may have left a gap as long as its host
/// time. Both are upper bounds (the first kernels may start before the enqueue returns).
/// With `gpu` (`--gpu-timeline`: CUDA events, aligned with `records`) it also prints the
/// device's measured busy and idle time per step class.
pub(crate) fn print_step_profile(
    records: &[burn_nanovllm::StepRecord],
    gpu: &[Option<burn_nanovllm::GpuStep>],
    overlap: bool,
) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    type Filter = fn(&burn_nanovllm::StepRecord) -> bool;
    // Each class: its steps' indices in `records` (and `gpu`).
    let mut classes: Vec<(String, Vec<usize>)> = Vec::new();
    let indices = |f: &dyn Fn(&burn_nanovllm::StepRecord) -> bool| -> Vec<usize> {
        (0..records.len()).filter(|&i| f(&records[i])).collect()
    };
    for (name, f) in [
        (
            "mixed/prefill, graph",
            (|r| r.num_tokens > r.num_seqs && r.graph) as Filter,
        ),
        ("mixed/prefill, eager", |r| {
            r.num_tokens > r.num_seqs && !r.graph
        }),
    ] {
        classes.push((name.into(), indices(&f)));
    }
    for (lo, hi) in [(1, 32), (33, 128), (129, 256), (257, usize::MAX)] {
        classes.push((
            if hi == usize::MAX {
                format!("decode {lo}+")
            } else {
                format!("decode {lo}-{hi}")
            },
            indices(&|r| r.num_tokens == r.num_seqs && (lo..=hi).contains(&r.num_seqs)),
        ));
    }
    eprintln!(
        "step profile (ms per step, {} steps): class, steps, tokens, schedule, forward, \
         sample, wait, post, GPU idle % (upper bound)",
        if overlap { "overlapped" } else { "synchronous" }
    );
    for (name, steps) in classes.iter().filter(|(_, rs)| !rs.is_empty()) {
        let rs: Vec<&burn_nanovllm::StepRecord> = steps.iter().map(|&i| &records[i]).collect();
        let n = rs.len() as f64;
        let mean = |f: &dyn Fn(&burn_nanovllm::StepRecord) -> std::time::Duration| {
            rs.iter().map(|r| ms(f(r))).sum::<f64>() / n
        };
        let step =
            |r: &burn_nanovllm::StepRecord| r.schedule + r.forward + r.sample + r.wait + r.post;
        let idle = |r: &burn_nanovllm::StepRecord| {
            if overlap && r.wait.as_micros() >= 20 {
                std::time::Duration::ZERO
            } else {
                step(r) - r.wait
            }
        };
        let idle = 100.0 * mean(&idle) / mean(&step);
        eprintln!(
            "{name}, {}, {:.0}, {:.3}, {:.3}, {:.3}, {:.3}, {:.3}, {idle:.1}",
            rs.len(),
            rs.iter().map(|r| r.num_tokens).sum::<usize>() as f64 / n,
            mean(&|r| r.schedule),
            mean(&|r| r.forward),
            mean(&|r| r.sample),
            mean(&|r| r.wait),
            mean(&|r| r.post),
        );
    }
    if !gpu.is_empty() {
        eprintln!(
            "device timeline (CUDA events, ms per step): class, steps, busy, idle before, idle %"
        );
        for (name, rs) in classes.iter().filter(|(_, rs)| !rs.is_empty()) {
            let steps: Vec<&burn_nanovllm::GpuStep> = rs
                .iter()
                .filter_map(|&i| gpu.get(i).and_then(Option::as_ref))
                .collect();
            if steps.is_empty() {
                continue;
            }
            let n = steps.len() as f64;
            let busy = steps.iter().map(|g| ms(g.busy)).sum::<f64>() / n;
            let idle = steps.iter().map(|g| ms(g.idle_before)).sum::<f64>() / n;
            eprintln!(
                "{name}, {}, {busy:.3}, {idle:.3}, {:.1}",
                steps.len(),
                100.0 * idle / (busy + idle)
            );
        }
    }
    let mixed: Vec<String> = records
        .iter()
        .filter(|r| r.num_tokens > r.num_seqs)
        .take(40)
        .map(|r| format!("{}/{}/{}", r.num_tokens, r.num_decodes, r.num_seqs))
        .collect();
    if !mixed.is_empty() {
        eprintln!(
            "first mixed steps (tokens/decode rows/seqs): {}",
            mixed.join(" ")
        );
    }
    for r in records
        .iter()
        .filter(|r| r.num_tokens > r.num_seqs && !r.graph)
        .take(5)
    {
        eprintln!(
            "eager mixed step: {} seqs ({} decode rows), {} tokens: forward {:.1} ms, sample {:.1} ms, \
             wait {:.1} ms",
            r.num_seqs,
            r.num_decodes,
            r.num_tokens,
            ms(r.forward),
            ms(r.sample),
            ms(r.wait)
        );
    }
}
