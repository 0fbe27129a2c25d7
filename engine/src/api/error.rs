//! Errors as OpenAI shapes them: one constructor per kind, each with its status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tl_engine_core::request::RequestError;

/// The `error` object of an error response or an error stream event.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorDetail {
    /// What went wrong.
    pub message: String,
    /// `invalid_request_error`, `engine_error`, `timeout`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, as OpenAI names it (`prompt`, `messages[2].content`), when
    /// one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    /// The HTTP status (whole responses only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u16>,
}

/// OpenAI's error `type`: the kinds of refusal this project answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// `invalid_request_error`: the request's own fault.
    InvalidRequest,
    /// `context_length_exceeded`: the prompt and completion can never fit.
    ContextLengthExceeded,
    /// `permission_denied`: the caller's role may not call this.
    PermissionDenied,
    /// `not_found`: nothing of that name.
    NotFound,
    /// `model_not_found`: the model is not served here.
    ModelNotFound,
    /// `wrong_role`: the engine does not take this kind of request in its role now.
    WrongRole,
    /// `rate_limit`: too many requests in flight.
    RateLimit,
    /// `engine_error`: an engine failed the request, or cannot take it now.
    Engine,
    /// `unavailable`: nothing can serve the request now.
    Unavailable,
    /// `timeout`: the request took longer than allowed.
    Timeout,
}

impl ErrorKind {
    /// Its name on the wire.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request_error",
            Self::ContextLengthExceeded => "context_length_exceeded",
            Self::PermissionDenied => "permission_denied",
            Self::NotFound => "not_found",
            Self::ModelNotFound => "model_not_found",
            Self::WrongRole => "wrong_role",
            Self::RateLimit => "rate_limit",
            Self::Engine => "engine_error",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
        }
    }
}

/// An error response body: `{"error": {...}}`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// A refusal as an HTTP answer: the status and OpenAI's error body. Every error an HTTP door
/// returns goes through this type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    /// The status.
    pub status: StatusCode,
    /// The `type` field.
    pub kind: ErrorKind,
    /// The message.
    pub message: String,
    /// The request field at fault (OpenAI's `param`), when one is.
    pub param: Option<String>,
}

impl ApiError {
    /// An error with this status, type and message: only through the constructors below, one
    /// per kind, so a status and its type never disagree.
    fn new(status: StatusCode, kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
        }
    }

    /// 400 `invalid_request_error` naming the field at fault: the message is "`field` said"
    /// (`message` says the rest: "is at most 5"), and
    /// OpenAI's `param` carries it.
    pub fn bad_field(param: impl Into<String>, message: impl std::fmt::Display) -> Self {
        let param = param.into();
        Self::bad_request(format!("`{param}` {message}")).at(param)
    }

    /// The same error, naming the field at fault in OpenAI's `param`.
    #[must_use]
    pub fn at(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    /// 405 `invalid_request_error`: the path exists, not with this method.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::InvalidRequest,
            message,
        )
    }

    /// 400 `invalid_request_error`: the request's own fault.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, ErrorKind::InvalidRequest, message)
    }

    /// 400 `context_length_exceeded`: the prompt and completion can never fit; retrying will
    /// not help.
    pub fn context_length_exceeded(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            ErrorKind::ContextLengthExceeded,
            message,
        )
    }

    /// 401 `invalid_request_error`: no API key, or not a known one.
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, ErrorKind::InvalidRequest, message)
    }

    /// 403 `permission_denied`: the caller's certificate role may not call this.
    pub fn permission_denied(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, ErrorKind::PermissionDenied, message)
    }

    /// 415 `invalid_request_error`: a body of a content type the endpoint does not take.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorKind::InvalidRequest,
            message,
        )
    }

    /// 404 `not_found`: nothing of that name (a KV handle).
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorKind::NotFound, message)
    }

    /// 404 `model_not_found`: the model is not served here.
    pub fn model_not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, ErrorKind::ModelNotFound, message)
    }

    /// 421 `wrong_role`: this engine does not take this kind of request in its role now (its
    /// role was changed since the sender last heard): the sender tries another engine.
    pub fn wrong_role(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::MISDIRECTED_REQUEST,
            ErrorKind::WrongRole,
            message,
        )
    }

    /// 429 `rate_limit`: too many requests in flight here.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, ErrorKind::RateLimit, message)
    }

    /// 429 `engine_error`: an engine's pool is full now.
    pub fn engine_busy(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, ErrorKind::Engine, message)
    }

    /// 502 `engine_error`: an engine failed the request.
    pub fn engine(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, ErrorKind::Engine, message)
    }

    /// 503 `engine_error`: this engine cannot run the request now.
    pub fn engine_unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, ErrorKind::Engine, message)
    }

    /// 503 `unavailable`: nothing can serve the request now (no engine, draining).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Unavailable,
            message,
        )
    }

    /// 504 `timeout`: the request took longer than allowed.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, ErrorKind::Timeout, message)
    }

    /// Its HTTP status.
    #[must_use]
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The body as a stream event (no status code in it).
    #[must_use]
    pub fn detail(&self) -> ErrorDetail {
        ErrorDetail {
            message: self.message.clone(),
            kind: self.kind.as_str().into(),
            param: self.param.clone(),
            code: None,
        }
    }
}

impl ApiError {
    /// The one mapping of an engine's gRPC refusal to HTTP: the request's fault is 400, a
    /// name the engine does not know 404, an engine that stopped taking this kind of request
    /// 421 (try another), no room 429, a draining engine 503, anything else 502.
    #[must_use]
    pub fn from_status(s: &tonic::Status) -> Self {
        let message = s.message().to_owned();
        match s.code() {
            tonic::Code::InvalidArgument => Self::bad_request(message),
            tonic::Code::NotFound => Self::not_found(message),
            tonic::Code::FailedPrecondition => Self::wrong_role(message),
            tonic::Code::ResourceExhausted => Self::rate_limited(message),
            tonic::Code::Unavailable => Self::engine_unavailable(message),
            _ => Self::engine(message),
        }
    }
}

/// The one mapping of a refused request to HTTP: 400 with the core's message.
impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let refused = Self::bad_request(e.to_string());
        match e {
            RequestError::Sampling(s) => refused.at(s.field()),
            _ => refused,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                message: self.message,
                kind: self.kind.as_str().into(),
                param: self.param,
                code: Some(self.status.as_u16()),
            },
        };
        let mut r = (self.status, Json(body)).into_response();
        // Every 429 says when to come back: load passes in about a second here (a place in
        // the queue, a slot of the key's), and clients (openai's among them) honour it.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        r
    }
}
