//! `shard-bench`: the workloads of BENCHMARK.md (W1, W1-sat, W2, W3, W4, W5, W6) through
//! the public `EntityRef` API, three nodes in one process or in three
//! (`--mode multi-process`); baseline (a), the transport alone
//! (`transport`); the workload and its baselines interleaved (`--pairs N
//! --limits PATH`); W2's latency chart (`--chart`). SPEC §13b.
//!
//! Shows a live line on stderr while it runs (messages handled, rate),
//! prints a table for people, then one JSON object on the last line for
//! machines; exits 1 when `missing_acks` is not 0 (a message not acked
//! after 60 s of retries) or a message that was not retried was handled
//! twice or out of order.
//!
//! Run: `cargo run --release --bin shard-bench -- w1 [--messages N]`

use std::process::ExitCode;

use clap::Parser;

#[path = "shard_bench/args.rs"]
mod args;
#[path = "shard_bench/baseline.rs"]
mod baseline;
#[path = "shard_bench/chart.rs"]
mod chart;
#[path = "shard_bench/coordinator.rs"]
mod coordinator;
#[path = "shard_bench/curve_chart.rs"]
mod curve_chart;
#[path = "shard_bench/durable.rs"]
mod durable;
#[path = "shard_bench/entities.rs"]
mod entities;
#[path = "shard_bench/handoff.rs"]
mod handoff;
#[path = "../../protocols/harness.rs"]
mod harness;
#[path = "shard_bench/limit.rs"]
mod limit;
#[path = "shard_bench/multi.rs"]
mod multi;
#[path = "shard_bench/nodes.rs"]
mod nodes;
#[cfg(feature = "management")]
#[path = "shard_bench/page.rs"]
mod page;
#[path = "shard_bench/pairs.rs"]
mod pairs;
#[cfg(feature = "postgres")]
#[path = "../../protocols/pg_server.rs"]
mod pg_server;
#[path = "../../protocols/ping.rs"]
mod ping;
#[path = "shard_bench/recovery.rs"]
mod recovery;
#[path = "shard_bench/reliable.rs"]
mod reliable;
#[path = "shard_bench/report.rs"]
mod report;
#[path = "shard_bench/transport.rs"]
mod transport;
#[path = "shard_bench/w1.rs"]
mod w1;
#[path = "shard_bench/w2.rs"]
mod w2;
#[path = "shard_bench/w3.rs"]
mod w3;
#[path = "shard_bench/w6.rs"]
mod w6;

use args::{Args, Mode, Workload};
use baseline::run_transport;
use report::exit_with;
use w1::{Beside, run_w1, run_w1_reliable};
use w2::{W2Shape, run_w2};
use w3::run_w3;

// What the workloads' modules reach through `super::`.
use harness::{cpu_time, peak_rss_kib, shares};
use nodes::stop;
use report::Run;
use w1::run_drivers;

fn main() -> ExitCode {
    let args = Args::parse();
    // The library's logs, when asked for (`RUST_LOG=warn`, say): off by
    // default, so that the measured runs write nothing.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let in_flight = args
        .in_flight
        .unwrap_or(if args.workload == Workload::W1Sat {
            256
        } else {
            16
        });
    let w1 = matches!(args.workload, Workload::W1 | Workload::W1Sat);
    if args.prometheus && (!w1 || args.mode == Mode::MultiProcess || args.pairs.is_some()) {
        eprintln!(
            "shard-bench: --prometheus runs w1 and w1-sat in one process (compare with farm-bench)"
        );
        return ExitCode::from(2);
    }
    if args.tls && (!w1 || args.mode == Mode::MultiProcess || args.pairs.is_some()) {
        eprintln!("shard-bench: --tls runs w1 and w1-sat in one process (compare with farm-bench)");
        return ExitCode::from(2);
    }
    if args.reliable
        && (!matches!(args.workload, Workload::W1 | Workload::W2)
            || args.mode == Mode::MultiProcess
            || args.pairs.is_some()
            || args.tls
            || args.prometheus)
    {
        eprintln!("shard-bench: --reliable runs w1 and w2 in one process");
        return ExitCode::from(2);
    }
    if args.journal == Some(durable::JournalKind::Fjall) && args.lanes.is_some_and(|n| n != 1) {
        eprintln!("shard-bench: --journal fjall commits through one log: --lanes 1 only");
        return ExitCode::from(2);
    }
    if (args.uniform || args.by_traffic) && args.workload != Workload::W6 {
        eprintln!("shard-bench: --uniform and --by-traffic are W6's");
        return ExitCode::from(2);
    }
    if args.workload == Workload::W6 && args.by_traffic && args.curve_chart.is_some() {
        eprintln!("shard-bench: w6 --curve-chart runs both placements: leave out --by-traffic");
        return ExitCode::from(2);
    }
    if args.durable_producer && !w1 {
        eprintln!("shard-bench: --durable-producer runs w1 --reliable --journal embedded");
        return ExitCode::from(2);
    }
    if args.page
        && (!w1 || args.mode == Mode::MultiProcess || args.tls || args.prometheus || args.reliable)
    {
        eprintln!("shard-bench: --page runs w1 and w1-sat in one process, alone");
        return ExitCode::from(2);
    }
    if args.page && !cfg!(feature = "management") {
        eprintln!("shard-bench: --page needs a build with --features management");
        return ExitCode::from(2);
    }
    if let Some(rounds) = args.pairs {
        let name = match args.workload {
            Workload::W1 => "w1",
            Workload::W1Sat => "w1-sat",
            _ => {
                eprintln!("shard-bench: --pairs runs w1 and w1-sat");
                return ExitCode::from(2);
            }
        };
        if args.page {
            return exit_with(pairs::against_plain(
                name,
                ("--page", "page_requests"),
                args.messages,
                in_flight,
                rounds,
            ));
        }
        return exit_with(pairs::interleave(
            name,
            args.messages,
            in_flight,
            rounds,
            args.limits.as_deref(),
        ));
    }
    let curves = matches!(
        args.workload,
        Workload::Coordinator | Workload::Entities | Workload::Recovery
    );
    if curves && args.mode == Mode::MultiProcess {
        eprintln!("shard-bench: coordinator, entities and recovery run in one process");
        return ExitCode::from(2);
    }
    if args.workload == Workload::Recovery && args.lengths.contains(&0) {
        eprintln!("shard-bench: --lengths takes journals of at least 1 event");
        return ExitCode::from(2);
    }
    if args.workload == Workload::Coordinator {
        let max = datum_cluster_sharding::MAX_SHARDS;
        if args.shards.iter().any(|&s| s == 0 || s > max) {
            eprintln!("shard-bench: --shards takes counts from 1 to {max}");
            return ExitCode::from(2);
        }
        if args.regions.iter().any(|&r| r == 0 || r > 100_000) {
            eprintln!("shard-bench: --regions takes counts from 1 to 100,000");
            return ExitCode::from(2);
        }
        return exit_with(coordinator::run(
            &args.shards,
            &args.regions,
            args.curve_chart.as_deref(),
        ));
    }
    if args.workload == Workload::Entities && args.entity_count.is_none() {
        if args.counts.contains(&0) {
            eprintln!("shard-bench: --counts takes counts of at least 1");
            return ExitCode::from(2);
        }
        return exit_with(entities::run(
            &args.counts,
            args.messages,
            args.curve_chart.as_deref(),
        ));
    }
    if args.workload == Workload::W5 && args.passivation.is_none() {
        return exit_with(limit::run_all(args.messages, in_flight));
    }
    if let Some(index) = args.child {
        return multi::child(index, &args, in_flight);
    }
    if args.mode == Mode::MultiProcess {
        if matches!(
            args.workload,
            Workload::Transport
                | Workload::W4
                | Workload::W5
                | Workload::Handoff
                | Workload::Coordinator
                | Workload::Entities
                | Workload::Recovery
                | Workload::W6
        ) || args.spawning
            || args.journal.is_some()
            || args.offered_rate.is_some()
        {
            eprintln!(
                "shard-bench: multi-process mode runs w1, w1-sat, w2 and w3, without --journal or --offered-rate"
            );
            return ExitCode::from(2);
        }
        return multi::parent(&args, in_flight);
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(in_process(args, in_flight))
}

async fn in_process(args: Args, in_flight: usize) -> ExitCode {
    let beside = Beside {
        tls: args.tls,
        prometheus: args.prometheus,
        page: args.page,
    };
    let result = match args.workload {
        Workload::W1 if args.reliable => {
            run_w1_reliable(
                args.messages,
                in_flight,
                reliable::Store {
                    journal: args.journal,
                    durable_producer: args.durable_producer,
                    lanes: args.lanes.map_or(1, |n| n as usize),
                },
            )
            .await
        }
        Workload::W1 => run_w1(args.messages, in_flight, "w1", beside).await,
        Workload::W1Sat => run_w1(args.messages, in_flight, "w1-sat", beside).await,
        Workload::Transport => run_transport(args.messages, in_flight).await,
        Workload::W2 if args.reliable => reliable::run_w2(args.messages).await,
        Workload::W2 => {
            let shape = W2Shape {
                downing: args.downing,
                victim_index: args.victim as usize,
                chart_path: &args.chart,
                offered_rate: args.offered_rate,
            };
            run_w2(args.messages, shape, args.journal).await
        }
        Workload::W3 => run_w3(args.messages, args.spawning).await,
        Workload::Handoff if !args.per_shard.is_empty() => {
            handoff::run_curve(&args.per_shard, args.curve_chart.as_deref()).await
        }
        Workload::Handoff => handoff::run(args.entities).await,
        Workload::Coordinator => unreachable!("the coordinator grid runs before the runtime"),
        Workload::Recovery => {
            let kind = args.journal.unwrap_or(durable::JournalKind::Embedded);
            recovery::run(&args.lengths, args.curve_chart.as_deref(), kind)
                .await
                .map_err(Into::into)
        }
        Workload::Entities => match args.entity_count {
            Some(count) if args.bare => entities::child_bare(count).await,
            Some(count) => entities::child_entities(count, args.messages).await,
            None => unreachable!("the entities parent runs before the runtime"),
        },
        Workload::W5 => match (args.passivation, args.mix) {
            (Some(passivation), Some(mix)) => {
                limit::run_one(args.messages, in_flight, passivation, mix).await
            }
            _ => unreachable!("w5 without --passivation runs its children above"),
        },
        Workload::W6 => match &args.curve_chart {
            Some(chart) => w6::run_pair(args.messages, in_flight, args.uniform, chart).await,
            None => w6::run(args.messages, in_flight, args.uniform, args.by_traffic).await,
        },
        Workload::W4 => {
            durable::run_w4(
                args.journal.unwrap_or(durable::JournalKind::Embedded),
                args.lanes.map(|n| n as usize),
                args.messages,
                in_flight,
                args.rounds,
            )
            .await
        }
    };
    match result {
        Ok((json, correct)) => {
            println!("{json}");
            if correct {
                ExitCode::SUCCESS
            } else {
                eprintln!("shard-bench: a correctness counter is off");
                ExitCode::from(1)
            }
        }
        Err(error) => {
            eprintln!("shard-bench: {error}");
            ExitCode::from(2)
        }
    }
}
