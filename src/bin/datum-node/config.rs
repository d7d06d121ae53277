//! Building the node's configuration from the flags: the cluster settings,
//! the seed discovery (`--discovery`) and the TLS material (`--tls-*`).

use std::process::ExitCode;
use std::time::Duration;

use datum_cluster_sharding::cluster::ClusterConfig;

use super::EXIT_START_FAILED;
use super::flags::{Args, Discovery};

/// The cluster configuration the flags ask for, with its seed discovery
/// and TLS material; on a failure, says why on stderr and gives exit code 1.
/// The cluster name, the secret and the seeds are moved out of `args` into
/// the configuration (taken, not copied).
pub(super) fn cluster_config(args: &mut Args) -> Result<ClusterConfig, ExitCode> {
    let discovery = match seed_discovery(args) {
        Ok(discovery) => discovery,
        Err(error) => {
            eprintln!("datum-node: cannot discover seeds: {error}");
            return Err(ExitCode::from(EXIT_START_FAILED));
        }
    };
    let tls = match tls(args) {
        Ok(tls) => tls,
        Err(error) => {
            eprintln!("datum-node: cannot load the TLS files: {error}");
            return Err(ExitCode::from(EXIT_START_FAILED));
        }
    };
    let mut config = ClusterConfig::builder()
        .cluster_name(std::mem::take(&mut args.cluster_name))
        .secret(std::mem::take(&mut args.secret))
        .bind_addr(args.bind)
        .seed_nodes(std::mem::take(&mut args.seeds.0))
        .heartbeat_interval(Duration::from_millis(args.heartbeat_ms))
        .acceptable_heartbeat_pause(Duration::from_millis(args.pause_ms))
        .monitored_by(args.monitored_by as usize)
        .gossip_fanout(args.gossip_fanout as usize)
        .gossip_interval(Duration::from_millis(args.gossip_ms))
        .downing_timeout(args.downing_ms.0)
        .max_frame_size(args.max_frame)
        .stable_after(Duration::from_millis(args.stable_after_ms))
        .build();
    config.split_brain = args.split_brain.0;
    config.advertised_addr = args.advertise;
    config.tls = tls;
    config.discovery = discovery;
    config.app_version = args.app_version.clone();
    config.roles = args.roles.0.iter().cloned().collect();
    Ok(config)
}

/// The seed discovery `--discovery` asks for.
fn seed_discovery(
    args: &Args,
) -> Result<Option<datum_cluster_sharding::cluster::SeedDiscovery>, String> {
    use datum_cluster_sharding::cluster::SeedDiscovery;
    let Some(source) = &args.discovery else {
        return Ok(None);
    };
    let found = match source {
        Discovery::File(path) => SeedDiscovery::file(path),
        #[cfg(feature = "discovery")]
        Discovery::Dns { name, port } => SeedDiscovery::dns(name, *port),
        #[cfg(feature = "discovery")]
        Discovery::DnsSrv(name) => SeedDiscovery::dns_srv(name),
        #[cfg(not(feature = "discovery"))]
        Discovery::Dns { name, .. } | Discovery::DnsSrv(name) => {
            return Err(format!(
                "--discovery dns ({name}) needs a build with `--features discovery`"
            ));
        }
    };
    #[cfg(feature = "discovery")]
    let found = match &args.discovery_nameservers {
        Some(servers) => found.name_servers(servers.0.clone()),
        None => found,
    };
    Ok(Some(found.required(args.discovery_required as usize)))
}

/// The TLS material the --tls-* flags name (none without them).
fn tls(args: &Args) -> Result<Option<datum_cluster_sharding::transport::Tls>, String> {
    let (Some(cert), Some(key), Some(ca)) = (&args.tls_cert, &args.tls_key, &args.tls_ca) else {
        return Ok(None);
    };
    #[cfg(feature = "tls")]
    {
        use datum_cluster_sharding::transport::{Tls, TlsConfig};
        let mut config = TlsConfig::new(cert, key, ca);
        config.peer_name = args.tls_peer_name.clone();
        Tls::load(config).map(Some).map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (cert, key, ca);
        Err("--tls-cert needs a build with `--features tls`".into())
    }
}
