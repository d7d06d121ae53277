//! TLS 1.3 under the handshake (feature `tls`): each pipe's TCP stream is
//! wrapped in a mutually authenticated TLS session before the handshake of
//! [`handshake`](super::handshake) runs inside it, so a peer needs both a
//! certificate the cluster's CA signed and the shared secret.
//!
//! [`Tls`] holds the loaded certificate chain, private key and CA roots, and
//! the file names they came from. Every new connection first looks at the
//! files' metadata (one `stat` each): when any changed, the files are loaded
//! again and new connections use them; established pipes keep their
//! session. A change that does not load (a half-written file, an expired
//! certificate) keeps the previous certificates and is logged.

use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::client::{verify_server_cert_signed_by_trust_anchor, verify_server_name};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector, client, server};

use super::connection::lock;
use super::error::ConnectError;
use super::stream::PipeIo;
use crate::util::warn_limit::{WarnLimit, warn_limited};

/// Where a node's TLS material lives (PEM files), and which name its peers'
/// certificates must carry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsConfig {
    /// This node's certificate, then any intermediates (PEM, one or more
    /// `CERTIFICATE` blocks).
    pub cert_chain: PathBuf,
    /// The certificate's private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub private_key: PathBuf,
    /// The CA certificates a peer's chain must lead to (PEM, one or more).
    pub ca_roots: PathBuf,
    /// The name every peer's certificate must be valid for. `None` (the
    /// default): the peer's own node address — the IP address dialed, or on
    /// the accepting side the address the peer claims in its `Hello` —
    /// must be among its certificate's IP subject alternative names. A DNS
    /// name here is matched as a TLS client matches a server name
    /// (wildcards included), for clusters whose nodes share one name.
    pub peer_name: Option<String>,
}

impl TlsConfig {
    /// The three PEM files, with peers named by their node addresses.
    pub fn new(
        cert_chain: impl Into<PathBuf>,
        private_key: impl Into<PathBuf>,
        ca_roots: impl Into<PathBuf>,
    ) -> Self {
        TlsConfig {
            cert_chain: cert_chain.into(),
            private_key: private_key.into(),
            ca_roots: ca_roots.into(),
            peer_name: None,
        }
    }

    /// Peers' certificates must be valid for `name` instead of their
    /// addresses.
    pub fn with_peer_name(mut self, name: impl Into<String>) -> Self {
        self.peer_name = Some(name.into());
        self
    }
}

/// Why TLS material was refused. Each variant names the file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        message: String,
    },
    /// The file is not PEM, or holds no block of the kind needed.
    #[error("{path}: {message}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
    /// The certificate or key is refused: expired or not yet valid, not
    /// signed by the CA roots, a key that does not match the certificate.
    #[error("certificate {path} refused: {reason}")]
    Certificate {
        /// The file.
        path: PathBuf,
        /// rustls's reason (an expired one names its `notAfter` time).
        reason: String,
    },
    /// `peer_name` is neither a DNS name nor an IP address.
    #[error("peer name {0:?} is not a DNS name or an IP address")]
    PeerName(String),
}

/// A node's TLS material, loaded, and reloaded when its files change.
/// Cheap to clone; clones share it. Set it as
/// [`TransportConfig::tls`](super::TransportConfig::tls).
#[derive(Clone)]
pub struct Tls(Arc<Inner>);

struct Inner {
    config: TlsConfig,
    peer_name: Option<ServerName<'static>>,
    provider: Arc<CryptoProvider>,
    current: Mutex<Arc<Loaded>>,
    /// The files' metadata when they last failed to load: not tried again
    /// until it changes (so a broken change costs one load, not one per
    /// connection).
    failed: Mutex<Option<Stamps>>,
    reload_failures: WarnLimit,
    /// When this node's certificate was last found still valid, and the
    /// warnings that it no longer is.
    own_checked: Mutex<Option<std::time::Instant>>,
    own_expired: WarnLimit,
}

/// What one load of the files made.
struct Loaded {
    stamps: Stamps,
    /// This node's certificate (the chain's first), its intermediates, and
    /// the roots: to see, while it runs, that it has not expired.
    own: CertificateDer<'static>,
    intermediates: Vec<CertificateDer<'static>>,
    roots: Arc<RootCertStore>,
    server: TlsAcceptor,
    client: TlsConnector,
}

/// The three files' metadata, to see that one changed.
type Stamps = [Option<(SystemTime, u64, u64)>; 3];

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("config", &self.0.config)
            .finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads the files and checks them: PEM that parses, a key that matches
    /// the certificate, and a certificate that chains to the CA roots and is
    /// valid now.
    pub fn load(config: TlsConfig) -> Result<Tls, TlsError> {
        let peer_name = match &config.peer_name {
            None => None,
            Some(name) => Some(
                ServerName::try_from(name.clone()).map_err(|_| TlsError::PeerName(name.clone()))?,
            ),
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let loaded = load(&config, &provider)?;
        Ok(Tls(Arc::new(Inner {
            config,
            peer_name,
            provider,
            current: Mutex::new(Arc::new(loaded)),
            failed: Mutex::new(None),
            reload_failures: WarnLimit::default(),
            own_checked: Mutex::new(None),
            own_expired: WarnLimit::default(),
        })))
    }

    /// What it was loaded from.
    pub fn config(&self) -> &TlsConfig {
        &self.0.config
    }

    /// Loads the files again now, whether or not they changed. On error the
    /// previous material stays in use. (New connections also reload by
    /// themselves when the files' metadata changed.)
    pub fn reload(&self) -> Result<(), TlsError> {
        let loaded = load(&self.0.config, &self.0.provider)?;
        *lock(&self.0.current) = Arc::new(loaded);
        *lock(&self.0.failed) = None;
        Ok(())
    }

    /// The material for a new connection: reloaded first if a file changed
    /// since the last load (and loads); else, or when the change does not
    /// load, the current one.
    fn current(&self) -> Arc<Loaded> {
        let current = lock(&self.0.current).clone();
        let now = stamps(&self.0.config);
        if now == current.stamps || lock(&self.0.failed).as_ref() == Some(&now) {
            self.check_own_validity(&current);
            return current;
        }
        match load(&self.0.config, &self.0.provider) {
            Ok(loaded) => {
                let loaded = Arc::new(loaded);
                *lock(&self.0.current) = loaded.clone();
                *lock(&self.0.failed) = None;
                tracing::info!(cert = %self.0.config.cert_chain.display(), "TLS files changed: reloaded");
                loaded
            }
            Err(error) => {
                *lock(&self.0.failed) = Some(now);
                warn_limited!(self.0.reload_failures, "TLS files changed but do not load; still using the previous ones"; %error);
                current
            }
        }
    }

    /// Warns (rate-limited), naming the file, when this node's certificate
    /// has expired while it ran: every peer now refuses its new pipes.
    /// Checked at most once a second (a signature verification).
    fn check_own_validity(&self, current: &Loaded) {
        {
            let mut checked = lock(&self.0.own_checked);
            if checked.is_some_and(|at| at.elapsed() < std::time::Duration::from_secs(1)) {
                return;
            }
            *checked = Some(std::time::Instant::now());
        }
        let valid = ParsedCertificate::try_from(&current.own).and_then(|own| {
            verify_server_cert_signed_by_trust_anchor(
                &own,
                &current.roots,
                &current.intermediates,
                UnixTime::now(),
                self.0.provider.signature_verification_algorithms.all,
            )
        });
        if let Err(error) = valid {
            let cert = self.0.config.cert_chain.display();
            warn_limited!(self.0.own_expired, "this node's TLS certificate is no longer valid: peers refuse its new connections; replace the files"; %cert, %error);
        }
    }

    /// Whether this node's own certificate names `addr` (or the peer name):
    /// a node whose certificate does not would be refused by every peer.
    pub(crate) fn check_own_name(&self, addr: SocketAddr) -> Result<(), String> {
        let own = lock(&self.0.current).own.clone();
        self.check_peer_name(&own, addr).map_err(|why| {
            format!(
                "this node's certificate {} does not name its address {addr}: {why}",
                self.0.config.cert_chain.display()
            )
        })
    }

    /// The name a peer at `addr` must have in its certificate.
    fn name_for(&self, addr: SocketAddr) -> ServerName<'static> {
        match &self.0.peer_name {
            Some(name) => name.clone(),
            None => ServerName::IpAddress(addr.ip().into()),
        }
    }

    /// The accepting side's TLS handshake. The peer's chain is verified
    /// against the CA roots here; its name, once the peer has said in its
    /// `Hello` who it is, by [`Tls::check_peer_name`].
    pub(crate) async fn accept(
        &self,
        stream: TcpStream,
    ) -> Result<(server::TlsStream<TcpStream>, CertificateDer<'static>), ConnectError> {
        let stream = self
            .current()
            .server
            .accept(stream)
            .await
            .map_err(handshake_error)?;
        let cert = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|chain| chain.first())
            .cloned()
            .ok_or_else(|| ConnectError::Tls("the peer presented no certificate".into()))?;
        Ok((stream, cert))
    }

    /// The dialing side's TLS handshake with the node at `addr`: its
    /// certificate must chain to the CA roots and name it.
    pub(crate) async fn connect(
        &self,
        stream: TcpStream,
        addr: SocketAddr,
    ) -> Result<client::TlsStream<TcpStream>, ConnectError> {
        self.current()
            .client
            .connect(self.name_for(addr), stream)
            .await
            .map_err(handshake_error)
    }

    /// Whether the accepted peer's certificate names the address it claims.
    pub(crate) fn check_peer_name(
        &self,
        cert: &CertificateDer<'_>,
        claimed: SocketAddr,
    ) -> Result<(), String> {
        let parsed = ParsedCertificate::try_from(cert).map_err(|e| e.to_string())?;
        verify_server_name(&parsed, &self.name_for(claimed)).map_err(|e| e.to_string())
    }
}

/// What a TLS node reports when its peer speaks plaintext.
pub(crate) const PEER_SPEAKS_PLAINTEXT: &str = "the peer speaks plaintext, not TLS: TLS must be configured on every node of the cluster, or on none";

/// A failed TLS handshake as a [`ConnectError`]: what rustls refused (a
/// certificate, either side's; an alert; bytes that are no TLS record) is
/// `Tls`, so that error always means a refusal retrying cannot cure while
/// the configuration stays; the connection failing under it (closed,
/// reset: a peer that stopped, or over its handshake bounds) is `Closed`
/// or `Io`, as without TLS.
fn handshake_error(e: std::io::Error) -> ConnectError {
    let refused = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>());
    match refused {
        // The first bytes are not a TLS record: a node without TLS (whose
        // `Hello`, or `Reject` of this node's `ClientHello`, opens with a
        // length prefix, whose first byte is 0).
        Some(rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType)) => {
            ConnectError::Tls(PEER_SPEAKS_PLAINTEXT.into())
        }
        Some(refused) => ConnectError::Tls(refused.to_string()),
        None if e.kind() == std::io::ErrorKind::UnexpectedEof => ConnectError::Closed,
        None => ConnectError::from(e),
    }
}

/// An error of the handshake that ran inside TLS: an I/O error of kind
/// `InvalidData` there is rustls's (a TCP stream never gives one) — in TLS
/// 1.3 a client learns that the server refused its certificate only then,
/// from the alert — so it is said as TLS's.
pub(crate) fn inside_tls(e: ConnectError) -> ConnectError {
    match e {
        ConnectError::Io {
            kind: std::io::ErrorKind::InvalidData,
            message,
        } => ConnectError::Tls(message),
        other => other,
    }
}

/// Reads, parses and checks the three files, and builds both sides' rustls
/// configurations (TLS 1.3 only).
fn load(config: &TlsConfig, provider: &Arc<CryptoProvider>) -> Result<Loaded, TlsError> {
    let stamps = stamps(config);
    let mut chain = certificates(&config.cert_chain)?;
    let key_pem = read(&config.private_key)?;
    let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| TlsError::Pem {
        path: config.private_key.clone(),
        message: format!("no private key: {e}"),
    })?;
    let mut roots = RootCertStore::empty();
    for ca in certificates(&config.ca_roots)? {
        roots.add(ca).map_err(|e| refused(&config.ca_roots, e))?;
    }
    let roots = Arc::new(roots);
    let roots_kept = roots.clone();

    let own = ParsedCertificate::try_from(&chain[0]).map_err(|e| refused(&config.cert_chain, e))?;
    verify_server_cert_signed_by_trust_anchor(
        &own,
        &roots,
        &chain[1..],
        UnixTime::now(),
        provider.signature_verification_algorithms.all,
    )
    .map_err(|e| refused(&config.cert_chain, e))?;

    let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| refused(&config.ca_roots, e))?;
    // This node's certificate must also do for client authentication (the
    // check above asked for server authentication): every pipe it dials
    // presents it.
    verifier
        .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
        .map_err(|e| refused(&config.cert_chain, e))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| refused(&config.cert_chain, e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| refused(&config.private_key, e))?;
    let mut client = ClientConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| refused(&config.cert_chain, e))?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain.clone(), key)
        .map_err(|e| refused(&config.private_key, e))?;
    // No session resumption: a resumed handshake checks no certificate, so
    // a peer whose certificate expired (or was replaced) since could come
    // back on its old session. Pipes live long; a full handshake per pipe
    // costs nothing that matters.
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    server.send_tls13_tickets = 0;
    client.resumption = rustls::client::Resumption::disabled();
    Ok(Loaded {
        stamps,
        own: chain.remove(0),
        intermediates: chain,
        roots: roots_kept,
        server: TlsAcceptor::from(Arc::new(server)),
        client: TlsConnector::from(Arc::new(client)),
    })
}

fn refused(path: &Path, e: impl std::fmt::Display) -> TlsError {
    // rustls words a chain's failure as a peer's; here it is our own file.
    let reason = e.to_string();
    TlsError::Certificate {
        path: path.to_owned(),
        reason: reason
            .strip_prefix("invalid peer certificate: ")
            .unwrap_or(&reason)
            .to_owned(),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|e| TlsError::Read {
        path: path.to_owned(),
        message: e.to_string(),
    })
}

/// The PEM certificates in `path`: at least one.
fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = read(path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            message: "no CERTIFICATE block".into(),
        });
    }
    Ok(certs)
}

/// Modification time, length and inode of each file (`None` if it cannot be
/// read): a replaced or rewritten file changes at least one.
fn stamps(config: &TlsConfig) -> Stamps {
    let stamp = |path: &Path| {
        let m = fs::metadata(path).ok()?;
        #[cfg(unix)]
        let inode = std::os::unix::fs::MetadataExt::ino(&m);
        #[cfg(not(unix))]
        let inode = 0;
        Some((m.modified().ok()?, m.len(), inode))
    };
    [
        stamp(&config.cert_chain),
        stamp(&config.private_key),
        stamp(&config.ca_roots),
    ]
}

/// TLS streams split through tokio's lock-protected halves: the reader and
/// the writer each drive the one rustls session.
impl PipeIo for server::TlsStream<TcpStream> {
    type Read = ReadHalf<Self>;
    type Write = WriteHalf<Self>;
    const TLS: bool = true;

    fn into_halves(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

impl PipeIo for client::TlsStream<TcpStream> {
    type Read = ReadHalf<Self>;
    type Write = WriteHalf<Self>;
    const TLS: bool = true;

    fn into_halves(self) -> (Self::Read, Self::Write) {
        tokio::io::split(self)
    }
}

/// Makes a test certificate authority and one certificate per node, and
/// writes them into `dir` (created if missing) as PEM files: `ca.pem`, and
/// `node-<i>.pem` with `node-<i>-key.pem` for each of `names` in order.
/// Files are created new: an existing one is an error, not overwritten.
/// The CA's own key is not kept. A name that parses as an IP address becomes an IP
/// subject alternative name, anything else a DNS name; each node's
/// certificate serves both sides of a pipe (server and client
/// authentication). Everything is valid from now for `valid_for`. Private
/// keys are written readable by the owner only. For tests and trying
/// things out: a production cluster's certificates come from its own CA.
pub fn generate_test_certificates(
    dir: &Path,
    names: &[&str],
    valid_for: std::time::Duration,
) -> Result<Vec<TlsConfig>, TlsError> {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };
    let failed = |what: &str, e: rcgen::Error| TlsError::Certificate {
        path: dir.to_owned(),
        reason: format!("cannot make {what}: {e}"),
    };
    let now = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    // rcgen's times are `time`'s; the epoch plus a std duration gives them
    // without naming that crate.
    let epoch = rcgen::date_time_ymd(1970, 1, 1);
    let validity = |params: &mut CertificateParams| {
        // A minute's slack for clocks a little behind this one.
        params.not_before = epoch + now.saturating_sub(std::time::Duration::from_secs(60));
        params.not_after = epoch + now.saturating_add(valid_for);
    };
    fs::create_dir_all(dir).map_err(|e| TlsError::Read {
        path: dir.to_owned(),
        message: e.to_string(),
    })?;
    let write = |name: &str, pem: &str, private: bool| -> Result<PathBuf, TlsError> {
        let path = dir.join(name);
        let written = write_new(&path, pem.as_bytes(), private);
        written.map_err(|e| TlsError::Read {
            path: path.clone(),
            message: e.to_string(),
        })?;
        Ok(path)
    };

    let mut ca_params =
        CertificateParams::new(Vec::<String>::new()).map_err(|e| failed("the CA", e))?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // A name of its own, so that two test CAs are told apart by name (a
    // peer from another one is then an unknown issuer, not a bad signature).
    let mut tag = [0u8; 8];
    getrandom::fill(&mut tag).map_err(|e| TlsError::Certificate {
        path: dir.to_owned(),
        reason: format!("random generator failed: {e}"),
    })?;
    let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
    ca_params.distinguished_name.push(
        DnType::CommonName,
        format!("datum-cluster-sharding test CA {tag}"),
    );
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut ca_params);
    let ca_key = KeyPair::generate().map_err(|e| failed("the CA key", e))?;
    // The CA's key is not written: nothing can mint more certificates of
    // this CA once these exist (make a new CA for more).
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(|e| failed("the CA", e))?;
    let ca_roots = write("ca.pem", &ca.pem(), false)?;

    let mut configs = Vec::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        let what = format!("the certificate of {name}");
        let mut params =
            CertificateParams::new(vec![name.to_string()]).map_err(|e| failed(&what, e))?;
        params.distinguished_name.push(DnType::CommonName, *name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        validity(&mut params);
        let key = KeyPair::generate().map_err(|e| failed(&what, e))?;
        let cert = params.signed_by(&key, &ca).map_err(|e| failed(&what, e))?;
        let cert_chain = write(&format!("node-{i}.pem"), &cert.pem(), false)?;
        let private_key = write(&format!("node-{i}-key.pem"), &key.serialize_pem(), true)?;
        configs.push(TlsConfig::new(cert_chain, private_key, ca_roots.clone()));
    }
    Ok(configs)
}

/// Writes a new file (never over one that exists, nor through a symbolic
/// link), `private` ones readable by their owner only (on Unix).
fn write_new(path: &Path, bytes: &[u8], private: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut options = fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if private {
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    }
    #[cfg(not(unix))]
    let _ = private;
    options.open(path)?.write_all(bytes)
}
