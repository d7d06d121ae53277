//! The live cluster page at `/` of the management endpoint (SPEC §14.1),
//! read by a real headless Chromium through WebDriver (Debian's `chromium`
//! and `chromium-driver`, which `.ci/run` installs when missing) against
//! three real `datum-node` processes on 127.0.0.1. The page must show
//! three members with their roles and versions, every shard, the page
//! node's asks (the same counts as its JSON route and `/metrics`) and its
//! events; after one node is SIGKILLed it must show it unreachable, then
//! out of the cluster, and its shards on the survivors, with the events
//! that say so; at a phone's width nothing may run off the screen.
//! Screenshots go to `target/cluster-page-*.png` for a person to look at.
//! Where the browser or its driver is missing the test says so and passes.

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};

mod common;
use common::KillOnDrop;

const BIN: &str = env!("CARGO_BIN_EXE_datum-node");
/// Generous: CI shares its two cores with other builds.
const LONG: Duration = Duration::from_secs(60);
const SHARDS: u64 = 16;

/// chromedriver and the browser it starts, in a process group of their
/// own: killed together when the test ends, whether it passed or not.
struct Group(std::process::Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: a plain kill(2) of our own child's process group.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// `name`'s path on this machine, if it is installed.
fn installed(names: &[&str]) -> Option<String> {
    names.iter().find_map(|name| {
        let out = Command::new("sh")
            .args(["-c", &format!("command -v {name}")])
            .output()
            .ok()?;
        let path = String::from_utf8(out.stdout).ok()?.trim().to_owned();
        (!path.is_empty()).then_some(path)
    })
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// The page node's management token: the page takes it from its address.
const TOKEN: &str = "page-token-7";

/// A `datum-node` hosting the counter with the endpoint on, its cluster
/// address and its endpoint's.
fn node(seeds: Option<&str>, drive: bool, roles: &str) -> (KillOnDrop, String, SocketAddr) {
    let mut command = Command::new(BIN);
    let shards = SHARDS.to_string();
    command
        .args(["--cluster-name", "cluster-page", "--bind", "127.0.0.1:0"])
        .args(["--roles", roles])
        .args(["--counter", "--shards", &shards])
        .args(["--management-addr", "127.0.0.1:0"])
        // (One build everywhere: an older one would be given no shards.)
        .args(["--app-version", "2.1"])
        // A detector with room for CI's shared cores (the browser runs on
        // them too): a false Down of a survivor would fail the test.
        .args(["--pause-ms", "1000", "--downing-ms", "1000"])
        .env("DATUM_SECRET", "cluster-page-secret")
        .env("RUST_LOG", "error")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(seeds) = seeds {
        command.args(["--seeds", seeds]);
    }
    if drive {
        // The page node: its data routes ask for a token.
        command.env("DATUM_MANAGEMENT_TOKEN", TOKEN);
        // New counters all the time: every shard is placed within seconds,
        // and a dead node's shards are placed again.
        command.args(["--drive", "4", "--drive-fresh", "--drive-rate", "50"]);
    }
    let mut child = KillOnDrop(command.spawn().expect("spawn datum-node"));
    let mut lines = BufReader::new(child.0.stdout.take().expect("stdout")).lines();
    let (mut cluster, mut endpoint) = (None, None);
    while cluster.is_none() || endpoint.is_none() {
        let line = lines
            .next()
            .expect("the node's start lines")
            .expect("stdout");
        let event: Value = serde_json::from_str(&line).expect("a JSON line");
        match event["event"].as_str() {
            Some("started") => cluster = event["addr"].as_str().map(str::to_owned),
            Some("management_listening") => {
                endpoint = event["addr"].as_str().and_then(|a| a.parse().ok())
            }
            _ => {}
        }
    }
    // Its later lines are read and dropped, so that it never blocks on a
    // full pipe.
    std::thread::spawn(move || for _ in lines {});
    (child, cluster.unwrap(), endpoint.unwrap())
}

/// What the page shows now, read from its DOM.
async fn shown(client: &Client) -> Value {
    let script = r#"
        const members = [...document.querySelectorAll('#members tbody tr')].map(r => ({
            node: r.dataset.node, status: r.dataset.status, reachable: r.dataset.reachable === 'true',
            app_version: r.dataset.appVersion,
            roles: r.querySelector('td[data-roles]')?.dataset.roles ?? null }));
        const load = [...document.querySelectorAll('#load tbody tr[data-node]')].map(r => ({
            node: r.dataset.node, answered: r.dataset.answered === '' ? null : Number(r.dataset.answered),
            rate: r.dataset.rate ? Number(r.dataset.rate) : null, p50: r.dataset.p50 || null,
            charts: r.querySelectorAll('svg.spark path[d*=","]').length }));
        const events = [...document.querySelectorAll('#events li')].map(li => ({
            kind: li.dataset.kind, text: li.textContent }));
        const owners = {};
        let unplaced = 0;
        for (const r of document.querySelectorAll('section[data-type="counter"] table.owners tbody tr')) {
            if (r.dataset.owner) owners[r.dataset.owner] = Number(r.dataset.shards);
            else unplaced = Number(r.dataset.shards);
        }
        return { members, owners, unplaced, load, events, read: document.body.dataset.read || null,
                 stale: document.getElementById('freshness').className === 'stale' };
    "#;
    client
        .execute(script, vec![])
        .await
        .expect("the page's script")
}

/// Reads the page until `check` holds of it, within `LONG`.
async fn until(client: &Client, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + LONG;
    loop {
        let view = shown(client).await;
        if check(&view) {
            return view;
        }
        assert!(
            Instant::now() < deadline,
            "the page never showed {what} within {LONG:?}; it shows {view}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn member<'a>(view: &'a Value, node: &str) -> Option<&'a Value> {
    view["members"]
        .as_array()?
        .iter()
        .find(|m| m["node"].as_str().is_some_and(|n| n.starts_with(node)))
}

fn placed(view: &Value) -> u64 {
    view["owners"]
        .as_object()
        .map_or(0, |o| o.values().filter_map(Value::as_u64).sum())
}

async fn get_json(at: SocketAddr, path: &str) -> Value {
    let body = reqwest::Client::new()
        .get(format!("http://{at}{path}"))
        .header("Authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {path}: {e}"))
        .text()
        .await
        .expect("a body");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body}"))
}

async fn screenshot(client: &Client, name: &str) {
    let png = client.screenshot().await.expect("a screenshot");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("cluster-page-{name}.png"));
    std::fs::write(&path, png).expect("write the screenshot");
    eprintln!("screenshot: {}", path.display());
}

#[test]
fn the_cluster_page_shows_members_and_shards_and_follows_a_kill() {
    let (Some(chromium), Some(driver)) = (
        installed(&["chromium", "chromium-browser", "google-chrome"]),
        installed(&["chromedriver"]),
    ) else {
        eprintln!(
            "skipped: the cluster page's browser test needs chromium and chromedriver \
             (Debian: apt-get install chromium chromium-driver)"
        );
        return;
    };
    let (_a, seed, page_at) = node(None, true, "web,api");
    let (_b, _, _) = node(Some(&seed), false, "");
    let (mut c, c_cluster, _) = node(Some(&seed), false, "batch");
    // Members and owners are named `addr#node-id@incarnation`.
    let c_addr = format!("{c_cluster}#");

    let port = free_port();
    let _driver = Group(
        Command::new(&driver)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver"),
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let client = session(&chromium, port, None).await;
        // The data routes refuse a read without the token...
        let refused = reqwest::get(format!("http://{page_at}/cluster/members"))
            .await
            .expect("GET /cluster/members");
        assert_eq!(refused.status().as_u16(), 401);
        // ...and the page takes it from its address's fragment, which it
        // then takes out of the address bar.
        client
            .goto(&format!("http://{page_at}/#token={TOKEN}"))
            .await
            .expect("open the page");

        // Three members, all Up and reachable; every shard placed, on all
        // three nodes.
        let view = until(&client, "three reachable Up members and every shard", |v| {
            let members = v["members"].as_array().map_or(0, |m| {
                m.iter()
                    .filter(|m| m["status"] == "Up" && m["reachable"] == true)
                    .count()
            });
            let owners = v["owners"].as_object().map_or(0, |o| o.len());
            members == 3 && placed(v) == SHARDS && owners == 3
        })
        .await;
        assert_eq!(view["unplaced"], 0, "{view}");
        // Each member's application version: the page node's own, the
        // others' as the coordinator's table tells it.
        until(&client, "every member's application version", |v| {
            let versions: Vec<&str> = (v["members"].as_array().into_iter().flatten())
                .filter_map(|m| m["app_version"].as_str())
                .collect();
            versions == ["2.1", "2.1", "2.1"]
        })
        .await;
        // Each member's roles, as it answered the load read.
        until(&client, "every member's roles", |v| {
            let mut roles: Vec<&str> = (v["members"].as_array().into_iter().flatten())
                .filter_map(|m| m["roles"].as_str())
                .collect();
            roles.sort_unstable();
            roles == ["", "api,web", "batch"]
        })
        .await;
        // The page node's asks, with charts; the other two ask nothing.
        let view = until(&client, "the page node's asks charted", |v| {
            let load = v["load"].as_array().cloned().unwrap_or_default();
            let asked = load
                .iter()
                .filter(|l| l["answered"].as_u64().is_some_and(|n| n > 0))
                .count();
            // (Four charts for the node that asks; a node that asks
            // nothing has no latency to chart.)
            let charted = |l: &&Value| {
                l["charts"] == if l["answered"].as_u64() > Some(0) { 4 } else { 3 }
            };
            load.len() == 3 && asked == 1 && load.iter().all(|l| charted(&l))
        })
        .await;
        let page_asks = (view["load"].as_array().into_iter().flatten())
            .find_map(|l| l["answered"].as_u64().filter(|n| *n > 0))
            .expect("the page node's asks");
        // Its rate, from the differences of the counts: it drives 4 loops
        // of at most 50 asks a second (paced; the bounds leave room for
        // CI's shared cores and for reads a little apart from their
        // stamps).
        let view = until(&client, "the page node's rate and median", |v| {
            (v["load"].as_array().into_iter().flatten()).any(|l| {
                l["rate"].as_f64().is_some_and(|r| r > 0.0) && l["p50"].as_str().is_some()
            })
        })
        .await;
        let rate = (view["load"].as_array().into_iter().flatten())
            .find_map(|l| l["rate"].as_f64().filter(|r| *r > 0.0))
            .expect("a rate");
        assert!((20.0..=400.0).contains(&rate), "asks per second {rate}: {view}");
        // Facts: the page's count of the page node's answered asks lies
        // between the route's before and after a later read of `/metrics`,
        // which counts the same asks (`_count` of the latency histogram).
        let load_of_page_node = |load: &Value| -> u64 {
            (load["members"].as_array().into_iter().flatten())
                .filter_map(|m| m["answered"].as_array())
                .map(|buckets| buckets.iter().filter_map(Value::as_u64).sum::<u64>())
                .max()
                .expect("a member's answered asks")
        };
        let before = load_of_page_node(&get_json(page_at, "/cluster/load/counter").await);
        let metrics = reqwest::Client::new()
            .get(format!("http://{page_at}/metrics"))
            .header("Authorization", format!("Bearer {TOKEN}"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("the metrics");
        let counted: u64 = metrics
            .lines()
            .filter(|l| l.starts_with("datum_ask_duration_seconds_count{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .map(|n| n as u64)
            .sum();
        let after = load_of_page_node(&get_json(page_at, "/cluster/load/counter").await);
        assert!(
            page_asks <= before && before <= counted && counted <= after,
            "the page's {page_asks}, the route's {before} then {after}, /metrics' {counted}"
        );
        // The events the node kept, with the joins among them.
        until(&client, "the members' joins among the events", |v| {
            (v["events"].as_array().into_iter().flatten())
                .filter(|e| e["kind"] == "member_up")
                .count()
                >= 2
        })
        .await;
        let address = client.current_url().await.expect("the page's address");
        assert_eq!(address.fragment(), None, "the token left in the address: {address}");
        // Facts, not guesses: the same figures as the JSON routes. (Shards
        // may still be rebalancing: read both until a page read and the
        // route's answer after it agree.)
        let members = get_json(page_at, "/cluster/members").await;
        assert_eq!(members["members"].as_array().map(Vec::len), Some(3));
        let deadline = Instant::now() + LONG;
        loop {
            let view = shown(&client).await;
            let shards = get_json(page_at, "/cluster/shards/counter").await;
            let mut routed = serde_json::Map::new();
            for shard in shards["shards"].as_array().expect("shards") {
                let owner = shard["owner"].as_str().expect("an owner").to_owned();
                let n = routed.get(&owner).and_then(Value::as_u64).unwrap_or(0);
                routed.insert(owner, json!(n + 1));
            }
            if view["owners"] == Value::Object(routed.clone()) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the page's shards per node never matched the route's: page {view}, route {routed:?}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        screenshot(&client, "three-nodes").await;

        // SIGKILL the third node: the page shows it unreachable, then out
        // of the cluster, and every shard on the two survivors.
        let killed = Instant::now();
        c.0.kill().expect("SIGKILL");
        let _ = c.0.wait();
        let view = until(&client, "the killed node unreachable", |v| {
            member(v, &c_addr).is_some_and(|m| m["reachable"] == false)
        })
        .await;
        eprintln!("unreachable on the page after {:?}", killed.elapsed());
        screenshot(&client, "unreachable").await;
        assert!(view["stale"] == false, "{view}");
        let view = until(
            &client,
            "the killed node out and its shards on the survivors",
            |v| {
                let gone = member(v, &c_addr).is_none_or(|m| m["status"] == "Down");
                let on_killed = v["owners"]
                    .as_object()
                    .is_some_and(|o| o.keys().any(|k| k.starts_with(&c_addr)));
                gone && !on_killed && placed(v) == SHARDS
            },
        )
        .await;
        eprintln!(
            "down, with every shard on the survivors, after {:?}",
            killed.elapsed()
        );
        assert_eq!(
            view["owners"].as_object().map(|o| o.len()),
            Some(2),
            "{view}"
        );
        screenshot(&client, "after-kill").await;
        // The kill among the events, and the round that placed its shards
        // again (the page node is the oldest: the coordinator).
        until(&client, "the kill and its rebalance round among the events", |v| {
            let events = v["events"].as_array().cloned().unwrap_or_default();
            let told = |kind: &str| {
                events.iter().any(|e| {
                    e["kind"] == kind && e["text"].as_str().is_some_and(|t| t.contains(&c_addr))
                })
            };
            let round = events.iter().any(|e| {
                e["kind"] == "rebalance_round"
                    && e["text"].as_str().is_some_and(|t| t.contains("dead_owner"))
            });
            told("unreachable") && (told("member_downed") || told("member_removed")) && round
        })
        .await;


        // Without the token the page says its data is stale and asks for
        // it; typed in, the page reads again.
        client
            .execute("sessionStorage.clear(); return null;", vec![])
            .await
            .expect("clear the tab's token");
        client
            .goto(&format!("http://{page_at}/"))
            .await
            .expect("open the page without its token");
        let asked = client
            .wait()
            .at_most(LONG)
            .for_element(Locator::Css("#token-form:not([hidden])"))
            .await
            .expect("the page asks for the token");
        assert!(shown(&client).await["stale"] == true);
        let field = asked
            .find(Locator::Css("#token"))
            .await
            .expect("the token field");
        field.send_keys(TOKEN).await.expect("type the token");
        asked
            .find(Locator::Css("button[type=submit]"))
            .await
            .expect("the button")
            .click()
            .await
            .expect("submit");
        until(&client, "two members read with the typed token", |v| {
            v["stale"] == false && v["members"].as_array().is_some_and(|m| m.len() == 2)
        })
        .await;
        client.close().await.expect("end the session");

        // On a phone (Chromium's emulation of a 390 px wide screen) nothing
        // runs off the screen: the tables scroll inside their own boxes.
        let phone = session(&chromium, port, Some((390, 844))).await;
        phone
            .goto(&format!("http://{page_at}/#token={TOKEN}"))
            .await
            .expect("open the page on the phone");
        until(&phone, "the page read on the phone, its load and events drawn", |v| {
            v["read"].is_string()
                && v["members"].as_array().is_some_and(|m| m.len() == 2)
                && v["load"].as_array().is_some_and(|l| l.len() == 2)
                && v["events"].as_array().is_some_and(|e| !e.is_empty())
        })
        .await;
        let wide = phone
            .execute(
                r#"const width = document.documentElement.clientWidth;
                   // (What a box that scrolls holds does not count.)
                   const clipped = (e) => {
                       for (let a = e.parentElement; a && a !== document.body; a = a.parentElement) {
                           if (getComputedStyle(a).overflowX !== 'visible') return true;
                       }
                       return false;
                   };
                   const over = [...document.querySelectorAll('body *')]
                       .filter(e => !clipped(e) && getComputedStyle(e).overflowX === 'visible'
                           && (e.getBoundingClientRect().right > width + 0.5
                               || e.getBoundingClientRect().left + e.scrollWidth > width + 0.5))
                       .map(e => e.tagName.toLowerCase() + (e.id ? '#' + e.id : '') + '.' + e.className + ' ' + (e.textContent || '').slice(0, 40));
                   return { width, scroll_width: document.documentElement.scrollWidth, over };"#,
                vec![],
            )
            .await
            .expect("the page's width");
        assert_eq!(wide["width"], 390, "{wide}");
        assert!(
            wide["scroll_width"].as_i64() <= wide["width"].as_i64()
                && wide["over"].as_array().is_some_and(Vec::is_empty),
            "the page is wider than a phone's screen: {wide}"
        );
        screenshot(&phone, "phone").await;
        phone.close().await.expect("end the phone's session");
    });
}

/// A WebDriver session of headless Chromium: a desktop's window, or with
/// `phone` a phone's screen of that many CSS pixels (Chromium's device
/// emulation: a desktop window cannot be made that narrow).
async fn session(chromium: &str, port: u16, phone: Option<(u32, u32)>) -> Client {
    let mut options = json!({
        "binary": chromium,
        "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--window-size=1100,1100"],
    });
    if let Some((width, height)) = phone {
        options["mobileEmulation"] = json!({
            "deviceMetrics": { "width": width, "height": height, "pixelRatio": 2.0, "touch": true },
        });
    }
    let mut capabilities = serde_json::Map::new();
    capabilities.insert("goog:chromeOptions".into(), options);
    let deadline = Instant::now() + LONG;
    loop {
        match ClientBuilder::new(HttpConnector::new())
            .capabilities(capabilities.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(client) => return client,
            Err(error) if Instant::now() < deadline => {
                let _ = error;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(error) => panic!("chromedriver never took a session: {error}"),
        }
    }
}
