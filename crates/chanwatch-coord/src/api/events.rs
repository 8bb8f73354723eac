//! The admin API's one-object reads and its event feed (DESIGN.md §7): `GET
//! /api/v1/channels/{name}`, `GET /api/v1/nodes/{id}`, `POST /api/v1/nodes/{id}/undrain` and
//! `GET /api/v1/events` (server-sent events; `?follow=0` for a JSON answer).
//!
//! Owns: those routes' parsing and answers. Must not: keep state (the history is the
//! handle's `EventLog`) or write (undrain goes through the handle).

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::IntoResponse;
use axum::Json;
use chanwatch_core::NodeId;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::broadcast::error::RecvError;

use super::{channel_name, HttpError, HttpResult};
use crate::events::Event;
use crate::handle::{ApiError, CoordHandle};

/// How often a follower gets a keep-alive comment: `ctl events --follow` takes a silence of
/// several of these as a frozen leader and reconnects.
pub const KEEP_ALIVE: Duration = Duration::from_secs(2);

fn node_id(id: &str) -> Result<NodeId, HttpError> {
    id.parse()
        .map_err(|_| HttpError::bad_request(format!("{id:?} is not a node id (a decimal number)")))
}

pub(super) async fn channel(State(h): State<CoordHandle>, Path(name): Path<String>) -> HttpResult {
    Ok(Json(h.channel_detail(channel_name(&name)?).await?).into_response())
}

pub(super) async fn node(State(h): State<CoordHandle>, Path(id): Path<String>) -> HttpResult {
    Ok(Json(h.node_detail(node_id(&id)?).await?).into_response())
}

pub(super) async fn undrain(State(h): State<CoordHandle>, Path(id): Path<String>) -> HttpResult {
    let id = node_id(&id)?;
    let was = h.undrain(id).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(json!({ "undrained": id.0, "was_draining": was })),
    )
        .into_response())
}

#[derive(Debug, Deserialize)]
pub(super) struct EventsQuery {
    /// Replay from this sequence number (default: the whole history kept).
    #[serde(default)]
    since: Option<u64>,
    /// `0`/`false`: answer `{history, events}` as JSON and end; otherwise follow (SSE).
    #[serde(default)]
    follow: Option<String>,
    /// The leader whose history `since` counts in: when another leader now keeps the history,
    /// `since` is ignored and it all replays (a follower reconnecting after a failover).
    #[serde(default)]
    leader: Option<String>,
}

/// The event history, replayed from `?since=N`, then followed as server-sent events: first an
/// event `history` (`{leader, since_ms, first_seq, last_seq}`), then one unnamed event per
/// history event (its `id` is the sequence number). The stream ends when this coordinator
/// stops leading or starts a new history, so a follower reconnects to the new leader.
pub(super) async fn events(
    State(h): State<CoordHandle>,
    Query(q): Query<EventsQuery>,
) -> Result<axum::response::Response, HttpError> {
    let status = h.status();
    if !status.leader {
        return Err(ApiError::NotLeader {
            leader_addr: status.leader_addr,
        }
        .into());
    }
    let follow = match q.follow.as_deref() {
        None | Some("" | "1" | "true") => true,
        Some("0" | "false") => false,
        Some(other) => {
            return Err(HttpError::bad_request(format!(
                "follow={other:?}: expected 1, true, 0 or false"
            )))
        }
    };
    let log = h.events().clone();
    let mut since = q.since.unwrap_or(0);
    if q.leader.is_some_and(|l| l != log.info().leader) {
        since = 0;
    }
    if !follow {
        let info = log.info();
        return Ok(Json(json!({ "history": info, "events": log.since(since) })).into_response());
    }
    let (info, replay, rx) = log.follow(since);
    let hello = SseEvent::default()
        .event("history")
        .json_data(&info)
        .map_err(|e| HttpError::bad_request(e.to_string()))?;
    let first = std::iter::once(Ok::<_, Infallible>(hello))
        .chain(replay.iter().map(|e| Ok(to_sse(e))))
        .collect::<Vec<_>>();
    let last = replay.last().map_or(info.last_seq, |e| e.seq);
    let live = futures_util::stream::unfold(
        (rx, h.watch_status(), last, false),
        |(mut rx, mut status, last, done)| async move {
            if done {
                return None;
            }
            loop {
                tokio::select! {
                    got = rx.recv() => match got {
                        Ok(e) if e.seq <= last => {
                            // A new history began (a new term): end, the follower reconnects.
                            return None;
                        }
                        Ok(e) => {
                            let seq = e.seq;
                            return Some((Ok(to_sse(&e)), (rx, status, seq, false)));
                        }
                        Err(RecvError::Lagged(n)) => {
                            let ev = SseEvent::default().event("lagged").data(n.to_string());
                            return Some((Ok(ev), (rx, status, last, false)));
                        }
                        Err(RecvError::Closed) => return None,
                    },
                    changed = status.changed() => {
                        if changed.is_err() || !status.borrow().leader {
                            let ev = SseEvent::default()
                                .event("end")
                                .data("this coordinator no longer leads; reconnect to the new leader");
                            return Some((Ok(ev), (rx, status, last, true)));
                        }
                    }
                }
            }
        },
    );
    let stream = futures_util::StreamExt::chain(futures_util::stream::iter(first), live);
    Ok(Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response())
}

fn to_sse(e: &Event) -> SseEvent {
    SseEvent::default()
        .id(e.seq.to_string())
        .json_data(e)
        .unwrap_or_else(|_| SseEvent::default().comment("an event that does not serialize"))
}
