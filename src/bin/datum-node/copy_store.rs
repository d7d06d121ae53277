//! `datum-node copy-store`: copies one embedded store into another, of
//! either kind and any layout (`persistence::copy`) — the one-shot way
//! from a redb file to redb lanes or to fjall, with every node that uses
//! either store stopped.

use std::path::PathBuf;
use std::process::ExitCode;

use super::EXIT_START_FAILED;
use super::flags::CopyStoreArgs;

/// A store named on the command line: `redb:FILE`, `redb-lanes=N:DIR` or
/// `fjall:DIR`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum StoreSpec {
    Redb(PathBuf),
    RedbLanes(usize, PathBuf),
    Fjall(PathBuf),
}

pub(super) fn store_spec(s: &str) -> Result<StoreSpec, String> {
    let (kind, path) = s
        .split_once(':')
        .ok_or("expected redb:FILE, redb-lanes=N:DIR or fjall:DIR")?;
    if path.is_empty() {
        return Err(format!("{kind}: a path is missing"));
    }
    let path = PathBuf::from(path);
    match kind {
        "redb" => Ok(StoreSpec::Redb(path)),
        "fjall" => Ok(StoreSpec::Fjall(path)),
        _ => match kind.strip_prefix("redb-lanes=").map(str::parse::<usize>) {
            Some(Ok(lanes)) if (1..=MAX_LANES).contains(&lanes) => {
                Ok(StoreSpec::RedbLanes(lanes, path))
            }
            Some(Ok(lanes)) => Err(format!("{lanes} lanes: from 1 to {MAX_LANES}")),
            Some(Err(_)) => Err(format!("{kind}: the lane count is not a number")),
            None => Err(format!(
                "{kind}: expected redb:FILE, redb-lanes=N:DIR or fjall:DIR"
            )),
        },
    }
}

/// Runs `datum-node copy-store`.
pub(super) fn copy_store(args: CopyStoreArgs) -> ExitCode {
    match copy(&args.from, &args.to) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("datum-node copy-store: {error}");
            ExitCode::from(EXIT_START_FAILED)
        }
    }
}

#[cfg(feature = "fjall")]
use datum_cluster_sharding::persistence::FjallPersistence;
use datum_cluster_sharding::persistence::{self, Copied, MAX_LANES, RedbPersistence};

/// An open store of either kind.
enum Open {
    Redb(RedbPersistence),
    #[cfg(feature = "fjall")]
    Fjall(FjallPersistence),
}

impl Open {
    fn store(&self) -> persistence::EmbeddedStore<'_> {
        match self {
            Open::Redb(store) => store.into(),
            #[cfg(feature = "fjall")]
            Open::Fjall(store) => store.into(),
        }
    }
}

fn open(spec: &StoreSpec) -> Result<Open, String> {
    let opened = match spec {
        StoreSpec::Redb(file) => RedbPersistence::open(file).map(Open::Redb),
        StoreSpec::RedbLanes(lanes, dir) => {
            RedbPersistence::open_lanes(dir, *lanes).map(Open::Redb)
        }
        #[cfg(feature = "fjall")]
        StoreSpec::Fjall(dir) => FjallPersistence::open(dir).map(Open::Fjall),
        #[cfg(not(feature = "fjall"))]
        StoreSpec::Fjall(_) => {
            return Err("fjall: a build with `--features fjall` is needed".into());
        }
    };
    opened.map_err(|e| e.to_string())
}

/// The file that shows a store is there: the redb file, a lanes
/// layout's first file, or fjall's version marker. A source is opened only
/// when it is there, since opening creates a store.
fn marker(spec: &StoreSpec) -> PathBuf {
    match spec {
        StoreSpec::Redb(file) => file.clone(),
        StoreSpec::RedbLanes(lanes, dir) => dir.join(format!("lane-0-of-{lanes}.redb")),
        StoreSpec::Fjall(dir) => dir.join("version"),
    }
}

/// Copies `from` into `to` (which must be empty, or missing); what it
/// copied, as one line.
fn copy(from: &StoreSpec, to: &StoreSpec) -> Result<String, String> {
    let there = marker(from);
    if !there.is_file() {
        return Err(format!(
            "no store to copy from: {} does not exist",
            there.display()
        ));
    }
    let source = open(from)?;
    let target = open(to)?;
    let Copied {
        events,
        journals,
        snapshots,
        states,
        remembered,
    } = persistence::copy(source.store(), target.store()).map_err(|e| e.to_string())?;
    Ok(format!(
        "copied {events} events of {journals} journals, {snapshots} snapshots, {states} states and {remembered} remembered entities"
    ))
}
