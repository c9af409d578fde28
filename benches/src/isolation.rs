//! How much one kind of hostile request slows a plain one, through the OpenAI server: a short
//! greedy completion's latency alone, then while hostile requests of each kind the server
//! bounds are in flight — constraints that are slow to compile, the most stop strings a request
//! may have, prompts of a megabyte, `n` = 64 — each kind alone, and while their benign twins
//! are (the same generations without the hostile part: no constraint, no stop strings, a short
//! prompt, 64 separate requests). Beside the twin, the plain request pays only for what makes
//! the request hostile; beside the hostile one alone it also shares the batch, which on a CPU
//! costs in proportion to the rows. The server is meant to keep both ratios under 2 (the
//! hostile work runs on bounded pools, off the engine thread, or bounded per token).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use serde_json::{Value, json};

use crate::report::{Report, percentile};
use crate::serve_bench::post_completion;

/// Hostile requests of one kind in flight at once.
const HOSTILE: usize = 4;
/// Timed plain requests per measurement.
const ROUNDS: usize = 7;

/// One kind of hostile request: its name and body, and its benign twin.
struct Vector {
    name: &'static str,
    body: Value,
    /// Hostile requests of it at once.
    count: usize,
    /// The same generation without the hostile part, and how many of it at once.
    twin: (Value, usize),
}

fn vectors() -> Vec<Vector> {
    // A JSON schema of 2,000 patterned properties: its grammar takes a while to build.
    let properties: serde_json::Map<String, Value> = (0..2000)
        .map(|i| {
            (
                format!("field_{i}"),
                json!({"type": "string", "pattern": format!("[a-z]{{1,{}}}[0-9]+", 1 + i % 7)}),
            )
        })
        .collect();
    let schema = json!({"type": "object", "properties": properties, "required": ["field_0"]});
    // The most stop strings a request may have: 256 of 63 bytes (16 KiB together).
    let stops: Vec<String> = (0..256)
        .map(|i| format!("{i:03}{}", "x".repeat(60)))
        .collect();
    let megabyte = "the\nquick\nbrown\nfox\njumps\nover\nthe\nlazy\ndog\n".repeat(24_000);
    vec![
        Vector {
            name: "slow grammar compiles",
            body: json!({"prompt": "A record:", "max_tokens": 8,
                "response_format": {"type": "json_schema",
                    "json_schema": {"name": "record", "schema": schema}}}),
            count: HOSTILE,
            twin: (json!({"prompt": "A record:", "max_tokens": 8}), HOSTILE),
        },
        Vector {
            name: "256 stop strings",
            body: json!({"prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": true,
                "stop": stops}),
            count: HOSTILE,
            twin: (
                json!({"prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": true}),
                HOSTILE,
            ),
        },
        Vector {
            name: "1 MB prompts",
            body: json!({"prompt": megabyte, "max_tokens": 1}),
            count: HOSTILE,
            twin: (
                json!({"prompt": "the quick brown fox", "max_tokens": 1}),
                HOSTILE,
            ),
        },
        Vector {
            name: "n = 64",
            body: json!({"prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": true,
                "n": 64, "temperature": 0.8, "seed": 1}),
            count: 1,
            twin: (
                json!({"prompt": "Once upon a time", "max_tokens": 128, "ignore_eos": true,
                    "temperature": 0.8, "seed": 1}),
                64,
            ),
        },
    ]
}

/// The plain request: 16 greedy tokens.
fn plain() -> Value {
    json!({"prompt": "The sea", "max_tokens": 16, "ignore_eos": true, "temperature": 0.0})
}

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> Result<u16> {
    let r = post_completion(client, url, body).await?;
    let status = r.status().as_u16();
    let _ = r.bytes().await;
    Ok(status)
}

/// Seconds the plain request takes.
async fn time_plain(client: &reqwest::Client, url: &str) -> Result<f64> {
    let start = Instant::now();
    let status = post(client, url, &plain()).await?;
    if status != 200 {
        bail!("the plain request got {status}");
    }
    Ok(start.elapsed().as_secs_f64())
}

/// Measures against the server at `url` (a model with a tokenizer: the requests are text).
pub fn run(url: &str) -> Result<Report> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(measure(url))
}

async fn measure(url: &str) -> Result<Report> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()?;
    let mut report = Report::new(
        "isolation: a plain request (16 greedy tokens) alone and beside hostile ones",
        &[
            "hostile",
            "in_flight",
            "hostile_status",
            "plain_p50_ms",
            "beside_twin_p50_ms",
            "solo_p50_ms",
            "ratio_to_twin",
            "ratio_to_solo",
        ],
    );
    // Warm-up, then the plain request alone.
    time_plain(&client, url).await?;
    let mut solo = Vec::new();
    for _ in 0..ROUNDS {
        solo.push(time_plain(&client, url).await?);
    }
    let solo = percentile(&mut solo, 0.5);
    for v in vectors() {
        let (p50, statuses) = beside(&client, url, &v.body, v.count).await?;
        let (twin, _) = beside(&client, url, &v.twin.0, v.twin.1).await?;
        report.row(vec![
            json!(v.name),
            json!(v.count),
            json!(format!("{statuses:?}")),
            json!(p50 * 1e3),
            json!(twin * 1e3),
            json!(solo * 1e3),
            json!(p50 / twin),
            json!(p50 / solo),
        ]);
    }
    Ok(report)
}

/// The plain request's median seconds while `count` requests of `body` are in flight, and the
/// statuses they got.
async fn beside(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    count: usize,
) -> Result<(f64, Vec<u16>)> {
    let mut times = Vec::new();
    let mut statuses = Vec::new();
    for _ in 0..ROUNDS {
        let others: Vec<_> = (0..count)
            .map(|_| {
                let (client, url, body) = (client.clone(), url.to_string(), body.clone());
                tokio::spawn(async move { post(&client, &url, &body).await })
            })
            .collect();
        // The other bodies are on their way: now the plain request.
        tokio::time::sleep(Duration::from_millis(20)).await;
        times.push(time_plain(client, url).await?);
        for h in others {
            statuses.push(h.await??);
        }
    }
    statuses.sort_unstable();
    statuses.dedup();
    Ok((percentile(&mut times, 0.5), statuses))
}
