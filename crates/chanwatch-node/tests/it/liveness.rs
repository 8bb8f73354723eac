//! A node waits out what etcd does to it (DESIGN §6 invariant 10): a NOSPACE alarm at
//! start-up, an auth-enabled etcd restarted under it with its token expired.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Epoch, Keys, VChannelInfo,
};
use chanwatch_node::{NodeConfig, NodeError, NodeMetrics, NodeStatus, RecordingHandler};
use chanwatch_store::{Clock, EtcdConfig, EtcdStore, MetaStore, Txn, TxnOp};
use chanwatch_testkit::{EtcdFixture, EtcdOptions};
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;

const ROOT: &str = "cw";

/// A node runtime in a task, with its status and a way to stop it.
struct Node {
    status: watch::Receiver<NodeStatus>,
    metrics: Arc<NodeMetrics>,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), NodeError>>,
}

impl Node {
    fn spawn(store: Arc<dyn MetaStore>) -> Node {
        let metrics = Arc::new(NodeMetrics::new());
        let config = NodeConfig {
            keys: keys(),
            session_ttl: Duration::from_secs(10),
            metrics: metrics.clone(),
            ..NodeConfig::default()
        };
        let (status_tx, status) = watch::channel(NodeStatus::default());
        let (stop, stopped) = oneshot::channel::<()>();
        let clock = Clock::system();
        let handler = Arc::new(RecordingHandler::new(clock));
        let task = tokio::spawn(chanwatch_node::run(
            store,
            handler,
            config,
            clock,
            status_tx,
            async {
                let _ = stopped.await;
            },
        ));
        Node {
            status,
            metrics,
            stop: Some(stop),
            task,
        }
    }

    fn alarm(&self, kind: &str) -> i64 {
        self.metrics.etcd_alarm.with_label_values(&[kind]).get()
    }

    /// Fails if the node's `run` returned: it must never exit on its own.
    fn ensure_running(&self) -> Result<()> {
        ensure!(!self.task.is_finished(), "the node exited");
        Ok(())
    }

    async fn wait_for(
        &mut self,
        what: &str,
        limit: Duration,
        ok: impl Fn(&NodeStatus) -> bool,
    ) -> Result<NodeStatus> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let s = self.status.borrow().clone();
            if ok(&s) {
                return Ok(s);
            }
            if self.task.is_finished() {
                let r = (&mut self.task).await?;
                bail!("the node exited while waiting for {what}: {r:?}");
            }
            if tokio::time::Instant::now() > deadline {
                bail!("no {what} within {limit:?}: {s:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        tokio::time::timeout(Duration::from_secs(10), self.task)
            .await
            .context("the node did not stop")??
            .context("the node's run ended with an error")
    }
}

fn keys() -> Keys {
    Keys::new(ROOT).unwrap_or_default()
}

fn config(fixture: &EtcdFixture, user: Option<(&str, &str)>) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
        probe_key: Some(keys().node_id_counter()),
        connect_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(3),
        ..EtcdConfig::default()
    }
}

/// Assigns `channel` to `node` as the coordinator would (through `etcdctl`, which
/// authenticates afresh each time, so only the node's own connection is under test), and
/// waits until the node acks it `Watched`.
async fn assign_and_wait_for_ack(
    fixture: &EtcdFixture,
    node: chanwatch_core::NodeId,
    channel: &str,
) -> Result<()> {
    let name = ChannelName::new(channel)?;
    let key = keys().channel(ChannelOwner::Node(node), &name);
    let info = ChannelInfo::new(name, Epoch(1), 0, VChannelInfo::default());
    let value = String::from_utf8(info.encode())?;
    fixture.etcdctl(&["put", &key, &value])?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let out = fixture.etcdctl(&["get", "--print-value-only", &key])?;
        if let Ok(info) = ChannelInfo::decode(out.trim().as_bytes()) {
            if info.state == ChannelState::Watched {
                return Ok(());
            }
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{key} not acknowledged Watched within 10 s: {out}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_during_nospace_waits_and_registers_once_the_alarm_is_disarmed() -> Result<()>
{
    let fixture = EtcdFixture::start_with(EtcdOptions {
        quota_backend_bytes: Some(300_000),
        ..EtcdOptions::default()
    })
    .await?;
    let store: Arc<dyn MetaStore> = Arc::new(EtcdStore::connect(config(&fixture, None)).await?);
    // Fill the quota with history (one key overwritten), as a busy cluster does.
    for i in 0..200u8 {
        let put = Txn::new().and_then([TxnOp::put("filler", vec![b'a' + i % 26; 20_000])]);
        if store.txn(put).await.is_err() {
            break;
        }
    }
    let alarms = fixture.etcdctl(&["alarm", "list"])?;
    ensure!(
        alarms.contains("NOSPACE"),
        "etcd never raised NOSPACE: {alarms}"
    );

    let mut node = Node::spawn(store.clone());
    // It cannot allocate an ID or grant a lease: it waits, says why, and shows the alarm.
    tokio::time::sleep(Duration::from_secs(3)).await;
    node.ensure_running()?;
    ensure!(
        node.status.borrow().sessions == 0,
        "registered during NOSPACE?"
    );
    ensure!(
        node.alarm("NOSPACE") == 1,
        "chanwatch_etcd_alarm{{type=\"NOSPACE\"}} is 1"
    );

    fixture.free_space_and_disarm()?;
    let s = node
        .wait_for("a session after the disarm", Duration::from_secs(15), |s| {
            s.id.is_some()
        })
        .await?;
    let id = s.id.context("id")?;
    ensure!(s.sessions == 1);
    assign_and_wait_for_ack(&fixture, id, "c1").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while node.alarm("NOSPACE") != 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the NOSPACE gauge did not clear"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    node.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_keeps_its_session_across_an_auth_etcd_restart_with_its_token_expired() -> Result<()>
{
    let mut fixture = EtcdFixture::start_with(EtcdOptions {
        root_password: Some("rootpw".into()),
        // Tokens expire after 2 s idle (300 s by default), so the node's token is dead when
        // etcd comes back, as after a restart from a snapshot.
        extra_args: vec!["--auth-token-ttl=2".into()],
        ..EtcdOptions::default()
    })
    .await?;
    // The node's role from docs/OPERATING.md's "etcd users and roles".
    fixture.add_user_with_role(
        "cw-node",
        "nodepw",
        &[
            ("readwrite", "cw/id/node"),
            ("readwrite", "cw/session/node/"),
            ("readwrite", "cw/channel/"),
            ("readwrite", "cw/worker/checkpoint/"),
        ],
    )?;
    let node_store: Arc<dyn MetaStore> =
        Arc::new(EtcdStore::connect(config(&fixture, Some(("cw-node", "nodepw")))).await?);

    let mut node = Node::spawn(node_store);
    let s = node
        .wait_for("a session", Duration::from_secs(10), |s| s.id.is_some())
        .await?;
    let id = s.id.context("id")?;
    assign_and_wait_for_ack(&fixture, id, "before").await?;

    fixture.restart().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    node.ensure_running()?;

    // It still serves under the same session: a new assignment is seen and acknowledged,
    // which needs a watch and a txn, i.e. a fresh token.
    assign_and_wait_for_ack(&fixture, id, "after").await?;
    let s = node.status.borrow().clone();
    ensure!(
        s.id == Some(id) && s.sessions == 1 && s.fences == 0,
        "same session, no fence: {s:?}"
    );
    node.stop().await
}
