//! The PostgreSQL store against a real, throwaway PostgreSQL server that
//! the test starts itself (the Debian package's `initdb` and `pg_ctl`, a
//! temporary directory, a free port on 127.0.0.1), stopped at the end.
//! Without the binaries the tests say so in one line and pass.
#![cfg(feature = "postgres")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use datum_cluster_sharding::persistence::{
    Journal, PersistenceError, PersistenceId, PgPersistence, conformance,
};
use datum_cluster_sharding::prelude::*;

/// A PostgreSQL server in a temporary directory, stopped when dropped.
struct Server {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    databases: AtomicU32,
}

/// The package's binaries, newest version first.
fn binaries() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

/// Runs a server binary, as the package's unprivileged user when root
/// (PostgreSQL refuses to run as root).
fn run(bin: &Path, program: &str, args: &[&str]) -> std::process::Output {
    let exe = bin.join(program);
    let root = std::env::var("USER").map(|u| u == "root").unwrap_or(false)
        || Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0"));
    let mut command = if root {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    command
        .args(args)
        .output()
        .expect("run a PostgreSQL binary")
}

impl Server {
    fn start() -> Option<Server> {
        let Some(bin) = binaries() else {
            println!(
                "PostgreSQL binaries not found: install the `postgresql` package to run these tests"
            );
            return None;
        };
        let dir = tempfile::Builder::new()
            .prefix("datum-pg-")
            .tempdir()
            .expect("a temporary directory");
        // The server's user must own its directory.
        let _ = Command::new("chown")
            .args(["-R", "postgres:postgres"])
            .arg(dir.path())
            .status();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let data = dir.path().join("data");
        let data = data.to_str().expect("a UTF-8 path");
        let init = run(
            &bin,
            "initdb",
            &["-D", data, "-U", "postgres", "-A", "trust", "--no-sync"],
        );
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let log = dir.path().join("server.log");
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            dir.path().display()
        );
        let started = run(
            &bin,
            "pg_ctl",
            &[
                "-D",
                data,
                "-l",
                log.to_str().expect("UTF-8"),
                "-o",
                &options,
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        assert!(
            started.status.success(),
            "pg_ctl start: {} {}",
            String::from_utf8_lossy(&started.stderr),
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        Some(Server {
            bin,
            dir,
            port,
            databases: AtomicU32::new(0),
        })
    }

    /// A fresh, empty database's connection string.
    fn database(&self) -> String {
        let name = format!("t{}", self.databases.fetch_add(1, Ordering::Relaxed));
        let created = Command::new(self.bin.join("createdb"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                &name,
            ])
            .output()
            .expect("createdb");
        assert!(
            created.status.success(),
            "createdb: {}",
            String::from_utf8_lossy(&created.stderr)
        );
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={name}",
            self.port
        )
    }

    fn store(&self) -> PgPersistence {
        PgPersistence::connect(&self.database(), 4).expect("connect")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let data = self.dir.path().join("data");
        let _ = run(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap_or("."),
                "-m",
                "immediate",
                "stop",
            ],
        );
    }
}

#[derive(Serialize, Deserialize)]
pub struct Add(pub u64);
#[derive(Serialize, Deserialize)]
pub struct Get;

protocol! {
    /// A counter whose additions are journaled.
    pub protocol Tally = "tally" {
        ask Add -> u64;
        ask Get -> u64;
    }
}

#[derive(Default)]
struct TallyEntity {
    total: u64,
}

impl Entity for TallyEntity {
    type Protocol = Tally;
}

impl EventSourced for TallyEntity {
    type Event = u64;
    fn apply(&mut self, n: &u64) {
        self.total += n;
    }
}

impl Handler<Add> for TallyEntity {
    async fn handle(&mut self, msg: Add, ctx: &EntityContext) -> ShardingResult<u64> {
        self.persist(ctx, msg.0).await?;
        Ok(self.total)
    }
}

impl Handler<Get> for TallyEntity {
    async fn handle(&mut self, _: Get, _: &EntityContext) -> ShardingResult<u64> {
        Ok(self.total)
    }
}

const T: Duration = Duration::from_secs(10);

async fn system_on(store: PgPersistence) -> ShardedSystem<NoStore, PgPersistence> {
    let system = ShardedSystem::builder()
        .num_shards(8)
        .journal(store)
        .start()
        .await
        .expect("start");
    system
        .register_event_sourced::<TallyEntity>(|_| TallyEntity::default())
        .await
        .expect("register");
    system
}

#[test]
fn the_postgres_store_keeps_the_contract() {
    let Some(server) = Server::start() else {
        return;
    };
    conformance::journal(|| server.store());
    conformance::snapshots(|| server.store());
    conformance::durable_state(|| server.store());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_share_one_journal_on_postgres_and_never_fork_it() {
    let Some(server) = tokio::task::spawn_blocking(Server::start)
        .await
        .expect("start")
    else {
        return;
    };
    let url = server.database();
    let connect = |url: String| async move {
        tokio::task::spawn_blocking(move || PgPersistence::connect(&url, 4))
            .await
            .expect("connect")
            .expect("connect")
    };
    // Two systems, each with its own pool, as two nodes would have.
    let a = system_on(connect(url.clone()).await).await;
    let b = system_on(connect(url.clone()).await).await;
    let (at_a, at_b) = (a.entity_ref::<Tally>("x"), b.entity_ref::<Tally>("x"));
    assert_eq!(at_a.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_b.ask(Get, T).await.expect("get"), 0);
    assert_eq!(at_a.ask(Add(1), T).await.expect("a writes"), 1);
    match at_b.ask(Add(5), T).await {
        Err(ShardingError::Persistence { error, .. }) => assert!(
            matches!(
                *error,
                PersistenceError::SequenceConflict {
                    expected: 0,
                    actual: 1,
                    ..
                }
            ),
            "{error}"
        ),
        other => panic!("a stale write: {other:?}"),
    }
    a.shutdown().await;
    b.shutdown().await;
    // A new node on the same database recovers the one history.
    let c = system_on(connect(url).await).await;
    assert_eq!(
        c.entity_ref::<Tally>("x").ask(Get, T).await.expect("get"),
        1
    );
    let id = PersistenceId::new("tally", "x");
    let journal = c.journal().clone();
    let events = tokio::task::spawn_blocking(move || journal.replay(&id, 1, u64::MAX, 10))
        .await
        .expect("replay")
        .expect("replay");
    assert_eq!(
        events.iter().map(|e| e.sequence_nr).collect::<Vec<_>>(),
        [1]
    );
    c.shutdown().await;
    drop(server);
}
