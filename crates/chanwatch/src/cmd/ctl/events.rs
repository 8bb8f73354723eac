//! `ctl events --follow`: the leader's server-sent events (`GET /api/v1/events`), printed as
//! they come, across leader changes: when the stream ends (the leader stepped down, died, or
//! went silent past a few keep-alives) it finds the leader again and goes on from the last
//! event it printed — or from the new leader's whole history, which is a new one.
//!
//! Owns: the SSE reading and the reconnect loop. Must not: write anywhere but stdout/stderr.

use std::time::Duration;

use anyhow::Result;
use reqwest::Method;

use super::describe::{event_line, history_note};
use super::leader::{Event, Failed, HistoryInfo, Leader};
use super::output::{emit, Format};

/// Silence after which a stream counts as dead: the server sends a keep-alive every 2 s.
const SILENCE: Duration = Duration::from_secs(8);

/// One server-sent event: its `event:` name (empty for the default) and `data:`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Sse {
    pub event: String,
    pub data: String,
}

/// Takes every complete event (ended by a blank line) out of `buf`; comments are dropped.
pub fn parse(buf: &mut String) -> Vec<Sse> {
    let mut out = Vec::new();
    while let Some(end) = buf.find("\n\n") {
        let block: String = buf.drain(..end + 2).collect();
        let mut ev = Sse::default();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                ev.event = v.trim_start().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                if !ev.data.is_empty() {
                    ev.data.push('\n');
                }
                ev.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        if !ev.event.is_empty() || !ev.data.is_empty() {
            out.push(ev);
        }
    }
    out
}

fn print(e: &Event, format: Format) -> Result<()> {
    let text = match format {
        Format::Json => serde_json::to_string(e)? + "\n",
        Format::Yaml => format!("---\n{}", serde_yaml_ng::to_string(e)?),
        Format::Table | Format::Wide => event_line(e),
    };
    emit(&text)
}

/// Prints events from `since` on until Ctrl-C, following the leader; gives up when no leader
/// answers for `--timeout`.
pub async fn follow(leader: &Leader, since: u64, format: Format) -> Result<()> {
    // The history we print from (its leader) and the last sequence number printed.
    let mut at: Option<(String, u64)> = None;
    let mut since = since;
    loop {
        let path = match &at {
            Some((l, seq)) => format!("/api/v1/events?since={}&leader={l}", seq + 1),
            None => format!("/api/v1/events?since={since}"),
        };
        let mut resp = leader
            .patiently(|_| async {
                let req = leader.request(Method::GET, &path, None).await?;
                // A frozen leader takes the connection and never answers.
                match tokio::time::timeout(SILENCE, req.send()).await {
                    Ok(Ok(r)) if r.status().is_success() => Ok(r),
                    // A standby (with `--admin`) names the leader.
                    Ok(Ok(r)) if r.status() == reqwest::StatusCode::SERVICE_UNAVAILABLE => {
                        Err(leader.unavailable(&r.bytes().await.unwrap_or_default()))
                    }
                    Ok(Ok(r)) => Err(Failed::Retry(format!(
                        "the coordinator answered {}",
                        r.status()
                    ))),
                    Ok(Err(e)) => Err(leader.unreachable(format!(
                        "the admin API does not answer: {:#}",
                        anyhow::Error::new(e)
                    ))),
                    Err(_) => Err(Failed::Retry(format!(
                        "the leader did not answer within {} s",
                        SILENCE.as_secs()
                    ))),
                }
            })
            .await?;
        let mut buf = String::new();
        'stream: loop {
            let chunk = match tokio::time::timeout(SILENCE, resp.chunk()).await {
                Ok(Ok(Some(c))) => c,
                // Ended, broken, or silent: find the leader again.
                _ => break 'stream,
            };
            buf.push_str(&String::from_utf8_lossy(&chunk));
            for ev in parse(&mut buf) {
                match ev.event.as_str() {
                    "history" => {
                        if let Ok(h) = serde_json::from_str::<HistoryInfo>(&ev.data) {
                            if at.as_ref().map(|(l, _)| l) != Some(&h.leader) {
                                eprint!("{}", history_note(&h));
                                at = Some((h.leader, since.saturating_sub(1)));
                            }
                        }
                    }
                    "end" => break 'stream,
                    "lagged" => eprintln!(
                        "warning: {} event(s) missed (this reader was slow)",
                        ev.data
                    ),
                    _ => {
                        let Ok(e) = serde_json::from_str::<Event>(&ev.data) else {
                            eprintln!(
                                "warning: an event this ctl does not understand: {}",
                                ev.data
                            );
                            continue;
                        };
                        print(&e, format)?;
                        at = Some((e.leader.clone(), e.seq));
                    }
                }
            }
        }
        // A new leader's history is new: replay all of it.
        since = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_sent_events_are_split_at_blank_lines_and_comments_dropped() {
        let mut buf =
            "event: history\ndata: {\"a\":1}\n\n: keep-alive\n\nid: 3\ndata: x\n\ndata: par"
                .to_owned();
        let got = parse(&mut buf);
        assert_eq!(
            got,
            vec![
                Sse {
                    event: "history".into(),
                    data: "{\"a\":1}".into()
                },
                Sse {
                    event: String::new(),
                    data: "x".into()
                },
            ]
        );
        assert_eq!(buf, "data: par");
    }
}
