//! Unit tests of `ctl status`.

use super::*;

fn report() -> Report {
    Report {
        leader: Some(Coord {
            id: "c1".into(),
            admin_addr: "127.0.0.1:9870".into(),
            since_ms: 40_000,
        }),
        standbys: vec![Coord {
            id: "c2".into(),
            admin_addr: "127.0.0.1:9872".into(),
            since_ms: 50_000,
        }],
        etcd: vec![
            Endpoint {
                endpoint: "http://a:2379".into(),
                healthy: true,
                error: None,
                member_id: "8e9e05c52164694d".into(),
                version: "3.4.23".into(),
                raft_leader: "8e9e05c52164694d".into(),
                is_leader: true,
                raft_term: 2,
                raft_index: 99,
                db_size: 8 * 1024 * 1024,
                db_size_in_use: 4 * 1024 * 1024,
                quota: 32 * 1024 * 1024,
                quota_source: "metrics",
                is_learner: false,
                errors: vec![],
            },
            Endpoint {
                error: Some("connection refused".into()),
                ..Endpoint::unasked("http://b:2379".into(), DEFAULT_QUOTA)
            },
        ],
        alarms: vec!["NOSPACE on member 8e9e05c52164694d".into()],
        drains: vec![3],
        fenced: vec![],
        paused: vec![NodeNote {
            node: 2,
            why: "etcd unreachable".into(),
        }],
        unknown: vec![],
        nodes: 3,
        channels: [("Watched".to_owned(), 7), ("remaining".to_owned(), 1)]
            .into_iter()
            .collect(),
        channels_total: 8,
        compaction: Some(Compaction {
            revision: 120,
            written_at_revision: 130,
        }),
        revision: 140,
    }
}

#[test]
fn the_table_shows_each_part_with_db_size_against_quota() -> Result<()> {
    let text = render(&report(), Format::Table, 100_000)?;
    assert!(
        text.contains("Leader:      c1  127.0.0.1:9870  since 60s ago"),
        "{text}"
    );
    assert!(
        text.contains("Standbys:    c2  127.0.0.1:9872  since 50s ago"),
        "{text}"
    );
    assert!(text.contains("8.0 MiB  32.0 MiB  25.0%"), "{text}");
    assert!(text.contains("http://b:2379  DOWN"), "{text}");
    assert!(text.contains("http://b:2379: connection refused"), "{text}");
    assert!(text.contains("Alarms:      NOSPACE on member"), "{text}");
    assert!(text.contains("Draining:    3\n"), "{text}");
    assert!(text.contains("Paused:      2 (etcd unreachable)"), "{text}");
    assert!(
        text.contains("Channels:    8 (ToWatch 0, Watched 7"),
        "{text}"
    );
    assert!(text.contains("remaining 1)"), "{text}");
    assert!(
        text.contains(
            "Compacted:   to revision 120 (written at revision 130; the store is at 140)"
        ),
        "{text}"
    );
    let wide = render(&report(), Format::Wide, 100_000)?;
    assert!(
        wide.contains("QUOTA FROM") && wide.contains("metrics"),
        "{wide}"
    );
    Ok(())
}

#[test]
fn json_and_yaml_carry_the_same_fields() -> Result<()> {
    let json: serde_json::Value = serde_json::from_str(&render(&report(), Format::Json, 0)?)?;
    assert_eq!(json["etcd"][0]["quota"], 32 * 1024 * 1024);
    assert_eq!(json["etcd"][0]["quota_source"], "metrics");
    assert_eq!(json["leader"]["id"], "c1");
    let yaml: serde_json::Value = serde_yaml_ng::from_str(&render(&report(), Format::Yaml, 0)?)?;
    assert_eq!(yaml, json);
    Ok(())
}

#[test]
fn the_quota_gauge_is_read_from_an_exposition() {
    let text = "# TYPE etcd_server_quota_backend_bytes gauge\netcd_server_quota_backend_bytes 3.3554432e+07\n";
    assert_eq!(parse_quota(text), Some(33_554_432));
    assert_eq!(parse_quota("x 1\n"), None);
}
