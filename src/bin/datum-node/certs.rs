//! `datum-node certs`: writes a test CA and node certificates for a TLS
//! cluster, and prints the `--tls-*` flags that use them.

use std::process::ExitCode;
#[cfg(feature = "tls")]
use std::time::Duration;

use super::EXIT_START_FAILED;
use super::flags::CertsArgs;

/// Runs `datum-node certs`.
pub(super) fn certs(args: CertsArgs) -> ExitCode {
    match write_certificates(&args) {
        Ok(lines) => {
            for line in lines {
                println!("{line}");
            }
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("datum-node certs: {error}");
            ExitCode::from(EXIT_START_FAILED)
        }
    }
}

/// Writes the test CA and certificates `args` asks for; gives, per name,
/// the `--tls-*` flags that use them.
pub(super) fn write_certificates(args: &CertsArgs) -> Result<Vec<String>, String> {
    #[cfg(feature = "tls")]
    {
        // Only new files are written: name the first that exists before any
        // is written (the writer refuses one too, but with only the OS's
        // "File exists", and after writing those before it).
        if let Some(path) = existing_certificate_file(&args.out, args.nodes.len()) {
            return Err(format!(
                "refusing to overwrite {}, which exists (remove it or choose another --out)",
                path.display()
            ));
        }
        let names: Vec<&str> = args.nodes.iter().map(String::as_str).collect();
        let valid_for = Duration::from_secs(args.days * 86_400);
        let configs = datum_cluster_sharding::transport::generate_test_certificates(
            &args.out, &names, valid_for,
        )
        .map_err(|e| e.to_string())?;
        Ok(names
            .iter()
            .zip(&configs)
            .map(|(name, c)| {
                format!(
                    "{name}: --tls-cert {} --tls-key {} --tls-ca {}",
                    c.cert_chain.display(),
                    c.private_key.display(),
                    c.ca_roots.display()
                )
            })
            .collect())
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = args;
        Err("needs a build with `--features tls`".into())
    }
}

/// The first of the files `datum-node certs` writes into `dir` for `nodes`
/// names that exists already (a link counts, whatever it points to).
#[cfg(feature = "tls")]
fn existing_certificate_file(dir: &std::path::Path, nodes: usize) -> Option<std::path::PathBuf> {
    let per_node = (0..nodes).flat_map(|i| [format!("node-{i}.pem"), format!("node-{i}-key.pem")]);
    std::iter::once("ca.pem".to_owned())
        .chain(per_node)
        .map(|name| dir.join(name))
        .find(|path| path.symlink_metadata().is_ok())
}
