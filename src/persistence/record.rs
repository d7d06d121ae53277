//! The record both embedded stores write for an event, a snapshot or a
//! state (SPEC §8b): version 1 is byte `1`; the writer's node id,
//! incarnation and generation (`u64` little-endian each); the payload's
//! version (`u32` LE); the manifest's length (`u32` LE) and its UTF-8
//! bytes; the payload's bytes to the end. A record that does not read so
//! is [`PersistenceError::Corrupt`], never applied.

use super::{Payload, PersistenceError, PersistenceId, PersistenceResult, StateRecord, Writer};

/// The record format the embedded stores write.
pub(super) const RECORD_FORMAT: u8 = 1;
pub(super) const HEADER: usize = 1 + 8 * 3 + 4 + 4;

pub(super) fn encode(payload: &Payload, writer: Writer, out: &mut Vec<u8>) {
    out.reserve(HEADER + payload.manifest.len() + payload.bytes.len());
    out.push(RECORD_FORMAT);
    out.extend_from_slice(&writer.node_id.to_le_bytes());
    out.extend_from_slice(&writer.incarnation.to_le_bytes());
    out.extend_from_slice(&writer.generation.to_le_bytes());
    out.extend_from_slice(&payload.version.to_le_bytes());
    out.extend_from_slice(&(payload.manifest.len() as u32).to_le_bytes());
    out.extend_from_slice(payload.manifest.as_bytes());
    out.extend_from_slice(&payload.bytes);
}

pub(super) fn decode(id: &PersistenceId, bytes: &[u8]) -> PersistenceResult<(Payload, Writer)> {
    let corrupt = |what: String| PersistenceError::Corrupt {
        persistence_id: id.clone(),
        what,
    };
    if bytes.len() < HEADER {
        return Err(corrupt(format!("a record of {} bytes", bytes.len())));
    }
    if bytes[0] != RECORD_FORMAT {
        return Err(corrupt(format!("record format {}", bytes[0])));
    }
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let writer = Writer {
        node_id: u64_at(1),
        incarnation: u64_at(9),
        generation: u64_at(17),
    };
    let version = u32_at(25);
    let len = u32_at(29) as usize;
    let rest = &bytes[HEADER..];
    if rest.len() < len {
        return Err(corrupt(format!(
            "a manifest of {len} bytes in {}",
            rest.len()
        )));
    }
    let manifest = std::str::from_utf8(&rest[..len])
        .map_err(|_| corrupt("a manifest that is not UTF-8".into()))?
        .to_owned();
    let payload = Payload {
        manifest,
        version,
        bytes: rest[len..].to_vec(),
    };
    Ok((payload, writer))
}

/// A stored state's revision, and its record unless it is a delete's
/// tombstone (the revision alone).
pub(super) fn read_state(
    id: &PersistenceId,
    bytes: &[u8],
) -> PersistenceResult<(u64, Option<StateRecord>)> {
    let Some((revision, record)) = bytes.split_first_chunk::<8>() else {
        return Err(PersistenceError::Corrupt {
            persistence_id: id.clone(),
            what: format!("a state of {} bytes", bytes.len()),
        });
    };
    let revision = u64::from_be_bytes(*revision);
    if record.is_empty() {
        return Ok((revision, None));
    }
    let (payload, writer) = decode(id, record)?;
    let state = StateRecord {
        revision,
        payload,
        writer,
    };
    Ok((revision, Some(state)))
}
