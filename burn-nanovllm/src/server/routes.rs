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
use tokio::sync::mpsc as tmpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::engine_loop::{EngineHandle, Event};
use super::error::ApiError;
use super::metrics::render;
use super::protocol::{Endpoint, OpenAiRequest, PromptSpec, ToolMode};
use super::tokenize::{PromptTokenizer, release_free_memory};
use super::tool_calls::{ToolCall, ToolCallStream, parse_tool_calls};

/// Bodies above this size hand their memory back to the OS once answered.
const RELEASE_AFTER_BYTES: usize = 1 << 20;

/// What every handler shares.
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: PromptTokenizer,
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
        if given != Some(key.as_str()) {
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
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let req = OpenAiRequest::parse(&body)?;
    if let Some(model) = &req.model
        && model != &s.model_name
    {
        return Err(ApiError {
            param: Some("model".into()),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "the model `{model}` does not exist: this server serves `{}`",
                    s.model_name
                ),
            )
        });
    }
    let info = &s.engine.info;
    let (mut params, max_tokens) = req.sampling_params(endpoint, &info.defaults)?;
    let (stream, usage) = req.streaming();
    let (constraint, tool_mode) = req.structured_output(endpoint)?;
    if let Some((constraint, field)) = constraint {
        check_constraint(&s, &constraint, field).await?;
        params.structured_output = Some(constraint);
    }
    let prompt = req.prompt(endpoint)?;
    let tools = req.template_tools();
    drop(req);
    let prompt = tokenize(prompt, tools, &s).await?;
    let max_model_len = info.max_model_len;
    match max_tokens {
        None => params.max_tokens = max_model_len.saturating_sub(prompt.len()).max(1),
        // vLLM's answer: the prompt and the completion must fit in the context (a prompt that
        // alone does not is refused by the engine, naming `prompt`).
        Some(m)
            if prompt.len() < max_model_len && prompt.len().saturating_add(m) > max_model_len =>
        {
            return Err(ApiError::bad_request(
                format!(
                    "this model's maximum context length is {max_model_len} tokens, but {} were \
                     requested ({} in the prompt, {m} in the completion): reduce the prompt or \
                     max_tokens",
                    prompt.len().saturating_add(m),
                    prompt.len()
                ),
                Some("max_tokens".into()),
            ));
        }
        Some(_) => {}
    }
    let num_prompt = prompt.len();
    let (id, rx) = s.engine.submit(prompt, params).await?;
    let reply = Reply {
        endpoint,
        id: match endpoint {
            Endpoint::Completions => format!("cmpl-{id}"),
            Endpoint::ChatCompletions => format!("chatcmpl-{id}"),
        },
        created: unix_now(),
        model: s.model_name.clone(),
        state: s.clone(),
        num_prompt,
        tool_mode,
    };
    if stream {
        Ok(reply.stream(rx, usage))
    } else {
        reply.collect(rx).await
    }
}

/// Compiles a request's constraint off the async workers (the engine's own compile is then a
/// cache hit): an invalid schema, regex or grammar is a 400 naming `field`.
async fn check_constraint(
    s: &AppState,
    constraint: &engine::StructuredOutput,
    field: String,
) -> Result<(), ApiError> {
    let compiler = s.engine.info.grammars.clone().ok_or_else(|| {
        ApiError::bad_request(
            "structured outputs need the model's tokenizer.json, which this model lacks".into(),
            Some(field.clone()),
        )
    })?;
    let constraint = constraint.clone();
    let compiled = tokio::task::spawn_blocking(move || compiler.compile(&constraint).map(drop))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("compiling the constraint failed: {e}"),
            )
        })?;
    compiled.map_err(|e| {
        let message = match e {
            engine::EngineError::InvalidParam { message, .. } => message,
            other => other.to_string(),
        };
        ApiError::bad_request(format!("{field}: {message}"), Some(field))
    })
}

async fn tokenize(
    prompt: PromptSpec,
    tools: Option<Value>,
    s: &AppState,
) -> Result<Vec<u32>, ApiError> {
    match prompt {
        PromptSpec::Tokens(ids) => Ok(ids),
        PromptSpec::Text(t) => s.tokenizer.encode(t, "prompt").await,
        PromptSpec::Chat(messages) => {
            let text = s
                .tokenizer
                .tokenizer("messages")?
                .apply_chat_template_with_tools(&messages, tools.as_ref(), true)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages".into())))?;
            drop(messages);
            s.tokenizer.encode(text, "messages").await
        }
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
    async fn collect(self, mut rx: tmpsc::UnboundedReceiver<Event>) -> Result<Response, ApiError> {
        let (mut text, mut tokens, mut lps, mut asked) = (String::new(), 0, Vec::new(), false);
        while let Some(ev) = rx.recv().await {
            let out = match ev {
                Event::Output(o) => o,
                Event::Failed(msg) => {
                    return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
                }
            };
            text.push_str(&out.new_text);
            tokens += out.new_token_ids.len();
            asked |= !out.new_logprobs.is_empty();
            lps.extend(out.new_logprobs);
            let Some(reason) = out.finish_reason else {
                continue;
            };
            if let FinishReason::Error(e) = &reason {
                return Err(ApiError::bad_request(e.clone(), None));
            }
            let logprobs = self.logprobs(&lps, asked, 0);
            let choice = match self.endpoint {
                Endpoint::Completions => json!({
                    "index": 0, "text": text, "logprobs": logprobs,
                    "finish_reason": reason.as_str(),
                }),
                Endpoint::ChatCompletions => {
                    let (content, calls) = match self.tool_mode {
                        ToolMode::Parse => parse_tool_calls(&text),
                        ToolMode::Off => (Some(text), Vec::new()),
                    };
                    let mut message = json!({"role": "assistant", "content": content});
                    let mut finish = reason.as_str();
                    if !calls.is_empty() {
                        message["tool_calls"] = json!(self.calls_json(&calls, 0, false));
                        finish = "tool_calls";
                    }
                    json!({
                        "index": 0, "message": message, "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                }
            };
            let object = match self.endpoint {
                Endpoint::Completions => "text_completion",
                Endpoint::ChatCompletions => "chat.completion",
            };
            return Ok(axum::Json(json!({
                "id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(tokens),
            }))
            .into_response());
        }
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the engine stopped before the request finished",
        ))
    }

    /// Server-sent events: a chunk per step, `data: [DONE]` at the end. A task forwards the
    /// engine's outputs; when the client goes away the SSE stream is dropped, the task's send
    /// fails, it drops the engine channel, and the engine thread aborts the request.
    fn stream(self, mut rx: tmpsc::UnboundedReceiver<Event>, usage: bool) -> Response {
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
            let (mut tokens, mut offset, mut first) = (0usize, 0usize, true);
            let mut tool_calls = (self.tool_mode == ToolMode::Parse).then(ToolCallStream::default);
            let mut num_calls = 0;
            loop {
                let ev = tokio::select! {
                    ev = rx.recv() => ev,
                    // Client gone: dropping `rx` makes the engine thread abort the request.
                    _ = tx.closed() => return,
                };
                let Some(ev) = ev else { break };
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
                tokens += out.new_token_ids.len();
                let asked = !out.new_logprobs.is_empty();
                let logprobs = self.logprobs(&out.new_logprobs, asked, offset);
                offset += out.new_text.len();
                let mut finish = Self::finish(&out.finish_reason);
                let choice = match self.endpoint {
                    Endpoint::Completions => json!({
                        "index": 0, "text": out.new_text, "logprobs": logprobs, "finish_reason": finish,
                    }),
                    Endpoint::ChatCompletions => {
                        let (mut content, mut calls) = (out.new_text.clone(), Vec::new());
                        if let Some(parser) = tool_calls.as_mut() {
                            (content, calls) = parser.push(&out.new_text);
                            if out.finish_reason.is_some() {
                                content.push_str(&parser.finish());
                            }
                        }
                        let mut delta = json!({"content": content});
                        if !calls.is_empty() {
                            delta["tool_calls"] = json!(self.calls_json(&calls, num_calls, true));
                            num_calls += calls.len();
                        }
                        if out.finish_reason.is_some() && num_calls > 0 {
                            finish = json!("tool_calls");
                        }
                        if first {
                            delta["role"] = json!("assistant");
                        }
                        json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
                    }
                };
                first = false;
                if tx.send(Ok(chunk(json!([choice]), None))).is_err() {
                    return;
                }
                if out.finish_reason.is_some() {
                    if usage {
                        let _ = tx.send(Ok(chunk(json!([]), Some(self.usage(tokens)))));
                    }
                    break;
                }
            }
            let _ = tx.send(Ok(SseEvent::default().data("[DONE]")));
        });
        Sse::new(UnboundedReceiverStream::new(events)).into_response()
    }
}
