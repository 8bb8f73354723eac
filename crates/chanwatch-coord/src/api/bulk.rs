//! Bulk registration over the admin API: `POST /api/v1/channels` with a JSON *array* of
//! channel objects (an object alone is the single add of `api.rs`).
//!
//! Owns: telling the two bodies apart, checking a list whole before anything is written —
//! every bad entry named by its index with why (bad name, listed twice, a vchannel over
//! 64 KiB, a field the coordinator sets, not an object, already registered) — and the
//! answers: 201 with the transitions, 400/409 with `refused: [{index, error}]`, 413 over
//! [`MAX_BULK_CHANNELS`] entries or [`MAX_BULK_BODY_BYTES`].
//! Fields an entry has besides `name` and `vchannel` are kept in the stored value, so fields
//! newer coordinators know (and this build does not) flow through.
//! Must not: write: the leader does, through [`CoordHandle::add_channels`].

use chanwatch_core::{COORDINATOR_FIELDS, MAX_CHANNEL_EXTRA_BYTES};
use std::collections::HashMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chanwatch_core::{ChannelInfo, ChannelName, Epoch, VChannelInfo};
use serde_json::{json, Value};

use super::{HttpError, HttpResult};
use crate::{BulkError, CoordHandle, MAX_BULK_CHANNELS};

/// Largest bulk request body: 10,000 entries with room for small vchannels (a list of big
/// ones is split by the client; `ctl add-channels` sends at most 8 MiB a call).
pub const MAX_BULK_BODY_BYTES: usize = 32 * 1024 * 1024;

/// Whether a request may carry a list (the guard's body check and size limit).
pub(super) fn takes_lists(method: &Method, path: &str) -> bool {
    method == Method::POST && path == "/api/v1/channels"
}

/// `POST /api/v1/channels`: a list is a bulk registration, anything else the single add.
pub(super) async fn add_one_or_many(State(h): State<CoordHandle>, body: Bytes) -> HttpResult {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'[') {
        // One channel: the route's body limit is the list's; a single add keeps its own.
        if body.len() > super::MAX_BODY_BYTES {
            return Err(HttpError {
                status: StatusCode::PAYLOAD_TOO_LARGE,
                message: format!(
                    "request body refused (length limit exceeded); the limit is {} bytes for \
                     one channel",
                    super::MAX_BODY_BYTES
                ),
                leader: None,
            });
        }
        return super::add_channel(State(h), Json::from_bytes(&body)).await;
    }
    let entries: Vec<Value> = serde_json::from_slice(&body)
        .map_err(|e| HttpError::bad_request(format!("bad request body: not a JSON list ({e})")))?;
    if entries.len() > MAX_BULK_CHANNELS {
        return Err(HttpError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!(
                "{} channels in one list; the limit is {MAX_BULK_CHANNELS} per request: split \
                 the list (ctl add-channels does)",
                entries.len()
            ),
            leader: None,
        });
    }
    if entries.is_empty() {
        return Err(HttpError::bad_request(
            "an empty list: send at least one channel object such as {\"name\": \"c1\"}",
        ));
    }
    let total = entries.len();
    let infos = match check(entries) {
        Ok(infos) => infos,
        Err(refused) => return Ok(refusal(StatusCode::BAD_REQUEST, total, refused)),
    };
    match h.add_channels(infos).await {
        Ok(t) => Ok((StatusCode::CREATED, Json(t)).into_response()),
        Err(BulkError::Refused(r)) => Ok(refusal(
            StatusCode::CONFLICT,
            total,
            r.into_iter().map(|(i, e)| (i, e.to_string())).collect(),
        )),
        Err(BulkError::Api(e)) => Err(e.into()),
        Err(BulkError::Partial { added, error }) => {
            let msg = format!(
                "{} of {total} channel(s) were registered (listed in `added`) before a write \
                 failed ({error}); the rest were not: send them again",
                added.len()
            );
            Ok((
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({ "error": msg, "added": added })),
            )
                .into_response())
        }
    }
}

/// 400/409 naming every refused entry.
fn refusal(status: StatusCode, total: usize, refused: Vec<(usize, String)>) -> Response {
    let mut msg = format!(
        "{} of {total} listed channel(s) refused; nothing was written:",
        refused.len()
    );
    for (i, why) in refused.iter().take(20) {
        msg += &format!(" [{i}] {why};");
    }
    if refused.len() > 20 {
        msg += &format!(" and {} more (see `refused`)", refused.len() - 20);
    }
    let list: Vec<Value> = refused
        .iter()
        .map(|(i, why)| json!({ "index": i, "error": why }))
        .collect();
    (status, Json(json!({ "error": msg, "refused": list }))).into_response()
}

/// Every entry as the value to store, or every refusal with its index.
fn check(entries: Vec<Value>) -> Result<Vec<ChannelInfo>, Vec<(usize, String)>> {
    let mut first: HashMap<String, usize> = HashMap::with_capacity(entries.len());
    let mut refused = Vec::new();
    let mut infos = Vec::with_capacity(entries.len());
    for (i, entry) in entries.into_iter().enumerate() {
        match entry_info(entry) {
            Ok(info) => {
                if let Some(was) = first.get(info.channel.as_str()) {
                    refused.push((
                        i,
                        format!("channel {} is listed twice (also at [{was}])", info.channel),
                    ));
                } else {
                    first.insert(info.channel.as_str().to_owned(), i);
                    infos.push(info);
                }
            }
            Err(why) => refused.push((i, why)),
        }
    }
    if refused.is_empty() {
        Ok(infos)
    } else {
        Err(refused)
    }
}

/// One entry as the value to store (the planner sets its state, epoch and time).
fn entry_info(entry: Value) -> Result<ChannelInfo, String> {
    let Value::Object(mut fields) = entry else {
        return Err(format!(
            "{}, not a JSON object such as {{\"name\": \"c1\"}}",
            kind(&entry)
        ));
    };
    let name = match fields.remove("name") {
        Some(Value::String(s)) => ChannelName::new(s).map_err(|e| e.to_string())?,
        Some(other) => return Err(format!("name is {}, not a string", kind(&other))),
        None => return Err("no name: each channel object needs \"name\"".into()),
    };
    let vchannel = match fields.remove("vchannel") {
        None | Some(Value::Null) => VChannelInfo::default(),
        Some(v) => {
            let v: VChannelInfo =
                serde_json::from_value(v).map_err(|e| format!("channel {name}: vchannel: {e}"))?;
            v.check_size().map_err(|e| format!("channel {name}: {e}"))?;
            v
        }
    };
    if let Some(k) = COORDINATOR_FIELDS.iter().find(|k| fields.contains_key(**k)) {
        return Err(format!(
            "channel {name}: field {k:?} is set by the coordinator; leave it out"
        ));
    }
    let extra_len = serde_json::to_vec(&fields).map_or(usize::MAX, |v| v.len());
    if extra_len > MAX_CHANNEL_EXTRA_BYTES {
        return Err(format!(
            "channel {name}: its fields besides name and vchannel take {extra_len} bytes; the \
             limit is {MAX_CHANNEL_EXTRA_BYTES}"
        ));
    }
    let info = ChannelInfo::new(name.clone(), Epoch(1), 0, vchannel);
    if fields.is_empty() {
        return Ok(info);
    }
    // Through the value's own decoding, so that a field this build knows is read typed (and
    // checked) and one it does not is kept verbatim.
    let mut value = serde_json::to_value(&info).map_err(|e| e.to_string())?;
    if let Value::Object(map) = &mut value {
        map.extend(fields);
    }
    let info =
        serde_json::from_value::<ChannelInfo>(value).map_err(|e| format!("channel {name}: {e}"))?;
    // The same rules as one channel's `weight` / `group` (planner/admin.rs).
    chanwatch_core::planner::Placement {
        weight: info.weight,
        group: info.group.clone(),
    }
    .check()
    .map_err(|e| format!("channel {name}: {e}"))?;
    Ok(info)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Object(_) => "an object",
        Value::Array(_) => "a list",
        Value::String(_) => "a string",
        Value::Number(_) => "a number",
        Value::Bool(_) => "a boolean",
        Value::Null => "null",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(json: &str) -> Vec<Value> {
        serde_json::from_str(json).expect("a JSON list")
    }

    #[test]
    fn a_weight_or_group_out_of_range_is_named_like_for_one_channel() {
        for (entry, says) in [
            (r#"{"name":"a","weight":0}"#, "weight 0 is out of range"),
            (r#"{"name":"a","group":"a/b"}"#, "group \"a/b\""),
        ] {
            let err = entry_info(serde_json::from_str(entry).expect("json")).expect_err(entry);
            assert!(err.contains(says), "{entry}: {err}");
        }
        let ok = entry_info(
            serde_json::from_str(r#"{"name":"a","weight":3,"group":"g"}"#).expect("json"),
        )
        .expect("a good weight and group");
        assert_eq!((ok.weight, ok.group.as_deref()), (3, Some("g")));
    }

    /// Every bad entry is named with its index and why; the good ones are not.
    #[test]
    fn every_bad_entry_is_named_with_its_index_and_why() {
        let big = "x".repeat(70 * 1024);
        let list = format!(
            r#"[{{"name":"ok-1"}}, {{"name":"bad name"}}, "c3", {{"name":"ok-1"}},
               {{"name":"c5","vchannel":{{"seek_position":"{big}"}}}},
               {{"name":"c6","state":"Watched"}}, {{"vchannel":{{}}}}, {{"name":7}},
               {{"name":"ok-2","weight":3}}]"#
        );
        let refused = check(entries(&list)).expect_err("bad entries");
        let idx: Vec<usize> = refused.iter().map(|(i, _)| *i).collect();
        assert_eq!(idx, [1, 2, 3, 4, 5, 6, 7], "{refused:?}");
        let why = |i: usize| &refused.iter().find(|(j, _)| *j == i).expect("named").1;
        assert!(why(2).contains("a string"), "{}", why(2));
        assert!(why(3).contains("listed twice (also at [0])"), "{}", why(3));
        assert!(why(4).contains("the limit is 65536 bytes"), "{}", why(4));
        assert!(why(5).contains("\"state\""), "{}", why(5));
        assert!(why(6).contains("no name"), "{}", why(6));
        assert!(why(7).contains("not a string"), "{}", why(7));
    }

    /// Fields besides name and vchannel reach the stored value unchanged.
    #[test]
    fn unknown_fields_are_kept_in_the_stored_value() {
        let infos = check(entries(
            r#"[{"name":"a","weight":3,"group":"g1","vchannel":{"collection_id":7}}]"#,
        ))
        .expect("fine");
        let stored: Value = serde_json::from_slice(&infos[0].encode()).expect("json");
        assert_eq!(
            (
                &stored["weight"],
                &stored["group"],
                &stored["vchannel"]["collection_id"]
            ),
            (&json!(3), &json!("g1"), &json!(7))
        );
    }
}
