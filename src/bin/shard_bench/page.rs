//! W1 with the live cluster page open: node 0 serves the management
//! endpoint, and a headless Chromium keeps its page open, reading the JSON
//! routes every second, for the whole run.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use datum_cluster_sharding::management::{Management, ManagementServer};

use super::harness::Node;

/// The endpoint and the browser reading its page.
pub(super) struct OpenPage {
    server: Option<ManagementServer>,
    browser: Option<Child>,
    _profile: tempfile::TempDir,
}

/// The browser's binary: Debian's `chromium`, or another Chromium by name.
fn browser() -> Option<String> {
    ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|name| {
            Command::new(name)
                .arg("--version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(str::to_owned)
}

/// Serves node 0's endpoint on a free port and opens its page in a
/// headless Chromium; returns once the page has read the routes five
/// times.
pub(super) async fn open<S: Send + Sync + 'static>(
    node: &Node<S>,
) -> Result<OpenPage, Box<dyn std::error::Error>> {
    let binary = browser().ok_or("--page needs chromium (Debian: apt-get install chromium)")?;
    let server = Management::new(node.cluster.clone())
        .system(&node.system)
        .serve("127.0.0.1:0".parse()?)
        .await?;
    let profile = tempfile::tempdir()?;
    let browser = Command::new(binary)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            // No work of the browser's own beside the page: what is
            // measured is the page's.
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-extensions",
            "--disable-sync",
            "--disable-default-apps",
            "--mute-audio",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("http://{}/", server.local_addr()))
        // The browser and the processes it starts, killed together.
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let page = OpenPage {
        server: Some(server),
        browser: Some(browser),
        _profile: profile,
    };
    // The page, its script and style, then about five seconds of reads
    // (three a second: the browser's own start is over by then).
    let deadline = Instant::now() + Duration::from_secs(30);
    while page.requests() < 18 {
        if Instant::now() > deadline {
            page.close().await;
            return Err("the browser never read the cluster page".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(page)
}

impl OpenPage {
    /// How many requests the endpoint has answered.
    pub(super) fn requests(&self) -> u64 {
        self.server.as_ref().map_or(0, ManagementServer::requests)
    }

    /// Closes the browser and stops the endpoint.
    pub(super) async fn close(mut self) {
        self.kill_browser();
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
    }

    fn kill_browser(&mut self) {
        if let Some(mut browser) = self.browser.take() {
            // SAFETY: a plain kill(2) of our own child's process group.
            unsafe { libc::kill(-(browser.id() as i32), libc::SIGKILL) };
            let _ = browser.wait();
        }
    }
}

/// A run that ends early (an error) closes the browser too.
impl Drop for OpenPage {
    fn drop(&mut self) {
        self.kill_browser();
    }
}
