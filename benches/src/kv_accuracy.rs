//! What an FP8 KV cache and FP8 weights cost in accuracy on a real checkpoint: perplexity of a
//! text the model did not train on, scored in windows through `LLMEngine::prompt_logits` (the prefill kernel
//! reads every key and value back from the cache), the top-1 agreement of every position with
//! the unquantised model, and greedy continuations of the text's first words.

use std::path::Path;

use anyhow::{Context, Result};
use burn_nanovllm::{
    DeviceKind, EngineConfig, KvCacheDtype, LLMEngine, Quantization, SamplingParams,
};

/// `max_model_len` of the scoring engines (at most the checkpoint's); windows are one token
/// shorter.
const WINDOW: usize = 1024;

/// Greedy continuations (text and token ids): prompts of this many tokens from the text, this
/// many new tokens.
const CONTINUATIONS: [(usize, usize); 3] = [(16, 32), (24, 32), (32, 32)];

/// One format's scores.
struct Scores {
    kv: KvCacheDtype,
    weights: Quantization,
    mean_nll: f64,
    picks: Vec<u32>,
    continuations: Vec<String>,
}

/// Scores `text` (at most `positions` predicted tokens) with the model's own dtype, each FP8
/// cache format, FP8 weights, and FP8 weights with an E4M3 cache, printing a table and
/// returning it as JSON.
pub(crate) fn run(
    dir: &Path,
    device: DeviceKind,
    text: &str,
    positions: usize,
) -> Result<serde_json::Value> {
    let mut all = Vec::new();
    for (kv, weights) in [
        (KvCacheDtype::Auto, Quantization::None),
        (KvCacheDtype::Fp8E4M3, Quantization::None),
        (KvCacheDtype::Fp8E5M2, Quantization::None),
        (KvCacheDtype::Auto, Quantization::Fp8),
        (KvCacheDtype::Fp8E4M3, Quantization::Fp8),
    ] {
        all.push(score(dir, device, text, positions, kv, weights)?);
    }
    let base = &all[0];
    let mut rows = Vec::new();
    println!(
        "kv_cache_dtype, quantization, positions, perplexity, vs unquantised, top-1 agreement"
    );
    for s in &all {
        let same = s
            .picks
            .iter()
            .zip(&base.picks)
            .filter(|(a, b)| a == b)
            .count();
        let agreement = same as f64 / base.picks.len() as f64;
        let (ppl, base_ppl) = (s.mean_nll.exp(), base.mean_nll.exp());
        println!(
            "{}, {}, {}, {ppl:.4}, {:+.3} %, {agreement:.4}",
            s.kv.name(),
            s.weights.name(),
            s.picks.len(),
            100.0 * (ppl / base_ppl - 1.0)
        );
        for (i, c) in s.continuations.iter().enumerate() {
            println!("  continuation {i}: {c}");
        }
        rows.push(serde_json::json!({
            "kv_cache_dtype": s.kv.name(),
            "quantization": s.weights.name(),
            "positions": s.picks.len(),
            "perplexity": ppl,
            "perplexity_change": ppl / base_ppl - 1.0,
            "top1_agreement": agreement,
            "continuations": s.continuations,
        }));
    }
    Ok(
        serde_json::json!({ "suite": "kv-accuracy", "model": dir.display().to_string(), "rows": rows }),
    )
}

fn score(
    dir: &Path,
    device: DeviceKind,
    text: &str,
    positions: usize,
    kv: KvCacheDtype,
    weights: Quantization,
) -> Result<Scores> {
    let window = WINDOW
        .min(model_qwen2::Qwen2Config::from_file(dir.join("config.json"))?.max_position_embeddings);
    let mut engine = LLMEngine::new(
        dir,
        EngineConfig {
            device,
            kv_cache_dtype: kv,
            quantization: weights,
            max_model_len: Some(window),
            max_num_batched_tokens: window,
            max_num_seqs: Some(8),
            num_kv_blocks: Some(4 * window.div_ceil(16)),
            enforce_eager: true,
            ..EngineConfig::default()
        },
    )
    .with_context(|| {
        format!(
            "engine with kv_cache_dtype {}, quantization {}",
            kv.name(),
            weights.name()
        )
    })?;
    let ids = engine.encode(text)?;
    let vocab = engine.model_config().vocab_size;
    let (mut nll, mut picks) = (0f64, Vec::new());
    for w in ids.chunks(window - 1).filter(|w| w.len() > 1) {
        if picks.len() >= positions {
            break;
        }
        let logits = engine.prompt_logits(w)?;
        for (pos, row) in logits.chunks(vocab).enumerate().take(w.len() - 1) {
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let z = row.iter().map(|x| ((x - m) as f64).exp()).sum::<f64>().ln() + m as f64;
            nll += z - row[w[pos + 1] as usize] as f64;
            let best = (0..vocab)
                .max_by(|&a, &b| row[a].total_cmp(&row[b]))
                .unwrap_or(0);
            picks.push(best as u32);
        }
    }
    anyhow::ensure!(!picks.is_empty(), "the text has fewer than two tokens");
    let mean_nll = nll / picks.len() as f64;
    let mut continuations = Vec::new();
    for (len, new) in CONTINUATIONS {
        let prompt = ids[..len.min(ids.len())].to_vec();
        let id = engine.add_request(
            prompt,
            SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(new)
            },
        )?;
        let (mut text, mut tokens) = (String::new(), Vec::new());
        let mut done = false;
        while !done {
            for o in engine.step()? {
                if o.id == id {
                    text.push_str(&o.new_text);
                    tokens.extend(o.new_token_ids);
                    done |= o.finish_reason.is_some();
                }
            }
        }
        continuations.push(format!("{text:?} {tokens:?}"));
    }
    Ok(Scores {
        kv,
        weights,
        mean_nll,
        picks,
        continuations,
    })
}
