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

/// A child process killed (and reaped) when the test ends, passed or
/// failed, so a failing assertion leaves no node running.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
