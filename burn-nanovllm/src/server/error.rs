//! OpenAI-style error responses: `{"error": {"message", "type", "param", "code"}}` with the
//! HTTP status.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use engine::EngineError;

/// An error answered to the client.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// Seconds the client should wait before retrying (503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
            retry_after: None,
        }
    }

    pub fn bad_request(message: String, param: Option<String>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, message)
        }
    }

    /// OpenAI's error type for a status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            _ => "internal_error",
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let param = match &e {
            EngineError::InvalidParam { field, .. } => Some(field.to_string()),
            EngineError::EmptyPrompt
            | EngineError::TokenOutOfVocab { .. }
            | EngineError::PromptTooLong { .. }
            | EngineError::OutOfKvBlocks { .. }
            | EngineError::NoTokenizer => Some("prompt".to_string()),
            _ => None,
        };
        match (param, &e) {
            (Some(field), _) => Self::bad_request(e.to_string(), Some(field)),
            (None, EngineError::DeviceFailed(_)) => {
                Self::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
            }
            (None, _) => Self::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
        }
    }
}

impl ApiError {
    /// The OpenAI error body (also sent as an event when a stream fails).
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
