//! `serve` as a process (the CLI binary, on loopback) under hostile prompts: long texts are
//! tokenized off the async workers, so a short request is answered while they are, and the
//! memory their tokenization took goes back to the OS. The process's resident memory is read
//! from `/proc`. Bounded: 13 requests per burst, 3 bursts, a timeout on each.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

/// The CLI's `serve`, killed when dropped.
struct ServeProcess {
    child: Child,
    base: String,
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ServeProcess {
    /// Starts `serve` on a free loopback port and waits for its "serving … on URL" line.
    fn start(args: &[&str]) -> Self {
        let mut child = Command::new(env!("CARGO_BIN_EXE_burn-nanovllm"))
            .arg("serve")
            .args(["--host", "127.0.0.1", "--port", "0"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the burn-nanovllm binary");
        let mut stderr = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        let base = loop {
            line.clear();
            assert!(
                stderr.read_line(&mut line).unwrap() > 0,
                "serve ended before serving"
            );
            if let Some(url) = line.split(" on ").nth(1).and_then(|r| r.split(' ').next())
                && line.starts_with("serving")
            {
                break url.to_string();
            }
        };
        // Keep draining stderr so that the server never blocks on a full pipe.
        std::thread::spawn(move || std::io::copy(&mut stderr, &mut std::io::sink()));
        Self { child, base }
    }

    /// Resident memory in bytes (`VmRSS`).
    fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .expect("VmRSS");
        kb << 10
    }
}

async fn complete(base: &str, body: String) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/completions"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// Four ~1 MB prompts (each ~250k tokens, one word a line: with no space to cut at, the prefix
/// probe passes them on, so they are tokenized whole, then refused as longer than
/// max_model_len = 4096) and a 4-token request sent just after them: the short one is answered
/// before any long one, and after three such bursts the server's memory is back near where it
/// started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_neither_stall_others_nor_keep_their_memory() {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2-tiny-tied");
    let server = ServeProcess::start(&[
        "--model",
        model.to_str().unwrap(),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "4096",
        "--num-kv-blocks",
        "300",
        "--max-num-seqs",
        "8",
    ]);
    let base = server.base.clone();
    let short = json!({"prompt": "The sea", "max_tokens": 4, "ignore_eos": true}).to_string();
    let (status, v) = complete(&base, short.clone()).await;
    assert_eq!(status, 200, "{v}");
    let baseline = server.rss();
    let long =
        json!({"prompt": "the\nquick\nbrown\nfox\njumps\nover\nthe\nlazy\ndog\n".repeat(24_000)})
            .to_string();
    let mut peak_growth = 0;
    for burst in 0..3 {
        let order = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let (base, body, order) = (base.clone(), long.clone(), order.clone());
                tokio::spawn(async move {
                    let (status, v) = complete(&base, body).await;
                    (order.fetch_add(1, Ordering::SeqCst), status, v)
                })
            })
            .collect();
        // The long bodies are on their way: now the short request.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (status, v) =
            tokio::time::timeout(Duration::from_secs(60), complete(&base, short.clone()))
                .await
                .expect("the short request is answered");
        let short_place = order.fetch_add(1, Ordering::SeqCst);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 4);
        for t in tasks {
            let (place, status, v) = tokio::time::timeout(Duration::from_secs(120), t)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(status, 400, "{v}");
            assert_eq!(v["error"]["param"], "prompt", "{v}");
            let message = v["error"]["message"].as_str().unwrap();
            assert!(message.contains("max_model_len = 4096"), "{message}");
            assert!(!message.contains("already hold"), "{message}");
            assert!(
                place > short_place,
                "burst {burst}: a long prompt was answered first"
            );
        }
        peak_growth = peak_growth.max(server.rss().saturating_sub(baseline));
    }
    let growth = server.rss().saturating_sub(baseline);
    eprintln!(
        "resident memory: baseline {} MiB, growth after 3 bursts {} MiB",
        baseline >> 20,
        growth >> 20
    );
    assert!(growth < 96 << 20, "the server kept {} MiB", growth >> 20);
}

/// A 32k context at the checkpoint's own `max_model_len` (the fixture's config with
/// `max_position_embeddings` = 32,768, `serve`'s default): a prompt of 3.9 MiB of words (under
/// the 4 MiB body limit, under the sound bound of 32,768 × 256 × 4 bytes) is refused by the
/// tokens of its first 512 KiB, and a short request is answered after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_too_long_for_a_32k_context_is_refused_by_its_prefix() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/qwen2-tiny-tied");
    let model = std::env::temp_dir().join(format!("burn-nanovllm-32k-{}", std::process::id()));
    std::fs::create_dir_all(&model).unwrap();
    for file in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(fixture.join(file), model.join(file)).unwrap();
    }
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap())
            .unwrap();
    config["max_position_embeddings"] = json!(32768);
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    let server =
        ServeProcess::start(&["--model", model.to_str().unwrap(), "--num-kv-blocks", "64"]);
    let base = server.base.clone();
    let words = "the quick brown fox jumps over the lazy dog ".repeat(93_000);
    let body = json!({"prompt": words, "max_tokens": 1}).to_string();
    assert!(body.len() < 4 << 20);
    let (status, v) = tokio::time::timeout(Duration::from_secs(120), complete(&base, body))
        .await
        .expect("the long prompt is answered");
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "prompt", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(
            "its first 524285 of 4092000 bytes already hold more than \
             max_model_len = 32768 tokens"
        ),
        "{message}"
    );
    let short = json!({"prompt": "The sea", "max_tokens": 4, "ignore_eos": true}).to_string();
    let (status, v) = complete(&base, short).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 4);
    drop(server);
    let _ = std::fs::remove_dir_all(&model);
}
