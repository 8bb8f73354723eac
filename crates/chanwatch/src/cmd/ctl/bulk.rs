//! `ctl add-channels --from-file F`: registering many channels at once.
//!
//! Owns: reading the file (`-` for stdin; one channel name or one JSON channel object per
//! line, blank lines and `#` comments skipped), checking all of it before anything is sent —
//! every bad line named with its number and why (bad name, bad JSON, listed twice, a value
//! too large, already registered: read from etcd) — then sending it in lists of at most
//! [`MAX_BULK_CHANNELS`] entries and [`MAX_LIST_BYTES`], with progress on stderr for long
//! files and the summary.
//! Must not: write to etcd (the leader does) or print the channel table.

use chanwatch_core::{COORDINATOR_FIELDS, MAX_CHANNEL_EXTRA_BYTES};
use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use chanwatch_coord::MAX_BULK_CHANNELS;
use chanwatch_core::{ChannelName, Keys, VChannelInfo};
use chanwatch_store::MetaStore;
use serde_json::{json, Map, Value};

use super::leader::{Leader, Refused};

/// Most bytes of JSON in one call (the API takes up to 32 MiB).
pub const MAX_LIST_BYTES: usize = 8 * 1024 * 1024;

/// One channel of the file, ready to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    /// 1-based line number in the file.
    pub number: usize,
    /// The channel object sent to the API.
    pub entry: Value,
    /// Its name.
    pub name: ChannelName,
}

/// The channels of a file, checked.
#[derive(Debug)]
pub struct File {
    /// Where it came from, for messages.
    pub source: String,
    /// Its channels, in file order.
    pub lines: Vec<Line>,
    /// Its bad lines (number, why), refused together with the lines naming channels already
    /// registered ([`check_registered`]) or alone ([`refuse_bad`]): nothing is sent if any.
    pub bad: Vec<(usize, String)>,
}

/// Reads `path` (`-`: stdin) and checks each line: the channels, and the bad lines kept in
/// [`File::bad`] (refused before anything is sent).
///
/// # Errors
/// The file cannot be read, or holds no line at all.
pub fn read(path: &str) -> Result<File> {
    let text = if path == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading channels from stdin")?;
        s
    } else {
        std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?
    };
    let source = if path == "-" { "stdin" } else { path }.to_owned();
    parse_keeping_bad(&source, &text)
}

/// Checks the text of a file (see [`read`]).
///
/// # Errors
/// Every bad line, with its number and why; nothing is sent.
#[cfg(test)]
pub fn parse(source: &str, text: &str) -> Result<File> {
    let file = parse_keeping_bad(source, text)?;
    refuse_bad(&file)?;
    Ok(file)
}

/// The lines of a file, its bad lines kept aside in [`File::bad`] so that the lines naming
/// registered channels can be named with them (a newcomer fixed three bad lines, then learnt
/// of a fourth).
///
/// # Errors
/// No line at all.
fn parse_keeping_bad(source: &str, text: &str) -> Result<File> {
    let mut lines = Vec::new();
    let mut bad: Vec<(usize, String)> = Vec::new();
    let mut seen: HashMap<ChannelName, usize> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let number = i + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Ok((name, entry)) => {
                if let Some(first) = seen.get(&name) {
                    bad.push((
                        number,
                        format!("channel {name} is listed twice (first on line {first})"),
                    ));
                } else {
                    seen.insert(name.clone(), number);
                    lines.push(Line {
                        number,
                        entry,
                        name,
                    });
                }
            }
            Err(why) => bad.push((number, why)),
        }
    }
    if lines.is_empty() && bad.is_empty() {
        bail!("{source}: no channels (every line is blank or a # comment); nothing was sent");
    }
    Ok(File {
        source: source.to_owned(),
        lines,
        bad,
    })
}

/// `Err` naming every bad line of `file`, if any.
///
/// # Errors
/// The bad lines.
pub fn refuse_bad(file: &File) -> Result<()> {
    refuse(&file.source, &file.bad)
}

/// `Err` naming every bad line, if any.
fn refuse(source: &str, bad: &[(usize, String)]) -> Result<()> {
    if bad.is_empty() {
        return Ok(());
    }
    let mut msg = format!(
        "{source}: {} bad line(s); nothing was registered:\n",
        bad.len()
    );
    for (n, why) in bad {
        msg += &format!("  line {n}: {why}\n");
    }
    bail!("{}", msg.trim_end())
}

/// One line: a name, or a JSON channel object.
fn parse_line(line: &str) -> Result<(ChannelName, Value), String> {
    if !line.starts_with('{') {
        let name = ChannelName::new(line).map_err(|e| format!("bad name: {e}"))?;
        return Ok((name.clone(), json!({ "name": name })));
    }
    let mut fields: Map<String, Value> = serde_json::from_str(line)
        .map_err(|e| format!("bad JSON: {e} (a line is a channel name or one JSON object)"))?;
    let name = match fields.get("name") {
        Some(Value::String(s)) => {
            ChannelName::new(s.clone()).map_err(|e| format!("bad name: {e}"))?
        }
        Some(_) => return Err("bad JSON: \"name\" is not a string".into()),
        None => return Err("bad JSON: the object has no \"name\"".into()),
    };
    if let Some(v) = fields.get("vchannel").filter(|v| !v.is_null()) {
        let v: VChannelInfo = serde_json::from_value(v.clone())
            .map_err(|e| format!("bad JSON: vchannel of {name}: {e}"))?;
        v.check_size()
            .map_err(|e| format!("value too large: channel {name}: {e}"))?;
    }
    if let Some(k) = COORDINATOR_FIELDS.iter().find(|k| fields.contains_key(**k)) {
        return Err(format!(
            "channel {name}: field {k:?} is set by the coordinator; leave it out"
        ));
    }
    let extra: Map<String, Value> = fields
        .iter()
        .filter(|(k, _)| *k != "name" && *k != "vchannel")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let extra_len = serde_json::to_vec(&extra).map_or(usize::MAX, |v| v.len());
    if extra_len > MAX_CHANNEL_EXTRA_BYTES {
        return Err(format!(
            "value too large: channel {name}: fields besides name and vchannel take \
             {extra_len} bytes; the limit is {MAX_CHANNEL_EXTRA_BYTES}"
        ));
    }
    fields.insert("name".into(), Value::String(name.to_string()));
    Ok((name, Value::Object(fields)))
}

/// Refuses the bad lines and the lines naming channels already registered (read from etcd),
/// all named together in line order.
///
/// # Errors
/// etcd unreachable, or bad lines or registered channels (every such line named).
pub async fn check_registered(file: &File, store: &dyn MetaStore, keys: &Keys) -> Result<()> {
    let range = chanwatch_store::KeyRange::prefix(keys.channels_prefix());
    let list = store.range_keys(&range).await?;
    let registered: HashSet<String> = list
        .kvs
        .iter()
        .filter_map(|kv| keys.parse_channel(&kv.key).ok())
        .map(|ck| ck.channel.to_string())
        .collect();
    let mut bad: Vec<(usize, String)> = file
        .lines
        .iter()
        .filter(|l| registered.contains(l.name.as_str()))
        .map(|l| {
            (
                l.number,
                format!("channel {} is already registered", l.name),
            )
        })
        .collect();
    bad.extend(file.bad.iter().cloned());
    bad.sort_by_key(|(n, _)| *n);
    refuse(&file.source, &bad)
}

/// The lines in lists of at most [`MAX_BULK_CHANNELS`] entries and [`MAX_LIST_BYTES`].
pub fn lists(lines: &[Line]) -> Vec<&[Line]> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (i, l) in lines.iter().enumerate() {
        let len = l.entry.to_string().len() + 1;
        if i > start && (i - start >= MAX_BULK_CHANNELS || bytes + len > MAX_LIST_BYTES) {
            out.push(&lines[start..i]);
            start = i;
            bytes = 0;
        }
        bytes += len;
    }
    if start < lines.len() {
        out.push(&lines[start..]);
    }
    out
}

/// Lists sent at once. The leader writes one list's txns at a time, off its loop, and
/// plans and queues lists that arrive meanwhile; but on the shared 2-core machine 2 and 4
/// lists at once kept etcd so busy that it timed out requests ("waiting for the applied
/// index took too long"): nodes' keepalives failed, the leader lost its lease, and queued
/// calls ran past `--timeout` (docs/BENCHMARKS.md, "Bulk lists off the leader's loop"). One at a time lets etcd catch
/// up between lists; raise it only with an etcd that has cores of its own.
pub const LISTS_IN_FLIGHT: usize = 1;

/// Sends the checked file to the leader, up to [`LISTS_IN_FLIGHT`] lists at once; the
/// summary line.
///
/// # Errors
/// The leader's refusal (refused entries named by their lines) or an unreachable leader;
/// says which lines were registered (the other lists of the file still went).
pub async fn send(file: &File, leader: &Leader, json_out: bool) -> Result<String> {
    use futures_util::StreamExt;
    let t0 = Instant::now();
    let total = file.lines.len();
    let lists = lists(&file.lines);
    let many = lists.len() > 1;
    let mut added = 0;
    let mut registered: Vec<(usize, usize)> = Vec::new();
    let mut first_error: Option<(usize, anyhow::Error)> = None;
    let mut answers = futures_util::stream::iter(lists.iter().enumerate().map(|(k, list)| {
        let body: Vec<&Value> = list.iter().map(|l| &l.entry).collect();
        async move { (k, leader.add_channels(&body).await) }
    }))
    .buffer_unordered(LISTS_IN_FLIGHT);
    while let Some((k, answer)) = answers.next().await {
        match answer {
            Ok(t) => {
                added += t.len();
                let list = lists[k];
                registered.push((list[0].number, list[list.len() - 1].number));
                if many {
                    eprintln!(
                        "add-channels: {added} of {total} registered ({:.1} s)",
                        t0.elapsed().as_secs_f64()
                    );
                }
            }
            Err(e) => {
                let earlier = match &first_error {
                    Some((j, _)) => k < *j,
                    None => true,
                };
                if earlier {
                    first_error = Some((k, e));
                }
            }
        }
    }
    drop(answers);
    if let Some((k, e)) = first_error {
        let list = lists[k];
        registered.sort_unstable();
        let done = if registered.is_empty() {
            "; nothing was registered".to_owned()
        } else {
            let spans: Vec<String> = registered.iter().map(|(a, b)| format!("{a}-{b}")).collect();
            format!(
                "; {added} channel(s) were registered (lines {}), the rest were not",
                spans.join(", ")
            )
        };
        if let Some(r) = e.downcast_ref::<Refused>() {
            let mut msg = format!(
                "the coordinator refused the list of lines {}-{} ({}){done}:\n",
                list[0].number,
                list[list.len() - 1].number,
                r.status
            );
            for (i, why) in &r.refused {
                let line = list.get(*i).map_or(0, |l| l.number);
                msg += &format!("  line {line}: {why}\n");
            }
            if r.refused.is_empty() {
                msg += &format!("  {}\n", r.message);
            }
            bail!("{}", msg.trim_end());
        }
        return Err(e.context(format!("sending {}{done}", file.source)));
    }
    let secs = t0.elapsed().as_secs_f64();
    Ok(if json_out {
        format!(
            "{}\n",
            json!({ "added": added, "seconds": (secs * 1000.0).round() / 1000.0 })
        )
    } else {
        format!("added {added} channel(s) in {secs:.2} s\n")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names, JSON objects, blank lines and comments; every bad line is named with its
    /// number and why, and no channel is returned.
    #[test]
    fn every_bad_line_is_named_with_its_number_and_why() {
        let big = "x".repeat(70 * 1024);
        let text = format!(
            "# channels\nc1\n\n{{\"name\":\"c2\",\"vchannel\":{{\"collection_id\":7}},\"weight\":2}}\n\
             bad name\n{{\"name\": \"c3\"\nc1\n{{\"name\":\"c4\",\"vchannel\":{{\"seek_position\":\"{big}\"}}}}\n\
             {{\"vchannel\":{{}}}}\n   # indented comment\nc5\n"
        );
        let e = parse("f.txt", &text).expect_err("bad lines").to_string();
        assert!(
            e.starts_with("f.txt: 5 bad line(s); nothing was registered"),
            "{e}"
        );
        for (line, why) in [
            (5, "line 5: bad name"),
            (6, "line 6: bad JSON"),
            (7, "line 7: channel c1 is listed twice (first on line 2)"),
            (8, "line 8: value too large"),
            (9, "line 9: bad JSON: the object has no \"name\""),
        ] {
            assert!(e.contains(why), "line {line}: {e}");
        }
        assert!(
            !e.contains("line 2:") && !e.contains("line 4:") && !e.contains("line 11:"),
            "{e}"
        );
    }

    /// A good file: names become `{"name": …}`, objects keep every field.
    #[test]
    fn names_and_objects_become_channel_objects() -> Result<()> {
        let f = parse("-", "a\n{\"name\":\"b\",\"weight\":3}\n# c\n")?;
        let entries: Vec<&Value> = f.lines.iter().map(|l| &l.entry).collect();
        assert_eq!(
            entries,
            [&json!({"name":"a"}), &json!({"name":"b","weight":3})]
        );
        assert_eq!(f.lines[1].number, 2);
        Ok(())
    }

    /// Long files go in lists of at most 10,000.
    #[test]
    fn long_files_are_split_into_lists_of_at_most_ten_thousand() -> Result<()> {
        let text: String = (0..25_001).map(|i| format!("c{i}\n")).collect();
        let f = parse("-", &text)?;
        let sizes: Vec<usize> = lists(&f.lines).iter().map(|l| l.len()).collect();
        assert_eq!(sizes, [10_000, 10_000, 5_001]);
        Ok(())
    }
}
