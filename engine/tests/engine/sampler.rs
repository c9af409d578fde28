//! The engine's sampler: penalties and bans on the device against the host reference.

use std::sync::Arc;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use engine::SamplingParams;
use engine::sampler::{SamplerRow, TokenMasks, apply_penalties, apply_penalties_host, sample};
use rand::{Rng, SeedableRng, rngs::StdRng};

use super::common::{Golden, engine_on, greedy, run_all, small_config, test_device};

fn rows_and_logits(vocab: usize) -> (Vec<Arc<SamplingParams>>, Vec<Vec<u32>>, Vec<f32>) {
    let mut rng = StdRng::seed_from_u64(5);
    let params = vec![
        Arc::new(SamplingParams {
            repetition_penalty: 1.3,
            ..SamplingParams::default()
        }),
        Arc::new(SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            ..SamplingParams::default()
        }),
        Arc::new(SamplingParams {
            repetition_penalty: 0.8,
            presence_penalty: -0.4,
            frequency_penalty: 1.5,
            ..SamplingParams::default()
        }),
        Arc::new(SamplingParams::default()),
    ];
    let histories: Vec<Vec<u32>> = (0..4)
        .map(|_| {
            (0..40)
                .map(|_| rng.random_range(0..vocab as u32 / 4))
                .collect()
        })
        .collect();
    let logits = (0..4 * vocab)
        .map(|_| rng.random::<f32>() * 8.0 - 4.0)
        .collect();
    (params, histories, logits)
}

fn check_penalties(device: &Device) {
    let vocab = 300;
    let (params, histories, logits) = rows_and_logits(vocab);
    let rows: Vec<SamplerRow<'_>> = (0..4)
        .map(|r| SamplerRow {
            params: &params[r],
            seed: 0,
            prompt: &histories[r][..20],
            output: &histories[r][20..],
            banned: if r == 3 { vec![5, 17] } else { Vec::new() },
        })
        .collect();
    let mut expected = logits.clone();
    apply_penalties_host(&mut expected, vocab, &rows);
    let t = Tensor::<2>::from_data(
        TensorData::new(logits.clone(), [4, vocab]),
        (device, DType::F32),
    );
    let got = apply_penalties(t, &rows)
        .into_data()
        .try_into_vec_as::<f32>()
        .unwrap();
    let mut changed = 0;
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert!(g == e || (g - e).abs() < 1e-6, "logit {i}: {g} vs {e}");
        changed += (*e != logits[i]) as usize;
    }
    assert!(changed > 40, "the penalties changed only {changed} logits");
    assert_eq!(got[3 * vocab + 5], f32::NEG_INFINITY);
    // A banned token is never drawn, even greedily when it is the largest logit.
    let mut peaked = logits.clone();
    peaked[3 * vocab + 17] = 100.0;
    let greedy = SamplingParams::greedy(1);
    let row = [SamplerRow {
        params: &greedy,
        seed: 0,
        prompt: &[],
        output: &[],
        banned: vec![17],
    }];
    let t = Tensor::<2>::from_data(
        TensorData::new(peaked[3 * vocab..].to_vec(), [1, vocab]),
        (device, DType::F32),
    );
    let mut draws =
        Tensor::<1, Int>::from_data(TensorData::new(vec![0i32; 4], [4]), (device, DType::I32));
    let out = sample(t, &row, TokenMasks::none(vocab), &[0], &mut draws)
        .unwrap()
        .0
        .wait()
        .unwrap();
    assert_ne!(out[0].token_id, 17);
}

#[test]
fn penalties_match_the_host_reference() {
    check_penalties(&Device::flex());
    check_penalties(&engine::DeviceKind::CubeclCpu.device().unwrap());
    check_penalties(&test_device().device().unwrap());
}

/// `logit_bias`, `allowed_token_ids` and `bad_words` through the engine, on the real Qwen2
/// vocabulary (`qwen2-tiny-tied`, greedy, overlapped and synchronous steps): a bias of +100
/// makes a token the only one drawn, −100 removes the greedy first token; only allowed tokens
/// are drawn; a one-token bad word is never drawn, a two-token one never completed. Token ids
/// outside the vocabulary are refused naming the field.
#[test]
fn logit_bias_allowed_tokens_and_bad_words_steer_the_draws() {
    use engine::EngineConfig;
    let name = "qwen2-tiny-tied";
    let prompt = Golden::load(name).prompts()[0].clone();
    for overlap in [true, false] {
        let config = EngineConfig {
            async_scheduling: Some(overlap),
            ..small_config()
        };
        let mut engine = engine_on(name, test_device(), config);
        let mut run = |params: SamplingParams| {
            run_all(&mut engine, vec![(prompt.clone(), params)])
                .remove(0)
                .tokens
        };
        let plain = run(greedy(8));
        let (t0, t1) = (plain[0], plain[1]);
        let boosted = run(SamplingParams {
            logit_bias: vec![(777, 100.0)],
            ..greedy(8)
        });
        assert_eq!(boosted, [777; 8], "overlap {overlap}");
        let lowered = run(SamplingParams {
            logit_bias: vec![(t0, -100.0)],
            ..greedy(8)
        });
        assert!(!lowered.contains(&t0), "{lowered:?} holds {t0}");
        let allowed = [11, 12, 13];
        let only = run(SamplingParams {
            allowed_token_ids: Some(allowed.to_vec()),
            temperature: 1.0,
            seed: Some(3),
            ignore_eos: true,
            ..greedy(16)
        });
        assert!(only.iter().all(|t| allowed.contains(t)), "{only:?}");
        let banned = run(SamplingParams {
            bad_words: vec![vec![t0]],
            ..greedy(8)
        });
        assert!(!banned.contains(&t0), "{banned:?}");
        // The pair (t0, t1) never appears: after t0, t1 is banned.
        let pair = run(SamplingParams {
            bad_words: vec![vec![t0, t1]],
            ..greedy(8)
        });
        assert_eq!(pair[0], t0);
        assert!(pair.windows(2).all(|w| w != [t0, t1]), "{pair:?}");
        assert_ne!(pair[1], t1);
        for (field, params) in [
            (
                "logit_bias",
                SamplingParams {
                    logit_bias: vec![(151_936, 1.0)],
                    ..greedy(2)
                },
            ),
            (
                "allowed_token_ids",
                SamplingParams {
                    allowed_token_ids: Some(vec![5, 200_000]),
                    ..greedy(2)
                },
            ),
            (
                "bad_words",
                SamplingParams {
                    bad_words: vec![vec![1, u32::MAX]],
                    ..greedy(2)
                },
            ),
            (
                "logit_bias",
                SamplingParams {
                    logit_bias: vec![(5, 101.0)],
                    ..greedy(2)
                },
            ),
        ] {
            let err = engine.add_request(prompt.clone(), params).unwrap_err();
            assert!(
                matches!(&err, engine::EngineError::InvalidParam { field: f, .. } if *f == field),
                "{field}: {err}"
            );
        }
    }
}
