//! Mapping etcd's errors onto [`StoreError`], so that callers can tell retryable from fatal
//! and the message says what to do. Split from `etcd.rs` to keep that file about the calls.

use crate::error::StoreError;

/// Maps etcd's errors by the server's fixed error strings (etcd's `rpctypes`), then by gRPC
/// code. `user` and `key` (the key or prefix the call named) go into the errors that need
/// them to be acted on.
pub(crate) fn map_err(endpoints: &str, user: &str, key: &str, e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(status) => {
            let msg = status.message().to_owned();
            if msg.contains("database space exceeded") {
                return StoreError::NoSpace;
            }
            if msg.contains("invalid auth token")
                || msg.contains("revision of auth store is old")
                || msg.contains("auth token is expired")
            {
                return StoreError::AuthTokenExpired(msg);
            }
            if msg.contains("permission denied") || status.code() == Code::PermissionDenied {
                if user.is_empty() {
                    return StoreError::Unauthenticated(format!(
                        "{msg} on {key:?} with no user given (etcd has auth on; a TLS client \
                         certificate's common name counts as a user)"
                    ));
                }
                return StoreError::PermissionDenied {
                    user: user.to_owned(),
                    key: key.to_owned(),
                };
            }
            if msg.contains("authentication failed") {
                return StoreError::Unauthenticated(format!("{msg} (user {user:?})"));
            }
            if msg.contains("user name is empty") {
                return StoreError::Unauthenticated(format!(
                    "{msg}: etcd has auth on and no user was given"
                ));
            }
            if msg.contains("too many operations in txn request") {
                return StoreError::TooManyOps { ops: 0, max: 0 };
            }
            if msg.contains("request is too large") {
                return StoreError::RequestTooLarge { bytes: 0, max: 0 };
            }
            if msg.contains("requested lease not found") {
                return StoreError::LeaseNotFound(0);
            }
            if msg.contains("required revision has been compacted") {
                return StoreError::Compacted {
                    compact_revision: 0,
                };
            }
            if msg.contains("required revision is a future revision") {
                return StoreError::FutureRevision {
                    requested: 0,
                    current: 0,
                };
            }
            match status.code() {
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                    StoreError::Unavailable {
                        endpoints: endpoints.to_owned(),
                        message: msg,
                    }
                }
                Code::Unauthenticated => {
                    StoreError::Unauthenticated(format!("{msg} (user {user:?})"))
                }
                Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                    StoreError::InvalidArgument(msg)
                }
                Code::ResourceExhausted => StoreError::RequestTooLarge { bytes: 0, max: 0 },
                _ => StoreError::Backend(format!("{:?}: {msg}", status.code())),
            }
        }
        E::TransportError(t) => StoreError::Unavailable {
            endpoints: endpoints.to_owned(),
            message: format!("{t}: {}", source_chain(&t)),
        },
        E::IoError(io) => StoreError::Unavailable {
            endpoints: endpoints.to_owned(),
            message: io.to_string(),
        },
        E::InvalidUri(u) => StoreError::Config(format!("bad etcd endpoint URL: {u}")),
        E::InvalidArgs(a) => StoreError::InvalidArgument(a),
        E::WatchError(w) => StoreError::WatchClosed(w),
        E::LeaseKeepAliveError(m) if m.contains("not found") => StoreError::LeaseNotFound(0),
        other => StoreError::Backend(other.to_string()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// What a watch cancelled by etcd means. etcd gives the reason as text: a Go-formatted gRPC
/// error (`rpc error: code = Unauthenticated desc = etcdserver: invalid auth token`), one of
/// its fixed strings (`etcdserver: permission denied`), or anything else (the watch closed).
pub(crate) fn cancel_error(endpoints: &str, user: &str, key: &str, reason: &str) -> StoreError {
    let known = [
        "invalid auth token",
        "permission denied",
        "auth store is old",
    ];
    if known.iter().any(|k| reason.contains(k)) {
        let desc = reason.rsplit("desc = ").next().unwrap_or(reason);
        let status = if reason.contains("permission denied") {
            tonic::Status::permission_denied(desc)
        } else {
            tonic::Status::unauthenticated(desc)
        };
        return map_err(endpoints, user, key, etcd_client::Error::GRpcStatus(status));
    }
    let why = if reason.is_empty() {
        "etcd cancelled the watch".to_owned()
    } else {
        reason.to_owned()
    };
    StoreError::WatchClosed(why)
}

/// Endpoints that can never connect, said at once instead of retried for ever (a newcomer's
/// `htp://…` and an `http://` endpoint with `--etcd-ca` were "unavailable" every few seconds):
/// a space in one (a list is comma-separated), a scheme other than `http://` or `https://` in
/// lower case (etcd's client reads no other: it put `http://` before `HTTPS://…`), and, when
/// TLS files are given (`tls`), an `http://` endpoint. None (`HOST:PORT`) is fine: the client
/// adds `http://`, or `https://` with TLS files.
pub(crate) fn check_endpoints(endpoints: &[String], tls: bool) -> Result<(), StoreError> {
    for e in endpoints {
        if e.chars().any(char::is_whitespace) {
            return Err(StoreError::Config(format!(
                "etcd endpoint {e:?} holds a space: separate endpoints with commas only"
            )));
        }
        match e.split_once("://").map(|(s, _)| s) {
            None | Some("https") => {}
            Some("http") if !tls => {}
            Some("http") => {
                return Err(StoreError::Config(format!(
                    "etcd endpoint {e} is plain HTTP but TLS files were given (--etcd-ca, \
                     --etcd-cert, --etcd-key): use https://, or drop the TLS flags"
                )))
            }
            Some(other) if matches!(other.to_ascii_lowercase().as_str(), "http" | "https") => {
                return Err(StoreError::Config(format!(
                    "bad etcd endpoint URL {e}: write the scheme in lower case ({}://)",
                    other.to_ascii_lowercase()
                )))
            }
            Some(other) => {
                return Err(StoreError::Config(format!(
                    "bad etcd endpoint URL {e}: the scheme {other}:// is neither http:// nor \
                     https://"
                )))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_that_can_never_connect_are_a_configuration_error() {
        let list = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert!(
            check_endpoints(&list(&["http://127.0.0.1:2379", "127.0.0.1:2380"]), false).is_ok()
        );
        assert!(check_endpoints(&list(&["https://etcd-1:2379", "[::1]:2379"]), true).is_ok());
        for (bad, tls, says) in [
            ("htp://127.0.0.1:2379", false, "the scheme htp://"),
            ("ftp://127.0.0.1:2379", true, "the scheme ftp://"),
            (
                "http://127.0.0.1:2379",
                true,
                "plain HTTP but TLS files were given",
            ),
            (
                "HTTPS://etcd-2:2379",
                true,
                "write the scheme in lower case (https://)",
            ),
            (" http://b:2379", false, "holds a space"),
        ] {
            let e = check_endpoints(&list(&["https://ok:2379", bad]), tls).expect_err(bad);
            assert!(
                matches!(&e, StoreError::Config(m) if m.contains(says) && m.contains(bad)),
                "{e}"
            );
        }
    }
}
