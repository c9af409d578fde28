//! A fuzz test of the HTTP API on loopback, over the trained default model: thousands of
//! request bodies drawn over the request schema (every field with values of every JSON type,
//! extreme numbers, nested junk, unknown fields) and byte-level mutations of valid bodies,
//! sent to every POST route. No answer may be a 5xx other than 503, the server must not
//! panic, and afterwards `/health` is 200 and a plain request is answered. A second, shorter
//! run sends the same kind of traffic from 64 concurrent clients. Bounded in count and time:
//! `max_model_len` 128 bounds every generation.

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, TestRng, TestRunner};
use serde_json::{Map, Value, json};

use super::server::{KEY, MODEL, TestServer, config, post, spawn_server};

const ROUTES: [&str; 5] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
];

/// Field names the routes know, and some they do not.
const FIELDS: [&str; 44] = [
    "model",
    "prompt",
    "messages",
    "input",
    "instructions",
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "top_logprobs",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "tools",
    "tool_choice",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "tokens",
    "text",
    "echo",
    "include_stop_str_in_output",
    "x-unknown",
    "user",
];

/// Any JSON value, biased to what breaks parsers and range checks: extreme and negative
/// numbers, huge and empty strings, NaN-like text, deep nesting.
fn any_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop_oneof![
            Just(0i64),
            Just(1),
            Just(-1),
            Just(i64::MAX),
            Just(i64::MIN),
            Just(u32::MAX as i64 + 1),
            -5i64..300,
        ]
        .prop_map(Value::from),
        prop_oneof![Just(u64::MAX)].prop_map(Value::from),
        prop_oneof![
            Just(0.0f64),
            Just(1e-45),
            Just(1e308),
            Just(-1e308),
            Just(0.5),
            Just(2.5),
            -3.0f64..3.0,
        ]
        .prop_map(|f| json!(f)),
        prop_oneof![
            Just(String::new()),
            Just("NaN".to_string()),
            Just("<tool_call>".to_string()),
            Just("start: \"a\"".to_string()),
            Just("(a+)+$".to_string()),
            Just("{\"type\": \"object\"}".to_string()),
            "[a-z ]{0,12}",
            "\\PC{0,8}",
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,10}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// A request body: a few fields of the schema with any values, often a valid core so that
/// the request gets past the first checks.
fn body() -> impl Strategy<Value = Value> {
    let field = (prop::sample::select(&FIELDS[..]), any_value());
    (prop::collection::vec(field, 0..8), 0u8..4).prop_map(|(fields, core)| {
        let mut m = Map::new();
        if core > 0 {
            m.insert("model".into(), json!(MODEL));
            m.insert("prompt".into(), json!("It was"));
            m.insert(
                "messages".into(),
                json!([{"role": "user", "content": "Hi"}]),
            );
            m.insert("input".into(), json!("Hi"));
            m.insert("max_tokens".into(), json!(4));
            m.insert("max_output_tokens".into(), json!(4));
            m.insert("tokens".into(), json!([1, 2, 3]));
        }
        for (k, v) in fields {
            m.insert(k.to_string(), v);
        }
        Value::Object(m)
    })
}

/// A small deterministic generator for the mutations (xorshift64*).
struct Mutator(u64);

impl Mutator {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }

    /// `bytes` mutated: bytes flipped, inserted, removed or duplicated, or the body cut short.
    fn mutate(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut b = bytes.to_vec();
        for _ in 0..1 + self.below(5) {
            let at = self.below(b.len());
            match self.below(5) {
                0 if !b.is_empty() => b[at] ^= 1 << self.below(8),
                1 => b.insert(at.min(b.len()), self.below(256) as u8),
                2 if !b.is_empty() => {
                    b.remove(at);
                }
                3 if !b.is_empty() => {
                    let piece: Vec<u8> = b[at..(at + 16).min(b.len())].to_vec();
                    b.splice(at..at, piece);
                }
                _ => b.truncate(at),
            }
        }
        b
    }
}

/// The fuzz bodies: `n` drawn over the schema, then `n / 2` mutations of valid ones, each
/// with a route.
fn cases(n: usize, seed: u8) -> Vec<(&'static str, Vec<u8>)> {
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(proptest::test_runner::RngAlgorithm::ChaCha, &[seed; 32]),
    );
    let strategy = body();
    let mut out = Vec::new();
    for i in 0..n {
        let v = strategy.new_tree(&mut runner).unwrap().current();
        out.push((ROUTES[i % ROUTES.len()], v.to_string().into_bytes()));
    }
    let valid = [
        json!({"model": MODEL, "prompt": "It was", "max_tokens": 4}),
        json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
               "response_format": {"type": "json_object"}, "stream": true}),
        json!({"input": "Hi", "max_output_tokens": 4,
               "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}),
        json!({"prompt": "Hi", "stop": ["a", "b"], "logit_bias": {"5": 1}, "top_k": 3}),
        json!({"tokens": [1, 2, 3]}),
    ];
    let mut m = Mutator(0x9e37_79b9_7f4a_7c15 ^ seed as u64);
    for i in 0..n / 2 {
        let k = i % valid.len();
        out.push((ROUTES[k], m.mutate(valid[k].to_string().as_bytes())));
    }
    out
}

async fn fuzz_server() -> TestServer {
    let make = || {
        let config = burn_nanovllm::EngineConfig {
            max_model_len: Some(128),
            ..super::server::engine_config()
        };
        Ok(burn_nanovllm::LLMEngine::new(
            burn_nanovllm::default_model_dir(),
            config,
        )?)
    };
    spawn_server(make, config()).await.0
}

/// Sends `body` to `route` and checks the status: anything but a 5xx other than 503.
async fn send(s: &TestServer, route: &str, body: &[u8]) {
    let body = String::from_utf8_lossy(body);
    let r = tokio::time::timeout(Duration::from_secs(60), post(s, route, &body, Some(KEY)))
        .await
        .unwrap_or_else(|_| panic!("{route} did not answer in 60 s: {body}"));
    let status = r.status().as_u16();
    // Read the whole answer (streams included): a failure inside a stream shows there.
    let text = r.text().await.unwrap_or_default();
    assert!(
        status < 500 || status == 503,
        "{route} answered {status} to {body}: {text}"
    );
}

/// The server still works: `/health` 200 and a plain request answered.
async fn still_serves(s: &TestServer) {
    let r = reqwest::get(format!("{}/health", s.base())).await.unwrap();
    assert_eq!(r.status(), 200);
    let body = json!({"model": MODEL, "prompt": "It was", "max_tokens": 3, "temperature": 0.0});
    let r = post(s, "/v1/completions", &body.to_string(), Some(KEY)).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_and_mutated_bodies_never_fail_the_server() {
    let s = fuzz_server().await;
    let start = Instant::now();
    let all = cases(2000, 7);
    for (route, body) in &all {
        send(&s, route, body).await;
    }
    still_serves(&s).await;
    eprintln!("{} bodies in {:.1?}", all.len(), start.elapsed());
    // 64 clients at once, 10 bodies each.
    let s = std::sync::Arc::new(s);
    let concurrent = cases(427, 11);
    let mut tasks = Vec::new();
    for chunk in concurrent.chunks(10) {
        let (s, chunk) = (s.clone(), chunk.to_vec());
        tasks.push(tokio::spawn(async move {
            for (route, body) in chunk {
                send(&s, route, &body).await;
            }
        }));
    }
    assert_eq!(tasks.len(), 64);
    for t in tasks {
        t.await.unwrap();
    }
    still_serves(&s).await;
}
