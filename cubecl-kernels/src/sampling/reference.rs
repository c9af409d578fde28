//! The host sampler: the same draws as the kernel (same hash, same thresholds), computed with
//! sorts instead of radix selection. The fallback off CubeCL devices and the test oracle.

use super::SamplingRow;

/// See the kernel's `mix32`.
pub fn mix32(x: u32) -> u32 {
    let mut h = x ^ (x >> 16);
    h = h.wrapping_mul(0x7feb_352d);
    h ^= h >> 15;
    h = h.wrapping_mul(0x846c_a68b);
    h ^ (h >> 16)
}

/// The per-row key of the kernel's hash, from the seed and the counter.
pub fn row_key(row: &SamplingRow) -> u32 {
    let (lo, hi) = (row.seed as u32, (row.seed >> 32) as u32);
    mix32(lo ^ mix32(hi ^ mix32(row.counter ^ 0x9e37_79b9)))
}

/// See the kernel's `uniform`.
pub fn uniform(row_key: u32, i: u32) -> f32 {
    let h = mix32(row_key ^ mix32(i));
    ((h >> 9) as f32 + 0.5) * 1.192_092_9e-7
}

/// See the kernel's `order_key`.
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b >= 0x8000_0000 {
        b ^ 0xffff_ffff
    } else {
        b | 0x8000_0000
    }
}

/// The smallest logit a row keeps after min-p, top-k and top-p (as an order key), and the
/// maximum logit. Greedy rows keep everything.
pub fn threshold(logits: &[f32], row: &SamplingRow) -> u32 {
    let t = row.effective_temperature();
    if t <= 0.0 {
        return 0;
    }
    let inv_t = 1.0 / t;
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut floor = 0u32;
    if row.min_p > 0.0 {
        floor = order_key(m + t * row.min_p.ln());
    }
    let mut kept: Vec<f32> = logits
        .iter()
        .copied()
        .filter(|&x| order_key(x) >= floor)
        .collect();
    kept.sort_by(|a, b| b.total_cmp(a));
    let k = row.top_k as usize;
    if k > 0 && k < logits.len() && k <= kept.len() {
        floor = floor.max(order_key(kept[k - 1]));
        kept.truncate(kept.iter().take_while(|&&x| order_key(x) >= floor).count());
    }
    if row.top_p < 1.0 {
        let fixed = |x: f32| (((x - m) * inv_t).exp() * 4_294_967_296.0) as u64;
        let total: u64 = kept.iter().map(|&x| fixed(x)).sum();
        let need = ((total as f32 * row.top_p) as u64).max(1);
        let mut acc = 0u64;
        for &x in &kept {
            acc += fixed(x);
            if acc >= need {
                floor = floor.max(order_key(x));
                break;
            }
        }
    }
    floor
}

/// One token per row of `logits` (`rows.len()` rows of `vocab` values).
pub fn sample(logits: &[f32], vocab: usize, rows: &[SamplingRow]) -> Vec<u32> {
    logits
        .chunks(vocab)
        .zip(rows)
        .map(|(x, row)| sample_row(x, row))
        .collect()
}

/// One token from one row: the argmax (greedy) or the Gumbel-max draw over the kept tokens;
/// token 0 when no token scores above −∞ (every token masked, or NaN logits), as the kernel.
pub fn sample_row(logits: &[f32], row: &SamplingRow) -> u32 {
    score_row(logits, row, 0).1
}

/// The winning score and token of one row whose `logits` are tokens `first..` of the
/// vocabulary (ids hashed and returned as global ids): the logit (greedy) or the Gumbel-max
/// score. Filters see only these logits: a shard of a row draws its own best only without them.
/// `(−∞, first)` when no token scores above −∞.
pub fn score_row(logits: &[f32], row: &SamplingRow, first: u32) -> (f32, u32) {
    let mut best = (f32::NEG_INFINITY, first);
    let t = row.effective_temperature();
    if t <= 0.0 {
        for (i, &x) in logits.iter().enumerate() {
            if x > best.0 {
                best = (x, first + i as u32);
            }
        }
        return best;
    }
    let floor = threshold(logits, row);
    let inv_t = 1.0 / t;
    let key = row_key(row);
    for (i, &x) in logits.iter().enumerate() {
        if order_key(x) >= floor {
            let id = first + i as u32;
            let score = x * inv_t - (-uniform(key, id).ln()).ln();
            if score > best.0 {
                best = (score, id);
            }
        }
    }
    best
}

/// Each row's token of a group-summed exchange (rows of `2·slots` values: scores, then tokens
/// as f32): the best score, the lowest token among equal ones.
pub fn pick_exchanged(exchange: &[f32], slots: usize) -> Vec<u32> {
    exchange
        .chunks(2 * slots)
        .map(|row| {
            let mut best = (row[0], row[slots] as u32);
            for s in 1..slots {
                let (v, i) = (row[s], row[slots + s] as u32);
                if v > best.0 || (v == best.0 && i < best.1) {
                    best = (v, i);
                }
            }
            best.1
        })
        .collect()
}

/// Sets every token of row `rows[r]` of `logits` (rows of `vocab` values) whose bit is clear in
/// `allowed[r·⌈vocab/32⌉..]` to −∞: the host version of [`super::mask_logits`].
pub fn mask_logits(logits: &mut [f32], vocab: usize, allowed: &[u32], rows: &[u32]) {
    let words = super::mask_words(vocab);
    for (r, &row) in rows.iter().enumerate() {
        let mask = &allowed[r * words..(r + 1) * words];
        let x = &mut logits[row as usize * vocab..(row as usize + 1) * vocab];
        for (t, x) in x.iter_mut().enumerate() {
            if (mask[t / 32] >> (t % 32)) & 1 == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}
