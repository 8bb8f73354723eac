//! Tests of the node machine: the exact commands it emits for each transition of DESIGN §3.

use super::*;
use crate::types::VChannelInfo;

fn info(ch: &str, state: ChannelState, epoch: u64) -> ChannelInfo {
    let mut i = ChannelInfo::new(
        ChannelName::new(ch).expect("valid"),
        Epoch(epoch),
        0,
        VChannelInfo::default(),
    );
    i.state = state;
    i
}
fn name(s: &str) -> ChannelName {
    ChannelName::new(s).expect("valid")
}

#[test]
fn an_assignment_whose_value_names_another_channel_is_refused() {
    let keys = Keys::default();
    let other = info("other", ChannelState::ToWatch, 1).encode();
    let err = decode_assignment(&keys, "chanwatch/channel/1/bad2", &other)
        .expect_err("key and value disagree");
    assert!(
        matches!(&err, BadAssignment::Mismatch { key, value }
            if key.as_str() == "bad2" && value.as_str() == "other"),
        "{err:?}"
    );
    assert!(err.to_string().contains("bad2"), "{err}");
    let (ck, i) =
        decode_assignment(&keys, "chanwatch/channel/1/other", &other).expect("key and value agree");
    assert_eq!((ck.channel, i.channel), (name("other"), name("other")));
    assert!(matches!(
        decode_assignment(&keys, "chanwatch/channel/1/x", b"{nope"),
        Err(BadAssignment::Value(_))
    ));
    assert!(matches!(
        decode_assignment(&keys, "chanwatch/channel/1/a/b", &other),
        Err(BadAssignment::Key(_))
    ));
}

#[test]
fn a_running_channel_reported_broken_stops_first_then_acks_watch_failed() {
    let mut m = NodeMachine::new();
    let a = info("a", ChannelState::ToWatch, 1);
    m.step(NodeEvent::Put {
        info: a.clone(),
        mod_revision: 10,
    });
    m.step(NodeEvent::LoadDone {
        channel: name("a"),
        epoch: Epoch(1),
        result: Ok(()),
    });
    m.step(NodeEvent::AckDone {
        channel: name("a"),
        committed: Some(11),
    });
    let broke = |epoch: u64, why: &str| NodeEvent::Broke {
        channel: name("a"),
        epoch: Epoch(epoch),
        reason: why.to_owned(),
    };
    assert_eq!(m.step(broke(0, "old run")), vec![], "another epoch");
    assert_eq!(
        m.step(broke(1, "disk full")),
        vec![NodeCommand::Stop { channel: name("a") }]
    );
    // The echo of our own Watched ack arrives while it stops: no restart.
    let mut watched = a.clone();
    watched.state = ChannelState::Watched;
    assert_eq!(
        m.step(NodeEvent::Put {
            info: watched.clone(),
            mod_revision: 11
        }),
        vec![]
    );
    // Stopped: only now WatchFailed, against the revision last seen.
    let mut failed = watched;
    failed.state = ChannelState::WatchFailed;
    failed.reason = Some("disk full".into());
    assert_eq!(
        m.step(NodeEvent::Stopped { channel: name("a") }),
        vec![NodeCommand::Ack {
            info: failed,
            expect_mod_revision: 11
        }]
    );
    assert_eq!(m.channels()[&name("a")].phase, Phase::Failed);
    assert_eq!(m.step(broke(1, "again")), vec![], "not running any more");
}

/// A run reported broken while it still loads (an `--exec` worker's `/fail` or exit that
/// came just around its `/ready`) is not acknowledged `Watched` when its load succeeds: it is
/// stopped, then `WatchFailed` with the first reason. A load that fails says its own reason.
#[test]
fn a_channel_reported_broken_while_loading_is_stopped_when_the_load_returns() {
    let mut m = NodeMachine::new();
    let a = info("a", ChannelState::ToWatch, 1);
    m.step(NodeEvent::Put {
        info: a.clone(),
        mod_revision: 10,
    });
    let broke = |epoch: u64, why: &str| NodeEvent::Broke {
        channel: name("a"),
        epoch: Epoch(epoch),
        reason: why.to_owned(),
    };
    assert_eq!(
        m.step(broke(1, "worker: no disk")),
        vec![],
        "waits for the load"
    );
    assert_eq!(m.step(broke(1, "the worker exited")), vec![]);
    assert_eq!(m.channels()[&name("a")].phase, Phase::Loading);
    assert_eq!(
        m.step(NodeEvent::Progress {
            channel: name("a"),
            epoch: Epoch(1),
            progress: crate::types::Progress {
                percent: 50,
                updated_at_ms: 1000,
            },
        }),
        vec![],
        "a load reported broken gets no more time from its progress"
    );
    assert_eq!(
        m.step(NodeEvent::LoadDone {
            channel: name("a"),
            epoch: Epoch(1),
            result: Ok(()),
        }),
        vec![NodeCommand::Stop { channel: name("a") }],
        "stopped, not acknowledged Watched"
    );
    let mut failed = a.clone();
    failed.state = ChannelState::WatchFailed;
    failed.reason = Some("worker: no disk".into());
    assert_eq!(
        m.step(NodeEvent::Stopped { channel: name("a") }),
        vec![NodeCommand::Ack {
            info: failed,
            expect_mod_revision: 10
        }]
    );
    assert_eq!(m.channels()[&name("a")].phase, Phase::Failed);

    // The same, the load failing: its own reason, at once.
    let b = info("b", ChannelState::ToWatch, 1);
    m.step(NodeEvent::Put {
        info: b.clone(),
        mod_revision: 20,
    });
    m.step(NodeEvent::Broke {
        channel: name("b"),
        epoch: Epoch(1),
        reason: "worker: no disk".into(),
    });
    let mut failed = b;
    failed.state = ChannelState::WatchFailed;
    failed.reason = Some("worker: no disk (POST /fail before POST /ready)".into());
    assert_eq!(
        m.step(NodeEvent::LoadDone {
            channel: name("b"),
            epoch: Epoch(1),
            result: Err("worker: no disk (POST /fail before POST /ready)".into()),
        }),
        vec![NodeCommand::Ack {
            info: failed,
            expect_mod_revision: 20
        }]
    );
    assert_eq!(m.channels()[&name("b")].broken, None);
}

#[test]
fn a_broken_channel_moved_away_while_stopping_acks_released_not_failed() {
    let mut m = NodeMachine::new();
    let a = info("a", ChannelState::Watched, 1);
    m.step(NodeEvent::Put {
        info: a.clone(),
        mod_revision: 10,
    });
    m.step(NodeEvent::LoadDone {
        channel: name("a"),
        epoch: Epoch(1),
        result: Ok(()),
    });
    m.step(NodeEvent::Broke {
        channel: name("a"),
        epoch: Epoch(1),
        reason: "x".into(),
    });
    let mut release = a.clone();
    release.state = ChannelState::ToRelease;
    assert_eq!(
        m.step(NodeEvent::Put {
            info: release.clone(),
            mod_revision: 12
        }),
        vec![]
    );
    let mut released = release;
    released.state = ChannelState::Released;
    assert_eq!(
        m.step(NodeEvent::Stopped { channel: name("a") }),
        vec![NodeCommand::Ack {
            info: released,
            expect_mod_revision: 12
        }]
    );
}

#[test]
fn to_watch_starts_then_acks_watched_against_the_revision_seen() {
    let mut m = NodeMachine::new();
    let a = info("a", ChannelState::ToWatch, 1);
    assert_eq!(
        m.step(NodeEvent::Put {
            info: a.clone(),
            mod_revision: 10
        }),
        vec![NodeCommand::Start { info: a.clone() }]
    );
    let mut watched = a.clone();
    watched.state = ChannelState::Watched;
    assert_eq!(
        m.step(NodeEvent::LoadDone {
            channel: name("a"),
            epoch: Epoch(1),
            result: Ok(())
        }),
        vec![NodeCommand::Ack {
            info: watched.clone(),
            expect_mod_revision: 10
        }]
    );
    assert_eq!(
        m.step(NodeEvent::AckDone {
            channel: name("a"),
            committed: Some(11)
        }),
        vec![]
    );
    // The echo of our own ack changes nothing.
    assert_eq!(
        m.step(NodeEvent::Put {
            info: watched,
            mod_revision: 11
        }),
        vec![]
    );
    assert_eq!(m.channels()[&name("a")].phase, Phase::Running);
}

#[test]
fn a_failed_load_acks_watch_failed_with_the_reason() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 1),
        mod_revision: 5,
    });
    let cmds = m.step(NodeEvent::LoadDone {
        channel: name("a"),
        epoch: Epoch(1),
        result: Err("disk full".into()),
    });
    let mut failed = info("a", ChannelState::WatchFailed, 1);
    failed.reason = Some("disk full".into());
    assert_eq!(
        cmds,
        vec![NodeCommand::Ack {
            info: failed,
            expect_mod_revision: 5
        }]
    );
}

#[test]
fn progress_is_written_only_while_loading_the_current_epoch() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 2),
        mod_revision: 5,
    });
    let p = Progress {
        percent: 40,
        updated_at_ms: 1000,
    };
    let cmds = m.step(NodeEvent::Progress {
        channel: name("a"),
        epoch: Epoch(2),
        progress: p.clone(),
    });
    assert!(
        matches!(&cmds[..], [NodeCommand::Ack { info, expect_mod_revision: 5 }] if info.progress == Some(p.clone()))
    );
    assert_eq!(
        m.step(NodeEvent::Progress {
            channel: name("a"),
            epoch: Epoch(1),
            progress: p
        }),
        vec![]
    );
}

#[test]
fn to_release_stops_then_acks_released() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 1),
        mod_revision: 5,
    });
    m.step(NodeEvent::LoadDone {
        channel: name("a"),
        epoch: Epoch(1),
        result: Ok(()),
    });
    let rel = info("a", ChannelState::ToRelease, 1);
    assert_eq!(
        m.step(NodeEvent::Put {
            info: rel,
            mod_revision: 9
        }),
        vec![NodeCommand::Stop { channel: name("a") }]
    );
    let cmds = m.step(NodeEvent::Stopped { channel: name("a") });
    assert_eq!(
        cmds,
        vec![NodeCommand::Ack {
            info: info("a", ChannelState::Released, 1),
            expect_mod_revision: 9
        }]
    );
}

#[test]
fn delete_during_a_load_stops_it_at_once_and_a_late_load_result_is_ignored() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 1),
        mod_revision: 5,
    });
    assert_eq!(
        m.step(NodeEvent::Delete { channel: name("a") }),
        vec![NodeCommand::Stop { channel: name("a") }]
    );
    assert_eq!(
        m.step(NodeEvent::LoadDone {
            channel: name("a"),
            epoch: Epoch(1),
            result: Ok(())
        }),
        vec![]
    );
    assert!(m.channels().is_empty());
}

#[test]
fn a_new_epoch_restarts_the_channel_and_drops_the_old_load() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 1),
        mod_revision: 5,
    });
    let a2 = info("a", ChannelState::ToWatch, 2);
    assert_eq!(
        m.step(NodeEvent::Put {
            info: a2.clone(),
            mod_revision: 8
        }),
        vec![
            NodeCommand::Stop { channel: name("a") },
            NodeCommand::Start { info: a2 }
        ]
    );
    assert_eq!(
        m.step(NodeEvent::LoadDone {
            channel: name("a"),
            epoch: Epoch(1),
            result: Ok(())
        }),
        vec![]
    );
}

#[test]
fn a_relist_never_restarts_an_epoch_this_node_reported_failed() {
    let mut m = NodeMachine::new();
    let a = info("a", ChannelState::ToWatch, 3);
    m.step(NodeEvent::Put {
        info: a.clone(),
        mod_revision: 10,
    });
    let out = m.step(NodeEvent::LoadDone {
        channel: name("a"),
        epoch: Epoch(3),
        result: Err("disk".into()),
    });
    assert!(
        matches!(&out[..], [NodeCommand::Ack { info, .. }] if info.state == ChannelState::WatchFailed)
    );
    // The ack is slow; a relist still shows ToWatch at epoch 3: no restart, ack again.
    let out = m.reset(vec![(a.clone(), 10)]);
    assert!(
        !out.iter().any(|c| matches!(c, NodeCommand::Start { .. })),
        "{out:?}"
    );
    assert!(
        matches!(&out[..], [NodeCommand::Ack { info, .. }] if info.state == ChannelState::WatchFailed)
    );
    // A new epoch (a retry here after the back-off) starts again.
    let out = m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 4),
        mod_revision: 12,
    });
    assert!(matches!(&out[..], [NodeCommand::Start { .. }]), "{out:?}");
}

#[test]
fn relist_deletes_what_is_gone_and_starts_what_is_new() {
    let mut m = NodeMachine::new();
    m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToWatch, 1),
        mod_revision: 5,
    });
    let b = info("b", ChannelState::ToWatch, 1);
    let cmds = m.reset(vec![(b.clone(), 7)]);
    assert_eq!(
        cmds,
        vec![
            NodeCommand::Stop { channel: name("a") },
            NodeCommand::Start { info: b }
        ]
    );
}

#[test]
fn to_release_of_a_channel_not_running_acks_released_at_once() {
    let mut m = NodeMachine::new();
    let cmds = m.step(NodeEvent::Put {
        info: info("a", ChannelState::ToRelease, 3),
        mod_revision: 5,
    });
    assert_eq!(
        cmds,
        vec![NodeCommand::Ack {
            info: info("a", ChannelState::Released, 3),
            expect_mod_revision: 5
        }]
    );
}
