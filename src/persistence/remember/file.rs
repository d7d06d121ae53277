//! `FileStore`: remember-entities in per-shard append logs that survive a
//! node restart.
//!
//! ```text
//!   <dir>/<hex(type name)>/<shard as 8 hex digits>.log
//!
//!   log    = header record*
//!   header = "DCSR" version:u8                      (5 bytes; version 1)
//!   record = len:u32 BE  crc:u32 BE  body[len]      (crc = CRC-32/IEEE of body)
//!   body   = op:u8 (1 = started, 2 = stopped)  entity id (UTF-8, len - 1 bytes)
//! ```
//!
//! A start appends one record. A stop rewrites the log with only the live
//! ids (compaction: a temporary file beside it, then an atomic rename, then
//! the directory synced), so a log never holds more than its live ids plus
//! the starts since its last compaction. Names are hex-encoded, so no type
//! name (`../`, `/`, NUL, …) can reach outside `<dir>`.
//!
//! On load, a torn last record (a power cut mid-append: too short, or its
//! checksum wrong at the very end) is dropped, reported with a warning, and
//! cut off the file, so the next append does not land behind garbage. A bad
//! header, a record that fails its checksum with more after it, or a body
//! that is not a known op with a UTF-8 id is an error: the log is left as it
//! is. A log from a newer format version is refused with an error saying so.

use std::collections::{BTreeSet, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::{RememberEntitiesStore, RememberRecord, StoreError, StoreRepair};
use crate::model::extractor::ShardId;

const MAGIC: &[u8; 4] = b"DCSR";
/// The log format this build writes and reads.
pub const FILE_STORE_VERSION: u8 = 1;
const HEADER_LEN: usize = 5;
const RECORD_HEAD: usize = 8;
const OP_STARTED: u8 = 1;
const OP_STOPPED: u8 = 2;
/// The longest type name the store accepts: its hex form is one directory
/// name, which file systems limit to 255 bytes.
pub const MAX_TYPE_NAME: usize = 120;
/// The longest entity id the store records (one record).
pub const MAX_ENTITY_ID: usize = 64 * 1024;

/// When the file store calls `fsync`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FileStoreFsyncPolicy {
    /// After every append and every compaction (and the directory after each
    /// rename). The default: a recorded id survives a power cut.
    #[default]
    Always,
    /// Only compactions are synced; an append survives a process crash (it
    /// is in the kernel) but may be lost with a power cut.
    OnCompaction,
    /// Never; the kernel writes back when it likes.
    Never,
}

/// A remember-entities store of per-shard append logs under one directory.
/// See the module documentation for the format and its guarantees.
///
/// ```
/// use datum_cluster_sharding::{FileStore, FileStoreFsyncPolicy, RememberEntitiesStore, ShardId};
/// let dir = std::env::temp_dir().join(format!("doc-file-store-{}", std::process::id()));
/// let store = FileStore::open(&dir, FileStoreFsyncPolicy::Always).unwrap();
/// store.record_entity_started("counter", ShardId(7), "cart-42").unwrap();
/// // One store per directory at a time: a second open is refused…
/// assert!(FileStore::open(&dir, FileStoreFsyncPolicy::Always).is_err());
/// // …until the first is closed, as when a process restarts.
/// drop(store);
/// let again = FileStore::open(&dir, FileStoreFsyncPolicy::Always).unwrap();
/// assert_eq!(again.list_entities_for_shard("counter", ShardId(7)).unwrap(), vec!["cart-42"]);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug)]
pub struct FileStore {
    dir: PathBuf,
    fsync: FileStoreFsyncPolicy,
    /// The live ids of each shard whose log has been read.
    shards: Mutex<HashMap<(String, ShardId), ShardCache>>,
    /// Logs repaired on load since `take_repairs` last looked.
    repairs: Mutex<Vec<StoreRepair>>,
    /// `<dir>/lock`, locked exclusively while the store is open: a second
    /// store on the same directory (in this process or another) is refused
    /// rather than interleaving its writes and caches with this one's.
    _lock: fs::File,
}

/// The name of the lock file under a store's directory.
pub const LOCK_FILE: &str = "lock";

/// One shard's ids as its log holds them, loaded on first use (`None`:
/// not loaded, or to be read again after a failed write), behind a lock of
/// its own.
type ShardCache = Arc<Mutex<Option<BTreeSet<String>>>>;

impl FileStore {
    /// A store under `dir` (created if missing) with the given fsync policy.
    /// Fails if another `FileStore` has `dir` open (an exclusive lock on
    /// `<dir>/lock`, released when the store is dropped or its process ends).
    pub fn open(dir: impl AsRef<Path>, fsync: FileStoreFsyncPolicy) -> Result<Self, StoreError> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir).map_err(|e| io_error("create", &dir, &e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io_error("open", &lock_path, &e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(fs::TryLockError::WouldBlock) => {
                return Err(StoreError(format!(
                    "{} is in use by another FileStore (its lock file is held)",
                    dir.display()
                )));
            }
            Err(fs::TryLockError::Error(e)) => return Err(io_error("lock", &lock_path, &e)),
        }
        remove_leftover_compactions(&dir)?;
        Ok(FileStore {
            dir,
            fsync,
            shards: Mutex::new(HashMap::new()),
            repairs: Mutex::new(Vec::new()),
            _lock: lock,
        })
    }

    /// The directory the store writes under.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn type_dir(&self, type_name: &str) -> Result<PathBuf, StoreError> {
        if type_name.is_empty() {
            // Its hex form is empty: the logs would land in the store's root.
            return Err(StoreError(
                "the file store needs a non-empty type name".into(),
            ));
        }
        if type_name.len() > MAX_TYPE_NAME {
            return Err(StoreError(format!(
                "type name of {} bytes is longer than the file store's {MAX_TYPE_NAME}",
                type_name.len()
            )));
        }
        Ok(self.dir.join(hex(type_name.as_bytes())))
    }

    fn log_path(&self, type_name: &str, shard: ShardId) -> Result<PathBuf, StoreError> {
        Ok(self
            .type_dir(type_name)?
            .join(format!("{:08x}.log", shard.0)))
    }

    /// Runs `f` on the live ids of a shard, loading its log first if needed.
    fn with_shard<T>(
        &self,
        type_name: &str,
        shard: ShardId,
        f: impl FnOnce(&Path, &mut BTreeSet<String>) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let path = self.log_path(type_name, shard)?;
        // The store-wide lock is held only to find the shard's own: one
        // shard's read (or a writer's append) does not wait for another's.
        let cell = {
            let mut shards = self.shards.lock().unwrap_or_else(|p| p.into_inner());
            shards
                .entry((type_name.to_owned(), shard))
                .or_default()
                .clone()
        };
        let mut cached = cell.lock().unwrap_or_else(|p| p.into_inner());
        if cached.is_none() {
            let (ids, dropped) = load(&path, self.fsync)?;
            if let Some(bytes) = dropped {
                let what = format!(
                    "{}: the log ended in a torn record ({bytes} bytes, a crash mid-append); it was cut off",
                    path.display()
                );
                let repair = StoreRepair {
                    type_name: type_name.to_owned(),
                    shard_id: shard,
                    what,
                };
                lock_or_poisoned(&self.repairs).push(repair);
            }
            *cached = Some(ids);
        }
        let ids = cached
            .as_mut()
            .ok_or_else(|| StoreError("BUG: shard vanished from the cache".into()))?;
        let result = f(&path, ids);
        if result.is_err() {
            // What is on disk after a failed write is not known: read the
            // log again on next use (which also cuts a torn tail).
            *cached = None;
        }
        result
    }

    fn sync_dir(&self, dir: &Path) -> Result<(), StoreError> {
        if self.fsync == FileStoreFsyncPolicy::Never {
            return Ok(());
        }
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_error("sync", dir, &e))
    }

    /// Appends records to a log, then syncs once (per the policy).
    fn append(&self, path: &Path, records: &[(u8, &str)]) -> Result<(), StoreError> {
        let dir = path
            .parent()
            .ok_or_else(|| StoreError("BUG: a log path without a directory".into()))?;
        let created = !path.exists();
        if created && !dir.exists() {
            fs::create_dir_all(dir).map_err(|e| io_error("create", dir, &e))?;
            // The new type directory's entry lives in the store's directory.
            self.sync_dir(&self.dir)?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| io_error("open", path, &e))?;
        let len = file
            .metadata()
            .map_err(|e| io_error("inspect", path, &e))?
            .len();
        let size: usize = records
            .iter()
            .map(|(_, id)| RECORD_HEAD + 1 + id.len())
            .sum();
        let mut bytes = Vec::with_capacity(HEADER_LEN + size);
        if len == 0 {
            bytes.extend_from_slice(&header());
        }
        for (op, entity_id) in records {
            put_record(&mut bytes, *op, entity_id);
        }
        if let Err(e) = file.write_all(&bytes) {
            // Take back what part of the record was written, so that the
            // next append does not land behind a fragment.
            if let Err(cut) = file.set_len(len) {
                tracing::warn!(path = %path.display(), error = %cut, "could not cut a failed append back");
            }
            return Err(io_error("append to", path, &e));
        }
        if self.fsync == FileStoreFsyncPolicy::Always {
            file.sync_data().map_err(|e| io_error("sync", path, &e))?;
            if created {
                self.sync_dir(dir)?;
            }
        }
        Ok(())
    }

    /// Rewrites the log with exactly `ids`: a temporary file, synced unless
    /// the policy is `Never`, renamed over the log, then the directory synced.
    fn compact(&self, path: &Path, ids: &BTreeSet<String>) -> Result<(), StoreError> {
        let dir = path
            .parent()
            .ok_or_else(|| StoreError("BUG: a log path without a directory".into()))?;
        if ids.is_empty() {
            match fs::remove_file(path) {
                Ok(()) => return self.sync_dir(dir),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                Err(e) => return Err(io_error("remove", path, &e)),
            }
        }
        if !dir.exists() {
            // A batch may compact a shard that had no log yet.
            fs::create_dir_all(dir).map_err(|e| io_error("create", dir, &e))?;
            self.sync_dir(&self.dir)?;
        }
        let mut bytes = header().to_vec();
        for id in ids {
            put_record(&mut bytes, OP_STARTED, id);
        }
        let tmp = path.with_extension("log.tmp");
        let mut file = File::create(&tmp).map_err(|e| io_error("create", &tmp, &e))?;
        file.write_all(&bytes)
            .map_err(|e| io_error("write", &tmp, &e))?;
        if self.fsync != FileStoreFsyncPolicy::Never {
            file.sync_all().map_err(|e| io_error("sync", &tmp, &e))?;
        }
        drop(file);
        fs::rename(&tmp, path).map_err(|e| io_error("rename over", path, &e))?;
        self.sync_dir(dir)
    }
}

impl RememberEntitiesStore for FileStore {
    fn take_repairs(&self) -> Vec<StoreRepair> {
        std::mem::take(&mut *lock_or_poisoned(&self.repairs))
    }

    fn record_entity_started(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        check_id(entity_id)?;
        self.with_shard(type_name, shard_id, |path, ids| {
            if ids.contains(entity_id) {
                return Ok(());
            }
            self.append(path, &[(OP_STARTED, entity_id)])?;
            ids.insert(entity_id.to_owned());
            Ok(())
        })
    }

    fn record_entity_stopped(
        &self,
        type_name: &str,
        shard_id: ShardId,
        entity_id: &str,
    ) -> Result<(), StoreError> {
        self.with_shard(type_name, shard_id, |path, ids| {
            if !ids.contains(entity_id) {
                return Ok(());
            }
            let mut live = ids.clone();
            live.remove(entity_id);
            self.compact(path, &live)?;
            *ids = live;
            Ok(())
        })
    }

    /// Group commit: per shard log, every start in the batch is appended
    /// with one write and one sync; a batch with a stop compacts the log
    /// once, to what is live after the whole batch. A failure fails every
    /// record of that shard in the batch (none of them is known durable).
    fn record_batch(&self, records: &[RememberRecord<'_>]) -> Vec<Result<(), StoreError>> {
        let mut results: Vec<Result<(), StoreError>> = records.iter().map(|_| Ok(())).collect();
        let mut groups: Vec<((&str, ShardId), Vec<usize>)> = Vec::new();
        for (i, r) in records.iter().enumerate() {
            if r.started
                && let Err(error) = check_id(r.entity_id)
            {
                results[i] = Err(error);
                continue;
            }
            let key = (r.type_name, r.shard_id);
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        for ((type_name, shard), members) in groups {
            let outcome = self.with_shard(type_name, shard, |path, ids| {
                let mut live = ids.clone();
                let mut appended: Vec<(u8, &str)> = Vec::new();
                let mut compact = false;
                for &i in &members {
                    let r = &records[i];
                    if r.started {
                        if live.insert(r.entity_id.to_owned()) {
                            appended.push((OP_STARTED, r.entity_id));
                        }
                    } else if live.remove(r.entity_id) {
                        compact = true;
                    }
                }
                if compact {
                    self.compact(path, &live)?;
                } else if !appended.is_empty() {
                    self.append(path, &appended)?;
                }
                *ids = live;
                Ok(())
            });
            if let Err(error) = outcome {
                for i in members {
                    results[i] = Err(error.clone());
                }
            }
        }
        results
    }

    fn list_entities_for_shard(
        &self,
        type_name: &str,
        shard_id: ShardId,
    ) -> Result<Vec<String>, StoreError> {
        self.with_shard(type_name, shard_id, |_, ids| {
            Ok(ids.iter().cloned().collect())
        })
    }

    fn list_shards(&self, type_name: &str) -> Result<Vec<ShardId>, StoreError> {
        let dir = self.type_dir(type_name)?;
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io_error("list", &dir, &e)),
        };
        let mut shards = Vec::new();
        for entry in entries {
            let entry = entry.map_err(|e| io_error("list", &dir, &e))?;
            let name = entry.file_name();
            let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".log")) else {
                continue;
            };
            if stem.len() == 8
                && let Ok(shard) = u32::from_str_radix(stem, 16)
            {
                shards.push(ShardId(shard));
            }
        }
        shards.sort();
        // By file name only: a log that fails to load is reported when its
        // own shard starts and lists it, not here for every shard.
        Ok(shards)
    }
}

fn header() -> [u8; HEADER_LEN] {
    [MAGIC[0], MAGIC[1], MAGIC[2], MAGIC[3], FILE_STORE_VERSION]
}

fn put_record(out: &mut Vec<u8>, op: u8, entity_id: &str) {
    let mut body = Vec::with_capacity(1 + entity_id.len());
    body.push(op);
    body.extend_from_slice(entity_id.as_bytes());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&crc32fast::hash(&body).to_be_bytes());
    out.extend_from_slice(&body);
}

fn check_id(entity_id: &str) -> Result<(), StoreError> {
    if entity_id.len() > MAX_ENTITY_ID {
        return Err(StoreError(format!(
            "entity id of {} bytes is longer than the file store's {MAX_ENTITY_ID}",
            entity_id.len()
        )));
    }
    Ok(())
}

/// What a log's bytes say: the live ids, and where the valid part ends if a
/// torn tail follows it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) ids: BTreeSet<String>,
    pub(crate) torn_at: Option<usize>,
}

/// Parses a whole log. Errors name what is wrong and where.
pub(crate) fn parse(bytes: &[u8]) -> Result<Parsed, String> {
    if bytes.len() < HEADER_LEN {
        // A log cut inside its header by a crash on its first append.
        return if MAGIC.starts_with(&bytes[..bytes.len().min(4)]) {
            Ok(Parsed {
                ids: BTreeSet::new(),
                torn_at: Some(0),
            })
        } else {
            Err("not a remember-entities log (no header at byte 0)".into())
        };
    }
    if &bytes[..4] != MAGIC {
        return Err("not a remember-entities log (bad magic at byte 0)".into());
    }
    let version = bytes[4];
    if version > FILE_STORE_VERSION {
        return Err(format!(
            "log format version {version} (byte 4) is newer than this build's {FILE_STORE_VERSION}"
        ));
    }
    if version == 0 {
        return Err("log format version 0 (byte 4) does not exist".into());
    }
    let mut ids = BTreeSet::new();
    let mut pos = HEADER_LEN;
    // The valid part ends at `pos`: what follows is the last append, torn.
    // (Built only then: a copy of the ids per record made reading a log
    // cost the square of its length.)
    let torn = |ids: BTreeSet<String>, pos: usize| {
        Ok(Parsed {
            ids,
            torn_at: Some(pos),
        })
    };
    while pos < bytes.len() {
        let rest = &bytes[pos..];
        if rest.len() < RECORD_HEAD {
            return torn(ids, pos);
        }
        // A power cut can leave the file longer than what was written,
        // the rest zeros: that too is the last append, torn.
        if rest.iter().all(|b| *b == 0) {
            return torn(ids, pos);
        }
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_be_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len == 0 || len > 1 + MAX_ENTITY_ID {
            return Err(format!(
                "record at byte {pos} has an impossible length {len}"
            ));
        }
        let Some(body) = rest.get(RECORD_HEAD..RECORD_HEAD + len) else {
            // The record runs past the end: the last append was cut short.
            return torn(ids, pos);
        };
        let end = pos + RECORD_HEAD + len;
        if crc32fast::hash(body) != crc {
            if end == bytes.len() {
                return torn(ids, pos);
            }
            return Err(format!("record at byte {pos} fails its checksum"));
        }
        let Some((&op, id)) = body.split_first() else {
            return Err(format!("empty record at byte {pos}"));
        };
        let id = std::str::from_utf8(id)
            .map_err(|_| format!("record at byte {pos} holds an id that is not UTF-8"))?;
        match op {
            OP_STARTED => {
                ids.insert(id.to_owned());
            }
            OP_STOPPED => {
                ids.remove(id);
            }
            other => return Err(format!("record at byte {pos} has unknown op {other}")),
        }
        pos = end;
    }
    Ok(Parsed { ids, torn_at: None })
}

/// Reads a log (a missing one is empty); a torn tail is cut off the file,
/// and how many bytes it had is returned beside the ids.
fn load(
    path: &Path,
    fsync: FileStoreFsyncPolicy,
) -> Result<(BTreeSet<String>, Option<usize>), StoreError> {
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut file) => {
            file.read_to_end(&mut bytes)
                .map_err(|e| io_error("read", path, &e))?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((BTreeSet::new(), None)),
        Err(e) => return Err(io_error("open", path, &e)),
    }
    let parsed = parse(&bytes).map_err(|e| StoreError(format!("{}: {e}", path.display())))?;
    if let Some(at) = parsed.torn_at {
        tracing::warn!(path = %path.display(), dropped_bytes = bytes.len() - at, "remember-entities log ends in a torn record; it was dropped");
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| io_error("open", path, &e))?;
        // Cut inside the header: start the log over.
        let keep = if at < HEADER_LEN { 0 } else { at };
        file.set_len(keep as u64)
            .map_err(|e| io_error("truncate", path, &e))?;
        if fsync != FileStoreFsyncPolicy::Never {
            file.sync_all().map_err(|e| io_error("sync", path, &e))?;
        }
    }
    Ok((parsed.ids, parsed.torn_at.map(|at| bytes.len() - at)))
}

fn lock_or_poisoned<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Removes the temporary files of compactions a crash interrupted (a
/// `<shard>.log.tmp` beside its log: the rename over the log never came, so
/// the log itself is intact, and the file would stay for ever).
fn remove_leftover_compactions(dir: &Path) -> Result<(), StoreError> {
    let entries = fs::read_dir(dir).map_err(|e| io_error("list", dir, &e))?;
    for type_dir in entries.flatten() {
        let path = type_dir.path();
        if !path.is_dir() {
            continue;
        }
        let logs = fs::read_dir(&path).map_err(|e| io_error("list", &path, &e))?;
        for log in logs.flatten() {
            let name = log.file_name();
            if name.to_str().is_some_and(|n| n.ends_with(".log.tmp")) {
                let tmp = log.path();
                fs::remove_file(&tmp).map_err(|e| io_error("remove", &tmp, &e))?;
                tracing::info!(path = %tmp.display(), "removed an interrupted compaction's temporary file");
            }
        }
    }
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 0xf) as usize] as char);
    }
    out
}

fn io_error(what: &str, path: &Path, error: &std::io::Error) -> StoreError {
    StoreError(format!("could not {what} {}: {error}", path.display()))
}

#[cfg(test)]
#[path = "file_tests.rs"]
mod tests;
