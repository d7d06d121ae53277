//! Copying an embedded store into another of any layout
//! ([`RedbPersistence::copy_into`]).

use redb::{ReadableTable, ReadableTableMetadata, Table, TableDefinition, WriteTransaction};

use super::{
    Copied, EVENTS, HIGHEST, REMEMBERED, RedbPersistence, SNAPSHOTS, STATES, store_error,
};
use crate::persistence::{PersistenceError, PersistenceResult, lane_of};

/// Opens `table` in each of `txns`.
fn open_in<'t, K: redb::Key + 'static, V: redb::Value + 'static>(
    txns: &'t [WriteTransaction],
    table: TableDefinition<K, V>,
) -> PersistenceResult<Vec<Table<'t, K, V>>> {
    txns.iter()
        .map(|txn| txn.open_table(table).map_err(store_error))
        .collect()
}

/// Whether every table of every file of `store` is empty.
fn is_empty(store: &RedbPersistence) -> PersistenceResult<bool> {
    for db in store.lanes.iter() {
        let txn = db.begin_read().map_err(store_error)?;
        let counts = [
            txn.open_table(EVENTS).map_err(store_error)?.len(),
            txn.open_table(HIGHEST).map_err(store_error)?.len(),
            txn.open_table(SNAPSHOTS).map_err(store_error)?.len(),
            txn.open_table(STATES).map_err(store_error)?.len(),
            txn.open_table(REMEMBERED).map_err(store_error)?.len(),
        ];
        for count in counts {
            if count.map_err(store_error)? > 0 {
                return Ok(false);
            }
        }
    }
    Ok(true)
}

pub(super) fn copy_into(
    source: &RedbPersistence,
    target: &RedbPersistence,
) -> PersistenceResult<Copied> {
    if !is_empty(target)? {
        return Err(PersistenceError::Invalid(
            "the store to copy into is not empty".into(),
        ));
    }
    let lanes = target.lanes.len();
    let txns = target
        .lanes
        .iter()
        .map(|db| db.begin_write().map_err(store_error))
        .collect::<PersistenceResult<Vec<_>>>()?;
    let mut copied = Copied::default();
    {
        let mut events = open_in(&txns, EVENTS)?;
        let mut highest = open_in(&txns, HIGHEST)?;
        let mut snapshots = open_in(&txns, SNAPSHOTS)?;
        let mut states = open_in(&txns, STATES)?;
        let mut remembered = txns[0].open_table(REMEMBERED).map_err(store_error)?;
        for db in source.lanes.iter() {
            let txn = db.begin_read().map_err(store_error)?;
            for entry in txn.open_table(EVENTS).map_err(store_error)?.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id, n) = key.value();
                events[lane_of(t, id, lanes)]
                    .insert((t, id, n), value.value())
                    .map_err(store_error)?;
                copied.events += 1;
            }
            for entry in txn.open_table(HIGHEST).map_err(store_error)?.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id) = key.value();
                highest[lane_of(t, id, lanes)]
                    .insert((t, id), value.value())
                    .map_err(store_error)?;
                copied.journals += 1;
            }
            for entry in txn.open_table(SNAPSHOTS).map_err(store_error)?.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id, n) = key.value();
                snapshots[lane_of(t, id, lanes)]
                    .insert((t, id, n), value.value())
                    .map_err(store_error)?;
                copied.snapshots += 1;
            }
            for entry in txn.open_table(STATES).map_err(store_error)?.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id) = key.value();
                states[lane_of(t, id, lanes)]
                    .insert((t, id), value.value())
                    .map_err(store_error)?;
                copied.states += 1;
            }
            for entry in txn.open_table(REMEMBERED).map_err(store_error)?.iter().map_err(store_error)? {
                let (key, _) = entry.map_err(store_error)?;
                remembered.insert(key.value(), ()).map_err(store_error)?;
                copied.remembered += 1;
            }
        }
    }
    for txn in txns {
        txn.commit().map_err(store_error)?;
    }
    Ok(copied)
}
