//! Penalties, `logit_bias` and bans: the host plans which logits they touch, the device
//! applies them in one gather/scatter.

use std::collections::BTreeMap;
use std::ops::Range;

use burn::tensor::{DType, FloatDType, IndexingUpdateOp, Int, Tensor, TensorData};

use super::rows::SamplerRow;

/// The penalty applied to one logit.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Adjustment {
    /// Repetition penalty factor (1 = none).
    repetition: f32,
    /// Subtracted: `frequency · count + presence · [count > 0] − logit_bias`.
    subtract: f32,
    /// Forced to −∞.
    banned: bool,
}

/// The logits a row's penalties and bans touch, by token id.
fn adjustments(row: &SamplerRow<'_>) -> BTreeMap<u32, Adjustment> {
    let p = row.params;
    let mut out: BTreeMap<u32, Adjustment> = BTreeMap::new();
    let none = Adjustment {
        repetition: 1.0,
        subtract: 0.0,
        banned: false,
    };
    if p.repetition_penalty != 1.0 {
        for &t in row.prompt.iter().chain(row.output) {
            out.entry(t).or_insert(none).repetition = p.repetition_penalty;
        }
    }
    if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
        let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
        for &t in row.output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            out.entry(t).or_insert(none).subtract =
                p.frequency_penalty * c as f32 + p.presence_penalty;
        }
    }
    // `logit_bias`: added after the penalties (as vLLM's logits processor does).
    for &(t, b) in &p.logit_bias {
        out.entry(t).or_insert(none).subtract -= b;
    }
    for &t in &row.banned {
        out.entry(t).or_insert(none).banned = true;
    }
    out
}

fn adjust(x: f32, a: &Adjustment) -> f32 {
    if a.banned {
        return f32::NEG_INFINITY;
    }
    let x = if x > 0.0 {
        x / a.repetition
    } else {
        x * a.repetition
    };
    x - a.subtract
}

/// Applies the rows' penalties and bans to host logits (`rows.len()` rows of `vocab`): the
/// reference of the device path.
pub fn apply_penalties_host(logits: &mut [f32], vocab: usize, rows: &[SamplerRow<'_>]) {
    for (r, row) in rows.iter().enumerate() {
        for (t, a) in adjustments(row) {
            let x = &mut logits[r * vocab + t as usize];
            *x = adjust(*x, &a);
        }
    }
}

/// Applies the rows' penalties and bans to `logits [rows, V]` on its device; returns them as
/// they came when no row has any, else in f32.
pub fn apply_penalties(logits: Tensor<2>, rows: &[SamplerRow<'_>]) -> Tensor<2> {
    let v = logits.dims()[1];
    Penalties::new(rows, v).apply(logits)
}

/// The logits a step's penalties and bans touch, flattened (`row · V + token`), with their
/// adjustments: the host's part of [`apply_penalties`].
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Penalties {
    index: Vec<i64>,
    repetition: Vec<f32>,
    subtract: Vec<f32>,
    banned: Vec<bool>,
}

impl Penalties {
    /// Of `rows` over a `vocab`-token vocabulary.
    pub fn new(rows: &[SamplerRow<'_>], vocab: usize) -> Self {
        let mut p = Self::default();
        for (r, row) in rows.iter().enumerate() {
            for (t, a) in adjustments(row) {
                p.index.push((r * vocab + t as usize) as i64);
                p.repetition.push(a.repetition);
                p.subtract.push(a.subtract);
                p.banned.push(a.banned);
            }
        }
        p
    }

    /// Those of the tokens `tokens` of a `vocab`-token vocabulary, indexed into a shard of
    /// the logits (`row · V_shard + token − tokens.start`).
    pub fn shard(&self, vocab: usize, tokens: &Range<usize>) -> Self {
        let mut p = Self::default();
        for (k, &at) in self.index.iter().enumerate() {
            let (row, token) = (at as usize / vocab, at as usize % vocab);
            if tokens.contains(&token) {
                p.index
                    .push((row * tokens.len() + token - tokens.start) as i64);
                p.repetition.push(self.repetition[k]);
                p.subtract.push(self.subtract[k]);
                p.banned.push(self.banned[k]);
            }
        }
        p
    }

    /// Applies them to `logits [rows, V]` on its device (as they came when there are none,
    /// else in f32).
    pub fn apply(&self, logits: Tensor<2>) -> Tensor<2> {
        if self.index.is_empty() {
            return logits;
        }
        let [s, v] = logits.dims();
        let device = logits.device();
        let n = self.index.len();
        let index = Tensor::<1, Int>::from_data(TensorData::new(self.index.clone(), [n]), &device);
        let repetition = Tensor::<1>::from_data(
            TensorData::new(self.repetition.clone(), [n]),
            (&device, DType::F32),
        );
        let subtract = Tensor::<1>::from_data(
            TensorData::new(self.subtract.clone(), [n]),
            (&device, DType::F32),
        );
        let banned = Tensor::<1, burn::tensor::Bool>::from_data(
            TensorData::new(self.banned.clone(), [n]),
            &device,
        );
        let flat = logits.cast(FloatDType::F32).reshape([s * v]);
        let x = flat.clone().select(0, index.clone());
        let positive = x.clone().greater_elem(0.0);
        let scaled = (x.clone() * repetition.clone()).mask_where(positive, x / repetition);
        let adjusted = (scaled - subtract).mask_fill(banned, f32::NEG_INFINITY);
        flat.select_assign(0, index, adjusted, IndexingUpdateOp::Assign)
            .reshape([s, v])
    }
}
