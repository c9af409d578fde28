//! The trained default model (`models/tiny-english`, real weights) against the transformers
//! float32 goldens stored beside it at training time: prompt logits at every position, greedy
//! continuations with their top-5 logits, and the tokenizer on the golden texts.

use super::common::*;
use super::generation::check_goldens;

/// Logits are O(10) here (a trained model, not random weights near zero): 1e-3 absolute is
/// ~1e-4 relative, far above f32 rounding and far below any real error.
const LOGIT_TOL: f32 = 1e-3;

#[test]
fn default_model_greedy_matches_transformers() {
    check_goldens(DEFAULT_MODEL, test_device(), false);
}

/// Prompt logits through `LLMEngine::prompt_logits`, and the tokenizer.
#[test]
fn default_model_prompt_logits_and_tokenizer_match_transformers() {
    let golden = Golden::load(DEFAULT_MODEL);
    let engine = engine_on(DEFAULT_MODEL, test_device(), small_config());
    let vocab = engine.model_config().vocab_size;
    let prompts = golden.json["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 4);
    let mut largest = 0f32;
    for (i, p) in prompts.iter().enumerate() {
        let key = format!("prompt.{i}");
        let ids = golden.ids(&format!("{key}.input_ids"));
        // The tokenizer (Rust `tokenizers`) gives the ids the Python one gave at training time.
        assert_eq!(
            engine.encode(p["text"].as_str().unwrap()).unwrap(),
            ids,
            "{key}: token ids"
        );
        let ours = engine.prompt_logits(&ids).unwrap();
        assert_eq!(ours.len(), ids.len() * vocab);
        let (ours, theirs) = match golden.has(&format!("{key}.logits")) {
            true => (&ours[..], golden.f32s(&format!("{key}.logits"))),
            false => (
                &ours[(ids.len() - 1) * vocab..],
                golden.f32s(&format!("{key}.last_logits")),
            ),
        };
        assert_eq!(ours.len(), theirs.len(), "{key}");
        let err = ours
            .iter()
            .zip(&theirs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(err < LOGIT_TOL, "{key}: max logit error {err}");
        largest = largest.max(theirs.iter().fold(0f32, |m, x| m.max(x.abs())));
    }
    // Real weights: logits far from zero, so the tolerance above is a tight relative one.
    assert!(largest > 5.0, "largest |logit| {largest}");
    // Bad scoring prompts are errors naming the problem.
    let err = |ids: &[u32]| engine.prompt_logits(ids).unwrap_err().to_string();
    assert!(err(&[]).contains("empty"));
    assert!(err(&[1, vocab as u32]).contains(&format!("id {vocab}")));
    assert!(err(&[1; 256]).contains("max_model_len = 256"));
}
