//! The status page's reads (DESIGN.md §7): `GET /api/v1/summary` and the paged, filtered form
//! of `GET /api/v1/channels` (`?name=&node=&state=&offset=&limit=`; without any of them the
//! route answers the plain list as before).
//!
//! Owns: parsing those parameters and the answers. Must not: keep state or write; what the
//! answers hold is `summary.rs`'s.

use axum::extract::State;
use axum::response::IntoResponse;
use axum::Json;
use chanwatch_core::{ChannelOwner, ChannelState, NodeId};
use serde::Serialize;

use super::{HttpError, HttpResult};
use crate::handle::CoordHandle;
use crate::summary::{ChannelFilter, MAX_PAGE};

/// Rows a page has when `limit` is not given.
const DEFAULT_LIMIT: usize = 50;

/// `GET /api/v1/summary`.
pub(super) async fn summary(State(h): State<CoordHandle>) -> HttpResult {
    Ok(Json(h.summary().await?).into_response())
}

/// The paging parameters of `GET /api/v1/channels`, as given.
#[derive(Debug, Default)]
pub(super) struct PageQuery<'a> {
    pub(super) name: Option<&'a str>,
    pub(super) node: Option<&'a str>,
    pub(super) state: Option<&'a str>,
    pub(super) offset: Option<&'a str>,
    pub(super) limit: Option<&'a str>,
}

impl PageQuery<'_> {
    /// Whether any was given: then the answer is a page, not the plain list.
    pub(super) fn given(&self) -> bool {
        self.name.is_some()
            || self.node.is_some()
            || self.state.is_some()
            || self.offset.is_some()
            || self.limit.is_some()
    }
}

fn number(what: &str, raw: Option<&str>, default: usize) -> Result<usize, HttpError> {
    match raw {
        None | Some("") => Ok(default),
        Some(v) => v
            .parse()
            .map_err(|_| HttpError::bad_request(format!("{what}={v:?}: expected a whole number"))),
    }
}

/// The filter and window a query asks for.
pub(super) fn parse(q: &PageQuery<'_>) -> Result<(ChannelFilter, usize, usize), HttpError> {
    let owner = match q.node {
        None | Some("") => None,
        Some("remaining") => Some(ChannelOwner::Remaining),
        Some(v) => Some(ChannelOwner::Node(NodeId(v.parse().map_err(|_| {
            HttpError::bad_request(format!(
                "node={v:?}: expected a node id (a decimal number) or remaining"
            ))
        })?))),
    };
    let state = match q.state {
        None | Some("") => None,
        Some(v) => Some(
            ChannelState::ALL
                .into_iter()
                .find(|s| s.as_str().eq_ignore_ascii_case(v))
                .ok_or_else(|| {
                    let all: Vec<&str> = ChannelState::ALL.iter().map(|s| s.as_str()).collect();
                    HttpError::bad_request(format!(
                        "state={v:?}: expected one of {}",
                        all.join(", ")
                    ))
                })?,
        ),
    };
    let offset = number("offset", q.offset, 0)?;
    let limit = number("limit", q.limit, DEFAULT_LIMIT)?;
    if limit == 0 || limit > MAX_PAGE {
        return Err(HttpError::bad_request(format!(
            "limit={limit}: expected 1 to {MAX_PAGE}"
        )));
    }
    let filter = ChannelFilter {
        name: q.name.filter(|n| !n.is_empty()).map(str::to_owned),
        owner,
        state,
    };
    Ok((filter, offset, limit))
}

/// A page row with its checkpoint (`?checkpoints=1`).
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    row: chanwatch_core::planner::ChannelRow,
    checkpoint: Option<Checkpoint>,
}

#[derive(Serialize)]
struct Checkpoint {
    position: String,
    epoch: u64,
    updated_at_ms: u64,
    age_ms: u64,
}

/// One page of channels; with `checkpoints`, each row's checkpoint, read from the store with
/// one get per row shown (not a range of every checkpoint).
pub(super) async fn page(h: &CoordHandle, q: &PageQuery<'_>, checkpoints: bool) -> HttpResult {
    let (filter, offset, limit) = parse(q)?;
    let page = h.channel_page(filter, offset, limit).await?;
    if !checkpoints {
        return Ok(Json(page).into_response());
    }
    let r = h.reads();
    let gets = page.rows.iter().map(|row| {
        let key = r.keys.checkpoint(&row.channel);
        async move { r.store.get(&key).await }
    });
    let got = futures_util::future::join_all(gets).await;
    let now = r.clock.unix_ms();
    let mut rows = Vec::with_capacity(page.rows.len());
    for (row, cp) in page.rows.into_iter().zip(got) {
        let cp = cp.map_err(|e| crate::ApiError::Store(e.to_string()))?;
        let checkpoint = cp
            .and_then(|kv| chanwatch_core::Checkpoint::decode(&kv.value).ok())
            .map(|c| Checkpoint {
                age_ms: now.saturating_sub(c.updated_at_ms),
                position: c.position,
                epoch: c.epoch.0,
                updated_at_ms: c.updated_at_ms,
            });
        rows.push(Row { row, checkpoint });
    }
    Ok(Json(serde_json::json!({
        "total": page.total,
        "offset": page.offset,
        "limit": page.limit,
        "rows": rows,
    }))
    .into_response())
}
