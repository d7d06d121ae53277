//! A throwaway PostgreSQL server for the tests and the benchmark runner:
//! the Debian package's `initdb` and `pg_ctl`, a temporary directory, a
//! free port on 127.0.0.1; stopped (and its directory removed) when
//! dropped. PostgreSQL refuses to run as root, so as root the server runs
//! as the package's `postgres` user.

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

/// Runs a server binary, as the package's unprivileged user when root.
fn run(bin: &Path, program: &str, args: &[&str]) -> std::process::Output {
    let exe = bin.join(program);
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
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
    /// Starts a server, or says in one line why it cannot (the package is
    /// not installed) and gives `None`.
    pub fn start(durability: Durability) -> Option<Server> {
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
        let init = run(&bin, "initdb", &init_args);
        assert!(
            init.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&init.stderr)
        );
        let fsync = match durability {
            Durability::Fsync => "on",
            Durability::NoFsync => "off",
        };
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync={fsync}",
            dir.path().display()
        );
        let server = Server {
            bin,
            dir,
            port,
            options,
            databases: AtomicU32::new(0),
        };
        server.resume();
        Some(server)
    }

    /// The server's port on 127.0.0.1.
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

    /// A fresh, empty database's connection string.
    pub fn database(&self) -> String {
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
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = run(
            &self.bin,
            "pg_ctl",
            &["-D", &self.data(), "-m", "immediate", "stop"],
        );
    }
}
