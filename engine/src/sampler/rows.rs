//! What the sampler takes of each row's request.

use crate::sampling_params::SamplingParams;

/// What the sampler needs of one row's request.
#[derive(Clone, Debug)]
pub struct SamplerRow<'a> {
    /// The request's parameters.
    pub params: &'a SamplingParams,
    /// The request's seed.
    pub seed: u64,
    /// Prompt tokens (repetition penalty).
    pub prompt: &'a [u32],
    /// Generated tokens so far (penalties).
    pub output: &'a [u32],
    /// Tokens that may not be drawn now (end-of-sequence and stop tokens before `min_tokens`).
    pub banned: Vec<u32>,
}
