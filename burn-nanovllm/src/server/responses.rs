//! OpenAI's Responses API, stateless (`POST /v1/responses`, `store` is not kept): `input` as
//! text or as items (messages, earlier function calls and their outputs), `instructions`,
//! `max_output_tokens`, `temperature`, `top_p`, `tools` (functions) and `tool_choice`,
//! `text.format` (a JSON schema, or any JSON object). The request becomes a chat request and
//! runs as one; the reply is a `response` object whose `output` holds the message and the
//! function calls, or with `stream: true` the Responses events (`response.created`,
//! `response.output_text.delta`, `response.output_text.done`, `response.completed`).

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use engine::FinishReason;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc as tmpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::admission::admit;
use super::engine_loop::Event;
use super::error::ApiError;
use super::protocol::{
    ContentIn, Endpoint, FunctionIn, JsonSchemaFormat, MessageIn, OpenAiRequest, ResponseFormat,
    ToolCallFunctionIn, ToolCallIn, ToolIn, ToolMode, parse_body,
};
use super::routes::{Shared, unix_now};
use super::tool_calls::{ToolCall, parse_tool_calls};

/// A Responses request.
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: Option<String>,
    input: Input,
    instructions: Option<String>,
    max_output_tokens: Option<i64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    tools: Option<Vec<ResponsesTool>>,
    tool_choice: Option<Value>,
    text: Option<TextOptions>,
    stream: Option<bool>,
    seed: Option<u64>,
}

/// `input`: text, or a list of items.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<InputItem>),
}

/// An item of `input`: a message (its `type` may be left out), an earlier function call, or a
/// function call's output.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum InputItem {
    Call {
        #[serde(rename = "type")]
        #[allow(dead_code)]
        kind: CallKind,
        call_id: String,
        name: String,
        arguments: String,
    },
    CallOutput {
        #[serde(rename = "type")]
        #[allow(dead_code)]
        kind: CallOutputKind,
        call_id: String,
        output: String,
    },
    Message {
        role: String,
        content: MessageContent,
    },
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum CallKind {
    FunctionCall,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "snake_case")]
enum CallOutputKind {
    FunctionCallOutput,
}

/// A message's content: text, or parts (`input_text` / `output_text`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

/// A tool: Responses functions are flat (`name` beside `type`).
#[derive(Debug, Deserialize)]
struct ResponsesTool {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    description: Option<String>,
    parameters: Option<Value>,
}

/// `text`: its `format`.
#[derive(Debug, Deserialize)]
struct TextOptions {
    format: Option<TextFormat>,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum TextFormat {
    Text,
    JsonObject,
    JsonSchema { schema: Value },
}

impl ResponsesRequest {
    /// The same request as a chat request.
    fn into_chat(self) -> Result<(OpenAiRequest, bool), ApiError> {
        let bad = |m: String, p: &str| ApiError::bad_request(m, Some(p.to_string()));
        let text = |t: String| Some(ContentIn::Text(t));
        let mut messages = Vec::new();
        if let Some(i) = self.instructions {
            messages.push(message("system", text(i)));
        }
        match self.input {
            Input::Text(t) => messages.push(message("user", text(t))),
            Input::Items(items) => {
                for (i, item) in items.into_iter().enumerate() {
                    match item {
                        InputItem::Message { role, content } => {
                            let content = match content {
                                MessageContent::Text(t) => t,
                                MessageContent::Parts(parts) => {
                                    let mut t = String::new();
                                    for (j, p) in parts.into_iter().enumerate() {
                                        match (p.kind.as_str(), p.text) {
                                            ("input_text" | "output_text" | "text", Some(x)) => {
                                                t.push_str(&x)
                                            }
                                            _ => {
                                                return Err(bad(
                                                    "only text content parts are supported".into(),
                                                    &format!("input[{i}].content[{j}]"),
                                                ));
                                            }
                                        }
                                    }
                                    t
                                }
                            };
                            messages.push(message(&role, text(content)));
                        }
                        InputItem::Call {
                            call_id,
                            name,
                            arguments,
                            ..
                        } => {
                            let mut m = message("assistant", None);
                            m.tool_calls = Some(vec![ToolCallIn {
                                id: Some(call_id),
                                function: ToolCallFunctionIn { name, arguments },
                            }]);
                            messages.push(m);
                        }
                        InputItem::CallOutput {
                            call_id, output, ..
                        } => {
                            let mut m = message("tool", text(output));
                            m.tool_call_id = Some(call_id);
                            messages.push(m);
                        }
                    }
                }
            }
        }
        let tools = self
            .tools
            .map(|tools| {
                tools
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| match (t.kind.as_str(), t.name) {
                        ("function", Some(name)) => Ok(ToolIn {
                            kind: "function".into(),
                            function: FunctionIn {
                                name,
                                description: t.description,
                                parameters: t.parameters,
                            },
                        }),
                        _ => Err(bad(
                            "only function tools with a name are supported".into(),
                            &format!("tools[{i}]"),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .transpose()?;
        // A named tool choice is flat here too: `{"type": "function", "name": …}`.
        let tool_choice = self.tool_choice.map(|c| match c.get("name") {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => c,
        });
        let response_format = match self.text.and_then(|t| t.format) {
            None | Some(TextFormat::Text) => None,
            Some(TextFormat::JsonObject) => Some(ResponseFormat::JsonObject),
            Some(TextFormat::JsonSchema { schema }) => Some(ResponseFormat::JsonSchema {
                json_schema: JsonSchemaFormat {
                    schema: Some(schema),
                },
            }),
        };
        let req = OpenAiRequest {
            model: self.model,
            messages: Some(messages),
            max_completion_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            seed: self.seed,
            tools,
            tool_choice,
            response_format,
            ..OpenAiRequest::default()
        };
        Ok((req, self.stream.unwrap_or(false)))
    }
}

fn message(role: &str, content: Option<ContentIn>) -> MessageIn {
    MessageIn {
        role: role.to_string(),
        content,
        tool_calls: None,
        tool_call_id: None,
    }
}

/// `POST /v1/responses`.
pub async fn responses(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = async {
        let req: ResponsesRequest = parse_body(body)?;
        let (chat, stream) = req.into_chat()?;
        let admitted = admit(&s, Endpoint::ChatCompletions, chat).await?;
        let reply = Reply {
            id: format!("resp_{}", admitted.id),
            created: unix_now(),
            model: s.model_name.clone(),
            num_prompt: admitted.num_prompt,
            tool_mode: admitted.tool_mode,
        };
        Ok::<_, ApiError>(match stream {
            true => reply.stream(admitted.events),
            false => reply.collect(admitted.events).await?,
        })
    };
    match run.await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// Builds a response's bodies.
struct Reply {
    id: String,
    created: u64,
    model: String,
    num_prompt: usize,
    tool_mode: ToolMode,
}

impl Reply {
    /// The `response` object: `status` `in_progress` (no `reason` yet), `completed`, or
    /// `incomplete` when the output hit its token limit.
    fn response(&self, text: &str, tokens: usize, reason: Option<&FinishReason>) -> Value {
        let (content, calls) = match (self.tool_mode == ToolMode::Parse, reason) {
            (true, Some(_)) => parse_tool_calls(text),
            _ => (Some(text.to_string()), Vec::new()),
        };
        let mut output = Vec::new();
        if let Some(t) = content.filter(|t| !t.is_empty() || reason.is_none()) {
            output.push(json!({
                "type": "message", "id": format!("msg_{}", self.id), "role": "assistant",
                "status": if reason.is_some() { "completed" } else { "in_progress" },
                "content": [{"type": "output_text", "text": t, "annotations": []}],
            }));
        }
        output.extend(calls.iter().enumerate().map(|(k, c)| self.call(c, k)));
        let status = match reason {
            None => "in_progress",
            Some(FinishReason::Length) => "incomplete",
            Some(_) => "completed",
        };
        json!({
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": output,
            "incomplete_details": (status == "incomplete")
                .then(|| json!({"reason": "max_output_tokens"})),
            "usage": {
                "input_tokens": self.num_prompt, "output_tokens": tokens,
                "total_tokens": self.num_prompt + tokens,
            },
        })
    }

    fn call(&self, c: &ToolCall, k: usize) -> Value {
        let mut call = c.to_json(&format!("call_{}_{k}", self.id), None);
        let f = call["function"].take();
        json!({
            "type": "function_call", "id": format!("fc_{}_{k}", self.id),
            "call_id": call["id"], "name": f["name"], "arguments": f["arguments"],
            "status": "completed",
        })
    }

    async fn collect(
        self,
        mut rx: tmpsc::UnboundedReceiver<(usize, Event)>,
    ) -> Result<Response, ApiError> {
        let (mut text, mut tokens) = (String::new(), 0);
        while let Some((_, ev)) = rx.recv().await {
            let out = match ev {
                Event::Output(o) => o,
                Event::Failed(msg) => {
                    return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, msg));
                }
            };
            text.push_str(&out.new_text);
            tokens += out.new_token_ids.len();
            match out.finish_reason {
                Some(FinishReason::Error(e)) => return Err(ApiError::bad_request(e, None)),
                Some(reason) => {
                    return Ok(
                        axum::Json(self.response(&text, tokens, Some(&reason))).into_response()
                    );
                }
                None => {}
            }
        }
        Err(ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the request ended without a finish reason",
        ))
    }

    fn stream(self, mut rx: tmpsc::UnboundedReceiver<(usize, Event)>) -> Response {
        let (tx, events) = tmpsc::unbounded_channel::<Result<SseEvent, Infallible>>();
        tokio::spawn(async move {
            let mut seq = 0u64;
            let send = |name: &str, mut data: Value, seq: &mut u64| {
                data["type"] = json!(name);
                data["sequence_number"] = json!(*seq);
                *seq += 1;
                tx.send(Ok(SseEvent::default().event(name).data(data.to_string())))
                    .is_ok()
            };
            let item = format!("msg_{}", self.id);
            send(
                "response.created",
                json!({"response": self.response("", 0, None)}),
                &mut seq,
            );
            let (mut text, mut tokens) = (String::new(), 0);
            while let Some((_, ev)) = rx.recv().await {
                let out = match ev {
                    Event::Output(o) => o,
                    Event::Failed(msg) => {
                        send("error", json!({"message": msg}), &mut seq);
                        return;
                    }
                };
                tokens += out.new_token_ids.len();
                // Tool calls come whole at the end (their text is the calls' JSON).
                if !out.new_text.is_empty() && self.tool_mode == ToolMode::Off {
                    let delta = json!({"item_id": item, "output_index": 0, "content_index": 0,
                                       "delta": out.new_text});
                    if !send("response.output_text.delta", delta, &mut seq) {
                        return; // client gone: dropping `rx` aborts the request
                    }
                }
                text.push_str(&out.new_text);
                match out.finish_reason {
                    Some(FinishReason::Error(e)) => {
                        send("error", json!({"message": e}), &mut seq);
                        return;
                    }
                    Some(reason) => {
                        if self.tool_mode == ToolMode::Off {
                            let done = json!({"item_id": item, "output_index": 0,
                                              "content_index": 0, "text": text});
                            send("response.output_text.done", done, &mut seq);
                        }
                        let response = self.response(&text, tokens, Some(&reason));
                        send(
                            "response.completed",
                            json!({"response": response}),
                            &mut seq,
                        );
                        return;
                    }
                    None => {}
                }
            }
        });
        Sse::new(UnboundedReceiverStream::new(events)).into_response()
    }
}
