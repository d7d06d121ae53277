//! Unit tests of the binary: the flags, the JSON lines, `datum-node
//! certs` and the `--drive-rate` pace.

use std::time::{Duration, Instant};

use clap::Parser;
use datum_cluster_sharding::identity::{NodeId, UniqueAddress};
use datum_cluster_sharding::membership::{MemberStatus, MembershipEvent, SplitBrainStrategy};

#[cfg(feature = "tls")]
use super::certs::write_certificates;
use super::drive::Pace;
#[cfg(feature = "tls")]
use super::flags::CertsArgs;
use super::flags::{Args, split_brain};
use super::output::{DriveLine, Line, MigrationLine, RegionLine, Stopped, event_line, json_line};
use super::{EXIT_JOIN_REFUSED, EXIT_LEAVE_TIMED_OUT, EXIT_START_FAILED, EXIT_STOPPED_BY_CLUSTER};

fn member() -> UniqueAddress {
    UniqueAddress {
        addr: "127.0.0.1:44767".parse().expect("literal"),
        node_id: NodeId(0x93b3_0568_2c1a_07ee),
        incarnation: 1_796_042_329_732_518,
    }
}

/// `--help` names every exit code the binary has, each once.
#[test]
fn help_lists_every_exit_code() {
    use clap::CommandFactory;
    let help = Args::command().render_long_help().to_string();
    // The list as one line: clap wraps long help to the terminal.
    let after = help
        .split_once("Exit codes: ")
        .expect("an exit code list")
        .1;
    let codes = after.split("\n\n").next().unwrap_or_default();
    let codes = codes.split_whitespace().collect::<Vec<_>>().join(" ");
    let listed: Vec<u8> = codes
        .trim_end_matches('.')
        .split("; ")
        .map(|each| {
            let code = each.split(' ').next().unwrap_or_default();
            code.parse()
                .unwrap_or_else(|_| panic!("{each:?} in {codes:?}"))
        })
        .collect();
    let every = [
        0,
        EXIT_START_FAILED,
        2,
        EXIT_STOPPED_BY_CLUSTER,
        EXIT_LEAVE_TIMED_OUT,
        EXIT_JOIN_REFUSED,
    ];
    assert_eq!(listed, every, "{codes}");
}

/// `datum-node certs` into a directory that holds them already refuses,
/// naming the file, and writes nothing.
#[cfg(feature = "tls")]
#[test]
fn certs_refuse_to_overwrite_naming_the_file() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let args = |nodes: &str| {
        CertsArgs::parse_from([
            "datum-node certs",
            "--out",
            dir.path().to_str().unwrap(),
            "--nodes",
            nodes,
        ])
    };
    let lines = write_certificates(&args("127.0.0.1,127.0.0.2")).expect("written");
    assert_eq!(lines.len(), 2, "{lines:?}");
    let error = write_certificates(&args("127.0.0.1")).expect_err("refused");
    let ca = dir.path().join("ca.pem");
    assert_eq!(
        error,
        format!(
            "refusing to overwrite {}, which exists (remove it or choose another --out)",
            ca.display()
        )
    );
    // Only a node's file there: named too, and no CA is written.
    let other = tempfile::tempdir().expect("a temporary directory");
    let key = other.path().join("node-1-key.pem");
    std::fs::write(&key, "").expect("written");
    let out = other.path().to_str().unwrap();
    let refused = CertsArgs::parse_from([
        "datum-node certs",
        "--out",
        out,
        "--nodes",
        "127.0.0.1,127.0.0.2",
    ]);
    let error = write_certificates(&refused).expect_err("refused");
    assert!(error.contains(&key.display().to_string()), "{error}");
    assert!(!other.path().join("ca.pem").exists());
}

/// `--drive-rate` paces a loop: 0 not at all, 50 a second 20 ms apart
/// (never faster); 100 unless told.
#[tokio::test]
async fn drive_rate_paces_each_loop() {
    let started = Instant::now();
    let mut unpaced = Pace::new(0);
    for _ in 0..1_000 {
        unpaced.wait().await;
    }
    assert!(started.elapsed() < Duration::from_secs(1));
    let started = Instant::now();
    let mut paced = Pace::new(50);
    for _ in 0..11 {
        paced.wait().await;
    }
    // The first goes at once, the ten after it 20 ms apart.
    assert!(started.elapsed() >= Duration::from_millis(200));
    let flags = [
        "--cluster-name",
        "c",
        "--secret",
        "s",
        "--counter",
        "--drive",
        "2",
    ];
    let args = Args::try_parse_from(std::iter::once("datum-node").chain(flags)).expect("parses");
    assert_eq!(args.drive_rate, 100);
}

#[test]
fn split_brain_flag_values() {
    assert_eq!(split_brain("off").expect("off").0, None);
    assert_eq!(
        split_brain("keep-majority").expect("parses").0,
        Some(SplitBrainStrategy::KeepMajority)
    );
    assert_eq!(
        split_brain("static-quorum:3").expect("parses").0,
        Some(SplitBrainStrategy::StaticQuorum(3))
    );
    assert_eq!(
        split_brain("keep-oldest-down-if-alone").expect("parses").0,
        Some(SplitBrainStrategy::KeepOldest {
            down_if_alone: true
        })
    );
    for bad in ["", "static-quorum:0", "static-quorum:x", "majority"] {
        assert!(split_brain(bad).is_err(), "{bad}");
    }
}

/// `--app-version` takes dot-separated numbers (default `0`), and
/// `--counter-version` 1 or 2 with `--counter` only.
#[test]
fn version_flags() {
    let parse = |extra: &[&str]| {
        let base = ["datum-node", "--cluster-name", "c", "--secret", "s"];
        Args::try_parse_from(base.iter().chain(extra))
    };
    let args = parse(&[]).expect("parses");
    assert_eq!(args.app_version, datum_cluster_sharding::AppVersion::zero());
    let args = parse(&["--app-version", "2.14.1"]).expect("parses");
    assert_eq!(args.app_version.as_str(), "2.14.1");
    let error = parse(&["--app-version", "2.x"]).expect_err("refused");
    assert!(error.to_string().contains("`2.x`"), "{error}");
    let args = parse(&["--counter", "--counter-version", "2"]).expect("parses");
    assert_eq!(args.counter_version, 2);
    assert!(parse(&["--counter", "--counter-version", "3"]).is_err());
    assert!(
        parse(&["--counter-version", "2"]).is_err(),
        "needs --counter"
    );
}

/// The lines keep the field names, order and number formatting SPEC
/// §10c.2 shows.
#[test]
fn lines_are_as_spec_shows_them() {
    let m = member();
    let cases = [
        (
            json_line(&Line::member("started", &m, 0)),
            r#"{"event":"started","addr":"127.0.0.1:44767","node_id":"93b305682c1a07ee","incarnation":1796042329732518,"t_ms":0}"#,
        ),
        (
            json_line(&Line {
                app_version: Some("2.1".into()),
                ..Line::member("started", &m, 0)
            }),
            r#"{"event":"started","addr":"127.0.0.1:44767","node_id":"93b305682c1a07ee","incarnation":1796042329732518,"app_version":"2.1","t_ms":0}"#,
        ),
        (
            json_line(&event_line(
                &MembershipEvent::MemberRemoved {
                    member: m,
                    previous: MemberStatus::Down,
                },
                3059,
            )),
            r#"{"event":"member_removed","addr":"127.0.0.1:44767","node_id":"93b305682c1a07ee","incarnation":1796042329732518,"previous":"Down","t_ms":3059}"#,
        ),
        (
            json_line(&event_line(&MembershipEvent::CoordinatorChanged(None), 7)),
            r#"{"event":"coordinator_changed","addr":null,"node_id":null,"incarnation":null,"t_ms":7}"#,
        ),
        (
            json_line(&Stopped {
                event: "stopped",
                reason: "left",
                t_ms: 12,
            }),
            r#"{"event":"stopped","reason":"left","t_ms":12}"#,
        ),
        (
            json_line(&RegionLine {
                event: "handed_off",
                type_name: "counter",
                shards: 0,
                shard_ids: Vec::new(),
                entities: 0,
                handing_off: 0,
                buffered: 0,
                registered: false,
                t_ms: 214,
            }),
            r#"{"event":"handed_off","type_name":"counter","shards":0,"shard_ids":[],"entities":0,"handing_off":0,"buffered":0,"registered":false,"t_ms":214}"#,
        ),
        (
            json_line(&RegionLine {
                event: "region_state",
                type_name: "counter",
                shards: 2,
                shard_ids: vec![3, 17],
                entities: 5,
                handing_off: 0,
                buffered: 0,
                registered: true,
                t_ms: 1_050,
            }),
            r#"{"event":"region_state","type_name":"counter","shards":2,"shard_ids":[3,17],"entities":5,"handing_off":0,"buffered":0,"registered":true,"t_ms":1050}"#,
        ),
        (
            json_line(&DriveLine {
                event: "drive",
                acked: 2_048,
                retries: 3,
                missing: 0,
                maybe: Some(2),
                refused: None,
                unconfirmed: None,
                t_ms: 1_050,
            }),
            r#"{"event":"drive","acked":2048,"retries":3,"missing":0,"maybe":2,"t_ms":1050}"#,
        ),
        (
            json_line(&DriveLine {
                event: "drive",
                acked: 2_048,
                retries: 3,
                missing: 0,
                maybe: Some(2),
                refused: Some(vec![0x1f2e_0000_0009]),
                unconfirmed: None,
                t_ms: 1_050,
            }),
            r#"{"event":"drive","acked":2048,"retries":3,"missing":0,"maybe":2,"refused":[34282428956681],"t_ms":1050}"#,
        ),
        (
            json_line(&DriveLine {
                event: "drive",
                acked: 9_120,
                retries: 41,
                missing: 0,
                maybe: None,
                refused: None,
                unconfirmed: Some(0),
                t_ms: 8_412,
            }),
            r#"{"event":"drive","acked":9120,"retries":41,"missing":0,"unconfirmed":0,"t_ms":8412}"#,
        ),
    ];
    for (line, expected) in cases {
        assert_eq!(line.expect("serialises"), expected);
    }
}

/// The migration lines are as SPEC §10c.2 shows them.
#[test]
fn migration_lines_are_as_spec_shows_them() {
    use datum_cluster_sharding::{MigrationEvent, ShardId};
    let started = Instant::now() - Duration::from_millis(2_210);
    let line = |event: &MigrationEvent| {
        let mut line = MigrationLine::of(event, started).expect("a known event");
        line.t_ms = 2_210;
        json_line(&line).expect("serialises")
    };
    let received = MigrationEvent::Received {
        type_name: "counter",
        shard: ShardId(17),
        from: member(),
        entities: 5,
        bytes: 40,
    };
    assert_eq!(
        line(&received),
        r#"{"event":"shard_received","type_name":"counter","shard":17,"from":"93b305682c1a07ee","entities":5,"t_ms":2210}"#
    );
    let fell_back = MigrationEvent::FellBack {
        type_name: "counter",
        shard: ShardId(3),
        from: None,
        reason: "the shard moved without a handoff (its owner was lost, or its handoff timed out)"
            .into(),
    };
    assert_eq!(
        line(&fell_back),
        r#"{"event":"shard_fell_back","type_name":"counter","shard":3,"reason":"the shard moved without a handoff (its owner was lost, or its handoff timed out)","t_ms":2210}"#
    );
    let refused = MigrationEvent::StateRefused {
        type_name: "counter",
        entity_id: "c-9".into(),
        reason: "the state has version 2, above this build's 1".into(),
    };
    assert_eq!(
        line(&refused),
        r#"{"event":"state_refused","type_name":"counter","entity_id":"c-9","reason":"the state has version 2, above this build's 1","t_ms":2210}"#
    );
}

/// A string value with a quote, a backslash, a newline and a NUL stays
/// on one line and parses back as exactly that value.
#[test]
fn hostile_text_is_escaped() {
    let hostile = "a\"b\\c\nd\0e";
    let line = json_line(&Line {
        previous: Some(hostile.to_owned()),
        ..Line::member(hostile, &member(), 1)
    })
    .expect("serialises");
    assert!(!line.contains('\n') && !line.contains('\0'), "{line}");
    let parsed: serde_json::Value = serde_json::from_str(&line).expect("valid JSON");
    assert_eq!(parsed["event"], hostile);
    assert_eq!(parsed["previous"], hostile);
    assert_eq!(parsed["incarnation"], 1_796_042_329_732_518_u64);
}
