//! A throwaway PostgreSQL server for the tests and the benchmark runner:
//! the Debian package's `initdb` and `pg_ctl`, a temporary directory, a
//! free port on 127.0.0.1 (or on an address of a network namespace);
//! stopped (and its directory removed) when dropped. PostgreSQL refuses to
//! run as root, so as root the server runs as the package's `postgres` user.

#![allow(dead_code)] // not every program that includes this file uses all of it

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

/// A PostgreSQL server in a temporary directory, stopped when dropped.
pub struct Server {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    options: String,
    databases: AtomicU32,
    /// Where clients connect over TCP.
    host: String,
    /// The network namespace it runs in, if not this process's.
    netns: Option<String>,
}

/// Whether commits reach the disk before they are acknowledged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// PostgreSQL's default (`fsync=on`, `synchronous_commit=on`): what a
    /// benchmark of durable writes must measure.
    Fsync,
    /// `fsync=off`: for tests, which check behaviour, not crash safety.
    NoFsync,
}

/// The package's binaries, newest version first.
pub fn binaries() -> Option<PathBuf> {
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop()
}

/// Runs a server binary, as the package's unprivileged user when root,
/// inside network namespace `netns` if one is given.
fn run(bin: &Path, netns: Option<&str>, program: &str, args: &[&str]) -> std::process::Output {
    let exe = bin.join(program);
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
    let mut argv: Vec<std::ffi::OsString> = Vec::new();
    if let Some(ns) = netns {
        argv.extend(["ip", "netns", "exec", ns].map(Into::into));
    }
    if root {
        argv.extend(["runuser", "-u", "postgres", "--"].map(Into::into));
    }
    argv.push(exe.into());
    let mut command = Command::new(&argv[0]);
    command.args(&argv[1..]);
    command
        .args(args)
        .output()
        .expect("run a PostgreSQL binary")
}

impl Server {
    /// Starts a server, or says in one line why it cannot (the package is
    /// not installed) and gives `None`.
    pub fn start(durability: Durability) -> Option<Server> {
        Server::start_on(durability, None, "127.0.0.1")
    }

    /// [`start`](Self::start), inside network namespace `netns`, listening
    /// there on `addr` (an address of one of its interfaces). Its socket
    /// directory, which [`psql`](Self::psql) and [`database`](Self::database)
    /// use, is reachable from every namespace.
    pub fn start_in(durability: Durability, netns: &str, addr: &str) -> Option<Server> {
        Server::start_on(durability, Some(netns), addr)
    }

    fn start_on(durability: Durability, netns: Option<&str>, addr: &str) -> Option<Server> {
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
        let mut init_args = vec!["-D", data, "-U", "postgres", "-A", "trust"];
        if durability == Durability::NoFsync {
            init_args.push("--no-sync");
        }
        let init = run(&bin, None, "initdb", &init_args);
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        if netns.is_some() {
            // initdb trusts loopback only; let in the namespace's subnets.
            use std::io::Write;
            let hba = dir.path().join("data/pg_hba.conf");
            std::fs::OpenOptions::new()
                .append(true)
                .open(hba)
                .and_then(|mut f| f.write_all(b"host all all samenet trust\n"))
                .expect("pg_hba.conf");
        }
        let fsync = match durability {
            Durability::Fsync => "on",
            Durability::NoFsync => "off",
        };
        let options = format!(
            "-p {port} -k {} -c listen_addresses={addr} -c fsync={fsync}",
            dir.path().display()
        );
        let server = Server {
            bin,
            dir,
            port,
            options,
            databases: AtomicU32::new(0),
            host: addr.to_owned(),
            netns: netns.map(str::to_owned),
        };
        server.resume();
        Some(server)
    }

    /// The server's port (on 127.0.0.1, or on the address it was started on).
    pub fn port(&self) -> u16 {
        self.port
    }

    fn data(&self) -> String {
        let data = self.dir.path().join("data");
        data.to_str().expect("a UTF-8 path").to_owned()
    }

    /// Stops the server at once (`-m immediate`: clients see their
    /// connections cut, as when a database host dies).
    pub fn halt(&self) {
        let stopped = run(
            &self.bin,
            self.netns.as_deref(),
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "-w", "stop"],
        );
        assert!(
            stopped.status.success(),
            "pg_ctl stop: {}",
            String::from_utf8_lossy(&stopped.stderr)
        );
    }

    /// Starts the server (again), on the same port and data.
    pub fn resume(&self) {
        let log = self.dir.path().join("server.log");
        let started = run(
            &self.bin,
            self.netns.as_deref(),
            "pg_ctl",
            &[
                "-D",
                &self.data(),
                "-l",
                log.to_str().expect("UTF-8"),
                "-o",
                &self.options,
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
    }

    /// A fresh, empty database's connection string (over TCP).
    pub fn database(&self) -> String {
        let name = format!("t{}", self.databases.fetch_add(1, Ordering::Relaxed));
        let created = self
            .client("createdb")
            .arg(&name)
            .output()
            .expect("createdb");
        assert!(
            created.status.success(),
            "createdb: {}",
            String::from_utf8_lossy(&created.stderr)
        );
        format!(
            "host={} port={} user=postgres dbname={name}",
            self.host, self.port
        )
    }

    /// The rows `sql` gives in `database` (a [`database`](Self::database)
    /// connection string), one line each, columns separated by `|`.
    pub fn psql(&self, database: &str, sql: &str) -> String {
        let name = database
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix("dbname="))
            .expect("a dbname");
        let out = self
            .client("psql")
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                name,
                "-c",
                sql,
            ])
            .output()
            .expect("psql");
        assert!(
            out.status.success(),
            "psql: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("UTF-8 rows")
    }

    /// A client program of the package, to reach the server through its
    /// socket directory.
    fn client(&self, program: &str) -> Command {
        let mut command = Command::new(self.bin.join(program));
        command.arg("-h").arg(self.dir.path());
        command.args(["-p", &self.port.to_string(), "-U", "postgres"]);
        command
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = run(
            &self.bin,
            self.netns.as_deref(),
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "stop"],
        );
    }
}
