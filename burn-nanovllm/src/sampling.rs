//! Sampling parameters and the sampler that turns logits into next tokens.

use burn::tensor::{Int, Tensor};
use rand::{Rng, SeedableRng, rngs::StdRng};

/// How to pick tokens and when to stop, per request (vLLM's `SamplingParams`).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Seed of the sampling RNG; `None` draws one.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            max_tokens: 64,
            ignore_eos: false,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }
}

/// Picks next tokens from logits: argmax on the device for greedy rows, softmax sampling with a
/// seeded RNG on the host otherwise.
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    /// A sampler whose random draws follow `seed` (or a fresh seed).
    pub fn new(seed: Option<u64>) -> Self {
        Self {
            rng: seed
                .map(StdRng::seed_from_u64)
                .unwrap_or_else(|| StdRng::from_rng(&mut rand::rng())),
        }
    }

    /// One token per row of `logits [B, V]` (f32), at `temperature`.
    pub fn sample(&mut self, logits: Tensor<2>, temperature: f32) -> Vec<u32> {
        if temperature <= 0.0 {
            let ids: Tensor<2, Int> = logits.argmax(1);
            return ids
                .into_data()
                .try_into_vec_as::<i64>()
                .unwrap()
                .into_iter()
                .map(|v| v as u32)
                .collect();
        }
        let v = logits.dims()[1];
        let host = logits.into_data().try_into_vec_as::<f32>().unwrap();
        host.chunks(v)
            .map(|row| self.sample_row(row, temperature))
            .collect()
    }

    fn sample_row(&mut self, row: &[f32], temperature: f32) -> u32 {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = row
            .iter()
            .map(|&l| (((l - max) / temperature) as f64).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut u = self.rng.random::<f64>() * total;
        for (i, w) in weights.iter().enumerate() {
            u -= w;
            if u <= 0.0 {
                return i as u32;
            }
        }
        (row.len() - 1) as u32
    }
}
