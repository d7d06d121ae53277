//! Seed nodes found while joining, instead of a fixed list: from a file that
//! may change, or (feature `discovery`) from DNS — the A/AAAA records of a
//! name (a Kubernetes headless service) or its SRV records (SPEC §10b.1).
//!
//! A joining node resolves its source every `interval` until it is a
//! member, asks every address found, and forms a new cluster by itself only
//! when its own address is the lowest of at least `required` addresses
//! found and none of the others has admitted it within the seed timeout.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The shortest interval between two resolutions.
pub(crate) const MIN_INTERVAL: Duration = Duration::from_millis(10);

/// Where a joining node finds its seeds (see the module docs).
#[derive(Clone, Debug)]
pub struct SeedDiscovery {
    source: Source,
    /// How often the source is resolved again while the node joins.
    pub interval: Duration,
    /// How many addresses the source must list, this node's own among
    /// them, before the lowest of them may form a new cluster. With 1, two
    /// nodes that each see only themselves at first both form one: set it
    /// to the number of nodes that start together (Akka's
    /// `required-contact-point-nr`).
    pub required: usize,
}

#[derive(Clone, Debug)]
enum Source {
    File(PathBuf),
    #[cfg(feature = "discovery")]
    Dns {
        name: String,
        /// With A/AAAA records; `None` asks for SRV records, which carry
        /// their ports.
        port: Option<u16>,
        /// Empty: the system's resolver configuration (`/etc/resolv.conf`).
        name_servers: Vec<SocketAddr>,
    },
}

/// Why a source could not be resolved. The node logs it, keeps the seeds
/// it had, and tries again after the interval.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The seed file could not be read.
    #[error("cannot read the seed file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A line of the seed file is not an `IP:port` address.
    #[error("{path}:{line}: not an IP:port address: {text:?}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// The line number, from 1.
        line: usize,
        /// What it held.
        text: String,
    },
    /// The DNS lookup failed (no such name is an empty answer, not this).
    #[error("DNS lookup of {name} failed: {reason}")]
    Dns {
        /// The name looked up.
        name: String,
        /// The resolver's error.
        reason: String,
    },
}

impl SeedDiscovery {
    fn new(source: Source) -> Self {
        SeedDiscovery {
            source,
            interval: Duration::from_secs(1),
            required: 1,
        }
    }

    /// Seeds from a file: one `IP:port` per line; blank lines and lines
    /// starting with `#` are skipped. It is read again at every interval,
    /// so it may be written while nodes join (write it whole, by rename: a
    /// half-written line is reported and the previous seeds kept).
    pub fn file(path: impl Into<PathBuf>) -> Self {
        Self::new(Source::File(path.into()))
    }

    /// Seeds from the A and AAAA records of `name`, each address with
    /// `port` (a headless service's pods).
    #[cfg(feature = "discovery")]
    pub fn dns(name: impl Into<String>, port: u16) -> Self {
        Self::new(Source::Dns {
            name: name.into(),
            port: Some(port),
            name_servers: Vec::new(),
        })
    }

    /// Seeds from the SRV records of `name` (`_datum._tcp.orders.svc…`):
    /// each target's A and AAAA addresses, with the record's port.
    #[cfg(feature = "discovery")]
    pub fn dns_srv(name: impl Into<String>) -> Self {
        Self::new(Source::Dns {
            name: name.into(),
            port: None,
            name_servers: Vec::new(),
        })
    }

    /// Ask these name servers (UDP, then TCP) instead of the system's.
    #[cfg(feature = "discovery")]
    pub fn name_servers(mut self, servers: Vec<SocketAddr>) -> Self {
        if let Source::Dns { name_servers, .. } = &mut self.source {
            *name_servers = servers;
        }
        self
    }

    /// The number of addresses required before the lowest may form a
    /// cluster (see [`required`](Self::required)); at least 1.
    pub fn required(mut self, n: usize) -> Self {
        self.required = n.max(1);
        self
    }

    /// How often to resolve again while joining (at least 10 ms).
    pub fn interval(mut self, interval: Duration) -> Self {
        self.interval = interval.max(MIN_INTERVAL);
        self
    }

    /// The addresses the source lists now, sorted, without duplicates.
    pub async fn resolve(&self) -> Result<Vec<SocketAddr>, DiscoveryError> {
        let mut found = match &self.source {
            Source::File(path) => read_file(path).await?,
            #[cfg(feature = "discovery")]
            Source::Dns {
                name,
                port,
                name_servers,
            } => dns::resolve(name, *port, name_servers).await?,
        };
        found.sort_unstable();
        found.dedup();
        Ok(found)
    }

    /// Whether `me` may form a new cluster among `found` (sorted): it is
    /// listed, it is the lowest, and at least `required` are listed.
    pub(crate) fn may_form(&self, me: SocketAddr, found: &[SocketAddr]) -> bool {
        found.len() >= self.required && found.first() == Some(&me)
    }
}

async fn read_file(path: &PathBuf) -> Result<Vec<SocketAddr>, DiscoveryError> {
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| DiscoveryError::Read {
            path: path.clone(),
            source,
        })?;
    // A byte-order mark, as some editors write, is not part of line 1.
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let mut found = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let addr = line.parse().map_err(|_| DiscoveryError::Malformed {
            path: path.clone(),
            line: i + 1,
            text: line.to_owned(),
        })?;
        found.push(addr);
    }
    Ok(found)
}

#[cfg(feature = "discovery")]
mod dns {
    use std::net::SocketAddr;

    use hickory_resolver::TokioResolver;
    use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
    use hickory_resolver::net::runtime::TokioRuntimeProvider;
    use hickory_resolver::proto::rr::RData;

    use super::DiscoveryError;

    /// A fresh resolver per resolution: discovery runs once an interval
    /// while joining, and a cache would only hide a record added since.
    fn resolver(name_servers: &[SocketAddr]) -> Result<TokioResolver, String> {
        let provider = TokioRuntimeProvider::default();
        let builder = if name_servers.is_empty() {
            TokioResolver::builder(provider).map_err(|e| e.to_string())?
        } else {
            let servers = name_servers
                .iter()
                .map(|server| {
                    let connections = [ConnectionConfig::udp(), ConnectionConfig::tcp()]
                        .into_iter()
                        .map(|mut c| {
                            c.port = server.port();
                            c
                        })
                        .collect();
                    NameServerConfig::new(server.ip(), true, connections)
                })
                .collect();
            TokioResolver::builder_with_config(ResolverConfig::from_name_servers(servers), provider)
        };
        builder.build().map_err(|e| e.to_string())
    }

    /// Whether `error` only says the name has no such records (yet).
    fn is_empty_answer(error: &hickory_resolver::net::NetError) -> bool {
        error.is_no_records_found() || error.is_nx_domain()
    }

    pub(super) async fn resolve(
        name: &str,
        port: Option<u16>,
        name_servers: &[SocketAddr],
    ) -> Result<Vec<SocketAddr>, DiscoveryError> {
        let failed = |reason: String| DiscoveryError::Dns {
            name: name.to_owned(),
            reason,
        };
        let resolver = resolver(name_servers).map_err(failed)?;
        let mut found = Vec::new();
        match port {
            Some(port) => match resolver.lookup_ip(name).await {
                Ok(ips) => found.extend(ips.iter().map(|ip| SocketAddr::new(ip, port))),
                Err(e) if is_empty_answer(&e) => {}
                Err(e) => return Err(failed(e.to_string())),
            },
            None => {
                let srv = match resolver.srv_lookup(name).await {
                    Ok(srv) => srv,
                    Err(e) if is_empty_answer(&e) => return Ok(found),
                    Err(e) => return Err(failed(e.to_string())),
                };
                // A target that fails is skipped; only when every one
                // fails is the resolution an error.
                let mut last_error = None;
                for record in srv.answers() {
                    let RData::SRV(srv) = &record.data else {
                        continue;
                    };
                    if srv.target.is_root() {
                        continue; // ".": no service here (RFC 2782)
                    }
                    match resolver.lookup_ip(srv.target.clone()).await {
                        Ok(ips) => found.extend(ips.iter().map(|ip| SocketAddr::new(ip, srv.port))),
                        Err(e) if is_empty_answer(&e) => {}
                        Err(e) => last_error = Some(e.to_string()),
                    }
                }
                if let (true, Some(error)) = (found.is_empty(), last_error) {
                    return Err(failed(error));
                }
            }
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_lowest_of_enough_addresses_may_form() {
        let a: SocketAddr = "127.0.0.1:7001".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:7002".parse().unwrap();
        let one = SeedDiscovery::file("seeds");
        assert!(one.may_form(a, &[a]));
        assert!(one.may_form(a, &[a, b]));
        assert!(!one.may_form(b, &[a, b]), "not the lowest");
        assert!(!one.may_form(a, &[b]), "not listed");
        assert!(!one.may_form(a, &[]));
        let two = SeedDiscovery::file("seeds").required(2);
        assert!(!two.may_form(a, &[a]), "too few");
        assert!(two.may_form(a, &[a, b]));
        assert_eq!(SeedDiscovery::file("seeds").required(0).required, 1);
    }
}
