//! `chanwatch ctl`: reads state straight from etcd and sends changes to the leader's admin
//! API (its address is in `{root}/coord/leader`).
//!
//! Owns: presentation (tables, `--json`) and the HTTP calls.
//! Must not: write to etcd: only the coordinator writes assignments.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use chanwatch_core::planner::{ChannelRow, NodeRow, Planner, PlannerConfig};
use chanwatch_core::{ChannelName, CoordSession, Keys, VChannelInfo};
use serde_json::{json, Value};

use clap::{Args as ClapArgs, Subcommand};

use crate::flags::{EtcdArgs, RootArg};

mod live;

/// Flags of `ctl`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Bearer token for the leader's admin API, when it requires one.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    #[command(subcommand)]
    pub what: Command,
}

/// What `ctl` does.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List channels: channel, node (or remaining), state, epoch, age, and whether the node
    /// says it has paused them (asked over its admin HTTP; etcd cannot know).
    Channels {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List live nodes, their channel counts and status (running, PAUSED, ? when the node
    /// did not answer its `/status`).
    Nodes {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Register a channel; the leader assigns it to the least-loaded node.
    AddChannel {
        /// Channel name: 1-255 characters of [A-Za-z0-9._-].
        name: String,
        /// What a node needs to restore it, as JSON (at most 64 KiB), e.g.
        /// '{"collection_id":7,"seek_position":"..."}'.
        #[arg(long)]
        vchannel: Option<String>,
    },
    /// Remove a channel; its node stops it at once.
    RemoveChannel {
        /// Channel name.
        name: String,
    },
    /// Move a channel to a node (break-before-make).
    Move {
        /// Channel name.
        name: String,
        /// Target node ID.
        #[arg(long)]
        to: u64,
    },
    /// Move every channel off a node and stop assigning to it.
    Drain {
        /// Node ID.
        node: u64,
    },
    /// Even out channels over nodes (max - min <= 1).
    Balance {
        /// Print the plan (channel, from, to) without moving anything.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

pub async fn run(args: Args) -> Result<()> {
    let keys = args.root.keys()?;
    // Validate input before touching the network.
    match &args.what {
        Command::AddChannel { name, vchannel } => {
            ChannelName::new(name.as_str()).map_err(|e| anyhow!("{e}"))?;
            if let Some(v) = vchannel {
                VChannelInfo::from_json(v.as_bytes()).map_err(|e| anyhow!("--vchannel: {e}"))?;
            }
        }
        Command::RemoveChannel { name } | Command::Move { name, .. } => {
            ChannelName::new(name.as_str()).map_err(|e| anyhow!("{e}"))?;
        }
        _ => {}
    }
    let store = args.etcd.connect_under(&keys).await?;
    let token = args.admin_token.clone();
    let send = |method: reqwest::Method, path: String, body: Option<Value>| {
        let store = store.clone();
        let keys = keys.clone();
        let token = token.clone();
        async move { call(&*store, &keys, token.as_deref(), method, &path, body).await }
    };
    match args.what {
        Command::Channels { json } => {
            let (state, _) = snapshot(&*store, &keys).await?;
            let rows = state.channel_rows();
            let live = live::ask(&state.node_rows()).await;
            if json {
                let out = live::channels_json(&rows, &live);
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print_channels(&rows, &live);
            }
            report_corrupt(&state);
        }
        Command::Nodes { json } => {
            let (state, _) = snapshot(&*store, &keys).await?;
            let rows = state.node_rows();
            let live = live::ask(&rows).await;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&live::nodes_json(&rows, &live))?
                );
            } else {
                print_nodes(&rows, &live);
            }
        }
        Command::AddChannel { name, vchannel } => {
            let vchannel: Value = match vchannel {
                Some(v) => serde_json::from_str(&v).context("--vchannel is not JSON")?,
                None => Value::Null,
            };
            let mut body = json!({ "name": name });
            if !vchannel.is_null() {
                body["vchannel"] = vchannel;
            }
            let out = send(
                reqwest::Method::POST,
                "/api/v1/channels".to_string(),
                Some(body),
            )
            .await?;
            print_transitions(&out);
        }
        Command::RemoveChannel { name } => {
            let out = send(
                reqwest::Method::DELETE,
                format!("/api/v1/channels/{name}"),
                None,
            )
            .await?;
            print_transitions(&out);
        }
        Command::Move { name, to } => {
            let path = format!("/api/v1/channels/{name}/move");
            let out = send(reqwest::Method::POST, path, Some(json!({ "to": to }))).await?;
            print_transitions(&out);
        }
        Command::Drain { node } => {
            send(
                reqwest::Method::POST,
                format!("/api/v1/nodes/{node}/drain"),
                None,
            )
            .await?;
            println!("node {node} is draining: its channels move off, break-before-make");
        }
        Command::Balance { dry_run, json } => {
            let path = format!("/api/v1/balance?dry_run={dry_run}");
            let out = send(reqwest::Method::POST, path, None).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&out["moves"])?);
            } else {
                let moves = out["moves"].as_array().cloned().unwrap_or_default();
                if moves.is_empty() {
                    println!("balanced: nothing to move");
                } else {
                    println!("{:<32} {:>8} {:>8}", "CHANNEL", "FROM", "TO");
                    for m in &moves {
                        println!(
                            "{:<32} {:>8} {:>8}",
                            m["channel"].as_str().unwrap_or("?"),
                            m["from"],
                            m["to"]
                        );
                    }
                    println!(
                        "{} move(s){}",
                        moves.len(),
                        if dry_run {
                            " planned (dry run: nothing moved)"
                        } else {
                            " started"
                        }
                    );
                }
            }
        }
    }
    Ok(())
}

async fn snapshot(store: &dyn chanwatch_store::MetaStore, keys: &Keys) -> Result<(Planner, i64)> {
    let list = store.range(&keys.all_prefix()).await?;
    let mut state = Planner::new(keys.clone(), PlannerConfig::default());
    state.reset(
        list.kvs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
    );
    Ok((state, list.revision))
}

fn report_corrupt(state: &Planner) {
    for (key, why) in state.corrupt() {
        eprintln!("warning: {key} does not decode ({why}); the coordinator leaves it alone");
    }
}

/// Sends a request to the leader's admin API.
async fn call(
    store: &dyn chanwatch_store::MetaStore,
    keys: &Keys,
    token: Option<&str>,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> Result<Value> {
    let leader = store.get(&keys.leader()).await?.ok_or_else(|| {
        anyhow!(
            "no coordinator is leader ({} is absent); start `chanwatch coord`",
            keys.leader()
        )
    })?;
    let session = CoordSession::decode(&leader.value)
        .map_err(|e| anyhow!("{} does not decode: {e}", keys.leader()))?;
    let url = format!("http://{}{}", session.admin_addr, path);
    let client = reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(30))
        .build()?;
    let mut req = client.request(method.clone(), &url);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    // The API refuses a write without this content type (no cross-site form posts), bodiless
    // ones included.
    if method != reqwest::Method::GET {
        req = req.header(reqwest::header::CONTENT_TYPE, "application/json");
    }
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("leader's admin API unreachable at {url}"))?;
    let status = resp.status();
    let value: Value = resp.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        let msg = value["error"].as_str().unwrap_or("no error message");
        bail!("the coordinator refused ({status}): {msg}");
    }
    Ok(value)
}

fn print_transitions(v: &Value) {
    for t in v.as_array().cloned().unwrap_or_default() {
        let to = match &t["to"] {
            Value::Null => "-".to_owned(),
            other => other.to_string().trim_matches('"').to_owned(),
        };
        let state = t["state"].as_str().unwrap_or("deleted");
        println!(
            "{} {}: node {} -> {} ({}, epoch {})",
            t["cause"].as_str().unwrap_or("?"),
            t["channel"].as_str().unwrap_or("?"),
            match &t["from"] {
                Value::Null => "-".to_owned(),
                other => other.to_string().trim_matches('"').to_owned(),
            },
            to,
            state,
            t["epoch"]
        );
    }
}

fn age(ms: u64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let secs = now.saturating_sub(ms) / 1000;
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn print_channels(rows: &[ChannelRow], live: &BTreeMap<u64, live::Live>) {
    println!(
        "{:<32} {:>10} {:<12} {:>6} {:>6} {:<8}",
        "CHANNEL", "NODE", "STATE", "EPOCH", "AGE", "NODE SAYS"
    );
    for r in rows {
        let node = r
            .node
            .map_or_else(|| "remaining".to_owned(), |n| n.to_string());
        let says = r
            .node
            .and_then(|n| live.get(&n))
            .map_or("", live::Live::cell);
        println!(
            "{:<32} {:>10} {:<12} {:>6} {:>6} {:<8}",
            r.channel.as_str(),
            node,
            r.state.as_str(),
            r.epoch,
            age(r.start_time_ms),
            says
        );
    }
    println!("{} channel(s)", rows.len());
    print_paused(live);
}

fn print_nodes(rows: &[NodeRow], live: &BTreeMap<u64, live::Live>) {
    println!(
        "{:>8} {:<24} {:>8} {:>8} {:<8} {:<8}",
        "ID", "ADMIN", "CHANNELS", "AGE", "STATUS", ""
    );
    for r in rows {
        println!(
            "{:>8} {:<24} {:>8} {:>8} {:<8} {:<8}",
            r.id,
            r.admin_addr,
            r.channels,
            age(r.started_at_ms),
            live.get(&r.id).map_or("", live::Live::cell),
            if r.draining { "draining" } else { "" }
        );
    }
    println!("{} node(s)", rows.len());
    print_paused(live);
}

/// One line per node that is paused or did not say, with why (the table has no room).
fn print_paused(live: &BTreeMap<u64, live::Live>) {
    for (id, l) in live {
        match l {
            live::Live::Paused(why) => println!("node {id} has paused its channels: {why}"),
            live::Live::Unknown(why) => println!("node {id}: status unknown ({why})"),
            live::Live::Running => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use chanwatch_store::{EmbeddedStore, MetaStore};
    use reqwest::Method;

    use super::*;

    /// ctl's writes pass the admin API's cross-site guard: the leader's advertised address as
    /// `Host`, and the JSON content type on every write, bodiless POSTs and DELETEs included
    /// (without it they got 415).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ctl_writes_pass_the_admin_apis_cross_site_guard() -> Result<()> {
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let handle = chanwatch_coord::Coordinator::builder(store.clone())
            .admin_addr(listener.local_addr()?.to_string())
            .session_ttl(Duration::from_secs(3))
            .spawn()?;
        let router = chanwatch_coord::api::router(
            handle.clone(),
            chanwatch_coord::api::ApiOptions::default(),
        );
        tokio::spawn(chanwatch_coord::api::serve(
            listener,
            router,
            std::future::pending(),
        ));
        let mut ready = handle.watch_status();
        tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
        let keys = Keys::default();
        let store = &*store;
        let add = Some(json!({ "name": "c1" }));
        let out = call(store, &keys, None, Method::POST, "/api/v1/channels", add).await?;
        assert_eq!(out[0]["channel"], json!("c1"), "{out}");
        let path = "/api/v1/balance?dry_run=true";
        let out = call(store, &keys, None, Method::POST, path, None).await?;
        assert_eq!(out["dry_run"], json!(true), "{out}");
        let path = "/api/v1/channels/c1";
        call(store, &keys, None, Method::DELETE, path, None).await?;
        // Refused for what it asks (no node 9), not for how it asks.
        let path = "/api/v1/nodes/9/drain";
        let e = call(store, &keys, None, Method::POST, path, None)
            .await
            .expect_err("node 9 does not exist");
        assert!(e.to_string().contains("not alive"), "{e}");
        Ok(())
    }
}
