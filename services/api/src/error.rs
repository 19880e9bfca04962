//! The one place where errors become HTTP responses, in OpenAI's shape:
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use mmserve_protocol::{CacheError, EncoderError, EngineError, RpcFailure};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The client sent something we cannot serve.
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    #[error("{0}")]
    PayloadTooLarge(String),
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No API key, or not one of `--api-key`'s.
    #[error("{0}")]
    Unauthorized(String),
    /// Overloaded: shed before any work, with the seconds after which to retry.
    #[error("{message}")]
    Overloaded { message: String, retry_after_s: u64 },
    #[error("Unknown route: {method} {path}")]
    RouteNotFound { method: String, path: String },
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: None }
    }

    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        ApiError::BadRequest { message: message.into(), param: Some(param.to_string()) }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            ApiError::ModelNotFound(_) | ApiError::RouteNotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The error object, with the id of the request being handled, if any.
    pub fn body(&self) -> serde_json::Value {
        self.body_for(crate::access::current().as_deref())
    }

    /// The error object for request `id` (also sent as an SSE frame when a stream fails).
    pub fn body_for(&self, id: Option<&str>) -> serde_json::Value {
        let (kind, code) = match self {
            ApiError::BadRequest { .. } => ("invalid_request_error", None),
            ApiError::PayloadTooLarge(_) => ("invalid_request_error", Some("payload_too_large")),
            ApiError::ModelNotFound(_) => ("invalid_request_error", Some("model_not_found")),
            ApiError::Unauthorized(_) => ("invalid_request_error", Some("invalid_api_key")),
            ApiError::RouteNotFound { .. } => ("invalid_request_error", Some("unknown_url")),
            ApiError::MethodNotAllowed { .. } => ("invalid_request_error", Some("method_not_allowed")),
            ApiError::Overloaded { .. } => ("rate_limit_error", Some("server_overloaded")),
            ApiError::Timeout(_) => ("invalid_request_error", Some("request_timeout")),
            ApiError::Unavailable(_) => ("service_unavailable", None),
            ApiError::Internal(_) => ("internal_error", None),
        };
        let param = match self {
            ApiError::BadRequest { param, .. } => param.clone(),
            _ => None,
        };
        let mut body =
            serde_json::json!({"error": {"message": self.to_string(), "type": kind, "param": param, "code": code}});
        if let Some(id) = id {
            body["error"]["request_id"] = id.into();
        }
        body
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::warn!("{self}");
        }
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let ApiError::Overloaded { retry_after_s, .. } = &self {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, (*retry_after_s).into());
        }
        response
    }
}

impl From<RpcFailure> for ApiError {
    fn from(e: RpcFailure) -> Self {
        ApiError::Unavailable(e.to_string())
    }
}

impl From<CacheError> for ApiError {
    fn from(e: CacheError) -> Self {
        match e {
            CacheError::TooLarge { .. } => ApiError::bad(e.to_string()),
            CacheError::Full { .. }
            | CacheError::Timeout(_)
            | CacheError::Disconnected
            | CacheError::Abandoned(_)
            | CacheError::Cancelled => ApiError::Unavailable(e.to_string()),
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<EncoderError> for ApiError {
    fn from(e: EncoderError) -> Self {
        match e {
            EncoderError::BadItem { .. } => ApiError::bad(e.to_string()),
            EncoderError::Timeout(_) | EncoderError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
            EncoderError::Internal(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::TooLong { .. } | EngineError::Invalid(_) => ApiError::bad(e.to_string()),
            EngineError::ShuttingDown | EngineError::Unavailable(_) => ApiError::Unavailable(e.to_string()),
            EngineError::DuplicateId(_) => ApiError::Internal(e.to_string()),
        }
    }
}

impl From<mmserve_media::MediaError> for ApiError {
    fn from(e: mmserve_media::MediaError) -> Self {
        ApiError::bad(e.to_string())
    }
}
