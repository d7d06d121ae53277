//! Reading what an earlier build stored: `Stored`, one stored record as an
//! entity type's reader (its upcaster) sees it, and `Unreadable`, why it
//! could not be read.

use serde::de::{DeserializeOwned, IgnoredAny};

use super::DeliveryRow;

/// One stored record — a journaled event, a snapshot, a durable state, or
/// a migrated state — as the entity type's reader sees it: the version its
/// writer stored it at, and its CBOR.
///
/// Each durable trait reads its records through one function, whose
/// default decodes the current shape: [`EventSourced::read_event`],
/// [`Snapshotted::read_snapshot`], [`DurableState::read_state`] and
/// [`Migratable::read_dehydrated`]. To read what an earlier build wrote,
/// override it with an upcaster: decode the shape of the record's version
/// and convert it into the current one.
///
/// ```
/// # use datum_cluster_sharding::prelude::*;
/// # #[derive(Serialize, Deserialize)] pub struct Add(pub u64);
/// # protocol! { pub protocol Counter = "counter" { tell Add; } }
/// /// Version 1 of the event: a bare number.
/// #[derive(Deserialize)]
/// struct AddedV1(u64);
///
/// /// Version 2: the number and who added it.
/// #[derive(Serialize, Deserialize)]
/// struct Added { by: u64, from: String }
///
/// impl From<AddedV1> for Added {
///     fn from(old: AddedV1) -> Added {
///         Added { by: old.0, from: "unknown".into() }
///     }
/// }
///
/// # #[derive(Default)] struct CounterEntity { total: u64 }
/// # impl Entity for CounterEntity { type Protocol = Counter; }
/// # impl Handler<Add> for CounterEntity {
/// #     async fn handle(&mut self, m: Add, ctx: &EntityContext) -> ShardingResult<()> {
/// #         self.persist(ctx, Added { by: m.0, from: "me".into() }).await
/// #     }
/// # }
/// impl EventSourced for CounterEntity {
///     type Event = Added;
///     const EVENT_VERSION: u32 = 2;
///     fn apply(&mut self, event: &Added) { self.total += event.by; }
///
///     fn read_event(stored: Stored<'_>) -> Result<Added, Unreadable> {
///         match stored.version() {
///             1 => stored.decode::<AddedV1>().map(Added::from),
///             _ => stored.decode(),
///         }
///     }
/// }
/// # fn main() {}
/// ```
///
/// A record of a version above the type's own is refused before its
/// reader is called (the build is older than the data), as is a record of
/// another type.
///
/// [`EventSourced::read_event`]: crate::EventSourced::read_event
/// [`Snapshotted::read_snapshot`]: crate::Snapshotted::read_snapshot
/// [`DurableState::read_state`]: crate::DurableState::read_state
/// [`Migratable::read_dehydrated`]: crate::Migratable::read_dehydrated
#[derive(Clone, Copy, Debug)]
pub struct Stored<'a> {
    version: u32,
    bytes: &'a [u8],
    /// Whether `bytes` is the pair `[record, deliveries]` (SPEC §13.17).
    paired: bool,
}

impl<'a> Stored<'a> {
    /// A record written alone at `version` as `bytes` (CBOR): what a
    /// reader gets (and what tests an upcaster without a store).
    pub fn new(version: u32, bytes: &'a [u8]) -> Self {
        Stored {
            version,
            bytes,
            paired: false,
        }
    }

    /// A record stored as the first of the pair `[record, deliveries]`.
    pub(crate) fn paired(version: u32, bytes: &'a [u8]) -> Self {
        Stored {
            version,
            bytes,
            paired: true,
        }
    }

    /// The version the record was stored at (its writer's
    /// `EVENT_VERSION`, `SNAPSHOT_VERSION` or `STATE_VERSION`); never above
    /// the reading type's own.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Decodes the record as a `T`: the current shape, or the shape of an
    /// earlier version.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, Unreadable> {
        let decoded = if self.paired {
            ciborium::from_reader::<(T, IgnoredAny), _>(self.bytes).map(|(record, _)| record)
        } else {
            ciborium::from_reader(self.bytes)
        };
        decoded.map_err(|e| Unreadable::new(format!("it does not decode: {e}")))
    }

    /// The deliveries table of a paired record.
    pub(crate) fn deliveries(&self) -> Result<Vec<DeliveryRow>, Unreadable> {
        ciborium::from_reader::<(IgnoredAny, Vec<DeliveryRow>), _>(self.bytes)
            .map(|(_, rows)| rows)
            .map_err(|e| Unreadable::new(format!("its deliveries do not decode: {e}")))
    }
}

/// Why a stored record could not be read into the current shape: it does
/// not decode as the shape its reader chose, or the reader refused it.
/// Recovery reports it as
/// [`PersistenceError::Corrupt`](crate::persistence::PersistenceError::Corrupt)
/// (nothing is applied); a migrated state that cannot be read leaves the
/// incarnation as its factory made it, with a
/// [`MigrationEvent`](crate::MigrationEvent) saying so.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unreadable(String);

impl Unreadable {
    /// A reader's own refusal, saying why.
    pub fn new(why: impl std::fmt::Display) -> Self {
        Unreadable(why.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cbor(value: &impl serde::Serialize) -> Vec<u8> {
        let mut bytes = Vec::new();
        ciborium::into_writer(value, &mut bytes).expect("encodes");
        bytes
    }

    #[test]
    fn a_record_alone_decodes_as_the_shape_its_reader_chooses() {
        let bytes = cbor(&(7u64, "x"));
        let stored = Stored::new(1, &bytes);
        assert_eq!(stored.version(), 1);
        assert_eq!(stored.decode::<(u64, String)>(), Ok((7, "x".into())));
        let wrong = stored.decode::<String>().expect_err("not a string");
        assert!(wrong.to_string().contains("does not decode"), "{wrong}");
    }

    #[test]
    fn a_paired_record_gives_its_record_and_its_deliveries_apart() {
        let rows = vec![DeliveryRow("p".into(), 1, 9)];
        let bytes = cbor(&((7u64, "x"), &rows));
        let stored = Stored::paired(2, &bytes);
        assert_eq!(stored.decode::<(u64, String)>(), Ok((7, "x".into())));
        assert_eq!(stored.deliveries(), Ok(rows));
        let alone = Stored::new(2, &bytes);
        assert!(alone.decode::<(u64, String)>().is_err());
    }
}
