//! The HTTP handlers: `/v1/completions`, `/v1/chat/completions` (JSON or server-sent events),
//! `/v1/models`, `/health`, `/metrics`, and the API-key check of `/v1/*`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use engine::{FinishReason, TokenLogprobs};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use subtle::ConstantTimeEq;
use tokio::sync::mpsc as tmpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::admission::admit;
use super::engine_loop::{EngineHandle, Event};
use super::error::ApiError;
use super::grammar_pool::GrammarPool;
use super::metrics::render;
use super::protocol::{Endpoint, OpenAiRequest, ToolMode, parse_body};
use super::tokenize::{PromptTokenizer, release_free_memory};
use super::tool_calls::{ToolCall, ToolCallStream, parse_tool_calls};

/// Bodies above this size hand their memory back to the OS once answered.
const RELEASE_AFTER_BYTES: usize = 1 << 20;

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: PromptTokenizer,
    pub grammars: GrammarPool,
    pub model_name: String,
    pub api_key: Option<String>,
    pub registry: Registry,
    pub started: u64,
}

pub type Shared = Arc<AppState>;

/// Seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `/v1/*` with `--api-key`: `Authorization: Bearer KEY` or 401.
pub async fn require_key(State(s): State<Shared>, req: Request, next: Next) -> Response {
    if let Some(key) = &s.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // Constant time over the key's bytes: the comparison says nothing of how much matched.
        let matches = given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes())));
        if !matches {
            let msg = match given {
                None => "missing API key: send `Authorization: Bearer <key>`",
                Some(_) => "invalid API key",
            };
            return ApiError::new(StatusCode::UNAUTHORIZED, msg).into_response();
        }
    }
    next.run(req).await
}

pub async fn health(State(s): State<Shared>) -> StatusCode {
    if s.engine.is_alive() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

pub async fn metrics(State(s): State<Shared>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        render(&s.registry),
    )
        .into_response()
}

pub async fn models(State(s): State<Shared>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_name,
            "object": "model",
            "created": s.started,
            "owned_by": "burn-nanovllm",
            "max_model_len": s.engine.info.max_model_len,
        }],
    }))
    .into_response()
}

pub async fn completions(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    respond(s, Endpoint::Completions, body).await
}

pub async fn chat_completions(
    State(s): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(s, Endpoint::ChatCompletions, body).await
}

async fn respond(s: Shared, endpoint: Endpoint, body: Result<Bytes, BytesRejection>) -> Response {
    let large = body.as_ref().is_ok_and(|b| b.len() > RELEASE_AFTER_BYTES);
    let response = match run(s, endpoint, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    if large {
        release_free_memory();
    }
    response
}

async fn run(
    s: Shared,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: OpenAiRequest = parse_body(body)?;
    let (stream, usage) = req.streaming();
    let admitted = admit(&s, endpoint, req).await?;
    let reply = Reply {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{}", admitted.id),
            Endpoint::ChatCompletions => format!("chatcmpl-{}", admitted.id),
        },
        created: unix_now(),
        model: s.model_name.clone(),
        state: s.clone(),
        num_prompt: admitted.num_prompt,
        tool_mode: admitted.tool_mode,
        n: admitted.n,
    };
    if stream {
        Ok(reply.stream(admitted.events, usage))
    } else {
        reply.collect(admitted.events).await
    }
}

/// Builds the response bodies of one request.
struct Reply {
    endpoint: Endpoint,
    id: String,
    created: u64,
    model: String,
    state: Shared,
    num_prompt: usize,
    tool_mode: ToolMode,
    /// Completions (`n`), each a choice of its index.
    n: usize,
}

/// One completion's text, tokens and log-probabilities so far ([`Reply::collect`]).
#[derive(Default)]
struct Collected {
    text: String,
    tokens: usize,
    lps: Vec<TokenLogprobs>,
    asked: bool,
    finish: Option<FinishReason>,
}

/// One completion's streaming state ([`Reply::stream`]).
#[derive(Default)]
struct Streamed {
    tokens: usize,
    offset: usize,
    started: bool,
    calls: usize,
    parser: Option<ToolCallStream>,
    done: bool,
}

impl Reply {
    /// The id of the `index`-th tool call of this response.
    fn call_id(&self, index: usize) -> String {
        format!("call_{}_{index}", self.id)
    }

    /// The calls' OpenAI JSON, numbered from `first` (streaming deltas carry their index).
    fn calls_json(&self, calls: &[ToolCall], first: usize, indexed: bool) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| c.to_json(&self.call_id(first + k), indexed.then_some(first + k)))
            .collect()
    }

    fn usage(&self, completion: usize) -> Value {
        json!({
            "prompt_tokens": self.num_prompt,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt + completion,
        })
    }

    fn token_text(&self, id: u32) -> String {
        self.state
            .engine
            .info
            .tokenizer
            .as_ref()
            .and_then(|t| t.decode(&[id], false).ok())
            .unwrap_or_default()
    }

    /// Log-probabilities in the endpoint's format (`null` when none were asked for).
    fn logprobs(&self, lps: &[TokenLogprobs], asked: bool, text_offset: usize) -> Value {
        if !asked {
            return Value::Null;
        }
        match self.endpoint {
            Endpoint::Completions => {
                let mut offset = text_offset;
                let mut offsets = Vec::new();
                let tokens: Vec<String> = lps
                    .iter()
                    .map(|l| {
                        let t = self.token_text(l.token_id);
                        offsets.push(offset);
                        offset += t.len();
                        t
                    })
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": lps.iter().map(|l| {
                        l.top.iter().map(|&(id, lp)| (self.token_text(id), json!(lp)))
                            .collect::<serde_json::Map<_, _>>()
                    }).collect::<Vec<_>>(),
                    "text_offset": offsets,
                })
            }
            Endpoint::ChatCompletions => {
                let entry = |id: u32, lp: f32| {
                    let t = self.token_text(id);
                    json!({"token": t, "logprob": lp, "bytes": t.as_bytes()})
                };
                json!({
                    "content": lps.iter().map(|l| {
                        let mut e = entry(l.token_id, l.logprob);
                        e["top_logprobs"] = l.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
                        e
                    }).collect::<Vec<_>>(),
                })
            }
        }
    }

    fn finish(reason: &Option<FinishReason>) -> Value {
        reason.as_ref().map_or(Value::Null, |r| json!(r.as_str()))
    }

    /// The whole completion as one JSON body.
    /// The choice of completion `index` in a whole body.
    fn choice(&self, index: usize, c: Collected) -> Value {
        let reason = c.finish.as_ref().expect("finished");
        let logprobs = self.logprobs(&c.lps, c.asked, 0);
        match self.endpoint {
            Endpoint::Completions => json!({
                "index": index, "text": c.text, "logprobs": logprobs,
                "finish_reason": reason.as_str(),
            }),
            Endpoint::ChatCompletions => {
                let (content, calls) = match self.tool_mode {
                    ToolMode::Parse => parse_tool_calls(&c.text),
                    ToolMode::Off => (Some(c.text), Vec::new()),
                };
                let mut message = json!({"role": "assistant", "content": content});
                let mut finish = reason.as_str();
                if !calls.is_empty() {
                    message["tool_calls"] = json!(self.calls_json(&calls, 0, false));
                    finish = "tool_calls";
                }
                json!({
                    "index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
        }
    }

    /// The whole response once every completion has finished: a choice each, in index order;
    /// the prompt counted once in `usage` (vLLM's rule), the completions' tokens added up.
    async fn collect(
        self,
        mut rx: tmpsc::UnboundedReceiver<(usize, Event)>,
    ) -> Result<Response, ApiError> {
        let mut all: Vec<Collected> = (0..self.n).map(|_| Collected::default()).collect();
        let mut left = self.n;
        while let Some((i, ev)) = rx.recv().await {
            let out = match ev {
                Event::Output(o) => o,
                Event::Failed(msg) => {
                    return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
                }
            };
            let c = &mut all[i];
            c.text.push_str(&out.new_text);
            c.tokens += out.new_token_ids.len();
            c.asked |= !out.new_logprobs.is_empty();
            c.lps.extend(out.new_logprobs);
            let Some(reason) = out.finish_reason else {
                continue;
            };
            if let FinishReason::Error(e) = &reason {
                return Err(ApiError::bad_request(e.clone(), None));
            }
            c.finish = Some(reason);
            left -= 1;
            if left > 0 {
                continue;
            }
            let tokens = all.iter().map(|c| c.tokens).sum();
            let choices: Vec<Value> = std::mem::take(&mut all)
                .into_iter()
                .enumerate()
                .map(|(i, c)| self.choice(i, c))
                .collect();
            let object = match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::ChatCompletions => "chat.completion",
            };
            return Ok(axum::Json(json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(tokens),
            }))
            .into_response());
        }
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped before the request finished",
        ))
    }

    /// Server-sent events: a chunk per completion per step (its `index` in the choice),
    /// `data: [DONE]` once every completion has finished. A task forwards the engine's
    /// outputs; when the client goes away the SSE stream is dropped, the task's send fails, it
    /// drops the events' channel, and the engine thread aborts the completions.
    fn stream(self, mut rx: tmpsc::UnboundedReceiver<(usize, Event)>, usage: bool) -> Response {
        let (tx, events) = tmpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
        tokio::spawn(async move {
            let object = match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::ChatCompletions => "chat.completion.chunk",
            };
            let chunk = |choices: Value, usage: Option<Value>| {
                let mut c = json!({
                    "id": self.id, "object": object, "created": self.created,
                    "model": self.model, "choices": choices,
                });
                if let Some(u) = usage {
                    c["usage"] = u;
                }
                SseEvent::default().data(c.to_string())
            };
            let mut all: Vec<Streamed> = (0..self.n)
                .map(|_| Streamed {
                    parser: (self.tool_mode == ToolMode::Parse).then(ToolCallStream::default),
                    ..Streamed::default()
                })
                .collect();
            let mut left = self.n;
            while left > 0 {
                let ev = tokio::select! {
                    ev = rx.recv() => ev,
                    // Client gone: dropping `rx` makes the engine thread abort the request.
                    _ = tx.closed() => return,
                };
                let Some((i, ev)) = ev else { break };
                let out = match ev {
                    Event::Output(o) => o,
                    Event::Failed(msg) => {
                        let err = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg);
                        let _ = tx.send(Ok(SseEvent::default().data(err.body().to_string())));
                        break;
                    }
                };
                if let Some(FinishReason::Error(e)) = &out.finish_reason {
                    let err = ApiError::bad_request(e.clone(), None);
                    let _ = tx.send(Ok(SseEvent::default().data(err.body().to_string())));
                    break;
                }
                let st = &mut all[i];
                st.tokens += out.new_token_ids.len();
                let asked = !out.new_logprobs.is_empty();
                let logprobs = self.logprobs(&out.new_logprobs, asked, st.offset);
                st.offset += out.new_text.len();
                let mut finish = Self::finish(&out.finish_reason);
                let choice = match self.endpoint {
                    Endpoint::Completions => json!({
                        "index": i, "text": out.new_text, "logprobs": logprobs, "finish_reason": finish,
                    }),
                    Endpoint::ChatCompletions => {
                        let (mut content, mut calls) = (out.new_text.clone(), Vec::new());
                        if let Some(parser) = st.parser.as_mut() {
                            (content, calls) = parser.push(&out.new_text);
                            if out.finish_reason.is_some() {
                                content.push_str(&parser.finish());
                            }
                        }
                        let mut delta = json!({"content": content});
                        if !calls.is_empty() {
                            delta["tool_calls"] = json!(self.calls_json(&calls, st.calls, true));
                            st.calls += calls.len();
                        }
                        if out.finish_reason.is_some() && st.calls > 0 {
                            finish = json!("tool_calls");
                        }
                        if !st.started {
                            delta["role"] = json!("assistant");
                        }
                        json!({"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                st.started = true;
                if tx.send(Ok(chunk(json!([choice]), None))).is_err() {
                    return;
                }
                if out.finish_reason.is_some() && !st.done {
                    st.done = true;
                    left -= 1;
                }
            }
            if left == 0 && usage {
                let tokens = all.iter().map(|s| s.tokens).sum();
                let _ = tx.send(Ok(chunk(json!([]), Some(self.usage(tokens)))));
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
        });
        Sse::new(UnboundedReceiverStream::new(events)).into_response()
    }
}
