//! The OpenAI request bodies of `/v1/completions` and `/v1/chat/completions` (one struct: the
//! two share every sampling field), their checks, and their mapping to `SamplingParams`;
//! the constraint they carry is `constraints.rs`'s.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use engine::SamplingParams;
use model_qwen2::ChatMessage;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;

/// Most completions one request may ask for (`n`).
pub const MAX_N: u32 = 64;

/// A completion or chat-completion request: OpenAI's fields and vLLM's extras.
#[derive(Debug, Default, Deserialize)]
pub struct OpenAiRequest {
    /// The served model's name (checked when given).
    pub model: Option<String>,
    /// `/v1/completions`: text or token ids.
    pub prompt: Option<PromptInput>,
    /// `/v1/chat/completions`: the conversation.
    pub messages: Option<Vec<MessageIn>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub seed: Option<u64>,
    /// Completions: the number of top log-probabilities (0–20); chat: whether to return them.
    pub logprobs: Option<serde_json::Value>,
    /// Chat: the number of top log-probabilities per token (0–20).
    pub top_logprobs: Option<u32>,
    /// Completions of the prompt (parallel sampling: the prompt is computed once).
    pub n: Option<u32>,
    /// OpenAI's candidates to rank; accepted only equal to `n`.
    pub best_of: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub min_tokens: Option<usize>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    pub echo: Option<bool>,
    /// OpenAI: `{"type": "text" | "json_object" | "json_schema", "json_schema": {…}}`.
    pub response_format: Option<ResponseFormat>,
    /// vLLM: one of `json`, `regex`, `choice`, `grammar`, `json_object`.
    pub structured_outputs: Option<StructuredOutputsIn>,
    /// vLLM's fields before `structured_outputs` (removed there in 0.12; still sent by clients).
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// Chat: the functions the model may call.
    pub tools: Option<Vec<ToolIn>>,
    /// Chat: `none`, `auto` (the default with tools), `required`, or
    /// `{"type": "function", "function": {"name": …}}`.
    pub tool_choice: Option<Value>,
    /// OpenAI: token id (as a string) → bias in [−100, 100], added to its logit.
    pub logit_bias: Option<std::collections::HashMap<String, f32>>,
    /// vLLM: only these tokens may be drawn.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM: words never generated (tokenized with and without a leading space).
    pub bad_words: Option<Vec<String>>,
    /// Chat (vLLM, transformers): extra variables for the chat template, such as Qwen3's
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Fields this server does not know: ignored, each name logged once (as vLLM does).
    #[serde(flatten)]
    pub unknown: std::collections::BTreeMap<String, Value>,
}

/// Logs (once per name, for the server's life) the fields of a request that are ignored.
pub fn log_unknown_fields(fields: &std::collections::BTreeMap<String, Value>) {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    if fields.is_empty() {
        return;
    }
    let mut seen = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    for name in fields.keys() {
        // Bounded: a client sending endless new names gets the first thousand logged.
        if seen.len() < 1000 && seen.insert(name.clone()) {
            eprintln!("warning: the request field `{name}` is not supported and is ignored");
        }
    }
}

/// `response_format`.
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

/// `response_format.json_schema` (its `name`, `description` and `strict` are accepted and not
/// needed: outputs always follow the schema strictly here).
#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub schema: Option<Value>,
}

/// vLLM's `structured_outputs`.
#[derive(Debug, Default, Deserialize)]
pub struct StructuredOutputsIn {
    /// A JSON schema (an object, or its JSON text).
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionIn,
}

/// A tool's function.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct FunctionIn {
    pub name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
}

/// An assistant message's tool call.
#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    pub id: Option<String>,
    pub function: ToolCallFunctionIn,
}

/// The function of a tool call: `arguments` is JSON text.
#[derive(Debug, Deserialize)]
pub struct ToolCallFunctionIn {
    pub name: String,
    pub arguments: String,
}

/// What a chat request does with its tools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolMode {
    /// No tools, or `tool_choice: none`: the reply is text.
    Off,
    /// The model may call tools: `<tool_call>` blocks in its output become `tool_calls`.
    Parse,
}

/// `prompt`: a string, token ids, or a one-element list of either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

/// A chat message: `content` as a string or as text parts; an assistant turn's `tool_calls`
/// and a tool turn's `tool_call_id`.
#[derive(Debug, Deserialize)]
pub struct MessageIn {
    pub role: String,
    pub content: Option<ContentIn>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
}

/// Message content.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ContentIn {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content; only `text` parts are supported.
#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A request body as axum hands it over (a rejection keeps its status), parsed as JSON; a
/// syntax or type error names the field (`max_tokens: invalid type …`).
pub fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError::new(e.status(), e.body_text()))?;
    let de = &mut serde_json::Deserializer::from_slice(&body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let param = (path != "." && path != "?").then(|| path.clone());
        let message = match &param {
            Some(p) => format!("{p}: {}", e.inner()),
            None => format!("invalid JSON body: {}", e.inner()),
        };
        ApiError::bad_request(message, param)
    })
}

/// Which endpoint a request came through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// What a request asks to run, checked.
pub enum PromptSpec {
    Text(String),
    Tokens(Vec<u32>),
    Chat(Vec<ChatMessage>),
}

impl OpenAiRequest {
    /// Streaming, and whether the stream ends with a usage chunk.
    pub fn streaming(&self) -> (bool, bool) {
        let stream = self.stream.unwrap_or(false);
        let usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        (stream, usage)
    }

    /// The prompt this endpoint takes, checked.
    pub fn prompt(&self, endpoint: Endpoint) -> Result<PromptSpec, ApiError> {
        let bad = |m: &str, p: &str| ApiError::bad_request(m.to_string(), Some(p.to_string()));
        match endpoint {
            Endpoint::Completions => match &self.prompt {
                None => Err(bad("prompt is required", "prompt")),
                Some(PromptInput::Text(t)) => Ok(PromptSpec::Text(t.clone())),
                Some(PromptInput::Tokens(ids)) => Ok(PromptSpec::Tokens(ids.clone())),
                Some(PromptInput::Texts(v)) if v.len() == 1 => Ok(PromptSpec::Text(v[0].clone())),
                Some(PromptInput::TokenLists(v)) if v.len() == 1 => {
                    Ok(PromptSpec::Tokens(v[0].clone()))
                }
                Some(_) => Err(bad(
                    "only one prompt per request is supported: send several requests",
                    "prompt",
                )),
            },
            Endpoint::ChatCompletions => {
                let messages = self
                    .messages
                    .as_ref()
                    .filter(|m| !m.is_empty())
                    .ok_or_else(|| bad("messages must hold at least one message", "messages"))?;
                let mut out = Vec::with_capacity(messages.len());
                for (i, m) in messages.iter().enumerate() {
                    if !matches!(
                        m.role.as_str(),
                        "system" | "user" | "assistant" | "developer" | "tool"
                    ) {
                        return Err(bad(
                            &format!("unsupported role `{}`", m.role),
                            &format!("messages[{i}].role"),
                        ));
                    }
                    let text = match &m.content {
                        None => String::new(),
                        Some(ContentIn::Text(t)) => t.clone(),
                        Some(ContentIn::Parts(parts)) => {
                            let mut text = String::new();
                            for (j, p) in parts.iter().enumerate() {
                                match (p.kind.as_str(), &p.text) {
                                    ("text", Some(t)) => text.push_str(t),
                                    _ => {
                                        return Err(bad(
                                            "only text content parts are supported",
                                            &format!("messages[{i}].content[{j}]"),
                                        ));
                                    }
                                }
                            }
                            text
                        }
                    };
                    let role = if m.role == "developer" {
                        "system"
                    } else {
                        &m.role
                    };
                    let mut message = ChatMessage::new(role, text);
                    message.tool_call_id = m.tool_call_id.clone();
                    // Templates read the arguments as an object.
                    message.tool_calls = m
                        .tool_calls
                        .iter()
                        .flatten()
                        .map(|c| {
                            let arguments = serde_json::from_str(&c.function.arguments)
                                .unwrap_or_else(|_| Value::String(c.function.arguments.clone()));
                            json!({"id": c.id, "type": "function", "function": {
                                "name": c.function.name, "arguments": arguments,
                            }})
                        })
                        .collect();
                    out.push(message);
                }
                Ok(PromptSpec::Chat(out))
            }
        }
    }

    /// The sampling parameters: the request's fields over the model's defaults
    /// (`generation_config.json`). `max_tokens` defaults to 16 on `/v1/completions` (OpenAI's
    /// default) and to the rest of the context on chat (`None` here: the caller fills it).
    pub fn sampling_params(
        &self,
        endpoint: Endpoint,
        defaults: &SamplingParams,
    ) -> Result<(SamplingParams, Option<usize>), ApiError> {
        let bad = |m: String, p: &str| ApiError::bad_request(m, Some(p.to_string()));
        let n = self.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(bad(format!("n must be in 1..={MAX_N}, got {n}"), "n"));
        }
        // vLLM's V1 engine: `best_of` only as `n` (one candidate per completion returned).
        if let Some(b) = self.best_of
            && b != n
        {
            return Err(bad(
                format!("best_of must equal n ({n}), got {b}: best-of ranking is not supported"),
                "best_of",
            ));
        }
        if self.echo == Some(true) {
            return Err(bad("echo is not supported".into(), "echo"));
        }
        let (field, max_tokens) = match endpoint {
            Endpoint::ChatCompletions if self.max_completion_tokens.is_some() => {
                ("max_completion_tokens", self.max_completion_tokens)
            }
            _ => ("max_tokens", self.max_tokens),
        };
        let max_tokens = match max_tokens {
            Some(m) if m < 1 => {
                return Err(bad(format!("{field} must be at least 1, got {m}"), field));
            }
            Some(m) => Some(m as usize),
            None if endpoint == Endpoint::Completions => Some(16),
            None => None,
        };
        let logprobs = match (endpoint, &self.logprobs) {
            (_, None | Some(serde_json::Value::Null)) => None,
            (Endpoint::Completions, Some(v)) => Some(v.as_u64().ok_or_else(|| {
                bad(
                    "logprobs must be an integer from 0 to 20".into(),
                    "logprobs",
                )
            })? as usize),
            (Endpoint::ChatCompletions, Some(v)) => match v.as_bool() {
                Some(true) => Some(self.top_logprobs.unwrap_or(0) as usize),
                Some(false) => None,
                None => return Err(bad("logprobs must be a boolean".into(), "logprobs")),
            },
        };
        if self.top_logprobs.is_some()
            && endpoint == Endpoint::ChatCompletions
            && logprobs.is_none()
        {
            return Err(bad(
                "top_logprobs needs logprobs = true".into(),
                "top_logprobs",
            ));
        }
        let top_k = match self.top_k {
            Some(k) if k < -1 => {
                return Err(bad(
                    format!("top_k must be -1, 0 or positive, got {k}"),
                    "top_k",
                ));
            }
            // Any k at or above the vocabulary keeps every token: wider than u32 is the same.
            Some(k) => k.clamp(0, u32::MAX as i64) as u32,
            None => defaults.top_k,
        };
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(defaults.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(defaults.frequency_penalty),
            seed: self.seed,
            // Unset on chat: the rest of the context, filled in once the prompt is tokenized
            // (the engine checks `min_tokens` against it then).
            max_tokens: max_tokens.unwrap_or(usize::MAX),
            min_tokens: self.min_tokens.unwrap_or(0),
            stop: match &self.stop {
                None => Vec::new(),
                Some(StopInput::One(s)) => vec![s.clone()],
                Some(StopInput::Many(v)) => v.clone(),
            },
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            logprobs,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            structured_output: None,
            logit_bias: self.logit_bias()?,
            allowed_token_ids: self.allowed_token_ids.clone(),
            // Tokenized once the tokenizer is at hand (`bad_words`).
            bad_words: Vec::new(),
        };
        p.validate().map_err(ApiError::from)?;
        Ok((p, max_tokens))
    }
}

impl OpenAiRequest {
    /// `logit_bias` as (token, bias): keys must be token ids.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let mut out: Vec<(u32, f32)> = Vec::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let t = k.trim().parse::<u32>().map_err(|_| {
                ApiError::bad_request(
                    format!("logit_bias keys are token ids, got `{k}`"),
                    Some("logit_bias".into()),
                )
            })?;
            out.push((t, b));
        }
        out.sort_by_key(|&(t, _)| t);
        Ok(out)
    }
}
