//! vLLM's `POST /tokenize` and `POST /detokenize`: a prompt (text, or a conversation through
//! the chat template) to token ids, and token ids to text, with the served model's tokenizer.

use axum::body::Bytes;
use axum::extract::State;
use axum::extract::rejection::BytesRejection;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::admission::{check_model, tokenize};
use super::error::ApiError;
use super::protocol::{Endpoint, OpenAiRequest, parse_body};
use super::routes::Shared;

/// `/detokenize`'s body.
#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
}

/// `POST /tokenize`: `{"prompt": …}` or `{"messages": […]}` (and `tools`) →
/// `{"count", "max_model_len", "tokens"}`.
pub async fn tokenize_route(
    State(s): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let run = async {
        let req: OpenAiRequest = parse_body(body)?;
        check_model(&s, req.model.as_deref())?;
        let endpoint = match req.messages.is_some() {
            true => Endpoint::ChatCompletions,
            false => Endpoint::Completions,
        };
        let prompt = req.prompt(endpoint)?;
        let tools = req.template_tools();
        let kwargs = req.chat_template_kwargs.map(Value::Object);
        let ids = tokenize(prompt, tools, kwargs, &s).await?;
        Ok::<_, ApiError>(json!({
            "count": ids.len(),
            "max_model_len": s.engine.info.max_model_len,
            "tokens": ids,
        }))
    };
    match run.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize`: `{"tokens": […]}` → `{"prompt": text}`.
pub async fn detokenize(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let run = || {
        let req: DetokenizeRequest = parse_body(body)?;
        check_model(&s, req.model.as_deref())?;
        let tokenizer = s.tokenizer.tokenizer("tokens")?;
        let vocab = s.engine.info.vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad_request(
                format!("token {bad} is outside the vocabulary of {vocab}"),
                Some("tokens".into()),
            ));
        }
        let text = tokenizer
            .decode(&req.tokens, false)
            .map_err(|e| ApiError::bad_request(e.to_string(), Some("tokens".into())))?;
        Ok(json!({ "prompt": text }))
    };
    match run() {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
