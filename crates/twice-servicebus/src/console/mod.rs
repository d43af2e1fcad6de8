//! The web console on the HTTP side port: one page, served by the binary itself, and the JSON
//! API it polls.
//!
//! | request | what | who |
//! |---|---|---|
//! | `GET /` | the page (HTML and CSS) | anyone |
//! | `GET /$console/app.js` | its script | anyone |
//! | `GET /$console/api/entities` | counts and operation totals of every entity | anyone (as `/entities`) |
//! | `GET /$console/api/key` | the name of the key that signed the token: signing in checks the key with it | any valid token |
//! | `GET /$console/api/peek?entity=E&dlq=1&from=N&max=M` | messages without locking them | `Listen` on `E` |
//! | `GET /$console/api/sessions?entity=E&skip=N&top=M` | sessions, their messages and state | `Listen` on `E` |
//! | `POST /$console/api/resubmit` | copies of dead-lettered messages sent back | `Send` and `Listen` (or `Manage`) |
//! | `POST /$console/api/purge` | dead-lettered messages deleted | `Send` and `Listen` (or `Manage`) |
//!
//! The API lives under `/$console/` because no Service Bus entity name may hold a `$`: the
//! administration API owns every other path. Tokens are the `SharedAccessSignature` of the
//! AMQP side and of the administration API, in `Authorization`; the page signs them in the
//! browser with the key the user types. A server with no key configured has nothing to check
//! reads against, so it serves them to anyone, and refuses every change.
//!
//! A POST must come from the console's own origin: one whose `Origin` (or `Sec-Fetch-Site`)
//! names another site is refused, so a page elsewhere cannot drive a logged-in console. Every
//! request must name this server in `Host` (its host name, `localhost` or an IP literal), which
//! keeps a DNS-rebinding page from reading even the open counts.

mod api;
mod auth;

use std::net::SocketAddr;

use crate::backend::{Backend, BackendError};
pub(crate) use crate::request::Request;
use crate::shared::Shared;

/// The page: markup and style; its script is [`SCRIPT`].
const PAGE: &str = include_str!("page.html");
/// The page's script, served apart so the page's content security policy allows no inline
/// script (message bodies are shown in it, and they are anyone's text).
const SCRIPT: &str = include_str!("app.js");

/// Where the console's script and API live.
pub(crate) const PREFIX: &str = "/$console/";

/// Headers every console response carries.
const NO_STORE: [(&str, &str); 3] = [
    ("cache-control", "no-store"),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
];

/// Extra headers of the page itself.
const PAGE_HEADERS: [(&str, &str); 2] = [
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; img-src data:; \
         connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
    ("x-frame-options", "DENY"),
];

/// A response: status line text, content type, extra headers and body.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Response {
    pub(crate) status: &'static str,
    pub(crate) content_type: &'static str,
    pub(crate) headers: Vec<(&'static str, &'static str)>,
    pub(crate) body: String,
}

impl Response {
    fn json(status: &'static str, body: &serde_json::Value) -> Self {
        Self {
            status,
            content_type: "application/json",
            headers: NO_STORE.to_vec(),
            body: body.to_string(),
        }
    }
}

/// Why a console request was refused: each kind is one status and one `code` in the JSON body
/// (`{"error": {"code": "...", "message": "..."}}`); a code, once shipped, keeps its meaning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ApiError {
    /// A parameter is missing, unknown or out of range, or the body is not the JSON asked for.
    #[error("{0}")]
    BadRequest(String),
    /// No token, or one that is not valid here.
    #[error("{0}")]
    Unauthorized(String),
    /// A valid token without the rights the request needs, a cross-site request, or a change
    /// on a server with no key.
    #[error("{0}")]
    Forbidden(String),
    /// No such entity or page.
    #[error("{0}")]
    NotFound(String),
    /// The method is not offered on the path.
    #[error("{0}")]
    MethodNotAllowed(String),
    /// The broker refused the change as things stand (an entity full, a message too large).
    #[error("{0}")]
    Conflict(String),
    /// A POST body that is not `application/json`.
    #[error("{0}")]
    UnsupportedMediaType(String),
    /// The broker cannot serve now.
    #[error("{0}")]
    Unavailable(String),
    /// The broker failed the operation for another reason.
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn status(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "400 Bad Request",
            ApiError::Unauthorized(_) => "401 Unauthorized",
            ApiError::Forbidden(_) => "403 Forbidden",
            ApiError::NotFound(_) => "404 Not Found",
            ApiError::MethodNotAllowed(_) => "405 Method Not Allowed",
            ApiError::Conflict(_) => "409 Conflict",
            ApiError::UnsupportedMediaType(_) => "415 Unsupported Media Type",
            ApiError::Unavailable(_) => "503 Service Unavailable",
            ApiError::Internal(_) => "500 Internal Server Error",
        }
    }

    fn code(&self) -> &'static str {
        match self {
            ApiError::BadRequest(_) => "bad_request",
            ApiError::Unauthorized(_) => "unauthorized",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not_found",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::Conflict(_) => "conflict",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::Unavailable(_) => "unavailable",
            ApiError::Internal(_) => "internal",
        }
    }

    /// The same error with `prefix` and `suffix` around its message.
    fn around(self, prefix: &str, suffix: &str) -> Self {
        let wrap = |m: String| format!("{prefix}{m}{suffix}");
        match self {
            ApiError::BadRequest(m) => ApiError::BadRequest(wrap(m)),
            ApiError::Unauthorized(m) => ApiError::Unauthorized(wrap(m)),
            ApiError::Forbidden(m) => ApiError::Forbidden(wrap(m)),
            ApiError::NotFound(m) => ApiError::NotFound(wrap(m)),
            ApiError::MethodNotAllowed(m) => ApiError::MethodNotAllowed(wrap(m)),
            ApiError::Conflict(m) => ApiError::Conflict(wrap(m)),
            ApiError::UnsupportedMediaType(m) => ApiError::UnsupportedMediaType(wrap(m)),
            ApiError::Unavailable(m) => ApiError::Unavailable(wrap(m)),
            ApiError::Internal(m) => ApiError::Internal(wrap(m)),
        }
    }

    fn response(&self) -> Response {
        let body = serde_json::json!({
            "error": { "code": self.code(), "message": self.to_string() }
        });
        Response::json(self.status(), &body)
    }
}

impl From<BackendError> for ApiError {
    fn from(e: BackendError) -> Self {
        match e {
            BackendError::EntityNotFound(_) | BackendError::MessageNotFound(_) => {
                ApiError::NotFound(e.to_string())
            }
            BackendError::Invalid(_) | BackendError::Unsupported(_) => {
                ApiError::BadRequest(e.to_string())
            }
            BackendError::QuotaExceeded(_)
            | BackendError::MessageSizeExceeded(_)
            | BackendError::AlreadyExists(_) => ApiError::Conflict(e.to_string()),
            BackendError::Unavailable(_) | BackendError::StorageFailed(_) => {
                ApiError::Unavailable(e.to_string())
            }
            _ => ApiError::Internal(e.to_string()),
        }
    }
}

/// Whether `path` is the console's: the page at `/` or anything under [`PREFIX`].
pub(crate) fn owns(path: &str) -> bool {
    path == "/" || path.starts_with(PREFIX)
}

/// Answers one console request (a path [`owns`] accepts). `addr` is the HTTP listener's
/// address. Resubmit and purge run in a task of their own, so a client that goes away (or a
/// request that times out) does not stop them between a send and its completion.
///
/// # Cancel safety
///
/// Cancel safe: the reads change nothing, and the changes finish in their own task.
pub(crate) async fn handle<B: Backend>(
    shared: &std::sync::Arc<Shared<B>>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Response {
    match route(shared, addr, req).await {
        Ok(r) => r,
        Err(e) => e.response(),
    }
}

async fn route<B: Backend>(
    shared: &std::sync::Arc<Shared<B>>,
    addr: SocketAddr,
    req: &Request<'_>,
) -> Result<Response, ApiError> {
    auth::check_host(shared, req)?;
    let rest = req.path.strip_prefix(PREFIX).unwrap_or("");
    let page = |content_type, body: &str, extra: &[(&'static str, &'static str)]| {
        let mut headers = NO_STORE.to_vec();
        headers.extend_from_slice(extra);
        Response { status: "200 OK", content_type, headers, body: body.to_owned() }
    };
    match (req.method, req.path, rest) {
        ("GET", "/", _) => Ok(page("text/html; charset=utf-8", PAGE, &PAGE_HEADERS)),
        ("GET", _, "app.js") => Ok(page("text/javascript; charset=utf-8", SCRIPT, &[])),
        ("GET", _, "api/entities") => Ok(api::entities(shared).await),
        ("GET", _, "api/key") => {
            let key_name = auth::key_name(shared, addr, req)?;
            Ok(Response::json("200 OK", &serde_json::json!({ "key_name": key_name })))
        }
        ("GET", _, "api/peek") => {
            let q = api::Query::parse(req.query, &["entity", "dlq", "from", "max"])?;
            api::peek(shared, addr, req, &q).await
        }
        ("GET", _, "api/sessions") => {
            let q = api::Query::parse(req.query, &["entity", "skip", "top"])?;
            api::sessions(shared, addr, req, &q).await
        }
        ("POST", _, "api/resubmit") => {
            auth::check_post(req)?;
            api::resubmit(shared, addr, req).await
        }
        ("POST", _, "api/purge") => {
            auth::check_post(req)?;
            api::purge(shared, addr, req).await
        }
        (_, "/", _)
        | (_, _, "app.js" | "api/entities" | "api/key" | "api/peek" | "api/sessions")
        | (_, _, "api/resubmit" | "api/purge") => Err(ApiError::MethodNotAllowed(format!(
            "{} is not allowed on {}",
            req.method, req.path
        ))),
        _ => Err(ApiError::NotFound(format!("no console resource at {}", req.path))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_carry_their_status_and_code() {
        let r = ApiError::BadRequest("max must be 1 to 100".into()).response();
        assert_eq!(r.status, "400 Bad Request");
        let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["error"]["code"], "bad_request");
        assert_eq!(v["error"]["message"], "max must be 1 to 100");
        let r: ApiError = BackendError::EntityNotFound("q9".into()).into();
        assert_eq!(r.status(), "404 Not Found");
        let r: ApiError = BackendError::Unavailable("closed".into()).into();
        assert_eq!(r.code(), "unavailable");
    }

    #[test]
    fn owns_the_root_and_its_prefix_only() {
        assert!(owns("/"));
        assert!(owns("/$console/api/peek"));
        assert!(!owns("/console"));
        assert!(!owns("/q1"));
        assert!(!owns("/$Resources/queues"));
    }
}
