//! Unit tests of `ctl`: flags, input checks and presentation.

use chanwatch_core::planner::PlannedMove;

use super::*;

fn moved() -> Vec<Transition> {
    serde_json::from_str(
        r#"[{"channel":"orders-2","cause":"manual","from":1,"to":3,"state":"ToWatch","epoch":4}]"#,
    )
    .expect("a transition")
}

/// A node name where an ID is wanted says what to give instead (a newcomer tried
/// `ctl move orders-0 --to a` and read "invalid digit found in string").
#[test]
fn a_node_name_where_an_id_is_wanted_says_what_to_give() {
    use clap::Parser;
    for args in [
        &["chanwatch", "ctl", "move", "orders-0", "--to", "a"][..],
        &["chanwatch", "ctl", "drain", "a"],
        &["chanwatch", "ctl", "undrain", "a"],
        &["chanwatch", "ctl", "describe", "node", "a"],
    ] {
        let e = crate::cli::Cli::try_parse_from(args).expect_err("a name is not an ID");
        assert!(
            e.to_string()
                .contains("'a' is not a node ID: give the number in the ID column of `ctl nodes`"),
            "{args:?}: {e}"
        );
    }
    assert!(crate::cli::Cli::try_parse_from(["chanwatch", "ctl", "drain", "7"]).is_ok());
}

/// Input is checked as the command line is parsed, before any network call: each bad value
/// is refused with what to give instead, and good ones arrive parsed.
#[test]
fn bad_input_is_refused_as_the_command_line_is_parsed_and_good_input_arrives_parsed() {
    use clap::Parser;
    let refused = |args: &[&str], says: &str| {
        let mut all = vec!["chanwatch", "ctl"];
        all.extend(args);
        let e = crate::cli::Cli::try_parse_from(&all).expect_err("bad input");
        assert!(e.to_string().contains(says), "{args:?}: {e}");
    };
    refused(&["add-channel", "bad name"], "[A-Za-z0-9._-]");
    refused(&["pin", "bad name"], "[A-Za-z0-9._-]");
    refused(&["describe", "channel", "bad name"], "[A-Za-z0-9._-]");
    refused(
        &["channels", "--state", "bogus"],
        "expected one of ToWatch, Watched",
    );
    refused(
        &["channels", "--node", "x"],
        "a node ID (a number) or `remaining`",
    );
    refused(&["add-channel", "x", "--vchannel", "{"], "--vchannel");
    refused(&["add-channel", "x", "--group", "a b"], "group \"a b\"");
    let parsed = |args: &[&str]| {
        let mut all = vec!["chanwatch", "ctl"];
        all.extend(args);
        match crate::cli::Cli::try_parse_from(&all)
            .expect("good input")
            .command
        {
            crate::cli::Command::Ctl(ctl) => ctl.what,
            other => panic!("not ctl: {other:?}"),
        }
    };
    assert!(matches!(
        parsed(&["channels", "--state", "towatch", "--node", "remaining"]),
        Command::Channels {
            node: Some(ChannelOwner::Remaining),
            state: Some(ChannelState::ToWatch),
        }
    ));
    assert!(matches!(
        parsed(&["move", "orders-0", "--to", "3"]),
        Command::Move { name, to: NodeId(3) } if name.as_str() == "orders-0"
    ));
}

/// A negative number gets the range it must be in (a newcomer's `--weight -1` got clap's
/// "to pass '-1' as a value, use '-- -1'", which then failed anyway).
#[test]
fn a_negative_number_is_told_its_range() {
    use clap::Parser;
    for (args, range) in [
        (
            &["chanwatch", "ctl", "add-channel", "x", "--weight", "-1"][..],
            "1..=1000000",
        ),
        (&["chanwatch", "node", "--capacity", "-2"], "1..=1000000"),
        (
            &["chanwatch", "standalone", "--capacity", "-2"],
            "1..=1000000",
        ),
        (&["chanwatch", "coord", "--max-txn-ops", "-4"], "4..=10000"),
    ] {
        let e = crate::cli::Cli::try_parse_from(args).expect_err("out of range");
        assert!(e.to_string().contains(range), "{args:?}: {e}");
        assert!(!e.to_string().contains("-- -"), "{args:?}: {e}");
    }
}

/// The writes print their answer in every format: a line each for a person, the typed
/// list for machines.
#[test]
fn transitions_print_as_lines_json_and_yaml() -> Result<()> {
    let t = moved();
    assert_eq!(
        transitions(Format::Table, &t)?,
        "manual orders-2: node 1 -> 3 (ToWatch, epoch 4)\n"
    );
    let json: serde_json::Value = serde_json::from_str(&transitions(Format::Json, &t)?)?;
    assert_eq!(json[0]["to"], 3);
    let yaml: serde_json::Value = serde_yaml_ng::from_str(&transitions(Format::Yaml, &t)?)?;
    assert_eq!(yaml, json);
    Ok(())
}

/// The leader answers a move with the release it wrote first (node 2 -> 2, ToRelease):
/// ctl says where the channel goes, not that release (it printed `node 2 -> 2`).
#[test]
fn a_move_prints_from_the_old_node_to_the_target() -> Result<()> {
    let release: Vec<Transition> = serde_json::from_str(
        r#"[{"channel":"orders-2","cause":"manual","from":2,"to":2,"state":"ToRelease","epoch":4}]"#,
    )?;
    let name = ChannelName::new("orders-2")?;
    assert_eq!(
        move_started(Format::Table, &name, NodeId(3), &release)?,
        "orders-2: node 2 -> node 3 (started: node 2 releases it first (epoch 4), then node 3 takes it)\n"
    );
    let json: serde_json::Value =
        serde_json::from_str(&move_started(Format::Json, &name, NodeId(3), &release)?)?;
    assert_eq!(
        (&json["from"], &json["to"]),
        (&serde_json::json!(2), &serde_json::json!(3))
    );
    assert_eq!(json["channel"], "orders-2");
    assert_eq!(json["transitions"][0]["state"], "ToRelease");
    // A parked channel moves at once.
    let parked: Vec<Transition> = serde_json::from_str(
        r#"[{"channel":"orders-2","cause":"manual","from":"remaining","to":3,"state":"ToWatch","epoch":5}]"#,
    )?;
    assert_eq!(
        move_started(Format::Table, &name, NodeId(3), &parked)?,
        "orders-2: remaining -> node 3 (ToWatch, epoch 5)\n"
    );
    Ok(())
}

#[test]
fn a_balance_plan_is_a_table_with_a_count() -> Result<()> {
    let plan = BalancePlan {
        dry_run: true,
        moves: serde_json::from_str::<Vec<PlannedMove>>(
            r#"[{"channel":"orders-10","from":1,"to":2}]"#,
        )?,
    };
    let out = balance_table(&plan);
    assert!(
        out.starts_with("CHANNEL    FROM  TO\norders-10     1   2\n"),
        "{out}"
    );
    assert!(
        out.ends_with("1 move(s) planned (dry run: nothing moved)\n"),
        "{out}"
    );
    Ok(())
}
