//! Reading the JSON lines `datum-node` prints (SPEC §10c.2), shared by the
//! tests that run it as a process.
#![allow(dead_code)] // not every test uses every helper

/// The string value of `"key":"…"` in a line, borrowed from it. The lines
/// are flat objects whose string values need no escaping (SPEC §10c.2), so
/// the text between the quotes is the value.
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pattern = format!("\"{key}\":\"");
    let start = line.find(&pattern)? + pattern.len();
    let len = line[start..].find('"')?;
    Some(&line[start..start + len])
}

/// The unsigned integer value of `key` in a JSON line.
pub fn number(line: &str, key: &str) -> Option<u64> {
    serde_json::from_str::<serde_json::Value>(line).ok()?[key].as_u64()
}

/// The array of unsigned integers under `key` (`shard_ids`), empty if
/// there is none.
pub fn numbers(line: &str, key: &str) -> Vec<u32> {
    serde_json::from_str::<serde_json::Value>(line)
        .ok()
        .and_then(|v| {
            v[key].as_array().map(|items| {
                items
                    .iter()
                    .filter_map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// The bytes of a hex string (as `psql` prints `encode(bytea, 'hex')`).
pub fn unhex(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
        .collect()
}

/// Every row of `datum-node`'s journaled counters (`protocols/journaled.rs`)
/// in the PostgreSQL store, for [`walk_counter_journals`].
pub const COUNTER_JOURNALS: &str = "SELECT entity_id, sequence_nr, manifest, writer_node, \
     writer_incarnation, writer_generation, encode(payload, 'hex') FROM datum_events \
     WHERE type_name = 'journaled-counter' ORDER BY entity_id, sequence_nr";

/// A journaled counter's event (`Added { by, onto }`, CBOR).
#[derive(serde::Deserialize)]
struct Added {
    by: u64,
    onto: u64,
}

/// One row of a counter's journal, as [`walk_counter_journals`] gives it.
pub enum CounterRow {
    /// An addition of this much.
    Added(u64),
    /// A reliable delivery's record (`journaled-counter#delivery`): its
    /// producer and number.
    Delivery(String, u64),
}

/// Walks the rows `psql` printed for [`COUNTER_JOURNALS`], checking that
/// each counter's sequence numbers run 1, 2, 3, … without a gap and that
/// each `Added` was added onto the sum of those before it (its writer had
/// applied them all: no fork); gives `each` every row's counter, writer
/// (`node/incarnation/generation`, the node as 16 hex digits) and event.
pub fn walk_counter_journals(rows: &str, mut each: impl FnMut(&str, String, CounterRow)) {
    // Per counter: the events read, and the sum of their additions.
    let mut read = std::collections::BTreeMap::<&str, (u64, u64)>::new();
    for row in rows.lines() {
        let cols: Vec<&str> = row.split('|').collect();
        let [
            entity,
            seq,
            manifest,
            node,
            incarnation,
            generation,
            payload,
        ] = cols[..]
        else {
            panic!("a row of seven columns: {row}");
        };
        let (events, total) = read.entry(entity).or_default();
        *events += 1;
        assert_eq!(
            seq.parse().ok(),
            Some(*events),
            "{entity}: a gap before {row}"
        );
        let bytes = unhex(payload);
        let event = match manifest {
            "journaled-counter" => {
                let added: Added = ciborium::from_reader(&bytes[..]).expect("an Added event");
                assert_eq!(added.onto, *total, "{entity}: a fork at {row}");
                *total = total.wrapping_add(added.by);
                CounterRow::Added(added.by)
            }
            "journaled-counter#delivery" => {
                let (producer, _epoch, seq): (String, u64, u64) =
                    ciborium::from_reader(&bytes[..]).expect("a delivery record");
                CounterRow::Delivery(producer, seq)
            }
            other => panic!("{entity}: an event of manifest {other}"),
        };
        // Node ids are u64s stored as bigint.
        let node = node.parse::<i64>().expect("a node id") as u64;
        each(
            entity,
            format!("{node:016x}/{incarnation}/{generation}"),
            event,
        );
    }
}

/// A child process killed (and reaped) when the test ends, passed or
/// failed, so a failing assertion leaves no node running.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
