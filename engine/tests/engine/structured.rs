//! Structured outputs on the trained default model: every constraint kind's outputs parse and
//! validate (serde_json and a JSON-schema validator), across seeds, mixed in batches with
//! unconstrained requests, with overlapped and plain step loops; unconstrained greedy outputs
//! stay what they are alone; under tensor parallelism (the LM head whole or split by
//! vocabulary) constrained outputs are what one rank gives; invalid constraints are refused
//! naming the field.

use engine::{
    EngineConfig, EngineError, FinishReason, LLMEngine, SamplingParams, StructuredOutput,
};
use serde_json::{Value, json};

use super::common::*;

/// A person: a schema of a few fields, bounded so that every output ends.
fn person_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"enum": ["Paris", "Lima", "Oslo"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": false,
    })
}

const EMAIL: &str = "[a-z]{2,8}@[a-z]{2,8}\\.(com|org)";
const SUM_GRAMMAR: &str = r#"
start: "(" num (" + " num)* ")"
num: /[0-9]{1,3}/
"#;
const COLOURS: [&str; 4] = ["red", "green", "dark blue", "sea/green (1.5+)"];

/// Is `text` a sum as [`SUM_GRAMMAR`] writes it?
fn is_sum(text: &str) -> bool {
    let Some(inner) = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')) else {
        return false;
    };
    inner
        .split(" + ")
        .all(|n| (1..=3).contains(&n.len()) && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Does `text` validate under `schema` (a JSON value's text)?
fn validates(schema: &Value, text: &str) -> Result<(), String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let validator = jsonschema::validator_for(schema).map_err(|e| e.to_string())?;
    validator.validate(&value).map_err(|e| e.to_string())
}

/// The constraints under test, each checked by its own oracle.
fn constraints() -> Vec<StructuredOutput> {
    vec![
        StructuredOutput::JsonSchema(person_schema()),
        StructuredOutput::JsonObject,
        StructuredOutput::Regex(EMAIL.into()),
        StructuredOutput::Choice(COLOURS.iter().map(|c| c.to_string()).collect()),
        StructuredOutput::Grammar(SUM_GRAMMAR.into()),
    ]
}

/// Checks one output against its constraint.
fn check(constraint: &StructuredOutput, text: &str) -> Result<(), String> {
    match constraint {
        StructuredOutput::JsonSchema(schema) => validates(schema, text),
        StructuredOutput::JsonObject => validates(&json!({"type": "object"}), text),
        // The validator's `pattern` is the regex oracle (anchored: the whole output).
        StructuredOutput::Regex(rx) => validates(
            &json!({"type": "string", "pattern": format!("^(?:{rx})$")}),
            &json!(text).to_string(),
        ),
        StructuredOutput::Choice(choices) => match choices.iter().any(|c| c == text) {
            true => Ok(()),
            false => Err("not one of the choices".into()),
        },
        StructuredOutput::Grammar(_) => match is_sum(text) {
            true => Ok(()),
            false => Err("not a sum".into()),
        },
    }
}

fn engine(config: EngineConfig) -> LLMEngine {
    let mut e = engine_on(DEFAULT_MODEL, test_device(), config);
    e.set_stream_text(true);
    e
}

/// `constraint` drawn greedily (`seed` `None`) or seeded at temperature 1, `max_tokens` long.
fn constrained(
    constraint: &StructuredOutput,
    seed: Option<u64>,
    max_tokens: usize,
) -> SamplingParams {
    SamplingParams {
        temperature: if seed.is_some() { 1.0 } else { 0.0 },
        seed,
        max_tokens,
        structured_output: Some(constraint.clone()),
        ..SamplingParams::default()
    }
}

fn prompts(e: &LLMEngine) -> Vec<Vec<u32>> {
    [
        "The man said his name was",
        "Call me Ishmael. Some years ago",
        "It was the best of times,",
    ]
    .iter()
    .map(|p| e.encode(p).unwrap())
    .collect()
}

/// Each kind, sampled under four seeds and greedy, in batches mixed with unconstrained greedy
/// requests, with overlapped steps and without: every constrained output completes its
/// constraint (finish reason `stop`) and validates; the unconstrained outputs are those the
/// requests give alone.
#[test]
fn constrained_outputs_validate_across_seeds_and_mixed_batches() {
    for overlap in [true, false] {
        let config = EngineConfig {
            async_scheduling: Some(overlap),
            max_num_seqs: Some(8),
            max_num_batched_tokens: 64,
            ..small_config()
        };
        let mut e = engine(config);
        let prompts = prompts(&e);
        let plain = |i: usize| (prompts[i % prompts.len()].clone(), greedy(12));
        let alone: Vec<Vec<u32>> = (0..3)
            .map(|i| run_all(&mut e, vec![plain(i)]).remove(0).tokens)
            .collect();
        let mut requests = Vec::new();
        let mut kinds = Vec::new();
        for (k, constraint) in constraints().into_iter().enumerate() {
            for seed in [None, Some(1), Some(2), Some(3), Some(4)] {
                let params = constrained(&constraint, seed, 160);
                requests.push((
                    prompts[(k + requests.len()) % prompts.len()].clone(),
                    params,
                ));
                kinds.push(Some(constraint.clone()));
                if requests.len() % 4 == 0 {
                    requests.push(plain(requests.len()));
                    kinds.push(None);
                }
            }
        }
        let outs = run_all(&mut e, requests.clone());
        let compiler = e.grammar_compiler().unwrap();
        let (mut checked, mut cut) = (0, 0);
        for ((out, kind), (prompt, _)) in outs.iter().zip(&kinds).zip(&requests) {
            match kind {
                // Any JSON object may hold a string this prose model never closes (it does, here):
                // one cut at `max_tokens` is a prefix its grammar accepts token by token.
                Some(StructuredOutput::JsonObject)
                    if out.last().finish_reason == Some(FinishReason::Length) =>
                {
                    let mut m = compiler.compile(&StructuredOutput::JsonObject).unwrap();
                    for &t in &out.tokens {
                        m.accept(t)
                            .unwrap_or_else(|e| panic!("{:?}: {e}", out.text));
                    }
                    assert!(
                        !m.is_finished() && out.text.starts_with('{'),
                        "{:?}",
                        out.text
                    );
                    cut += 1;
                }
                Some(constraint) => {
                    assert_eq!(
                        out.last().finish_reason,
                        Some(FinishReason::Stop),
                        "overlap {overlap}, {constraint:?}: {:?}",
                        out.text
                    );
                    if let Err(e) = check(constraint, &out.text) {
                        panic!(
                            "overlap {overlap}, {}: {e}: {:?}",
                            constraint.kind(),
                            out.text
                        );
                    }
                    checked += 1;
                }
                None => {
                    let i = prompts.iter().position(|p| p == prompt).unwrap();
                    assert_eq!(out.tokens, alone[i], "overlap {overlap}: unconstrained row");
                }
            }
        }
        assert_eq!(checked + cut, 25);
        // The seeds differ in what they write: constraints shape outputs, not fix them.
        let jsons: std::collections::HashSet<&str> = outs
            .iter()
            .zip(&kinds)
            .filter(|(_, k)| matches!(k, Some(StructuredOutput::JsonSchema(_))))
            .map(|(o, _)| o.text.as_str())
            .collect();
        assert!(jsons.len() >= 3, "overlap {overlap}: {jsons:?}");
    }
}

/// A schema, regex, grammar or choice list that cannot compile is refused when the request is
/// added, naming the field; the engine goes on serving.
#[test]
fn invalid_constraints_are_refused_naming_the_field() {
    let mut e = engine(small_config());
    let prompt = prompts(&e).remove(0);
    let bad = [
        (
            StructuredOutput::JsonSchema(json!({"type": "nonsense"})),
            "json",
        ),
        (StructuredOutput::JsonSchema(json!([1, 2])), "json"),
        (StructuredOutput::Regex("[a-".into()), "regex"),
        (
            StructuredOutput::Grammar("start: undefined_rule".into()),
            "grammar",
        ),
        (StructuredOutput::Choice(Vec::new()), "choice"),
    ];
    for (constraint, kind) in bad {
        let params = SamplingParams {
            structured_output: Some(constraint.clone()),
            ..greedy(8)
        };
        match e.add_request(prompt.clone(), params) {
            Err(EngineError::InvalidParam { field, message }) => {
                assert_eq!(field, "structured_output");
                assert!(
                    message.contains(&format!("invalid {kind} constraint")),
                    "{message}"
                );
            }
            other => panic!("{constraint:?}: {other:?}"),
        }
    }
    assert_eq!(e.num_waiting(), 0);
    let out = run_all(&mut e, vec![(prompt, greedy(4))]);
    assert_eq!(out[0].tokens.len(), 4);
}

/// `min_tokens` takes end-of-sequence out of a constrained row's mask (unless nothing else is
/// left): the output still completes its constraint.
#[test]
fn min_tokens_lengthen_a_constrained_output_within_its_grammar() {
    let mut e = engine(small_config());
    let prompt = prompts(&e).remove(1);
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 64,
        min_tokens: 6,
        structured_output: Some(StructuredOutput::Grammar(SUM_GRAMMAR.into())),
        ..SamplingParams::default()
    };
    let out = run_all(&mut e, vec![(prompt, params)]).remove(0);
    assert!(is_sum(&out.text), "{:?}", out.text);
    assert_eq!(out.last().finish_reason, Some(FinishReason::Stop));
}

/// Constraints over the real Qwen2 vocabulary (`fixtures/qwen2-tiny-tied`: 151,936 tokens,
/// `<tool_call>` = 151657 and `</tool_call>` = 151658 added tokens). A grammar that names the
/// special tokens allows exactly them where they stand and takes them as drawn; a text
/// constraint spelling the same characters never admits them (their bytes are no text), so a
/// model that emits them whole can only follow a grammar that names them.
#[test]
fn grammars_name_special_tokens_of_the_real_qwen_vocabulary() {
    use engine::GrammarCompiler;
    let tokenizer = model_qwen2::Qwen2Tokenizer::from_dir(fixture("qwen2-tiny-tied")).unwrap();
    let compiler = GrammarCompiler::new(&tokenizer, &[151645], 151936).unwrap();
    assert_eq!(compiler.special_token("<tool_call>"), Some(151657));
    assert_eq!(compiler.special_token("</tool_call>"), Some(151658));
    assert_eq!(compiler.special_token("<|im_end|>"), Some(151645));
    assert_eq!(compiler.special_token("tool_call"), None);
    let words = cubecl_kernels::mask_words(151936);
    let allowed = |m: &mut engine::GrammarMatcher| {
        let mut mask = vec![0u32; words];
        m.fill_mask(&mut mask).unwrap();
        (0..151936u32)
            .filter(|&t| (mask[t as usize / 32] >> (t % 32)) & 1 == 1)
            .collect::<Vec<u32>>()
    };
    let grammar = r#"start: <tool_call> "\n" %json {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"], "additionalProperties": false} "\n" </tool_call>"#;
    let mut m = compiler
        .compile(&StructuredOutput::Grammar(grammar.into()))
        .unwrap();
    assert_eq!(allowed(&mut m), [151657]);
    m.accept(151657).unwrap();
    // "\n", then the JSON object, written by the tokenizer's own ids.
    let text = "\n{\"a\": 1}\n";
    let tok = model_qwen2::Qwen2Tokenizer::from_dir(fixture("qwen2-tiny-tied")).unwrap();
    for id in tok.encode(text).unwrap() {
        assert!(allowed(&mut m).contains(&id), "token {id} of {text:?}");
        m.accept(id).unwrap();
    }
    assert_eq!(allowed(&mut m), [151658]);
    m.accept(151658).unwrap();
    assert!(m.is_finished());
    // A text constraint never admits a special token it does not name. (llguidance's forced
    // text `<tool_call>` tokenizes to the special token, as Hugging Face's tokenizer would, and
    // then refuses it: with it filtered out such a constraint allows nothing there, a clear
    // error before any draw, instead of a draw that breaks the constraint.)
    for text in [
        StructuredOutput::Regex("<tool_call>[a-z]+".into()),
        StructuredOutput::Grammar(r#"start: "<tool_call>" /[a-z]+/"#.into()),
        StructuredOutput::JsonObject,
    ] {
        let mut m = compiler.compile(&text).unwrap();
        let mut mask = vec![0u32; words];
        match m.fill_mask(&mut mask) {
            Ok(()) => assert_eq!((mask[151657 / 32] >> (151657 % 32)) & 1, 0, "{text:?}"),
            Err(e) => assert!(e.contains("allows no token"), "{text:?}: {e}"),
        }
        assert!(m.accept(151657).is_err(), "{text:?}");
    }
    // JSON has no forced marker: its first tokens are there, and no special one among them.
    let mut m = compiler.compile(&StructuredOutput::JsonObject).unwrap();
    let ids = allowed(&mut m);
    assert!(
        !ids.is_empty() && ids.iter().all(|&t| t < 151643),
        "{ids:?}"
    );
}

/// Under tensor parallelism (TP 2, the LM head whole on both ranks or split by vocabulary, so
/// that each rank masks its own shard of the logits), every constraint kind gives what one
/// rank gives, greedy and seeded, mixed in one batch; the outputs that complete validate.
#[test]
fn constrained_outputs_under_tensor_parallelism_match_one_rank() {
    let config = EngineConfig {
        max_num_seqs: Some(8),
        max_num_batched_tokens: 64,
        ..small_config()
    };
    let mut one = engine(config.clone());
    let prompts = prompts(&one);
    let mut requests = Vec::new();
    for (k, constraint) in constraints().into_iter().enumerate() {
        for seed in [None, Some(7)] {
            let params = constrained(&constraint, seed, 96);
            requests.push((prompts[k % prompts.len()].clone(), params));
        }
    }
    let reference = run_all(&mut one, requests.clone());
    for vocab_parallel in [false, true] {
        let mut e = engine(EngineConfig {
            tensor_parallel_size: 2,
            vocab_parallel,
            ..config.clone()
        });
        let outs = run_all(&mut e, requests.clone());
        for (i, ((out, want), (_, params))) in
            outs.iter().zip(&reference).zip(&requests).enumerate()
        {
            let constraint = params.structured_output.as_ref().unwrap();
            assert_eq!(
                out.tokens,
                want.tokens,
                "vocab parallel {vocab_parallel}, request {i} ({}): {:?}",
                constraint.kind(),
                out.text
            );
            if out.last().finish_reason == Some(FinishReason::Stop) {
                check(constraint, &out.text).unwrap_or_else(|e| panic!("{e}: {:?}", out.text));
            }
        }
    }
}
