//! Does a request's text depend on what else the server runs? One greedy completion alone, then
//! the same request sent while a flood of random requests is in flight, round after round: how
//! many rounds give the alone text and log-probabilities (the chosen token's and the top 5, as
//! the server prints them). Without `--batch-invariant` a GPU engine's answer usually changes
//! with the batch; with it, every round must match.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::report::Report;
use crate::serve_bench::post_completion;
use crate::workload::random_requests;

/// The flood and the rounds.
pub struct Probe<'a> {
    /// The server's base URL.
    pub url: &'a str,
    /// Requests in flight beside the probe each round.
    pub flood: usize,
    /// Rounds.
    pub rounds: usize,
    /// Prompt and output tokens of the flood's requests (vLLM's random dataset, ±`range_ratio`).
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
    /// Token ids of the flood's prompts stay below this.
    pub vocab: u32,
    /// Seed of the flood (a round adds its index).
    pub seed: u64,
}

/// The probe: greedy, a fixed length, text prompt, log-probabilities.
fn probe_body(max_tokens: usize) -> Value {
    json!({"prompt": "The history of the lighthouse begins", "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": true, "logprobs": 5})
}

/// The first choice of a completion: `(text, logprobs)`.
async fn complete(client: &reqwest::Client, url: &str, body: &Value) -> Result<(String, Value)> {
    let r = post_completion(client, url, body).await?;
    let status = r.status();
    let v: Value = r.json().await.context("response body")?;
    if !status.is_success() {
        bail!("status {status}: {v}");
    }
    let text = v["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .context("no choices[0].text")?;
    Ok((text, v["choices"][0]["logprobs"].clone()))
}

/// Runs the probe against `p.url`; one row per round and a summary row.
pub fn run(p: &Probe<'_>) -> Result<Report> {
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(measure(p))
}

async fn measure(p: &Probe<'_>) -> Result<Report> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let mut report = Report::new(
        &format!(
            "invariance probe: one greedy request alone, then beside {} others, {} rounds",
            p.flood, p.rounds
        ),
        &["round", "same_text", "same_logprobs", "text"],
    );
    let body = probe_body(p.output_len);
    let (alone, alone_logprobs) = complete(&client, p.url, &body).await?;
    report.row(vec![json!("alone"), json!(true), json!(true), json!(alone)]);
    let (mut same, mut same_logprobs) = (0, 0);
    for round in 0..p.rounds {
        let flood: Vec<_> = random_requests(
            p.flood,
            p.input_len,
            p.output_len,
            p.range_ratio,
            p.vocab,
            p.seed + round as u64,
        )
        .into_iter()
        .map(|item| {
            let body = json!({"prompt": item.prompt, "max_tokens": item.max_tokens,
                "ignore_eos": true, "temperature": 0.8, "seed": round});
            let (client, url) = (client.clone(), p.url.to_string());
            tokio::spawn(async move { complete(&client, &url, &body).await })
        })
        .collect();
        // The flood is on its way: the probe joins its batches.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (text, logprobs) = complete(&client, p.url, &body).await?;
        for request in flood {
            request.await??;
        }
        let (equal, equal_logprobs) = (text == alone, logprobs == alone_logprobs);
        same += equal as usize;
        same_logprobs += equal_logprobs as usize;
        report.row(vec![
            json!(round),
            json!(equal),
            json!(equal_logprobs),
            json!(if equal { String::new() } else { text }),
        ]);
    }
    report.row(vec![
        json!("total"),
        json!(format!("{same} of {}", p.rounds)),
        json!(format!("{same_logprobs} of {}", p.rounds)),
        json!(""),
    ]);
    Ok(report)
}
