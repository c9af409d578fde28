//! FP8 through the engine: KV caches (`EngineConfig::kv_cache_dtype`) and weights
//! (`EngineConfig::quantization`), on the trained default model (real weights: its keys,
//! values and activations have the ranges the scales must cover) on CubeCL's CPU runtime in
//! f32 (the FP8 products emulated; `ENGINE_TEST_DEVICE=cuda`: CUDA in bf16, cuBLASLt's FP8
//! GEMM): prompt log-probabilities close to the unquantised model's, KV scales measured per
//! layer and kv head, four times the blocks of an f32 cache in the same budget, and generation
//! through chunked prefill, prefix-cache hits and preemption agreeing with the prompt's own
//! scoring.

use engine::{DeviceKind, EngineConfig, KvCacheDtype, LLMEngine, Quantization};

use super::common::*;

/// CUDA when `ENGINE_TEST_DEVICE` names it, else CubeCL's CPU runtime (Burn's CPU backend has
/// no FP8 kernels).
fn device() -> DeviceKind {
    match test_device() {
        DeviceKind::Cuda(i) => DeviceKind::Cuda(i),
        _ => DeviceKind::CubeclCpu,
    }
}

fn engine(kv_cache_dtype: KvCacheDtype, config: EngineConfig) -> LLMEngine {
    let dtype = match device() {
        DeviceKind::Cuda(_) => burn::tensor::DType::BF16,
        _ => burn::tensor::DType::F32,
    };
    engine_on(
        DEFAULT_MODEL,
        device(),
        EngineConfig {
            kv_cache_dtype,
            dtype: Some(dtype),
            ..config
        },
    )
}

/// `small_config` with FP8 weights.
fn fp8_weights() -> EngineConfig {
    EngineConfig {
        quantization: Quantization::Fp8,
        ..small_config()
    }
}

/// Next-token log-likelihood and top-1 picks of the golden prompts with each format: E4M3
/// keeps the mean negative log-likelihood within 2 % of the unquantised cache's and the top-1
/// pick at ≥ 90 % of positions; E5M2 (two mantissa bits) within 5 % and 85 %. A cache of
/// scales 1 (vLLM's default without a checkpoint scale) would saturate any key beyond 448.
#[test]
fn fp8_prompt_scores_stay_close_to_the_unquantised_cache() {
    let golden = Golden::load(DEFAULT_MODEL);
    let prompts = golden.prompts();
    let reference = engine(KvCacheDtype::Auto, small_config());
    assert!(reference.limits().kv_scales.is_none());
    let score = |e: &LLMEngine| prompt_scores(e, &prompts);
    let (base_nll, base_picks) = score(&reference);
    for (kv, nll_tol, top1) in [
        (KvCacheDtype::Fp8E4M3, 0.02, 0.90),
        (KvCacheDtype::Fp8E5M2, 0.05, 0.85),
    ] {
        let e = engine(kv, small_config());
        let scales = e.limits().kv_scales.clone().expect("measured scales");
        let layers = e.model_config().num_hidden_layers;
        let kv_heads = e.model_config().num_key_value_heads;
        assert_eq!(scales.keys.len(), layers);
        for s in scales.keys.iter().chain(&scales.values) {
            assert_eq!(s.len(), kv_heads);
            assert!(s.iter().all(|x| x.is_finite() && *x > 0.0), "{kv:?}: {s:?}");
        }
        let scores = score(&e);
        assert_close(
            &format!("{kv:?} cache"),
            scores,
            (base_nll, &base_picks[..]),
            nll_tol,
            top1,
        );
    }
}

/// The KV budget holds four times the blocks of an f32 cache (CPU sizing: `cpu_kv_cache_bytes`).
#[test]
fn fp8_cache_holds_more_blocks_in_the_same_budget() {
    if matches!(device(), DeviceKind::Cuda(_)) {
        return; // CUDA sizes the pool from free memory: measured in docs/BENCHMARKS.md.
    }
    let config = || EngineConfig {
        cpu_kv_cache_bytes: 4 << 20,
        max_num_seqs: Some(64),
        max_num_batched_tokens: 64,
        max_model_len: Some(256),
        ..EngineConfig::default()
    };
    let f32_blocks = engine(KvCacheDtype::Auto, config()).limits().num_kv_blocks;
    let fp8 = engine(KvCacheDtype::Fp8E4M3, config());
    assert_eq!(fp8.limits().kv_cache_dtype, KvCacheDtype::Fp8E4M3);
    let fp8_blocks = fp8.limits().num_kv_blocks;
    assert!(
        fp8_blocks >= 4 * f32_blocks - 3 && fp8_blocks <= 4 * f32_blocks + 3,
        "{fp8_blocks} FP8 blocks vs {f32_blocks} f32"
    );
}

/// Greedy generation over an FP8 cache, with and without FP8 weights, with chunked prefill
/// (24-token steps), a prefix of whole blocks shared by every prompt (cache hits) and a pool
/// too small for all of them (preemption): every request completes, and its first token is the
/// top pick of its prompt's own scoring (same engine) where that pick leads by a clear margin.
#[test]
fn fp8_generation_survives_chunking_prefix_hits_and_preemption() {
    let golden = Golden::load(DEFAULT_MODEL);
    // Golden prompts in a row, cut to three whole blocks that every request shares.
    let mut shared: Vec<u32> = golden.prompts().concat();
    assert!(shared.len() >= 48, "{} shared tokens", shared.len());
    shared.truncate(48);
    let prompts: Vec<Vec<u32>> = golden
        .prompts()
        .iter()
        .map(|p| shared.iter().chain(p).copied().collect())
        .collect();
    for quantization in [Quantization::None, Quantization::Fp8] {
        let mut e = engine(
            KvCacheDtype::Fp8E4M3,
            tight_pool(EngineConfig {
                enable_prefix_caching: true,
                quantization,
                ..small_config()
            }),
        );
        assert_eq!(e.limits().quantization, quantization);
        let vocab = e.model_config().vocab_size;
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| e.add_request(p.clone(), greedy(24)).unwrap())
            .collect();
        let done = drain(&mut e, &ids);
        let mut checked = 0;
        for (p, f) in prompts.iter().zip(&done) {
            assert_eq!(f.tokens.len(), 24, "{quantization:?}");
            let lp = log_softmax(&e.prompt_logits(p).unwrap(), vocab);
            let last = &lp[(p.len() - 1) * vocab..];
            let top = argmax(last);
            let mut sorted = last.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 0.05 {
                assert_eq!(f.tokens[0] as usize, top, "{quantization:?}: first token");
                checked += 1;
            }
        }
        assert!(
            checked >= prompts.len() / 2,
            "{quantization:?}: {checked} prompts with a clear pick"
        );
        let stats = e.stats();
        assert!(stats.preemptions > 0, "{quantization:?}: no preemption");
        assert!(
            stats.prefix_hit_tokens > 0,
            "{quantization:?}: no prefix-cache hit"
        );
    }
}

/// FP8 weights (each layer's products E4M3 with a scale per output feature, activations
/// quantised per token) keep the golden prompts' mean negative log-likelihood within 2 % of
/// the unquantised model's and the top-1 pick at ≥ 90 % of positions; with an FP8 cache as
/// well, within 3 % and 85 %.
#[test]
fn fp8_weights_keep_prompt_scores_close() {
    let golden = Golden::load(DEFAULT_MODEL);
    let prompts = golden.prompts();
    let reference = engine(KvCacheDtype::Auto, small_config());
    assert_eq!(reference.limits().quantization, Quantization::None);
    let (base_nll, base_picks) = prompt_scores(&reference, &prompts);
    drop(reference);
    for (kv, nll_tol, top1) in [
        (KvCacheDtype::Auto, 0.02, 0.90),
        (KvCacheDtype::Fp8E4M3, 0.03, 0.85),
    ] {
        let e = engine(kv, fp8_weights());
        assert_eq!(e.limits().quantization, Quantization::Fp8);
        let scores = prompt_scores(&e, &prompts);
        let what = format!("fp8 weights, {kv:?} cache");
        assert_close(&what, scores, (base_nll, &base_picks[..]), nll_tol, top1);
    }
}

/// Under tensor parallelism (TP 2 on CubeCL's CPU runtime, ranks as threads) each rank
/// quantises its own shard (its rows of q/k/v and gate/up, its columns of o_proj and down, each
/// with its own scale, as are the activations of its shard): the greedy continuations of the
/// golden prompts agree with one rank's with FP8 weights about as far as one rank's FP8 ones
/// agree with its unquantised weights' — the common prefixes at least 3/4 as long in total, the
/// rest being quantisation noise of another grain (`prompt_logits` runs on one rank only). A
/// rank with wrong codes or scales parts after a token or two.
#[test]
fn fp8_weights_under_tensor_parallelism() {
    if matches!(device(), DeviceKind::Cuda(_)) {
        return; // Several GPUs: measured on the device (docs/BENCHMARKS.md).
    }
    let prompts = Golden::load(DEFAULT_MODEL).prompts();
    let continue_all = |config: EngineConfig| {
        let quantization = config.quantization;
        let mut e = engine(KvCacheDtype::Auto, config);
        assert_eq!(e.limits().quantization, quantization);
        let ids: Vec<_> = prompts
            .iter()
            .map(|p| e.add_request(p.clone(), greedy(8)).unwrap())
            .collect();
        drain(&mut e, &ids)
    };
    let one = continue_all(fp8_weights());
    let two = continue_all(EngineConfig {
        tensor_parallel_size: 2,
        ..fp8_weights()
    });
    let common_prefixes = |x: &[Finished], y: &[Finished]| -> Vec<usize> {
        x.iter()
            .zip(y)
            .map(|(a, b)| {
                a.tokens
                    .iter()
                    .zip(&b.tokens)
                    .take_while(|(x, y)| x == y)
                    .count()
            })
            .collect()
    };
    let common = common_prefixes(&one, &two);
    let quantisation = common_prefixes(&one, &continue_all(small_config()));
    eprintln!(
        "TP 2 against one rank, FP8 weights: common greedy prefixes {common:?} of 8; one rank's \
         FP8 against its unquantised weights: {quantisation:?}"
    );
    let total = |c: &[usize]| c.iter().sum::<usize>();
    assert!(
        total(&common) * 4 >= total(&quantisation) * 3,
        "TP 2 parts from one rank early: {common:?}, against FP8's own {quantisation:?}"
    );
}

/// Mean NLL within `nll_tol` (relative) of the reference's and the top-1 picks agreeing at a
/// fraction ≥ `top1` of positions (both printed).
fn assert_close(
    what: &str,
    (nll, picks): (f64, Vec<usize>),
    (base_nll, base_picks): (f64, &[usize]),
    nll_tol: f64,
    top1: f64,
) {
    let same = picks.iter().zip(base_picks).filter(|(a, b)| a == b).count();
    let agreement = same as f64 / picks.len() as f64;
    eprintln!("{what}: mean NLL {nll:.4} vs {base_nll:.4}, top-1 agreement {agreement:.3}");
    assert!(
        ((nll - base_nll) / base_nll).abs() < nll_tol,
        "{what}: mean NLL {nll} vs {base_nll}"
    );
    assert!(agreement >= top1, "{what}: top-1 agreement {agreement}");
}

/// FP8 weights on Burn's CPU backend are refused naming the option.
#[test]
fn fp8_weights_are_refused_without_fp8_kernels() {
    let err = LLMEngine::new(
        fixture(DEFAULT_MODEL),
        EngineConfig {
            device: DeviceKind::Cpu,
            ..fp8_weights()
        },
    )
    .err()
    .expect("refused")
    .to_string();
    assert!(err.contains("quantization") && err.contains("fp8"), "{err}");
}

/// A copy of the `qwen2-tiny-untied` fixture in a temporary folder whose first `layers` layers
/// carry f32 scalars `self_attn.k_scale` = 0.5 + layer and `self_attn.v_scale` = 0.25 ·
/// (layer + 1), as vLLM and llm-compressor export them.
fn checkpoint_with_kv_scales(tag: &str, layers: usize) -> std::path::PathBuf {
    let src = fixture("qwen2-tiny-untied");
    let dir = std::env::temp_dir().join(format!("fp8-kv-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let scales: Vec<(String, [u8; 4])> = (0..layers)
        .flat_map(|l| {
            [
                (
                    format!("model.layers.{l}.self_attn.k_scale"),
                    0.5 + l as f32,
                ),
                (
                    format!("model.layers.{l}.self_attn.v_scale"),
                    0.25 * (l + 1) as f32,
                ),
            ]
        })
        .map(|(n, v)| (n, v.to_le_bytes()))
        .collect();
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st.tensors();
    for (name, b) in &scales {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![], b).unwrap();
        views.push((name.clone(), view));
    }
    let out = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
    dir
}

/// A checkpoint's own `k_scale`/`v_scale` are the FP8 cache's scales (each layer's given to
/// every kv head), the unquantised cache loads the same checkpoint, and scales on only some
/// layers are refused naming the first layer without them.
#[test]
fn fp8_cache_takes_the_checkpoint_scales() {
    let layers = 3;
    let dir = checkpoint_with_kv_scales("all", layers);
    let config = || EngineConfig {
        device: device(),
        ..small_config()
    };
    let fp8 = LLMEngine::new(
        &dir,
        EngineConfig {
            kv_cache_dtype: KvCacheDtype::Fp8E4M3,
            ..config()
        },
    )
    .unwrap();
    let c = fp8.model_config();
    assert_eq!(c.num_hidden_layers, layers, "the fixture's depth");
    let scales = fp8.limits().kv_scales.clone().expect("scales");
    let kv_heads = c.num_key_value_heads;
    for l in 0..layers {
        assert_eq!(scales.keys[l], vec![0.5 + l as f32; kv_heads]);
        assert_eq!(scales.values[l], vec![0.25 * (l + 1) as f32; kv_heads]);
    }
    drop(fp8);
    let plain = LLMEngine::new(&dir, config()).unwrap();
    assert!(plain.limits().kv_scales.is_none());
    drop(plain);
    let partial = checkpoint_with_kv_scales("partial", 1);
    let err = LLMEngine::new(&partial, config())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("model.layers.1.self_attn.k_scale"), "{err}");
    for d in [dir, partial] {
        let _ = std::fs::remove_dir_all(d);
    }
}
