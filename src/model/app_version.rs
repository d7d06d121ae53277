//! The application version a node runs (`ClusterConfig::app_version`):
//! shards go to the nodes of the newest one, so a rolling upgrade of the
//! application moves each shard once, onto a node of the new build.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

/// A node's application version: dot-separated decimal numbers, compared
/// number by number, a missing number counting as 0 (`"1.10" > "1.9"`,
/// `"2" == "2.0.0"`). The default is `"0"`.
///
/// Placement prefers it after the protocol version (SPEC §13.2): new
/// shards, rebalance moves and the shards of a node that leaves go only to
/// eligible nodes of the newest application version among those of the
/// newest protocol version, and no rebalance round starts while the type's
/// hosts (reachable or not) run more than one.
///
/// ```
/// use datum_cluster_sharding::AppVersion;
/// let v = |s: &str| s.parse::<AppVersion>().unwrap();
/// assert!(v("1.10") > v("1.9"));
/// assert_eq!(v("2"), v("2.0.0"));
/// assert_eq!(v("2.0.0").to_string(), "2.0.0");
/// assert!("1.x".parse::<AppVersion>().is_err());
/// ```
#[derive(Clone)]
pub struct AppVersion {
    /// As it was written.
    text: Arc<str>,
    /// Its numbers, without trailing zeros.
    numbers: Arc<[u64]>,
}

/// Why a text is not an [`AppVersion`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{text}` is not an application version (1 to {MAX_NUMBERS} dot-separated decimal numbers, such as `2.14.1`)"
)]
pub struct AppVersionError {
    text: String,
}

/// At most this many numbers.
const MAX_NUMBERS: usize = 16;

impl AppVersion {
    /// `"0"`, the version of a node that names none.
    pub fn zero() -> AppVersion {
        AppVersion {
            text: "0".into(),
            numbers: Arc::new([]),
        }
    }

    /// Parses `text`: 1 to 16 dot-separated decimal numbers, each below
    /// 2^64 (at most 100 bytes in all).
    pub fn parse(text: &str) -> Result<AppVersion, AppVersionError> {
        let refused = || AppVersionError {
            text: text.chars().take(100).collect(),
        };
        if text.len() > 100 {
            return Err(refused());
        }
        let mut numbers = Vec::new();
        for part in text.split('.') {
            if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                return Err(refused());
            }
            numbers.push(part.parse::<u64>().map_err(|_| refused())?);
        }
        if numbers.len() > MAX_NUMBERS {
            return Err(refused());
        }
        while numbers.last() == Some(&0) {
            numbers.pop();
        }
        Ok(AppVersion {
            text: text.into(),
            numbers: numbers.into(),
        })
    }

    /// Whether this is `"0"` (or `"0.0"`, …): the version of a node that
    /// names none.
    pub fn is_zero(&self) -> bool {
        self.numbers.is_empty()
    }

    /// The version as it was written.
    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl Default for AppVersion {
    fn default() -> Self {
        AppVersion::zero()
    }
}

impl std::str::FromStr for AppVersion {
    type Err = AppVersionError;
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        AppVersion::parse(text)
    }
}

impl fmt::Display for AppVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for AppVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AppVersion({})", self.text)
    }
}

impl PartialEq for AppVersion {
    fn eq(&self, other: &Self) -> bool {
        self.numbers == other.numbers
    }
}

impl Eq for AppVersion {}

impl PartialOrd for AppVersion {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for AppVersion {
    /// Number by number; with trailing zeros dropped, a longer list of
    /// equal leading numbers is the later version.
    fn cmp(&self, other: &Self) -> Ordering {
        self.numbers.cmp(&other.numbers)
    }
}

impl std::hash::Hash for AppVersion {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.numbers.hash(state);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v(text: &str) -> AppVersion {
        AppVersion::parse(text).expect("a version")
    }

    #[test]
    fn versions_compare_number_by_number() {
        assert!(v("1.10") > v("1.9"));
        assert!(v("1.2.1") > v("1.2"));
        assert!(v("2") > v("1.99.99"));
        assert_eq!(v("2"), v("2.0.0"));
        assert_eq!(v("0"), AppVersion::zero());
        assert!(v("0.0").is_zero() && !v("0.1").is_zero());
        assert_eq!(AppVersion::default(), v("0.0"));
        assert_eq!(v("1.02"), v("1.2"));
        assert_eq!(v("3.1").to_string(), "3.1");
    }

    #[test]
    fn malformed_versions_are_refused_by_name() {
        for bad in [
            "", ".", "1.", ".1", "1..2", "1.x", "v1", "-1", "1 ", "1.2-rc1",
        ] {
            let error = AppVersion::parse(bad).expect_err(bad);
            assert!(error.to_string().contains(&format!("`{bad}`")), "{error}");
        }
        assert!(AppVersion::parse("18446744073709551616").is_err());
        assert!(AppVersion::parse(&["1"; 16].join(".")).is_ok());
        assert!(AppVersion::parse(&["1"; 17].join(".")).is_err());
        assert!(AppVersion::parse(&"1".repeat(101)).is_err());
    }
}
