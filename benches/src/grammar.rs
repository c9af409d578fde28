//! Structured outputs' host cost: for `R` constrained rows per step, the time to compute their
//! token masks and to advance their matchers past the drawn tokens, through the engine's own
//! row-parallel helpers (`engine::structured_output::{fill_masks, accept_tokens}`), on a pool of
//! all cores and on one thread. Rows follow bench.py's JSON schema ([`bench_schema`]) and draw
//! a uniformly random allowed token each step (as random weights do); a finished row starts a
//! fresh request. No device is involved: this is the work the engine overlaps with a forward.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use engine::structured_output::{
    GrammarCompiler, GrammarMatcher, StructuredOutput, accept_tokens, fill_masks,
};
use rand::{Rng, SeedableRng, rngs::StdRng};
use serde_json::json;

use crate::engine_bench::bench_schema;
use crate::report::Report;

/// A uniformly random token among those `mask` (`⌈V/32⌉` words) allows.
fn random_allowed(mask: &[u32], rng: &mut StdRng) -> u32 {
    let total: u32 = mask.iter().map(|w| w.count_ones()).sum();
    let mut k = rng.random_range(0..total);
    for (i, &w) in mask.iter().enumerate() {
        let n = w.count_ones();
        if k < n {
            let mut w = w;
            for _ in 0..k {
                w &= w - 1;
            }
            return i as u32 * 32 + w.trailing_zeros();
        }
        k -= n;
    }
    unreachable!("k < total")
}

/// Times per step, summed over the measured steps.
#[derive(Default)]
struct Totals {
    mask: Duration,
    advance: Duration,
    masks: usize,
    forced: usize,
    trie_nodes: usize,
    slices: usize,
    finished: usize,
}

/// `steps` steps of `rows` constrained rows on the current rayon pool.
fn simulate(
    compiler: &GrammarCompiler,
    constraint: &StructuredOutput,
    rows: usize,
    steps: usize,
    seed: u64,
) -> Result<Totals> {
    let words = cubecl_kernels::mask_words(compiler.vocab_size());
    let mut rng = StdRng::seed_from_u64(seed);
    let mut matchers: Vec<GrammarMatcher> = (0..rows)
        .map(|_| compiler.compile(constraint))
        .collect::<engine::Result<_>>()?;
    let mut masks = vec![0u32; rows * words];
    let mut totals = Totals::default();
    for _ in 0..steps {
        let start = Instant::now();
        let mut refs: Vec<Option<&mut GrammarMatcher>> = matchers.iter_mut().map(Some).collect();
        let errors = fill_masks(&mut refs, &mut masks, words);
        totals.mask += start.elapsed();
        if let Some(e) = errors.into_iter().flatten().next() {
            anyhow::bail!("mask failed: {e}");
        }
        let tokens: Vec<u32> = masks
            .chunks(words)
            .map(|m| random_allowed(m, &mut rng))
            .collect();
        for (m, row) in matchers.iter().zip(masks.chunks(words)) {
            let (nodes, slices) = m.last_mask_cost();
            totals.trie_nodes += nodes;
            totals.slices += slices;
            totals.forced += (row.iter().map(|w| w.count_ones()).sum::<u32>() == 1) as usize;
        }
        totals.masks += rows;
        let start = Instant::now();
        let mut pairs: Vec<(&mut GrammarMatcher, u32)> =
            matchers.iter_mut().zip(tokens.iter().copied()).collect();
        let done = accept_tokens(&mut pairs);
        totals.advance += start.elapsed();
        for (m, done) in matchers.iter_mut().zip(done) {
            if done.map_err(anyhow::Error::msg)? {
                totals.finished += 1;
                *m = compiler.compile(constraint)?;
            }
        }
    }
    Ok(totals)
}

/// The grammar suite: mask and advance time per step for each row count in `rows`, with all
/// cores and with one thread, over the tokenizer of `tokenizer_dir` and a `vocab_size`-token
/// logits row.
pub fn run(
    tokenizer_dir: &Path,
    vocab_size: usize,
    rows: &[usize],
    steps: usize,
) -> Result<Report> {
    let tokenizer = model_qwen2::Qwen2Tokenizer::from_dir(tokenizer_dir)?;
    let compiler = GrammarCompiler::new(&tokenizer, &[], vocab_size)?;
    let constraint = StructuredOutput::JsonSchema(bench_schema());
    let mut report = Report::new(
        "grammar masks and advances (bench.py's JSON schema, random allowed tokens)",
        &[
            "rows",
            "threads",
            "steps",
            "mask_ms_per_step",
            "advance_ms_per_step",
            "mask_us_per_row",
            "advance_us_per_row",
            "trie_nodes_per_mask",
            "slices_per_mask",
            "forced_rows_pct",
            "finished",
        ],
    );
    let all = rayon::current_num_threads();
    for &r in rows {
        for threads in [all, 1] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()?;
            // Warm-up: first masks fill llguidance's lexer caches.
            pool.install(|| simulate(&compiler, &constraint, r, 8, 1))?;
            let t = pool.install(|| simulate(&compiler, &constraint, r, steps, 2))?;
            let ms = |d: Duration| d.as_secs_f64() * 1e3 / steps as f64;
            let per_row = |d: Duration| d.as_secs_f64() * 1e6 / t.masks as f64;
            report.row(vec![
                json!(r),
                json!(threads),
                json!(steps),
                json!(ms(t.mask)),
                json!(ms(t.advance)),
                json!(per_row(t.mask)),
                json!(per_row(t.advance)),
                json!(t.trie_nodes as f64 / t.masks as f64),
                json!(t.slices as f64 / t.masks as f64),
                json!(100.0 * t.forced as f64 / t.masks as f64),
                json!(t.finished),
            ]);
            if threads == 1 {
                break;
            }
        }
    }
    Ok(report)
}
