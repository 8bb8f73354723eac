//! Request guard of the admin API: no cross-site writes, no DNS rebinding (DESIGN.md §7).
//!
//! Owns: the checks every request passes before a route sees it —
//! - `Host` (every method), always with the bound port: an IP address (the bound one, or any:
//!   a browser sends an IP host only to that IP, so it cannot be a DNS-rebinding attack),
//!   `localhost`, or a name the operator allowed (`--admin-host`). 421 otherwise: a page under
//!   a foreign name that resolves to us (DNS rebinding) reads and writes nothing.
//! - `Origin` (every method), when sent: `http://` and the same host and port as `Host`. 403
//!   otherwise.
//! - writes (POST, PUT, PATCH, DELETE): `Content-Type: application/json` (415 otherwise) — a
//!   browser cannot send that cross-site without a CORS preflight, which this API never
//!   answers — and a body that is empty or a JSON *object* (400 otherwise; 413 over
//!   [`MAX_BODY_BYTES`](super::MAX_BODY_BYTES)). `POST /api/v1/channels` alone also takes a
//!   JSON *array* (bulk registration), up to
//!   [`MAX_BULK_BODY_BYTES`](super::bulk::MAX_BULK_BODY_BYTES).
//!
//! Must not: look at the bearer token (that is `require_token`'s) or at what a route means.

use std::net::{IpAddr, SocketAddr};

use axum::extract::Request;
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::HttpError;

/// The address the listener is bound to; [`super::serve`] puts it into every request.
#[derive(Debug, Clone, Copy)]
pub(super) struct BoundAddr(pub(super) SocketAddr);

/// Host names (lower case, no port) the API answers to besides IP addresses and `localhost`.
#[derive(Debug, Clone, Default)]
pub(super) struct AllowedHosts(pub(super) Vec<String>);

fn refuse(status: StatusCode, message: String) -> Response {
    HttpError {
        status,
        message,
        leader: None,
    }
    .into_response()
}

fn is_write(m: &Method) -> bool {
    matches!(
        *m,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    )
}

/// The middleware: runs the checks of the module docs, in that order.
pub(super) async fn guard(allowed: &AllowedHosts, req: Request, next: Next) -> Response {
    let Some(BoundAddr(bound)) = req.extensions().get::<BoundAddr>().copied() else {
        return refuse(
            StatusCode::INTERNAL_SERVER_ERROR,
            "the admin API was served without chanwatch_coord::api::serve, so it cannot check \
             the Host header; serve it with api::serve"
                .into(),
        );
    };
    let host = req
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or_else(|| req.uri().authority().map(|a| a.as_str().to_owned()));
    let Some(host) = host else {
        return refuse(
            StatusCode::MISDIRECTED_REQUEST,
            format!("request without a Host header refused; send Host: {bound}"),
        );
    };
    if let Err(why) = check_host(&host, bound, allowed) {
        return refuse(StatusCode::MISDIRECTED_REQUEST, why);
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
        if let Err(why) = check_origin(&origin, &host) {
            return refuse(StatusCode::FORBIDDEN, why);
        }
    }
    if !is_write(req.method()) {
        return next.run(req).await;
    }
    let content_type = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    if let Err(why) = check_content_type(content_type.as_deref()) {
        return refuse(StatusCode::UNSUPPORTED_MEDIA_TYPE, why);
    }
    let bulk = super::bulk::takes_lists(req.method(), req.uri().path());
    let limit = if bulk {
        super::bulk::MAX_BULK_BODY_BYTES
    } else {
        super::MAX_BODY_BYTES
    };
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, limit).await {
        Ok(b) => b,
        Err(e) => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body refused ({e}); the limit is {limit} bytes"),
            )
        }
    };
    if let Err(why) = check_body(&bytes, bulk) {
        return refuse(StatusCode::BAD_REQUEST, why);
    }
    next.run(Request::from_parts(parts, axum::body::Body::from(bytes)))
        .await
}

/// Splits `host[:port]` (port 80 when absent; IPv6 in brackets) into a lower-case name without
/// brackets and a port.
fn split_host(raw: &str, default_port: u16) -> Option<(String, u16)> {
    if raw.contains(['@', '/', '?', '#']) || raw.is_empty() {
        return None;
    }
    let (name, port) = if let Some(rest) = raw.strip_prefix('[') {
        let (name, after) = rest.split_once(']')?;
        match after {
            "" => (name, default_port),
            p => (name, p.strip_prefix(':')?.parse().ok()?),
        }
    } else {
        match raw.rsplit_once(':') {
            None => (raw, default_port),
            Some((name, p)) => (name, p.parse().ok()?),
        }
    };
    if name.is_empty() || (name.contains(':') && !raw.starts_with('[')) {
        return None;
    }
    Some((name.to_ascii_lowercase(), port))
}

/// `Ok` when `host` (a `Host` header) names this API: see the module docs.
fn check_host(host: &str, bound: SocketAddr, allowed: &AllowedHosts) -> Result<(), String> {
    let accepted = || {
        let mut names = vec![format!("an IP address (such as {})", bound.ip())];
        names.push("localhost".into());
        names.extend(allowed.0.iter().cloned());
        format!("{}, with port {}", names.join(", "), bound.port())
    };
    let Some((name, port)) = split_host(host, 80) else {
        return Err(format!(
            "Host {host:?} refused: not a host[:port]; this API answers to {}",
            accepted()
        ));
    };
    let ours = port == bound.port()
        && (name.parse::<IpAddr>().is_ok() || name == "localhost" || allowed.0.contains(&name));
    if ours {
        Ok(())
    } else {
        Err(format!(
            "Host {host:?} refused: this API answers only to {} (another name could be a DNS \
             rebinding attack from a web page); call it by its address, or allow the name with \
             --admin-host",
            accepted()
        ))
    }
}

/// `Ok` when `origin` (an `Origin` header) is the same host and port as `host`.
fn check_origin(origin: &str, host: &str) -> Result<(), String> {
    let same = origin
        .split_once("://")
        // This API serves plain HTTP only, so its own pages have an http:// origin.
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("http"))
        .and_then(|(_, rest)| split_host(rest.strip_suffix('/').unwrap_or(rest), 80))
        .is_some_and(|o| split_host(host, 80) == Some(o));
    if same {
        Ok(())
    } else {
        Err(format!(
            "Origin {origin:?} is not this API ({host}): cross-site requests are refused; use \
             `chanwatch ctl` or this API's own status page"
        ))
    }
}

/// `Ok` when a write's `Content-Type` is `application/json` (parameters allowed).
fn check_content_type(content_type: Option<&str>) -> Result<(), String> {
    let essence = content_type.map(|c| c.split(';').next().unwrap_or("").trim());
    if essence.is_some_and(|e| e.eq_ignore_ascii_case("application/json")) {
        return Ok(());
    }
    Err(format!(
        "writes need Content-Type: application/json (got {}); send it on every POST and \
         DELETE, also without a body",
        match content_type {
            Some(c) => format!("{c:?}"),
            None => "none".into(),
        }
    ))
}

/// `Ok` when a write's body is empty or a JSON object.
fn check_body(bytes: &[u8], arrays: bool) -> Result<(), String> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(());
    }
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| format!("bad request body: not JSON ({e}); send a JSON object"))?;
    let kind = match value {
        serde_json::Value::Object(_) => return Ok(()),
        serde_json::Value::Array(_) if arrays => return Ok(()),
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Null => "null",
    };
    Err(format!(
        "bad request body: {kind}; send a JSON object such as {{\"name\": \"c1\"}}"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().expect("a socket address")
    }

    #[test]
    fn host_must_be_an_ip_localhost_or_an_allowed_name_with_the_bound_port() {
        let bound = a("127.0.0.1:8080");
        let none = AllowedHosts::default();
        for ok in [
            "127.0.0.1:8080",
            "localhost:8080",
            "LocalHost:8080",
            "[::1]:8080",
            "127.0.0.2:8080",
        ] {
            assert_eq!(check_host(ok, bound, &none), Ok(()), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "localhost.:8080",
            "127.0.0.1:8081",
            "localhost",
            "127.0.0.1",
            "user@127.0.0.1:8080",
            "",
            "::1:8080",
            "127.0.0.1:x",
        ] {
            let e = check_host(bad, bound, &none).expect_err("refused");
            assert!(e.contains("refused") && e.contains("8080"), "{bad}: {e}");
        }
        assert_eq!(check_host("localhost", a("127.0.0.1:80"), &none), Ok(()));
        assert_eq!(check_host("[::1]:9", a("[::1]:9"), &none), Ok(()));
        // Off loopback, and on an unspecified bind (ctl then sends Host 0.0.0.0:PORT): IP
        // addresses with the port; a DNS name only when allowed.
        for bound in [a("10.0.0.5:9"), a("0.0.0.0:9"), a("[::]:9")] {
            assert_eq!(check_host("10.0.0.5:9", bound, &none), Ok(()));
            assert_eq!(check_host("0.0.0.0:9", bound, &none), Ok(()));
            let e = check_host("coord.example:9", bound, &none).expect_err("a name");
            assert!(e.contains("--admin-host"), "{e}");
            let allowed = AllowedHosts(vec!["coord.example".into()]);
            assert_eq!(check_host("Coord.Example:9", bound, &allowed), Ok(()));
            assert!(check_host("coord.example:10", bound, &allowed).is_err());
        }
    }

    #[test]
    fn origin_must_be_the_same_host_and_port() {
        assert_eq!(
            check_origin("http://127.0.0.1:8080", "127.0.0.1:8080"),
            Ok(())
        );
        assert_eq!(check_origin("http://LOCALHOST:80", "localhost"), Ok(()));
        assert_eq!(check_origin("http://[::1]:5", "[::1]:5"), Ok(()));
        for bad in [
            "http://evil.example",
            "http://evil.example:8080",
            "http://localhost:8080",
            "https://127.0.0.1:8080",
            "null",
            "file://",
            "http://127.0.0.1:8081",
        ] {
            let e = check_origin(bad, "127.0.0.1:8080").expect_err("refused");
            assert!(e.contains("cross-site") && e.contains(bad), "{bad}: {e}");
        }
    }

    #[test]
    fn writes_need_json_content_and_an_object_body() {
        assert_eq!(check_content_type(Some("application/json")), Ok(()));
        assert_eq!(
            check_content_type(Some("Application/JSON; charset=utf-8")),
            Ok(())
        );
        for bad in [
            None,
            Some("text/plain"),
            Some("application/x-www-form-urlencoded"),
        ] {
            let e = check_content_type(bad).expect_err("refused");
            assert!(e.contains("Content-Type: application/json"), "{e}");
        }
        assert_eq!(check_body(b"", false), Ok(()));
        assert_eq!(check_body(b" \n", false), Ok(()));
        assert_eq!(check_body(br#"{"name":"x"}"#, false), Ok(()));
        assert!(check_body(br#"["x"]"#, false)
            .expect_err("refused")
            .contains("an array"));
        assert_eq!(check_body(br#"[{"name":"x"}]"#, true), Ok(()));
        assert!(check_body(b"\"x\"", true)
            .expect_err("refused")
            .contains("a string"));
        assert!(check_body(b"{nope", true)
            .expect_err("refused")
            .contains("bad request body"));
    }
}
