//! The OpenAI and vLLM surface beyond completions and chats, on the real Qwen2 vocabulary
//! (`fixtures/qwen2-tiny-tied`): the Responses API (text, JSON schema, function calls, the
//! streamed events), `/tokenize` and `/detokenize`, `logit_bias` / `allowed_token_ids` /
//! `bad_words`, fields parsed at full width, bounds on stop strings, unknown fields ignored.

use serde_json::{Value, json};

use super::server::{
    KEY, MODEL, TestServer, config, post, qwen_vocabulary_server, qwen3_chat_server, start,
};

async fn json_of(s: &TestServer, path: &str, body: Value) -> (u16, Value) {
    let r = post(s, path, &body.to_string(), Some(KEY)).await;
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `/tokenize` of a text and of a conversation (through the chat template), `/detokenize`
/// back to the text; ids outside the vocabulary are a 400 naming `tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let s = start(config()).await;
    let text = "Hello, tokenizer: <tool_call> 123";
    let (status, v) = json_of(&s, "/tokenize", json!({"model": MODEL, "prompt": text})).await;
    assert_eq!(status, 200, "{v}");
    let ids = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["max_model_len"], 256);
    assert!(
        ids.contains(&json!(151657)),
        "{v}: <tool_call> is one token"
    );
    let (status, back) = json_of(&s, "/detokenize", json!({"tokens": ids})).await;
    assert_eq!(status, 200);
    assert_eq!(back["prompt"], text);
    let chat = json!({"messages": [{"role": "user", "content": text}]});
    let (status, v) = json_of(&s, "/tokenize", chat).await;
    assert_eq!(status, 200);
    assert!(v["count"].as_u64().unwrap() > ids.len() as u64 + 4, "{v}");
    let (status, v) = json_of(&s, "/detokenize", json!({"tokens": [1, 151936]})).await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("tokens"))
    );
    let (status, _) = json_of(&s, "/tokenize", json!({"model": "other", "prompt": "x"})).await;
    assert_eq!(status, 404);
    // Behind the API key, as /v1.
    let r = post(&s, "/tokenize", &json!({"prompt": "x"}).to_string(), None).await;
    assert_eq!(r.status(), 401);
}

/// Greedy ids of a completion of `prompt` with `extra` fields (`logprobs` carries the tokens).
async fn completion(s: &TestServer, extra: Value) -> (u16, Value) {
    let mut body = json!({"model": MODEL, "prompt": "The weather", "max_tokens": 6,
                          "temperature": 0.0});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    json_of(s, "/v1/completions", body).await
}

/// `logit_bias`, `allowed_token_ids` and `bad_words` change the draws as they say; numeric
/// fields are parsed at full width (`top_k` 2³² + 1 keeps every token, as absent; it once
/// wrapped to 1); `min_tokens` on a chat without `max_tokens`; stop strings bounded; unknown
/// fields (`best_of` among them) ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampling_fields_of_openai_and_vllm() {
    let s = start(config()).await;
    let (_, plain) = completion(&s, json!({})).await;
    let plain_text = plain["choices"][0]["text"].as_str().unwrap().to_string();
    let ids = |text: &str| {
        let text = text.to_string();
        let s = &s;
        async move {
            let (_, v) = json_of(s, "/tokenize", json!({"prompt": text})).await;
            v["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect::<Vec<u32>>()
        }
    };
    // " Paris" as one token, boosted everywhere.
    let paris = ids(" Paris").await;
    assert_eq!(paris.len(), 1);
    let (status, v) = completion(&s, json!({"logit_bias": {paris[0].to_string(): 100}})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], " Paris".repeat(6));
    let (status, v) = completion(&s, json!({"allowed_token_ids": [paris[0]]})).await;
    assert_eq!(
        (status, v["choices"][0]["text"].clone()),
        (200, json!(" Paris".repeat(6)))
    );
    // The greedy text's first word, banned: it never starts the text.
    let first = plain_text.split_whitespace().next().unwrap().to_string();
    let (status, v) = completion(&s, json!({"bad_words": [first]})).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(
        !text.trim_start().starts_with(&first),
        "{text:?} starts with {first:?}"
    );
    let (status, v) = completion(&s, json!({"logit_bias": {"x": 1}})).await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("logit_bias"))
    );
    let (status, v) = completion(&s, json!({"logit_bias": {"5": 1000}})).await;
    assert_eq!(
        (status, v["error"]["param"].clone()),
        (400, json!("logit_bias"))
    );
    // top_k beyond u32: every token kept, the same draw as without it.
    let sampled = |extra: Value| {
        let mut e = json!({"temperature": 1.0, "seed": 7});
        for (k, v) in extra.as_object().unwrap() {
            e[k] = v.clone();
        }
        completion(&s, e)
    };
    let (_, free) = sampled(json!({})).await;
    let (status, wide) = sampled(json!({"top_k": 4_294_967_297u64})).await;
    assert_eq!(status, 200);
    assert_eq!(wide["choices"][0]["text"], free["choices"][0]["text"]);
    // min_tokens on a chat without max_tokens (was refused against a placeholder of 1).
    let chat = json!({"model": MODEL, "min_tokens": 3, "temperature": 0.0,
                      "messages": [{"role": "user", "content": "Hi"}], "stop": ["."]});
    let (status, v) = json_of(&s, "/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() >= 3);
    // Stop strings: at most 256, 16 KiB together.
    let many: Vec<String> = (0..300).map(|i| format!("stop{i}")).collect();
    let (status, v) = completion(&s, json!({"stop": many})).await;
    assert_eq!((status, v["error"]["param"].clone()), (400, json!("stop")));
    let (status, _) = completion(&s, json!({"stop": ["x".repeat(20_000)]})).await;
    assert_eq!(status, 400);
    let (status, _) = completion(
        &s,
        json!({"stop": (0..200).map(|i| format!("s{i}")).collect::<Vec<_>>()}),
    )
    .await;
    assert_eq!(status, 200);
    // Unknown fields are ignored.
    let (status, v) = completion(&s, json!({"best_of": 1, "frobnicate": {"a": 1}})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["text"], plain_text);
}

/// The Responses API: text in, a `response` whose message holds the text; a JSON schema
/// through `text.format`; a forced function call as a `function_call` item whose arguments
/// validate; a call and its output in the input; the streamed events, whose deltas add up to
/// the final text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_api_text_schema_function_calls_and_events() {
    let s = qwen_vocabulary_server().await;
    let (status, v) = json_of(
        &s,
        "/v1/responses",
        json!({
            "model": MODEL, "input": "Say something.", "instructions": "Be brief.",
            "max_output_tokens": 5, "temperature": 0.0,
        }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 5);
    let text = v["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(v["output"][0]["content"][0]["type"], "output_text");
    assert!(!text.is_empty());
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                        "maximum": 99}}, "required": ["n"], "additionalProperties": false});
    let (status, v) = json_of(
        &s,
        "/v1/responses",
        json!({
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "A number."}]}],
            "text": {"format": {"type": "json_schema", "name": "n", "schema": schema}},
            "max_output_tokens": 40, "temperature": 1.0, "seed": 2,
        }),
    )
    .await;
    assert_eq!(
        (status, v["status"].clone()),
        (200, json!("completed")),
        "{v}"
    );
    let out: Value =
        serde_json::from_str(v["output"][0]["content"][0]["text"].as_str().unwrap()).unwrap();
    assert!(out["n"].as_u64().unwrap() < 100, "{out}");
    let tools = json!([{"type": "function", "name": "add", "description": "adds",
                        "parameters": {"type": "object", "properties": {"a": {"type": "integer",
                        "minimum": 0, "maximum": 9}}, "required": ["a"],
                        "additionalProperties": false}}]);
    let (status, v) = json_of(
        &s,
        "/v1/responses",
        json!({
            "input": "Add.", "tools": tools, "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 200, "temperature": 1.0, "seed": 5,
        }),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let call = v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == "function_call")
        .unwrap_or_else(|| panic!("no function call: {v}"));
    assert_eq!(call["name"], "add");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!(args["a"].as_u64().unwrap() <= 9, "{args}");
    // The call and its output as input items.
    let (status, v) = json_of(&s, "/v1/responses", json!({
        "input": [
            {"role": "user", "content": "Add."},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{\"a\": 1}"},
            {"type": "function_call_output", "call_id": "c1", "output": "1"},
        ],
        "tools": tools, "max_output_tokens": 4, "temperature": 0.0,
    }))
    .await;
    assert_eq!(status, 200, "{v}");
    // Streamed: created, deltas, done, completed; the deltas are the final text.
    let body = json!({"input": "Say something.", "instructions": "Be brief.",
                      "max_output_tokens": 5, "temperature": 0.0, "stream": true});
    let r = post(&s, "/v1/responses", &body.to_string(), Some(KEY)).await;
    assert_eq!(r.status(), 200);
    let sse = r.text().await.unwrap();
    let events: Vec<Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds.first(), Some(&"response.created"));
    assert_eq!(kinds.last(), Some(&"response.completed"));
    assert!(kinds.contains(&"response.output_text.done"), "{kinds:?}");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, text);
    let last = events.last().unwrap();
    assert_eq!(last["response"]["output"][0]["content"][0]["text"], text);
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1));
}

/// `n` completions of one prompt (parallel sampling): `n` choices indexed from 0, distinct
/// draws, the same again for the same seed, the prompt counted once in `usage`; the later
/// completions reuse the first one's prompt blocks (the prefix cache's hit rate rises);
/// streamed, every index's chunks and one `[DONE]`. `best_of` other than `n`, and `n` out of
/// range, are 400s naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_completions_share_their_prompt() {
    let s = start(config()).await;
    let prompt = "It was the best of times, it was the worst of times, it was the age of \
                  wisdom, it was the age of foolishness, it was the epoch of belief";
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "n": 4,
                      "temperature": 1.0, "seed": 11});
    let (status, v) = json_of(&s, "/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let texts: Vec<String> = (0..4)
        .map(|i| {
            assert_eq!(v["choices"][i]["index"], i);
            v["choices"][i]["text"].as_str().unwrap().to_string()
        })
        .collect();
    let distinct: std::collections::HashSet<&String> = texts.iter().collect();
    assert!(distinct.len() > 1, "{texts:?}");
    let (_, tokenized) = json_of(&s, "/tokenize", json!({"prompt": prompt})).await;
    assert_eq!(v["usage"]["prompt_tokens"], tokenized["count"]);
    assert_eq!(v["usage"]["completion_tokens"], 32);
    let (_, again) = json_of(&s, "/v1/completions", body).await;
    let again: Vec<&str> = (0..4)
        .map(|i| again["choices"][i]["text"].as_str().unwrap())
        .collect();
    assert_eq!(again, texts, "the same seed, the same completions");
    let metrics = reqwest::get(format!("{}/metrics", s.base()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let hit_rate: f64 = metrics
        .lines()
        .find(|l| l.starts_with("burn_nanovllm_prefix_cache_hit_rate"))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{metrics}"));
    assert!(hit_rate > 0.5, "prefix hit rate {hit_rate}");
    // Streamed chat: both indices, then [DONE].
    let chat = json!({"model": MODEL, "n": 2, "max_tokens": 5, "stream": true, "seed": 3,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let r = post(&s, "/v1/chat/completions", &chat.to_string(), Some(KEY)).await;
    let sse = r.text().await.unwrap();
    let data: Vec<&str> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let mut seen = [0usize; 2];
    let mut finished = [false; 2];
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        let i = c["choices"][0]["index"].as_u64().unwrap() as usize;
        seen[i] += 1;
        finished[i] |= !c["choices"][0]["finish_reason"].is_null();
    }
    assert!(
        seen.iter().all(|&k| k > 0) && finished == [true, true],
        "{sse}"
    );
    for (field, extra) in [
        ("best_of", json!({"n": 2, "best_of": 3})),
        ("n", json!({"n": 0})),
        ("n", json!({"n": 1000})),
    ] {
        let (status, v) = completion(&s, extra).await;
        assert_eq!((status, v["error"]["param"].clone()), (400, json!(field)));
    }
}

/// `chat_template_kwargs` reach the template (vLLM's field): Qwen3's `enable_thinking: false`
/// ends the prompt with an empty thinking block, through `/tokenize` and a chat completion,
/// whose prompt tokens count it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_template_kwargs_reach_the_template() {
    let s = qwen3_chat_server().await;
    let messages = json!([{"role": "user", "content": "Hi!"}]);
    let tokens = |v: &Value| -> Vec<u64> {
        v["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap())
            .collect()
    };
    let (status, plain) = json_of(
        &s,
        "/tokenize",
        json!({"model": MODEL, "messages": messages}),
    )
    .await;
    assert_eq!(status, 200, "{plain}");
    let plain = tokens(&plain);
    // <|im_start|> assistant \n
    assert_eq!(plain[plain.len() - 3..], [151644, 77091, 198]);
    let kwargs = json!({"enable_thinking": false});
    let (status, off) = json_of(
        &s,
        "/tokenize",
        json!({"model": MODEL, "messages": messages, "chat_template_kwargs": kwargs}),
    )
    .await;
    assert_eq!(status, 200, "{off}");
    // … <think> \n\n </think> \n\n
    assert_eq!(
        tokens(&off),
        [&plain[..], &[151667, 271, 151668, 271]].concat()
    );
    let (status, v) = json_of(
        &s,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "chat_template_kwargs": kwargs,
               "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], plain.len() + 4);
    let (status, v) = json_of(
        &s,
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": messages, "chat_template_kwargs": [1], "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
}
