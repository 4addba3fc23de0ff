//! The web console in a real browser (Chromium, driven through chromedriver with
//! `fantoccini`): a three-runner cluster on one SQLite file, its console on the first runner's
//! operations server. The pages show the cluster's live data, and an interrupt pressed in the
//! console interrupts the workflow.
//!
//! `cargo xtask ci` installs Debian's `chromium` and `chromium-driver` when they are missing
//! and passes their paths as `CLUSTER_TEST_CHROMIUM` and `CLUSTER_TEST_CHROMEDRIVER`; without
//! them the test skips with a message, except under `CI=true`, where it fails. The screenshots
//! go to the test's temporary directory, and to `docs/images/` with
//! `CLUSTER_UPDATE_SCREENSHOTS=1`.
#![cfg(all(feature = "console", feature = "sqlite"))]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use durable_cluster::Runner;
use durable_cluster::workflow::{ExecutionId, Workflow, WorkflowEngine, WorkflowResult};
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::json;

mod support;
use support::{Approval, ApprovalPayload, approve};

const ADMIN: &str = "browser-admin-token-0123456789abcdef01234";
const SECRET: &str = "console-browser-0123456789abcdef0123456789abcdef";

/// How long a page may take to show what the test waits for.
const DEADLINE: Duration = Duration::from_secs(30);

/// The browser and its driver, from the variables `cargo xtask ci` sets.
#[expect(clippy::print_stderr, reason = "a skipped test says why")]
fn browser_paths() -> Option<(String, String)> {
    let chromium = std::env::var("CLUSTER_TEST_CHROMIUM").ok().filter(|path| !path.is_empty());
    let driver = std::env::var("CLUSTER_TEST_CHROMEDRIVER").ok().filter(|path| !path.is_empty());
    match (chromium, driver) {
        (Some(chromium), Some(driver)) => Some((chromium, driver)),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "CLUSTER_TEST_CHROMIUM and CLUSTER_TEST_CHROMEDRIVER are not set and CI=true: \
                 the browser test must run (cargo xtask ci installs chromium)"
            );
            eprintln!(
                "skipping the browser test: CLUSTER_TEST_CHROMIUM and CLUSTER_TEST_CHROMEDRIVER are not set"
            );
            None
        }
    }
}

/// A free port on loopback (chromedriver takes a port number, not port 0).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Starts chromedriver and waits until it listens.
async fn chromedriver(path: &str) -> (tokio::process::Child, u16) {
    let port = free_port();
    let child = tokio::process::Command::new(path)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("chromedriver starts");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "chromedriver listens");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (child, port)
}

async fn browser(chromium: &str, port: u16) -> Client {
    let mut capabilities = serde_json::Map::new();
    capabilities.insert(
        "goog:chromeOptions".to_owned(),
        json!({
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,1000"],
        }),
    );
    let connector = hyper_util::client::legacy::connect::HttpConnector::new();
    ClientBuilder::new(connector)
        .capabilities(capabilities)
        .connect(&format!("http://127.0.0.1:{port}"))
        .await
        .expect("a browser session")
}

/// Three runners on one SQLite file; the first serves the console.
async fn cluster() -> (Vec<Runner>, SocketAddr) {
    let storage = format!("sqlite:{}", support::database("browser").display());
    let mut runners = Vec::new();
    for index in 0..3 {
        let mut vars =
            vec![("CLUSTER_STORAGE_URL", storage.as_str()), ("CLUSTER_RPC_SECRET", SECRET)];
        if index == 0 {
            vars.extend([("CLUSTER_OPS_LISTEN", "127.0.0.1:0"), ("CLUSTER_ADMIN_TOKEN", ADMIN)]);
        }
        let name =
            if index == 0 { "browser".to_owned() } else { format!("browser-unused-{index}") };
        let settings = support::env(&name, &vars).unwrap();
        runners.push(Runner::start(&settings, |_| Ok(())).await.unwrap());
    }
    let ops = runners[0].ops_address().expect("the console's server");
    (runners, ops)
}

/// Waits until the page at `url` (reloaded) contains `text`.
async fn wait_for_text(client: &Client, url: &str, text: &str) -> String {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        client.goto(url).await.unwrap();
        let source = client.source().await.unwrap();
        if source.contains(text) {
            return source;
        }
        assert!(tokio::time::Instant::now() < deadline, "{url} never showed {text:?}: {source}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Keeps a screenshot: in the test's temporary directory, and in `docs/images/` when asked.
async fn screenshot(client: &Client, name: &str) {
    let png = client.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    let temporary = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}.png"));
    std::fs::write(&temporary, &png).unwrap();
    if std::env::var("CLUSTER_UPDATE_SCREENSHOTS").as_deref() == Ok("1") {
        let docs = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/images");
        std::fs::create_dir_all(&docs).unwrap();
        std::fs::write(docs.join(format!("{name}.png")), &png).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_shows_the_cluster_and_interrupts_a_workflow() {
    let Some((chromium, driver)) = browser_paths() else { return };
    let (runners, ops) = cluster().await;
    let engine = WorkflowEngine::cluster(&runners[1].sharding).unwrap();
    Approval::register(&engine, approve).unwrap();
    for runner in [&runners[0], &runners[2]] {
        Approval::register(&WorkflowEngine::cluster(&runner.sharding).unwrap(), approve).unwrap();
    }
    let mut ids: Vec<ExecutionId> = Vec::new();
    for order in ["order-1041", "order-1042", "order-1043"] {
        let payload = ApprovalPayload { approval_id: order.to_owned() };
        ids.push(engine.execute_discard::<Approval>(payload).await.unwrap());
    }
    for id in &ids {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !engine.poll::<Approval>(id).await.unwrap().is_some_and(|r| r.is_suspended()) {
            assert!(tokio::time::Instant::now() < deadline, "{id} suspends");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    let (mut driver_process, port) = chromedriver(&driver).await;
    let client = browser(&chromium, port).await;
    let base = format!("http://{ops}/admin");
    // Signed out: the login page.
    client.goto(&base).await.unwrap();
    let token = client.find(Locator::Css("input[name=token]")).await.unwrap();
    token.send_keys(ADMIN).await.unwrap();
    client
        .find(Locator::Css("form[action='/admin/login'] button"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    // Signed in, the browser lands on the overview.
    let landed = client.wait().at_most(DEADLINE).for_element(Locator::Id("runners")).await;
    assert!(landed.is_ok(), "signed in: {}", client.source().await.unwrap());
    // The overview: three runners, the shard grid, no stuck work.
    let overview = wait_for_text(&client, &base, "Runners (3)").await;
    assert!(!overview.contains("id=\"stuck\""), "nothing is stuck");
    let cells = client.find_all(Locator::Css("#shards .cell")).await.unwrap();
    assert_eq!(cells.len(), 300, "one cell per shard");
    wait_for_text(&client, &base, "300, 0 not held by their assigned runner").await;
    screenshot(&client, "console-overview").await;

    // The workflows: the three executions, suspended.
    let list =
        wait_for_text(&client, &format!("{base}/workflows?status=suspended"), ids[2].as_str())
            .await;
    for id in &ids {
        assert!(list.contains(id.as_str()), "{id} is listed");
    }
    screenshot(&client, "console-workflows").await;

    // One execution: press Interrupt, accept the confirmation.
    let id = &ids[0];
    let page = format!("{base}/workflows/Approval/{id}");
    client.goto(&page).await.unwrap();
    let status = client.find(Locator::Id("status")).await.unwrap().text().await.unwrap();
    assert_eq!(status, "suspended");
    screenshot(&client, "console-execution").await;
    client.find(Locator::Id("interrupt")).await.unwrap().click().await.unwrap();
    client.accept_alert().await.unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !matches!(engine.poll::<Approval>(id).await.unwrap(), Some(WorkflowResult::Complete(_))) {
        assert!(tokio::time::Instant::now() < deadline, "the interrupt ends the execution");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let interrupted = wait_for_text(&client, &page, ">interrupted<").await;
    assert!(interrupted.contains("interrupt"), "the timeline shows the interrupt");
    screenshot(&client, "console-interrupted").await;
    // The others still wait.
    for other in &ids[1..] {
        assert!(engine.poll::<Approval>(other).await.unwrap().is_some_and(|r| r.is_suspended()));
    }

    client.close().await.unwrap();
    let _ = driver_process.kill().await;
    for runner in runners {
        runner.shutdown().await;
    }
    support::remove_database("browser");
}
