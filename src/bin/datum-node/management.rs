//! The management and metrics wiring (`--management-addr`): the Prometheus
//! recorder installed before the node starts, the listener bound before it
//! joins, and the endpoint served once the node and its system run.

#[cfg(feature = "management")]
use std::net::SocketAddr;
#[cfg(feature = "management")]
use std::process::ExitCode;
#[cfg(feature = "management")]
use std::time::{Duration, Instant};

#[cfg(feature = "management")]
use datum_cluster_sharding::cluster::ClusterNode;

#[cfg(feature = "management")]
use super::EXIT_START_FAILED;
use super::flags::Args;
#[cfg(feature = "management")]
use super::hosted::Hosted;
#[cfg(feature = "management")]
use super::output::{Listening, emit};

/// With `--management-addr`: the Prometheus recorder, installed before the
/// node starts so that every metric of the node registers with it.
#[cfg(feature = "management")]
pub(super) type Recorder = metrics_exporter_prometheus::PrometheusHandle;
/// Without the `management` feature there is none.
#[cfg(not(feature = "management"))]
pub(super) type Recorder = std::convert::Infallible;

/// Installs the process's Prometheus recorder when `--management-addr` asks
/// for the endpoint.
pub(super) fn recorder(args: &Args) -> Result<Option<Recorder>, String> {
    if args.management_addr.is_none() {
        return Ok(None);
    }
    #[cfg(feature = "management")]
    {
        datum_cluster_sharding::telemetry::prometheus_builder()
            .install_recorder()
            .map(Some)
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "management"))]
    Err("--management-addr needs a build with `--features management`".into())
}

/// The `--management-*` limits.
#[cfg(feature = "management")]
struct ManagementLimits {
    max_connections: Option<u32>,
    header_timeout_ms: u64,
    idle_timeout_ms: u64,
    token: Option<String>,
}

/// Serves the management endpoint on `listener` for `node` (and its system).
#[cfg(feature = "management")]
fn serve_management(
    listener: tokio::net::TcpListener,
    limits: ManagementLimits,
    node: &ClusterNode,
    system: Option<&Hosted>,
    recorder: Recorder,
) -> std::io::Result<datum_cluster_sharding::management::ManagementServer> {
    use datum_cluster_sharding::management::Management;
    let mut management = Management::new(node.clone())
        .prometheus(recorder)
        .header_read_timeout(Duration::from_millis(limits.header_timeout_ms))
        .idle_timeout(Duration::from_millis(limits.idle_timeout_ms));
    if let Some(n) = limits.max_connections {
        management = management.max_connections(n as usize);
    }
    if let Some(token) = limits.token {
        management = management.token(token);
    }
    match system {
        Some(Hosted::Counter(system)) => management = management.system(system),
        #[cfg(feature = "postgres")]
        Some(Hosted::Journaled(system)) => management = management.system(system),
        None => {}
    }
    management.serve_on(listener)
}

/// Binds the `--management-addr` listener (none without the flag); on a
/// failure, says why on stderr and gives exit code 1.
#[cfg(feature = "management")]
pub(super) async fn bind_management(
    addr: Option<SocketAddr>,
) -> Result<Option<tokio::net::TcpListener>, ExitCode> {
    match addr {
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => Ok(Some(listener)),
            Err(error) => {
                eprintln!("datum-node: cannot serve the management endpoint on {addr}: {error}");
                Err(ExitCode::from(EXIT_START_FAILED))
            }
        },
        None => Ok(None),
    }
}

/// Serves the management endpoint on `listener` for `node` (and its
/// system) with the `--management-*` limits, and prints the
/// `management_listening` line (nothing without `--management-addr`); on a
/// failure, says why on stderr, crashes the node and gives exit code 1.
#[cfg(feature = "management")]
pub(super) async fn start_management(
    args: &Args,
    listener: Option<tokio::net::TcpListener>,
    recorder: Option<Recorder>,
    node: &ClusterNode,
    system: Option<&Hosted>,
    started: Instant,
) -> Result<Option<datum_cluster_sharding::management::ManagementServer>, ExitCode> {
    match (listener, recorder) {
        (Some(listener), Some(recorder)) => {
            let limits = ManagementLimits {
                max_connections: args.management_max_connections,
                header_timeout_ms: args.management_header_timeout_ms,
                idle_timeout_ms: args.management_idle_timeout_ms,
                token: args.management_token.clone(),
            };
            match serve_management(listener, limits, node, system, recorder) {
                Ok(server) => {
                    emit(&Listening::new(server.local_addr(), started));
                    Ok(Some(server))
                }
                Err(error) => {
                    eprintln!("datum-node: cannot serve the management endpoint: {error}");
                    node.crash().await;
                    Err(ExitCode::from(EXIT_START_FAILED))
                }
            }
        }
        _ => Ok(None),
    }
}
