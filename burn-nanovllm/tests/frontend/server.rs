//! The OpenAI-compatible server on loopback, with the tiny Qwen2 fixture (real tokenizer and
//! chat template, random weights) on Burn's CPU backend. Every load is bounded in count and time.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::types::chat::{
    ChatCompletionRequestUserMessageArgs, CreateChatCompletionRequestArgs,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use burn::tensor::DType;
use burn_nanovllm::server::{Server, ServerConfig};
use burn_nanovllm::{
    ChatMessage, DeviceKind, EngineConfig, LLM, LLMEngine, Prompt, SamplingParams,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::StreamExt;

pub(super) const MODEL: &str = "tiny";
pub(super) const KEY: &str = "sk-test";

/// Real Qwen2 tokenizer and chat template, random weights.
const TOKENIZED: &str = "qwen2-tiny-tied";
/// No tokenizer.json: token-id prompts only.
const IDS_ONLY: &str = "qwen2-tiny-untied";

fn fixture_named(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

fn fixture() -> PathBuf {
    fixture_named(TOKENIZED)
}

pub(super) fn engine_config() -> EngineConfig {
    EngineConfig {
        device: DeviceKind::Cpu,
        dtype: Some(DType::F32),
        max_num_seqs: Some(8),
        max_num_batched_tokens: 256,
        num_kv_blocks: Some(128),
        max_model_len: Some(256),
        ..EngineConfig::default()
    }
}

/// A server on 127.0.0.1 (a free port); dropping `stop` shuts it down.
pub(super) struct TestServer {
    base: String,
    _stop: oneshot::Sender<()>,
}

impl TestServer {
    /// `http://127.0.0.1:PORT`.
    pub(super) fn base(&self) -> &str {
        &self.base
    }
}

pub(super) async fn start(config: ServerConfig) -> TestServer {
    start_with(TOKENIZED, config).await
}

async fn start_with(model: &'static str, config: ServerConfig) -> TestServer {
    let make = move || Ok(LLMEngine::new(fixture_named(model), engine_config())?);
    spawn_server(make, config).await.0
}

/// A server over the engine `make` builds, and the task that serves it.
pub(super) async fn spawn_server(
    make: impl FnOnce() -> Result<LLMEngine, burn_nanovllm::LlmError> + Send + 'static,
    config: ServerConfig,
) -> (TestServer, JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::task::spawn_blocking(move || Server::new(make, config).unwrap())
        .await
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let serving = tokio::spawn(server.serve(listener, async {
        let _ = stopped.await;
    }));
    (TestServer { base, _stop: stop }, serving)
}

/// A server over `fixtures/qwen2-tiny-tied`: the real Qwen2 vocabulary (151,936 tokens, its
/// added tokens and chat template), random weights; room for the tools' system prompt.
pub(super) async fn qwen_vocabulary_server() -> TestServer {
    real_vocabulary_server(TOKENIZED).await
}

/// The same weights with a Qwen3-style tokenizer (`fixtures/qwen2-tiny-qwen3-chat`: `<think>`,
/// `</think>`, `<tool_response>` added by its config, Qwen3's chat template).
pub(super) async fn qwen3_chat_server() -> TestServer {
    real_vocabulary_server("qwen2-tiny-qwen3-chat").await
}

async fn real_vocabulary_server(model: &'static str) -> TestServer {
    let make = move || {
        let config = EngineConfig {
            max_model_len: Some(2048),
            num_kv_blocks: Some(512),
            ..engine_config()
        };
        Ok(LLMEngine::new(fixture_named(model), config)?)
    };
    spawn_server(make, config()).await.0
}

pub(super) fn config() -> ServerConfig {
    ServerConfig {
        model_name: MODEL.into(),
        api_key: Some(KEY.into()),
        shutdown_timeout: Duration::from_secs(1),
        ..ServerConfig::default()
    }
}

pub(super) fn client(s: &TestServer) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(format!("{}/v1", s.base))
            .with_api_key(KEY),
    )
}

/// The engine's own output (through `LLM::generate`) with the model's defaults, greedy.
async fn engine_text(prompt: Prompt, max_tokens: usize) -> String {
    tokio::task::spawn_blocking(move || {
        let mut llm = LLM::new(fixture(), engine_config()).unwrap();
        llm.set_progress(false);
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..llm.engine().default_sampling_params()
        };
        let out = llm.generate(&[prompt], &params).unwrap();
        out[0].text.clone().unwrap()
    })
    .await
    .unwrap()
}

pub(super) async fn post(
    s: &TestServer,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> reqwest::Response {
    post_at(&s.base, path, body, key).await
}

/// `post` by the server's base URL (for spawned tasks).
async fn post_at(base: &str, path: &str, body: &str, key: Option<&str>) -> reqwest::Response {
    let mut req = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    req.send().await.unwrap()
}

async fn metric(s: &TestServer, name: &str) -> f64 {
    let text = reqwest::get(format!("{}/metrics", s.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("burn_nanovllm_{name} ")))
        .unwrap_or_else(|| panic!("metric {name} in {text}"))
        .parse()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_client_gets_the_engine_text_streaming_and_not() {
    let s = start(config()).await;
    let c = client(&s);
    let prompt = "The capital of France is";
    let expected = engine_text(Prompt::Text(prompt.into()), 16).await;
    let req = CreateCompletionRequestArgs::default()
        .model(MODEL)
        .prompt(prompt)
        .max_tokens(16u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let whole = c.completions().create(req.clone()).await.unwrap();
    assert_eq!(whole.choices[0].text, expected);
    let usage = whole.usage.unwrap();
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    let mut stream = c.completions().create_stream(req).await.unwrap();
    let mut streamed = String::new();
    while let Some(chunk) = stream.next().await {
        for choice in chunk.unwrap().choices {
            streamed.push_str(&choice.text);
        }
    }
    assert_eq!(streamed, expected);

    // Chat: the template applied, the same text both ways.
    let user = "Write a haiku about Rust.";
    let expected = engine_text(Prompt::Chat(vec![ChatMessage::new("user", user)]), 12).await;
    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content(user)
            .build()
            .unwrap()
            .into()])
        .max_completion_tokens(12u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let whole = c.chat().create(req.clone()).await.unwrap();
    assert_eq!(
        whole.choices[0].message.content.as_deref(),
        Some(expected.as_str())
    );
    let mut stream = c.chat().create_stream(req).await.unwrap();
    let mut streamed = String::new();
    while let Some(chunk) = stream.next().await {
        for choice in chunk.unwrap().choices {
            streamed.push_str(choice.delta.content.as_deref().unwrap_or_default());
        }
    }
    assert_eq!(streamed, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_equal_their_solo_outputs() {
    let s = start(config()).await;
    let body = |i: usize| {
        json!({"model": MODEL, "prompt": format!("Request number {i} says"), "max_tokens": 12,
               "temperature": 0, "ignore_eos": true})
        .to_string()
    };
    let text = |v: Value| v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut solo = Vec::new();
    for i in 0..32 {
        solo.push(text(
            post(&s, "/v1/completions", &body(i), Some(KEY))
                .await
                .json()
                .await
                .unwrap(),
        ));
    }
    let tasks: Vec<_> = (0..32)
        .map(|i| {
            let (base, b) = (s.base.clone(), body(i));
            tokio::spawn(async move {
                let r = post_at(&base, "/v1/completions", &b, Some(KEY)).await;
                assert_eq!(r.status(), 200);
                r.json::<Value>().await.unwrap()
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let v = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 12);
        assert_eq!(text(v), solo[i], "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_dropped_mid_stream_frees_its_blocks() {
    let s = start(config()).await;
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240,
                      "temperature": 0, "ignore_eos": true, "stream": true});
    let mut resp = post(&s, "/v1/completions", &body.to_string(), Some(KEY)).await;
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: {"), "{first:?}");
    assert_eq!(metric(&s, "num_requests_running").await, 1.0);
    assert!(metric(&s, "kv_cache_usage_perc").await > 0.0);
    drop(resp);
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&s, "num_requests_running").await != 0.0
        || metric(&s, "kv_cache_usage_perc").await != 0.0
    {
        assert!(
            Instant::now() < deadline,
            "the dropped request still holds blocks"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Aborted, not finished: it stopped well before its 240 tokens.
    assert_eq!(metric(&s, "requests_finished_total").await, 0.0);
    assert!(metric(&s, "generation_tokens_total").await < 240.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_stays_healthy() {
    let s = start(config()).await;
    let ok = json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).to_string();
    let long: Vec<u32> = (0..300).map(|i| 100 + i).collect();
    // (body, path, API key, expected status, expected `param`)
    type Case<'a> = (String, &'a str, Option<&'a str>, u16, Option<&'a str>);
    // A completion refused with 400 naming `param`.
    let refused = |body: &str, param: &'static str| -> Case {
        (body.into(), "/v1/completions", Some(KEY), 400, Some(param))
    };
    let chat_refused = |body: &str, param: &'static str| -> Case {
        (
            body.into(),
            "/v1/chat/completions",
            Some(KEY),
            400,
            Some(param),
        )
    };
    let cases: Vec<Case> = vec![
        ("{not json".into(), "/v1/completions", Some(KEY), 400, None),
        refused(r#"{"prompt": "Hi", "max_tokens": "many"}"#, "max_tokens"),
        refused(r#"{"prompt": "Hi", "max_tokens": -4}"#, "max_tokens"),
        refused(r#"{"prompt": "Hi", "temperature": -1}"#, "temperature"),
        refused(r#"{"prompt": "Hi", "n": 65}"#, "n"),
        refused(&json!({"prompt": long}).to_string(), "prompt"),
        (
            r#"{"prompt": "Hi", "model": "gpt-9"}"#.into(),
            "/v1/completions",
            Some(KEY),
            404,
            Some("model"),
        ),
        chat_refused(r#"{"messages": []}"#, "messages"),
        chat_refused(
            r#"{"messages": [{"role": "wizard", "content": "x"}]}"#,
            "messages[0].role",
        ),
        (ok.clone(), "/v1/completions", None, 401, None),
        (ok.clone(), "/v1/completions", Some("sk-wrong"), 401, None),
        // Past the context (max_model_len = 256) with the prompt: vLLM's 400; past i64: a type
        // error naming the field.
        refused(
            r#"{"prompt": "Hi", "max_tokens": 2147483648}"#,
            "max_tokens",
        ),
        refused(
            r#"{"prompt": "Hi", "max_tokens": 9223372036854775807}"#,
            "max_tokens",
        ),
        chat_refused(
            r#"{"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 255}"#,
            "max_tokens",
        ),
        refused(
            r#"{"prompt": "Hi", "max_tokens": 18446744073709551616}"#,
            "max_tokens",
        ),
    ];
    for (body, path, key, status, param) in cases {
        let r = post(&s, path, &body, key).await;
        assert_eq!(r.status().as_u16(), status, "{body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], status, "{v}");
        assert!(!v["error"]["message"].as_str().unwrap().is_empty());
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{v}");
        }
    }
    // Texts that cannot fit (1 MB: over 256 tokens × 256 bytes, the longest token, × 4) are
    // refused by their size before tokenization; the context message counts tokens.
    let huge = "lorem ipsum ".repeat(1 << 17);
    let bodies = [
        ("/v1/completions", json!({"prompt": huge}), "prompt"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": huge}]}),
            "messages",
        ),
    ];
    for (path, body, field) in bodies {
        let r = post(&s, path, &body.to_string(), Some(KEY)).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], field, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("bytes of text are more than max_model_len = 256"),
            "{message}"
        );
    }
    let over = json!({"prompt": "Hi", "max_tokens": 256}).to_string();
    let r = post(&s, "/v1/completions", &over, Some(KEY)).await;
    let v: Value = r.json().await.unwrap();
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("maximum context length is 256 tokens"),
        "{message}"
    );
    assert!(message.contains("in the completion"), "{message}");
    let r = post(&s, "/v1/completions", &ok, Some(KEY)).await;
    assert_eq!(r.status(), 200);
    let models: Value = reqwest::Client::new()
        .get(format!("{}/v1/models", s.base))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    let health = reqwest::get(format!("{}/health", s.base)).await.unwrap();
    assert_eq!(health.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_flood_sheds_load_with_503_and_loses_nothing() {
    let s = start(ServerConfig {
        max_pending: 8,
        ..config()
    })
    .await;
    let body = json!({"model": MODEL, "prompt": "Flood", "max_tokens": 4, "ignore_eos": true,
                      "temperature": 0})
    .to_string();
    let http = reqwest::Client::new();
    let start = Instant::now();
    let tasks: Vec<_> = (0..500)
        .map(|_| {
            let (http, url, body) = (
                http.clone(),
                format!("{}/v1/completions", s.base),
                body.clone(),
            );
            tokio::spawn(async move {
                let r = http
                    .post(url)
                    .bearer_auth(KEY)
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let retry = r.headers().contains_key("retry-after");
                let v: Value = r.json().await.unwrap();
                (status, retry, v)
            })
        })
        .collect();
    let (mut accepted, mut shed) = (0, 0);
    for t in tasks {
        let (status, retry, v) = tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("bounded in time")
            .unwrap();
        match status {
            200 => {
                accepted += 1;
                assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
            }
            503 => {
                shed += 1;
                assert!(retry, "503 without Retry-After");
                assert_eq!(v["error"]["code"], 503);
            }
            other => panic!("status {other}: {v}"),
        }
    }
    assert_eq!(accepted + shed, 500);
    assert!(shed > 0, "a queue of 8 should overflow");
    assert!(accepted >= 8);
    eprintln!(
        "flood: {accepted} served, {shed} shed in {:.1?}",
        start.elapsed()
    );
    // Every accepted request finished and was counted; the server is idle and healthy.
    assert_eq!(metric(&s, "requests_finished_total").await, accepted as f64);
    assert_eq!(metric(&s, "requests_rejected_total").await, shed as f64);
    assert_eq!(metric(&s, "num_requests_running").await, 0.0);
    assert_eq!(
        reqwest::get(format!("{}/health", s.base))
            .await
            .unwrap()
            .status(),
        200
    );
}

/// A model folder without tokenizer.json streams token-id prompts (ids counted, text empty)
/// and refuses what needs text, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_ids_stream_on_a_model_without_tokenizer() {
    let s = start_with(IDS_ONLY, config()).await;
    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": true, "stream": true,
                      "stream_options": {"include_usage": true}});
    let text = post(&s, "/v1/completions", &body.to_string(), Some(KEY))
        .await
        .text()
        .await
        .unwrap();
    let chunks: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert_eq!(
        chunks.last().unwrap()["usage"]["completion_tokens"],
        6,
        "{text}"
    );
    for (body, param) in [
        (json!({"prompt": "text", "max_tokens": 2}), "prompt"),
        (json!({"prompt": [1, 2], "stop": ["x"]}), "stop"),
    ] {
        let r = post(&s, "/v1/completions", &body.to_string(), Some(KEY)).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    assert_eq!(metric(&s, "requests_finished_total").await, 1.0);
}

/// A device failure (injected in the runner at the 4th forward, as a poisoned device fails
/// every later one): every request in flight, running or waiting, streaming or not, gets its
/// cause; `/health` turns 503, `/metrics` counts it, new requests get 503; then `serve` returns
/// the failure, within the grace period and a bound, for `serve` to exit non-zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_fails_every_request_and_stops_the_server() {
    const CAUSE: &str = "injected device fault";
    let make = || {
        let mut engine = LLMEngine::new(fixture(), engine_config())?;
        engine.set_fault_hook(Box::new(|forward| match forward {
            0..3 => Ok(()),
            _ => Err(format!("{CAUSE} at forward {forward}")),
        }));
        Ok(engine)
    };
    let config = ServerConfig {
        failure_grace: Duration::from_secs(1),
        ..config()
    };
    let (s, serving) = spawn_server(make, config).await;
    let body = |i: usize, stream: bool| {
        json!({"prompt": format!("Request {i} goes"), "max_tokens": 40, "ignore_eos": true,
               "stream": stream})
        .to_string()
    };
    // 12 requests: more than max_num_seqs = 8, so some wait when the device fails.
    let tasks: Vec<_> = (0..12)
        .map(|i| {
            let (base, b) = (s.base.clone(), body(i, i % 3 == 0));
            tokio::spawn(async move {
                let r = post_at(&base, "/v1/completions", &b, Some(KEY)).await;
                (r.status().as_u16(), r.text().await.unwrap())
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let (status, text) = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .unwrap()
            .unwrap();
        assert!(text.contains(CAUSE), "request {i}: {status} {text}");
        if i % 3 == 0 {
            // Streams started with 200: the error comes as an event, then [DONE].
            assert!(status == 200 || status == 503, "request {i}: {status}");
        } else {
            assert!(
                status == 500 || status == 503,
                "request {i}: {status} {text}"
            );
        }
    }
    let health = reqwest::get(format!("{}/health", s.base)).await.unwrap();
    assert_eq!(health.status(), 503);
    assert_eq!(metric(&s, "engine_failures_total").await, 1.0);
    let r = post(&s, "/v1/completions", &body(99, false), Some(KEY)).await;
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains(CAUSE));
    let served = tokio::time::timeout(Duration::from_secs(30), serving)
        .await
        .expect("serve returns after the failure")
        .unwrap();
    let err = served.expect_err("serve ends with the failure");
    assert!(err.to_string().contains(CAUSE), "{err}");
}

/// The default model ships a chat template: chat completions and the terminal chat work out
/// of the box, and a turn ends at `<|im_end|>` or `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_model_chats_out_of_the_box() {
    let make = || {
        Ok(LLMEngine::new(
            burn_nanovllm::default_model_dir(),
            engine_config(),
        )?)
    };
    let (s, _serving) = spawn_server(make, config()).await;
    let request = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages([ChatCompletionRequestUserMessageArgs::default()
            .content("Tell me about the sea.")
            .build()
            .unwrap()
            .into()])
        .max_completion_tokens(16u32)
        .temperature(0.0)
        .build()
        .unwrap();
    let reply = client(&s).chat().create(request).await.unwrap();
    let content = reply.choices[0].message.content.clone().unwrap();
    assert!(!content.trim().is_empty(), "{reply:?}");
    let usage = reply.usage.unwrap();
    assert!(usage.completion_tokens >= 1 && usage.completion_tokens <= 16);
    // ChatML turns: the prompt holds <|im_start|>user … <|im_end|> <|im_start|>assistant.
    let expected = tokio::task::spawn_blocking(|| {
        let llm = LLM::new(burn_nanovllm::default_model_dir(), engine_config()).unwrap();
        let t = llm.engine().tokenizer().unwrap().clone();
        let text = t
            .apply_chat_template(&[ChatMessage::new("user", "Tell me about the sea.")], true)
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nTell me about the sea.<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(
            llm.engine()
                .eos_token_ids()
                .contains(&t.token_to_id("<|im_end|>").unwrap())
        );
        t.encode(&text).unwrap().len()
    })
    .await
    .unwrap();
    assert_eq!(usage.prompt_tokens as usize, expected);
    // The terminal chat over the same model: two turns, then end of input.
    let transcript = tokio::task::spawn_blocking(|| {
        let mut llm = LLM::new(burn_nanovllm::default_model_dir(), engine_config()).unwrap();
        llm.set_progress(false);
        let params = SamplingParams {
            temperature: 0.0,
            max_tokens: 8,
            ..SamplingParams::default()
        };
        let mut out = Vec::new();
        let input = &b"Hello there.\nWhat is the sea?\n"[..];
        burn_nanovllm::chat_loop(&mut llm, &params, None, input, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    })
    .await
    .unwrap();
    assert_eq!(transcript.matches("> ").count(), 3, "{transcript}");
    assert!(transcript.lines().count() >= 3, "{transcript}");
}
