//! The embedded redb store's records, read and written whole for
//! [`copy`](crate::persistence::copy()).

use redb::{ReadableTable, ReadableTableMetadata, Table, TableDefinition, WriteTransaction};

use super::{EVENTS, HIGHEST, REMEMBERED, RedbPersistence, SNAPSHOTS, STATES, store_error};
use crate::persistence::copy::{Records, Stored};
use crate::persistence::{PersistenceResult, lane_of};

/// Opens `table` in each of `txns`.
fn open_in<'t, K: redb::Key + 'static, V: redb::Value + 'static>(
    txns: &'t [WriteTransaction],
    table: TableDefinition<K, V>,
) -> PersistenceResult<Vec<Table<'t, K, V>>> {
    txns.iter()
        .map(|txn| txn.open_table(table).map_err(store_error))
        .collect()
}

impl Records for RedbPersistence {
    fn holds_nothing(&self) -> PersistenceResult<bool> {
        for db in self.lanes.iter() {
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

    fn export(
        &self,
        each: &mut dyn FnMut(Stored) -> PersistenceResult<()>,
    ) -> PersistenceResult<()> {
        for db in self.lanes.iter() {
            let txn = db.begin_read().map_err(store_error)?;
            let events = txn.open_table(EVENTS).map_err(store_error)?;
            for entry in events.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id, n) = key.value();
                each(Stored::Event(
                    t.into(),
                    id.into(),
                    n,
                    value.value().to_vec(),
                ))?;
            }
            let highest = txn.open_table(HIGHEST).map_err(store_error)?;
            for entry in highest.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id) = key.value();
                each(Stored::Highest(t.into(), id.into(), value.value()))?;
            }
            let snapshots = txn.open_table(SNAPSHOTS).map_err(store_error)?;
            for entry in snapshots.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id, n) = key.value();
                each(Stored::Snapshot(
                    t.into(),
                    id.into(),
                    n,
                    value.value().to_vec(),
                ))?;
            }
            let states = txn.open_table(STATES).map_err(store_error)?;
            for entry in states.iter().map_err(store_error)? {
                let (key, value) = entry.map_err(store_error)?;
                let (t, id) = key.value();
                each(Stored::State(t.into(), id.into(), value.value().to_vec()))?;
            }
            let remembered = txn.open_table(REMEMBERED).map_err(store_error)?;
            for entry in remembered.iter().map_err(store_error)? {
                let (key, _) = entry.map_err(store_error)?;
                let (t, shard, id) = key.value();
                each(Stored::Remembered(t.into(), shard, id.into()))?;
            }
        }
        Ok(())
    }

    /// One transaction per file, committed one after the other.
    fn import(&self, records: &[Stored]) -> PersistenceResult<()> {
        if records.is_empty() {
            return Ok(());
        }
        let lanes = self.lanes.len();
        let txns = self
            .lanes
            .iter()
            .map(|db| db.begin_write().map_err(store_error))
            .collect::<PersistenceResult<Vec<_>>>()?;
        {
            let mut events = open_in(&txns, EVENTS)?;
            let mut highest = open_in(&txns, HIGHEST)?;
            let mut snapshots = open_in(&txns, SNAPSHOTS)?;
            let mut states = open_in(&txns, STATES)?;
            let mut remembered = txns[0].open_table(REMEMBERED).map_err(store_error)?;
            for record in records {
                match record {
                    Stored::Event(t, id, n, value) => events[lane_of(t, id, lanes)]
                        .insert((t.as_str(), id.as_str(), *n), value.as_slice())
                        .map(drop),
                    Stored::Highest(t, id, n) => highest[lane_of(t, id, lanes)]
                        .insert((t.as_str(), id.as_str()), *n)
                        .map(drop),
                    Stored::Snapshot(t, id, n, value) => snapshots[lane_of(t, id, lanes)]
                        .insert((t.as_str(), id.as_str(), *n), value.as_slice())
                        .map(drop),
                    Stored::State(t, id, value) => states[lane_of(t, id, lanes)]
                        .insert((t.as_str(), id.as_str()), value.as_slice())
                        .map(drop),
                    Stored::Remembered(t, shard, id) => remembered
                        .insert((t.as_str(), *shard, id.as_str()), ())
                        .map(drop),
                }
                .map_err(store_error)?;
            }
        }
        for txn in txns {
            txn.commit().map_err(store_error)?;
        }
        Ok(())
    }
}
