//! Tests of the domain types: names, round trips of every value (proptest), decoders that
//! never panic.

use super::*;
use proptest::prelude::*;

#[test]
fn channel_names_follow_the_rules() {
    assert!(ChannelName::new("by-dev-rootcoord-dml_0_123v0").is_ok());
    assert_eq!(ChannelName::new(""), Err(NameError::Empty));
    assert!(matches!(
        ChannelName::new("a/b"),
        Err(NameError::BadChar { ch: '/', at: 1, .. })
    ));
    assert!(matches!(
        ChannelName::new("é"),
        Err(NameError::BadChar { .. })
    ));
    assert_eq!(
        ChannelName::new("x".repeat(256)),
        Err(NameError::TooLong { len: 256 })
    );
    assert!(ChannelName::new("x".repeat(255)).is_ok());
    assert!(matches!(
        ChannelName::new(".."),
        Err(NameError::Reserved(_))
    ));
}

#[test]
fn node_ids_have_one_canonical_form() {
    assert_eq!("42".parse::<NodeId>().ok(), Some(NodeId(42)));
    assert_eq!("0".parse::<NodeId>().ok(), Some(NodeId(0)));
    for bad in ["", "042", "+1", "-1", "1a", "18446744073709551616"] {
        assert!(bad.parse::<NodeId>().is_err(), "{bad:?} accepted");
    }
}

#[test]
fn channel_info_keeps_unknown_fields() {
    let raw = br#"{"v":1,"channel":"c1","state":"Watched","epoch":3,"start_time_ms":5,
        "vchannel":{"collection_id":7,"shiny":true},"future_field":{"a":1}}"#;
    let info = ChannelInfo::decode(raw).expect("decodes");
    assert_eq!(info.state, ChannelState::Watched);
    assert_eq!(
        info.extra.get("future_field"),
        Some(&serde_json::json!({"a":1}))
    );
    assert_eq!(info.vchannel.extra.get("shiny"), Some(&Value::Bool(true)));
    let again = ChannelInfo::decode(&info.encode()).expect("re-decodes");
    assert_eq!(again, info);
}

#[test]
fn channel_info_refuses_future_versions_and_bad_names() {
    let v2 = br#"{"v":2,"channel":"c","state":"Watched","epoch":1,"start_time_ms":0}"#;
    assert!(matches!(
        ChannelInfo::decode(v2),
        Err(DecodeError::Version { found: 2, .. })
    ));
    let bad = br#"{"v":1,"channel":"a b","state":"Watched","epoch":1,"start_time_ms":0}"#;
    assert!(matches!(
        ChannelInfo::decode(bad),
        Err(DecodeError::Json { .. })
    ));
    let state = br#"{"v":1,"channel":"c","state":"Dancing","epoch":1,"start_time_ms":0}"#;
    assert!(ChannelInfo::decode(state).is_err());
}

#[test]
fn oversized_vchannel_is_refused_with_the_limit_in_the_message() {
    let big = format!(
        r#"{{"metadata":{{"blob":"{}"}}}}"#,
        "x".repeat(MAX_VCHANNEL_BYTES)
    );
    let err = VChannelInfo::from_json(big.as_bytes()).expect_err("over the cap");
    assert!(err.to_string().contains("65536"), "{err}");
    let ok = format!(r#"{{"metadata":{{"blob":"{}"}}}}"#, "x".repeat(1000));
    assert!(VChannelInfo::from_json(ok.as_bytes()).is_ok());
}

pub(crate) fn name_strategy() -> impl Strategy<Value = ChannelName> {
    "[A-Za-z0-9._-]{1,40}"
        .prop_filter("reserved", |s| s != "." && s != "..")
        .prop_map(|s| ChannelName::new(s).expect("valid by construction"))
}

fn state_strategy() -> impl Strategy<Value = ChannelState> {
    proptest::sample::select(ChannelState::ALL.to_vec())
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::String),
    ]
}

fn extra_strategy(known: &'static [&'static str]) -> impl Strategy<Value = Map<String, Value>> {
    proptest::collection::btree_map("x_[a-z]{1,6}", json_leaf(), 0..3).prop_map(move |m| {
        m.into_iter()
            .filter(|(k, _)| !known.contains(&k.as_str()))
            .collect()
    })
}

fn vchannel_strategy() -> impl Strategy<Value = VChannelInfo> {
    (
        any::<u64>(),
        proptest::option::of("[ -~]{0,20}"),
        proptest::collection::vec(any::<i64>(), 0..4),
        proptest::collection::vec(any::<i64>(), 0..4),
        proptest::collection::btree_map("[a-z]{1,6}", json_leaf(), 0..3),
        extra_strategy(&[]),
    )
        .prop_map(
            |(collection_id, seek_position, unflushed, flushed, meta, extra)| VChannelInfo {
                collection_id,
                seek_position,
                unflushed_segment_ids: unflushed,
                flushed_segment_ids: flushed,
                metadata: meta.into_iter().collect(),
                extra,
            },
        )
}

prop_compose! {
    fn channel_info_strategy()(
        channel in name_strategy(),
        state in state_strategy(),
        epoch in any::<u64>(),
        start in any::<u64>(),
        vchannel in vchannel_strategy(),
        reason in proptest::option::of(".{0,30}"),
        progress in proptest::option::of((0u8..=100, any::<u64>())),
        extra in extra_strategy(&[]),
        placement in (any::<u32>(), proptest::option::of("[a-z0-9]{1,8}"), any::<bool>()),
        round in proptest::option::of((any::<u64>(), any::<u32>())),
    ) -> ChannelInfo {
        ChannelInfo {
            v: CHANNEL_INFO_VERSION, channel, state, epoch: Epoch(epoch), start_time_ms: start,
            vchannel, reason,
            progress: progress.map(|(percent, updated_at_ms)| Progress { percent, updated_at_ms }),
            weight: placement.0, group: placement.1, pinned: placement.2,
            round: round.map(|(id, puts)| RoundHint { id, puts }),
            extra,
        }
    }
}

proptest! {
    #[test]
    fn channel_info_round_trips(info in channel_info_strategy()) {
        let decoded = ChannelInfo::decode(&info.encode()).expect("round trip");
        prop_assert_eq!(decoded, info);
    }

    #[test]
    fn sessions_and_checkpoints_round_trip(
        id in any::<u64>(), addr in "[ -~]{0,30}", started in any::<u64>(),
        capacity in any::<u32>(), epoch in any::<u64>(), pos in ".{0,30}",
        extra in extra_strategy(&[]),
    ) {
        let node = NodeSession {
            id: NodeId(id), admin_addr: addr.clone(), version: "0.1.0".into(),
            started_at_ms: started, capacity, name: format!("host-{id}"), extra: extra.clone(),
        };
        prop_assert_eq!(NodeSession::decode(&node.encode()).expect("node"), node);
        let coord = CoordSession {
            id: format!("c{id}"), admin_addr: addr, started_at_ms: started, extra: extra.clone(),
        };
        prop_assert_eq!(CoordSession::decode(&coord.encode()).expect("coord"), coord);
        let state = (capacity % 2 == 0).then(|| serde_json::json!({"count": capacity, "digest": id}));
        let cp = Checkpoint { epoch: Epoch(epoch), position: pos, state, updated_at_ms: started, extra };
        prop_assert_eq!(Checkpoint::decode(&cp.encode()).expect("checkpoint"), cp);
    }

    #[test]
    fn decoders_never_panic_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = ChannelInfo::decode(&bytes);
        let _ = NodeSession::decode(&bytes);
        let _ = CoordSession::decode(&bytes);
        let _ = Checkpoint::decode(&bytes);
        let _ = VChannelInfo::from_json(&bytes);
        let _ = std::str::from_utf8(&bytes).map(|s| s.parse::<NodeId>());
    }

    #[test]
    fn node_ids_round_trip(n in any::<u64>()) {
        prop_assert_eq!(n.to_string().parse::<NodeId>().ok(), Some(NodeId(n)));
    }
}

/// `weight`, `group` and `pinned` (DESIGN §2) are absent from a value written before them,
/// read as 1 / none / false, and a value with the defaults is written without them, so an
/// older reader sees exactly what it wrote; set, they round-trip.
#[test]
fn placement_fields_default_when_absent_and_are_written_only_when_set() {
    let old = br#"{"v":1,"channel":"a","state":"Watched","epoch":2,"start_time_ms":5}"#;
    let info = ChannelInfo::decode(old).expect("an old value");
    assert_eq!(
        (info.weight, info.group.as_deref(), info.pinned),
        (1, None, false)
    );
    assert_eq!(info.load_weight(), 1);
    let text = String::from_utf8(info.encode()).expect("utf8");
    assert!(
        !text.contains("weight") && !text.contains("group") && !text.contains("pinned"),
        "{text}"
    );
    let mut set = info;
    set.weight = 3;
    set.group = Some("c7".into());
    set.pinned = true;
    let back = ChannelInfo::decode(&set.encode()).expect("round trip");
    assert_eq!(back, set);
    set.weight = 0;
    assert_eq!(set.load_weight(), 1, "0 counts as 1");
}
