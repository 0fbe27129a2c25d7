//! The public endpoint against web pages. A browser on this host reaches a gateway on loopback,
//! and a page can make it send two kinds of request there:
//!
//! - **DNS rebinding**: the page's own name is made to resolve to 127.0.0.1, so its requests,
//!   same-origin in the browser's eyes, reach the gateway with `Host: attacker.example`, and
//!   the page reads the answers (Ollama's CVE-2024-28224 is this class);
//! - **simple cross-site requests**: a `POST` with `Content-Type: text/plain` (or a form) that
//!   the browser sends without asking, with the page's `Origin`.
//!
//! So every request passes three checks before its key is looked at (each refusal is 403, or
//! 415 for the content type, with an OpenAI-style error that names the setting that opens it):
//!
//! 1. From a caller on loopback, `Host` must be a loopback name (`localhost`, `*.localhost`),
//!    an IP address, or on `[gateway] allowed_hosts`. Callers from elsewhere reached the
//!    gateway through a network the operator exposed it on, with names the operator chose.
//! 2. A request carrying `Origin` must come from a loopback origin (`http://localhost:3000`,
//!    `http://127.0.0.1:8080`) or one on `[gateway] allowed_origins`. A browser sends `Origin`
//!    on every cross-site `POST`; SDKs and `curl` send none.
//! 3. A `POST` with a body must say `Content-Type: application/json` (`json_only = false`
//!    turns this off): the browser cannot send that cross-site without a preflight, which
//!    this gateway never grants.
//!
//! `"*"` on either list opens that check entirely.

use std::net::IpAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::api::ApiError;
use crate::net::server::Caller;

/// What the public endpoint lets browsers and names through.
#[derive(Clone, Debug, Default)]
pub struct BrowserPolicy(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// Extra `Host` names (lower-case, without port); `*`: any.
    hosts: Vec<String>,
    /// Extra origins (lower-case `scheme://host[:port]`); `*`: any.
    origins: Vec<String>,
    /// Refuse a `POST` body that is not `application/json`.
    json_only: bool,
}

impl BrowserPolicy {
    /// The policy of `[gateway] allowed_hosts`, `allowed_origins` and `json_only`.
    #[must_use]
    pub fn new(hosts: &[String], origins: &[String], json_only: bool) -> Self {
        let lower = |v: &[String]| {
            v.iter()
                .map(|s| s.trim().trim_end_matches('/').to_ascii_lowercase())
                .collect()
        };
        Self(Arc::new(Inner {
            hosts: lower(hosts),
            origins: lower(origins),
            json_only,
        }))
    }

    /// Why a request from `caller` with `method` and `headers` is refused, if it is.
    fn refuses(
        &self,
        caller: Option<&Caller>,
        method: &Method,
        headers: &HeaderMap,
        authority: Option<&str>,
    ) -> Option<Refusal> {
        let p = &self.0;
        if caller.is_some_and(|c| c.addr.ip().is_loopback()) && !p.hosts.iter().any(|h| h == "*") {
            let host = headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .or(authority)
                .unwrap_or("");
            let name = host_name(host);
            if !(is_loopback_name(&name)
                || name.parse::<IpAddr>().is_ok()
                || p.hosts.contains(&name))
            {
                return Some(Refusal::Host(host.to_owned()));
            }
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("").trim().to_ascii_lowercase();
            let open = p.origins.iter().any(|o| o == "*" || *o == origin);
            if !open && !is_loopback_origin(&origin) {
                return Some(Refusal::Origin(origin));
            }
        }
        if p.json_only && method == Method::POST {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let mime = ct
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            let has_body = headers
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .is_none_or(|n| n.trim() != "0");
            if has_body && mime != "application/json" {
                return Some(Refusal::ContentType(ct.to_owned()));
            }
        }
        None
    }
}

/// Why the policy refused a request.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    Host(String),
    Origin(String),
    ContentType(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Self::Host(h) => ApiError::permission_denied(format!(
                "Host {h:?} is not a name of this server: from loopback, only localhost, an \
                     IP address or a name on [gateway] allowed_hosts is served (a web page \
                     rebinding its own name to this host sends its own name)"
            )),
            Self::Origin(o) => ApiError::permission_denied(format!(
                "a request from the web page at {o:?} is refused: only loopback origins and \
                     those on [gateway] allowed_origins are served"
            )),
            Self::ContentType(c) => ApiError::unsupported_media_type(format!(
                "Content-Type {c:?} is refused: send the body as application/json (curl: \
                     -H 'Content-Type: application/json'); [gateway] json_only = false accepts \
                     any"
            )),
        }
        .into_response()
    }
}

/// The middleware: [`BrowserPolicy`]'s checks, before the key's.
pub async fn guard(State(p): State<BrowserPolicy>, req: Request, next: Next) -> Response {
    let caller = req.extensions().get::<Caller>();
    let authority = req.uri().authority().map(|a| a.as_str().to_owned());
    if let Some(refusal) = p.refuses(caller, req.method(), req.headers(), authority.as_deref()) {
        return refusal.into_response();
    }
    next.run(req).await
}

/// The lower-case name of a `Host` value, without its port (and without the brackets of an
/// IPv6 literal).
fn host_name(host: &str) -> String {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else if host.matches(':').count() > 1 {
        host // an IPv6 literal without brackets
    } else {
        host.split(':').next().unwrap_or("")
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// `localhost` or a name under it (RFC 6761: they resolve to loopback and nowhere else).
fn is_loopback_name(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

/// An `http(s)://` origin whose host is a loopback name or a loopback address.
fn is_loopback_origin(origin: &str) -> bool {
    let Some(rest) = origin
        .strip_prefix("http://")
        .or_else(|| origin.strip_prefix("https://"))
    else {
        return false;
    };
    let name = host_name(rest);
    is_loopback_name(&name) || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(addr: &str) -> Caller {
        Caller {
            addr: addr.parse().unwrap(),
            peer: None,
        }
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    const JSON: (&str, &str) = ("content-type", "application/json");

    #[test]
    fn hosts_from_loopback_are_loopback_names_addresses_or_listed() {
        let p = BrowserPolicy::new(&["gw.internal".into()], &[], true);
        let local = caller("127.0.0.1:5000");
        for ok in [
            "localhost:8000",
            "LOCALHOST",
            "app.localhost:1",
            "127.0.0.1:8000",
            "[::1]:8000",
            "10.1.2.3",
            "gw.internal:8000",
        ] {
            let h = headers(&[("host", ok), JSON]);
            assert_eq!(
                p.refuses(Some(&local), &Method::POST, &h, None),
                None,
                "{ok}"
            );
        }
        for bad in [
            "attacker.example:8000",
            "localhost.attacker.example",
            "",
            "gw.internal.evil",
        ] {
            let h = headers(&[("host", bad), JSON]);
            assert_eq!(
                p.refuses(Some(&local), &Method::POST, &h, None),
                Some(Refusal::Host(bad.into())),
                "{bad}"
            );
        }
        // From another host, the operator's names are whatever its network says.
        let h = headers(&[("host", "attacker.example"), JSON]);
        assert_eq!(
            p.refuses(Some(&caller("10.0.0.7:1")), &Method::POST, &h, None),
            None
        );
        // `*` opens it.
        let open = BrowserPolicy::new(&["*".into()], &[], true);
        assert_eq!(open.refuses(Some(&local), &Method::GET, &h, None), None);
    }

    #[test]
    fn origins_must_be_loopback_or_listed() {
        let p = BrowserPolicy::new(&[], &["https://ui.example.com".into()], true);
        let local = caller("127.0.0.1:5000");
        for ok in [
            "http://localhost:3000",
            "http://127.0.0.1:8080",
            "http://[::1]",
            "https://ui.example.com",
        ] {
            let h = headers(&[("host", "localhost"), ("origin", ok)]);
            assert_eq!(
                p.refuses(Some(&local), &Method::GET, &h, None),
                None,
                "{ok}"
            );
        }
        for bad in [
            "http://attacker.example",
            "null",
            "http://localhost.attacker.example",
            "file://",
        ] {
            let h = headers(&[("host", "localhost"), ("origin", bad)]);
            assert!(
                matches!(
                    p.refuses(Some(&local), &Method::GET, &h, None),
                    Some(Refusal::Origin(_))
                ),
                "{bad}"
            );
        }
        let open = BrowserPolicy::new(&[], &["*".into()], true);
        let h = headers(&[("host", "localhost"), ("origin", "http://attacker.example")]);
        assert_eq!(open.refuses(Some(&local), &Method::GET, &h, None), None);
    }

    #[test]
    fn posts_are_json_unless_opened() {
        let p = BrowserPolicy::new(&[], &[], true);
        let local = caller("127.0.0.1:5000");
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
        ] {
            let h = headers(&[("host", "localhost"), ("content-type", ok)]);
            assert_eq!(
                p.refuses(Some(&local), &Method::POST, &h, None),
                None,
                "{ok}"
            );
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            let h = headers(&[("host", "localhost"), ("content-type", bad)]);
            assert_eq!(
                p.refuses(Some(&local), &Method::POST, &h, None),
                Some(Refusal::ContentType(bad.into())),
                "{bad}"
            );
        }
        // No content type at all is not JSON either; an empty POST has nothing to type.
        let h = headers(&[("host", "localhost")]);
        assert!(p.refuses(Some(&local), &Method::POST, &h, None).is_some());
        let h = headers(&[("host", "localhost"), ("content-length", "0")]);
        assert_eq!(p.refuses(Some(&local), &Method::POST, &h, None), None);
        let h = headers(&[("host", "localhost"), ("content-type", "text/plain")]);
        assert_eq!(
            BrowserPolicy::new(&[], &[], false).refuses(Some(&local), &Method::POST, &h, None),
            None
        );
    }
}
