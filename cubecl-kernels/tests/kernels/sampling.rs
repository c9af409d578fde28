//! The sampling kernel against the host sampler (same hash, same thresholds).

use burn::tensor::{DType, Int, Tensor, TensorData};
use cubecl_kernels::SamplingRow;
use cubecl_kernels::sampling::reference;
use rand::Rng;

use super::common::*;

/// Rows of random logits with the parameters a step may mix: greedy, plain temperature (scores
/// spread over a few times the Gumbel noise's, or far wider), each filter alone and all
/// together, ties at the top.
fn cases(rng: &mut rand::rngs::StdRng, vocab: usize) -> (Vec<f32>, Vec<SamplingRow>) {
    let base = SamplingRow {
        temperature: 0.8,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed: 0,
        counter: 0,
    };
    let mut rows = vec![
        SamplingRow::greedy(),
        SamplingRow::greedy(),
        base,
        SamplingRow {
            temperature: 2.5,
            ..base
        },
        SamplingRow { top_k: 1, ..base },
        SamplingRow { top_k: 7, ..base },
        SamplingRow { top_p: 0.5, ..base },
        SamplingRow {
            top_p: 0.05,
            ..base
        },
        SamplingRow { min_p: 0.2, ..base },
        SamplingRow {
            top_k: 20,
            top_p: 0.8,
            min_p: 0.05,
            ..base
        },
        SamplingRow {
            top_k: vocab as u32 + 5,
            top_p: 0.999,
            ..base
        },
        // Scores spread far wider than the noise: most tokens skip their noise.
        SamplingRow {
            temperature: 0.01,
            ..base
        },
    ];
    for (i, r) in rows.iter_mut().enumerate() {
        r.seed = rng.random::<u64>();
        r.counter = i as u32 * 3;
    }
    let mut logits: Vec<f32> = (0..rows.len() * vocab)
        .map(|_| rng.random::<f32>() * 10.0 - 5.0)
        .collect();
    // Ties at the maximum of row 1: the lowest id wins.
    logits[vocab + 10] = 9.0;
    logits[vocab + 20] = 9.0;
    (logits, rows)
}

/// `logits` as a `dtype` tensor on `device`, and the values it holds (rounded to `dtype`).
fn upload(
    logits: &[f32],
    shape: [usize; 2],
    dtype: DType,
    device: &burn::tensor::Device,
) -> (Tensor<2>, Vec<f32>) {
    let held: Vec<f32> = match dtype {
        DType::BF16 => logits
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect(),
        DType::F16 => logits
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect(),
        _ => logits.to_vec(),
    };
    let t = Tensor::<2>::from_data(TensorData::new(held.clone(), shape), (device, dtype));
    assert_eq!(t.dtype(), dtype);
    (t, held)
}

/// The kernel reads the logits in the model's dtype (f32, bf16 or f16) as they are: the same
/// draws as the host reference over the values the tensor holds.
#[test]
fn sampling_matches_host_reference() {
    let mut rng = rng("sampling_matches_host_reference");
    let device = kernel_device();
    for (vocab, dtype) in [
        (3, DType::F32),
        (257, DType::F32),
        (1000, DType::F32),
        (257, DType::BF16),
        (1000, DType::BF16),
        (1000, DType::F16),
    ] {
        let (logits, rows) = cases(&mut rng, vocab);
        let (t, logits) = upload(&logits, [rows.len(), vocab], dtype, &device);
        let got = draw(t, &rows);
        for (r, row) in rows.iter().enumerate() {
            let x = &logits[r * vocab..(r + 1) * vocab];
            check_draw(x, row, got[r], &format!("row {r} (V={vocab}, {dtype:?})"));
        }
        if vocab > 20 {
            assert_eq!(got[1], 10, "ties: the lowest id");
            // Top-k = 1 keeps the maximum (every copy of it: bf16 rounding makes ties).
            let row4 = &logits[4 * vocab..5 * vocab];
            assert_eq!(
                row4[got[4] as usize],
                row4[argmax(row4)],
                "top_k = 1 draws a maximum"
            );
        }
    }
}

/// A token whose hash is the largest a row can give draws no differently from the others: a
/// row of 64 tokens where token 0 is e³⁰ times likelier than each other one, with a seed whose
/// hash of some other token has all its top bits set (found on the host), draws token 0 on the
/// device and on the host. (A uniform draw that rounded up to 1 made that token's Gumbel noise
/// +∞: it won whatever its probability, about one row in 110 at a 151,936-token vocabulary.)
#[test]
fn the_largest_hash_wins_no_draw() {
    const VOCAB: u32 = 64;
    let row_of = |seed| SamplingRow {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        counter: 5,
    };
    let (seed, token) = (0u64..)
        .find_map(|seed| {
            let key = reference::row_key(&row_of(seed));
            (1..VOCAB)
                .find(|&i| reference::mix32(key ^ reference::mix32(i)) >> 8 == 0x00ff_ffff)
                .map(|i| (seed, i))
        })
        .expect("a seed");
    let row = row_of(seed);
    let mut x = vec![0.0f32; VOCAB as usize];
    x[0] = 30.0;
    let u = reference::uniform(reference::row_key(&row), token);
    assert!(u > 0.0 && u < 1.0, "token {token}: u = {u}");
    assert_eq!(reference::sample_row(&x, &row), 0, "host, seed {seed}");
    let device = kernel_device();
    for dtype in [DType::F32, DType::BF16] {
        let (t, _) = upload(&x, [1, VOCAB as usize], dtype, &device);
        let got = draw(t, &[row]);
        assert_eq!(
            got,
            [0],
            "{dtype:?}, seed {seed}: token {token} has the largest hash"
        );
    }
}

/// The kernel's token `got` for a row of logits `x`: one the reference keeps, and the
/// reference's draw unless two scores tie to rounding.
fn check_draw(x: &[f32], row: &SamplingRow, got: i64, what: &str) {
    let want = reference::sample_row(x, row);
    let g = got as u32;
    assert!(
        (g as usize) < x.len(),
        "{what}: token {g} outside the vocabulary"
    );
    let floor = reference::threshold(x, row);
    assert!(
        reference::order_key(x[g as usize]) >= floor,
        "{what}: token {g} was filtered out"
    );
    if g != want {
        let score = |i: u32| {
            let key = reference::row_key(row);
            x[i as usize] / row.temperature - (-reference::uniform(key, i).ln()).ln()
        };
        assert!(
            row.temperature > 0.0 && (score(g) - score(want)).abs() < 1e-4,
            "{what}: kernel drew {g}, reference {want}"
        );
    }
}

/// A row drawn alone, whose draw is split over several cubes (few rows leave the device
/// idle), gets the token the reference draws and the one it gets among other rows: every kind
/// of row (filtered rows stay whole), f32 and bf16.
#[test]
fn split_rows_draw_the_tokens_of_whole_rows() {
    let mut rng = rng("split_rows_draw_the_tokens_of_whole_rows");
    let device = kernel_device();
    for (vocab, dtype) in [(3000, DType::F32), (40_000, DType::BF16)] {
        let (logits, rows) = cases(&mut rng, vocab);
        let (t, logits) = upload(&logits, [rows.len(), vocab], dtype, &device);
        let draws = |t: Tensor<2>, rows: &[SamplingRow]| -> Vec<i64> {
            cubecl_kernels::sample(t, rows)
                .unwrap()
                .into_data()
                .try_into_vec_as::<i64>()
                .unwrap()
        };
        let batched = draws(t, &rows);
        for (r, row) in rows.iter().enumerate() {
            let x = &logits[r * vocab..(r + 1) * vocab];
            let (one, _) = upload(x, [1, vocab], dtype, &device);
            let alone = draws(one, std::slice::from_ref(row))[0];
            let what = format!("row {r} (V={vocab}, {dtype:?}) alone");
            check_draw(x, row, alone, &what);
            assert_eq!(alone, batched[r], "{what}: not the token of the batch");
        }
    }
}

/// A vocabulary split over 2, 3 or 4 ranks (shards of unequal sizes): each shard's draw
/// (`sample_shard`, global ids), the exchanges summed as the ranks' all-reduce sums them, and
/// `pick_exchanged_into` give every unfiltered row the token `sample` draws over its whole row
/// (greedy, plain temperature, ties, scores far wider than the noise), on the kernel device and
/// on the reference one; a filtered row is refused.
#[test]
fn vocabulary_shards_exchange_the_tokens_of_whole_rows() {
    let mut rng = rng("vocabulary_shards_exchange_the_tokens_of_whole_rows");
    for device in [kernel_device(), reference_device()] {
        for (vocab, dtype) in [(1001, DType::F32), (40_000, DType::BF16)] {
            let (logits, rows) = cases(&mut rng, vocab);
            let keep: Vec<usize> = (0..rows.len())
                .filter(|&r| !rows[r].needs_whole_row(vocab))
                .collect();
            assert!(keep.len() >= 5, "greedy, plain and wide-score rows");
            let rows: Vec<SamplingRow> = keep.iter().map(|&r| rows[r]).collect();
            let logits: Vec<f32> = keep
                .iter()
                .flat_map(|&r| logits[r * vocab..(r + 1) * vocab].to_vec())
                .collect();
            let b = rows.len();
            let (whole, _) = upload(&logits, [b, vocab], dtype, &device);
            let want = draw(whole.clone(), &rows);
            for slots in [2, 3, 4] {
                let mut sum = Tensor::<2>::zeros([b, 2 * slots], (&device, DType::F32));
                let mut first = 0;
                for slot in 0..slots {
                    let len = vocab / slots + usize::from(slot < vocab % slots);
                    let part = whole.clone().slice([0..b, first..first + len]);
                    let shard = cubecl_kernels::VocabShard { first, slot, slots };
                    let exchange = cubecl_kernels::sample_shard(part, &rows, shard, vocab).unwrap();
                    sum = sum + exchange;
                    first += len;
                }
                let mut out = Tensor::<1, Int>::from_data(
                    TensorData::new(vec![-1i32; b + 2], [b + 2]),
                    (&device, DType::I32),
                );
                cubecl_kernels::pick_exchanged_into(sum, &mut out).unwrap();
                let got: Vec<i64> = out.into_data().try_into_vec_as::<i64>().unwrap();
                assert_eq!(&got[..b], &want[..], "V={vocab} {dtype:?}, {slots} shards");
                assert_eq!(&got[b..], &[-1, -1], "slots past the rows are untouched");
            }
        }
        let filtered = SamplingRow {
            top_k: 5,
            ..SamplingRow::greedy()
        };
        let filtered = SamplingRow {
            temperature: 1.0,
            ..filtered
        };
        let x = Tensor::<2>::zeros([1, 10], (&device, DType::F32));
        let shard = cubecl_kernels::VocabShard {
            first: 0,
            slot: 0,
            slots: 2,
        };
        assert!(cubecl_kernels::sample_shard(x, &[filtered], shard, 20).is_err());
    }
}

/// Draws follow the filtered distribution: the frequency of each kept token over many seeds
/// is close to its renormalised probability.
#[test]
fn draws_follow_the_filtered_distribution() {
    let device = kernel_device();
    let vocab = 6;
    let logits = [2.0f32, 1.0, 0.5, 0.0, -1.0, -3.0];
    let n = 4000;
    let row = |seed: u64| SamplingRow {
        temperature: 1.0,
        top_k: 4,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        counter: 1,
    };
    let rows: Vec<SamplingRow> = (0..n).map(|s| row(s as u64)).collect();
    let flat: Vec<f32> = (0..n).flat_map(|_| logits).collect();
    let t = Tensor::<2>::from_data(TensorData::new(flat, [n, vocab]), (&device, DType::F32));
    let got = draw(t, &rows);
    let z: f32 = logits[..4].iter().map(|x| x.exp()).sum();
    for (i, &x) in logits.iter().enumerate() {
        let freq = got.iter().filter(|&&g| g == i as i64).count() as f32 / n as f32;
        let p = if i < 4 { x.exp() / z } else { 0.0 };
        assert!(
            (freq - p).abs() < 0.03,
            "token {i}: frequency {freq}, probability {p}"
        );
    }
}

/// The kernel's tokens for `rows` of logits `t`, on the host.
fn draw(t: Tensor<2>, rows: &[SamplingRow]) -> Vec<i64> {
    cubecl_kernels::sample(t, rows)
        .unwrap()
        .into_data()
        .try_into_vec_as::<i64>()
        .unwrap()
}

fn argmax(x: &[f32]) -> usize {
    (0..x.len()).fold(0, |b, i| if x[i] > x[b] { i } else { b })
}

/// `sample_into` writes a step's tokens into the first slots of a standing buffer, leaving the
/// rest as they were, and `read_ints_async` reads them back as they were when it was called,
/// although the buffer is overwritten by work enqueued after the call and before the wait —
/// on both the kernel device and the reference one (plain Burn, no in-place path).
#[test]
fn tokens_land_in_a_standing_buffer_and_read_back_as_of_the_call() {
    let mut rng = rng("tokens_land_in_a_standing_buffer");
    for device in [kernel_device(), reference_device()] {
        let vocab = 257;
        let (logits, rows) = cases(&mut rng, vocab);
        let b = rows.len();
        let tensor = |logits: &[f32]| {
            Tensor::<2>::from_data(
                TensorData::new(logits.to_vec(), [b, vocab]),
                (&device, DType::F32),
            )
        };
        let want: Vec<i32> = cubecl_kernels::sample(tensor(&logits), &rows)
            .unwrap()
            .into_data()
            .try_into_vec_as::<i32>()
            .unwrap();
        let mut buffer = Tensor::<1, Int>::from_data(
            TensorData::new(vec![-7i32; b + 5], [b + 5]),
            (&device, DType::I32),
        );
        cubecl_kernels::sample_into(tensor(&logits), &rows, &mut buffer).unwrap();
        let pending = cubecl_kernels::read_ints_async(&buffer).unwrap();
        // Work enqueued after the read started: greedy draws of other logits into the buffer.
        let other: Vec<f32> = logits.iter().map(|x| -x).collect();
        let greedy = vec![SamplingRow::greedy(); b];
        cubecl_kernels::sample_into(tensor(&other), &greedy, &mut buffer).unwrap();
        let got = pending.wait().unwrap();
        assert_eq!(&got[..b], &want[..], "the tokens of the first draw");
        assert_eq!(&got[b..], &[-7; 5], "slots past the rows are untouched");
        let after: Vec<i32> = buffer.into_data().try_into_vec_as::<i32>().unwrap();
        let flipped: Vec<i32> = (0..b)
            .map(|r| argmax(&other[r * vocab..(r + 1) * vocab]) as i32)
            .collect();
        assert_eq!(
            &after[..b],
            &flipped[..],
            "the second draw landed after the read"
        );
    }
    let bad = Tensor::<1, Int>::from_data(
        TensorData::new(vec![0u32; 3], [3]),
        (&kernel_device(), DType::U32),
    );
    assert!(
        cubecl_kernels::read_ints_async(&bad).is_err(),
        "u32 sources are refused"
    );
}

/// Structured outputs' masks: the listed rows keep exactly their allowed tokens (the rest
/// become −∞, as the host reference computes), unlisted rows are untouched, and the sampler
/// then draws allowed tokens only, greedy and seeded alike.
#[test]
fn masked_rows_keep_only_their_allowed_tokens() {
    let mut rng = rng("masked_rows_keep_only_their_allowed_tokens");
    let device = kernel_device();
    for (vocab, dtype) in [
        (5, DType::F32),
        (32, DType::BF16),
        (100, DType::F32),
        (1000, DType::BF16),
    ] {
        let (logits, rows) = cases(&mut rng, vocab);
        let b = rows.len();
        let words = vocab.div_ceil(32);
        // Every other row, in a shuffled order; a few allowed tokens each (one for row 0).
        let masked: Vec<u32> = [4, 0, 8, 2, 6, 10]
            .into_iter()
            .filter(|&r| r < b as u32)
            .collect();
        let mut allowed = vec![0u32; masked.len() * words];
        for (k, &r) in masked.iter().enumerate() {
            let n = if r == 0 {
                1
            } else {
                1 + rng.random_range(0..vocab.min(9))
            };
            for _ in 0..n {
                let t = rng.random_range(0..vocab);
                allowed[k * words + t / 32] |= 1 << (t % 32);
            }
        }
        let (t, logits) = upload(&logits, [b, vocab], dtype, &device);
        // Through upload memory (pinned on CUDA: uploaded without a host copy).
        let mut upload = cubecl_kernels::UploadBuffer::new(&device, allowed.len());
        upload.as_mut_slice().copy_from_slice(&allowed);
        let data = upload.into_data([masked.len(), words]);
        let got = cubecl_kernels::mask_logits(t, data, &masked).unwrap();
        assert_eq!(got.dtype(), dtype, "masked in the logits' dtype");
        let mut want = logits.clone();
        reference::mask_logits(&mut want, vocab, &allowed, &masked);
        let host: Vec<f32> = got.clone().into_data().try_into_vec_as::<f32>().unwrap();
        assert_eq!(host, want, "V={vocab}: masked logits");
        assert!(
            host.iter().filter(|x| x.is_infinite()).count() > 0,
            "V={vocab}: the masks removed nothing"
        );
        let drawn: Vec<i64> = cubecl_kernels::sample(got, &rows)
            .unwrap()
            .into_data()
            .try_into_vec_as::<i64>()
            .unwrap();
        for (k, &r) in masked.iter().enumerate() {
            let tok = drawn[r as usize] as usize;
            assert!(
                (allowed[k * words + tok / 32] >> (tok % 32)) & 1 == 1,
                "V={vocab}: row {r} drew the disallowed token {tok}"
            );
        }
    }
    // Bad arguments are errors, not kernel faults.
    let t = Tensor::<2>::zeros([2, 40], (&device, DType::F32));
    let words = |n: usize| TensorData::new(vec![0u32; n], [1, n]);
    let err = cubecl_kernels::mask_logits(t.clone(), words(3), &[0]).unwrap_err();
    assert!(err.to_string().contains("need [1, 2] u32 words"), "{err}");
    let err = cubecl_kernels::mask_logits(t, words(2), &[2]).unwrap_err();
    assert!(err.to_string().contains("row 2 of 2"), "{err}");
}

/// Temperatures far below any useful one are greedy (below 1e-5, vLLM's rule), and no row
/// draws an id outside the vocabulary: at 1e-5 (sampled), 1e-20, 1e-38 and f32's smallest
/// subnormal, with scores that overflow when divided by them, on plain rows, on rows masked
/// to a few tokens and on rows masked whole or of NaN logits (every score −∞: the winner is
/// still a token of the vocabulary, the first).
#[test]
fn tiny_temperatures_are_greedy_and_every_id_is_in_the_vocabulary() {
    let mut rng = rng("tiny_temperatures_are_greedy_and_every_id_is_in_the_vocabulary");
    let device = kernel_device();
    let temperatures = [1e-5f32, 1e-20, 1e-38, f32::from_bits(1)];
    for (vocab, dtype) in [(300, DType::F32), (1000, DType::BF16), (5000, DType::F32)] {
        let mut rows = Vec::new();
        let mut logits = Vec::new();
        for (k, &temperature) in temperatures.iter().enumerate() {
            for kind in 0..4 {
                rows.push(SamplingRow {
                    temperature,
                    seed: rng.random(),
                    counter: k as u32,
                    ..SamplingRow::greedy()
                });
                logits.extend((0..vocab).map(|t| match kind {
                    // Masked whole, or NaN logits.
                    2 => f32::NEG_INFINITY,
                    3 => f32::NAN,
                    // Masked to three tokens.
                    1 if t % 97 != 5 => f32::NEG_INFINITY,
                    _ => rng.random::<f32>() * 60.0 - 30.0,
                }));
            }
        }
        let b = rows.len();
        let (t, held) = upload(&logits, [b, vocab], dtype, &device);
        let got = draw(t, &rows);
        for (r, row) in rows.iter().enumerate() {
            let x = &held[r * vocab..(r + 1) * vocab];
            let what = format!("V={vocab} {dtype:?} row {r} (T={:e})", row.temperature);
            assert!((0..vocab as i64).contains(&got[r]), "{what}: id {}", got[r]);
            match r % 4 {
                2 | 3 => assert_eq!(got[r], 0, "{what}: no token above -inf"),
                _ if row.temperature < cubecl_kernels::sampling::GREEDY_BELOW => {
                    assert_eq!(got[r] as usize, argmax(x), "{what}: greedy")
                }
                _ => check_draw(x, row, got[r], &what),
            }
            assert_eq!(
                got[r] as u32,
                reference::sample_row(x, row),
                "{what}: the host sampler"
            );
        }
    }
}
