//! The admin on a runner's operations server (feature `console`), over real HTTP, on SQLite:
//! off without a token; every page and endpoint refused without a token or with a wrong one;
//! reads allowed with the read token; actions refused with the read token and from another
//! origin, and applied with the admin token; the console's login and pages.
#![cfg(all(feature = "console", feature = "sqlite"))]

use std::net::SocketAddr;
use std::time::Duration;

use durable_cluster::Runner;
use durable_cluster::workflow::{ExecutionId, Workflow, WorkflowEngine, WorkflowResult};

mod support;
use support::{Answer, Approval, ApprovalPayload, approve, exchange};

const ADMIN: &str = "admin-token-0123456789abcdef0123456789";
const READ: &str = "read-token-0123456789abcdef0123456789ab";

fn bearer(token: &str) -> Vec<(String, String)> {
    vec![("Authorization".to_owned(), format!("Bearer {token}"))]
}

async fn get(ops: SocketAddr, path: &str, headers: &[(String, String)]) -> Answer {
    exchange(ops, "GET", path, headers, b"").await
}

async fn post(ops: SocketAddr, path: &str, headers: &[(String, String)], body: &[u8]) -> Answer {
    exchange(ops, "POST", path, headers, body).await
}

/// A runner with the admin on, and an `Approval` execution waiting for its deferred.
async fn runner(name: &str) -> (Runner, WorkflowEngine, ExecutionId) {
    let settings = support::env(
        name,
        &[
            ("CLUSTER_OPS_LISTEN", "127.0.0.1:0"),
            ("CLUSTER_ADMIN_TOKEN", ADMIN),
            ("CLUSTER_ADMIN_READ_TOKEN", READ),
            ("CLUSTER_RPC_SECRET", "console-test-0123456789abcdef0123456789abcdef"),
        ],
    )
    .unwrap();
    let runner = Runner::start(&settings, |_| Ok(())).await.unwrap();
    let engine = WorkflowEngine::cluster(&runner.sharding).unwrap();
    Approval::register(&engine, approve).unwrap();
    let id = engine
        .execute_discard::<Approval>(ApprovalPayload { approval_id: name.to_owned() })
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !engine.poll::<Approval>(&id).await.unwrap().is_some_and(|r| r.is_suspended()) {
        assert!(tokio::time::Instant::now() < deadline, "the approval suspends");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (runner, engine, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_needs_a_token_and_actions_need_the_admin_scope() {
    let (runner, engine, id) = runner("console-access").await;
    let ops = runner.ops_address().unwrap();
    let execution = format!("/admin/api/workflows/Approval/{id}");
    let reads = [
        "/admin/api/runners".to_owned(),
        "/admin/api/shards".to_owned(),
        "/admin/api/backlog".to_owned(),
        "/admin/api/messages".to_owned(),
        "/admin/api/workflows".to_owned(),
        execution.clone(),
        "/admin/api/stuck".to_owned(),
        "/admin".to_owned(),
        "/admin/workflows".to_owned(),
        format!("/admin/workflows/Approval/{id}"),
    ];
    let wrong = "wrong-token-0123456789abcdef0123456789ab";
    for path in &reads {
        assert_eq!(get(ops, path, &[]).await.status, 401, "{path} without a token");
        assert_eq!(get(ops, path, &bearer(wrong)).await.status, 401, "{path} with a wrong token");
        let read = get(ops, path, &bearer(READ)).await;
        assert_eq!(read.status, 200, "{path} with the read token: {}", read.body);
        assert!(read.head.to_ascii_lowercase().contains("content-security-policy"), "{path}");
    }
    let actions = [
        format!("{execution}/interrupt"),
        format!("{execution}/resume"),
        format!("{execution}/purge"),
        format!("{execution}/deferreds/approval"),
        "/admin/api/messages/1/retry".to_owned(),
        "/admin/api/messages/1/cancel".to_owned(),
        "/admin/api/messages/1/release".to_owned(),
        format!("/admin/workflows/Approval/{id}/interrupt"),
    ];
    for path in &actions {
        assert_eq!(post(ops, path, &[], b"{}").await.status, 401, "{path} without a token");
        assert_eq!(post(ops, path, &bearer(wrong), b"{}").await.status, 401, "{path}");
        assert_eq!(post(ops, path, &bearer(READ), b"{}").await.status, 403, "{path} read token");
        let mut foreign = bearer(ADMIN);
        foreign.push(("Origin".to_owned(), "http://evil.example".to_owned()));
        assert_eq!(post(ops, path, &foreign, b"{}").await.status, 403, "{path} other origin");
    }
    // Nothing changed: the execution still waits.
    assert!(engine.poll::<Approval>(&id).await.unwrap().is_some_and(|r| r.is_suspended()));

    // The admin token acts.
    let body = br#"{"value":"ops"}"#;
    let done = post(ops, &format!("{execution}/deferreds/approval"), &bearer(ADMIN), body).await;
    assert_eq!(done.status, 200, "{}", done.body);
    assert!(done.body.contains("\"changed\":true"), "{}", done.body);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !matches!(engine.poll::<Approval>(&id).await.unwrap(), Some(WorkflowResult::Complete(_)))
    {
        assert!(tokio::time::Instant::now() < deadline, "the approval completes");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let again = post(ops, &format!("{execution}/deferreds/approval"), &bearer(ADMIN), body).await;
    assert!(again.body.contains("\"changed\":false"), "{}", again.body);
    let detail = get(ops, &execution, &bearer(READ)).await;
    assert!(detail.body.contains("\"status\":\"completed\""), "{}", detail.body);
    // Bad input gets a clear answer.
    let bad = post(ops, &format!("{execution}/deferreds/approval"), &bearer(ADMIN), b"[").await;
    assert_eq!(bad.status, 409, "{}", bad.body);
    assert_eq!(get(ops, "/admin/api/workflows?limit=0", &bearer(READ)).await.status, 409);
    assert_eq!(get(ops, "/admin/api/workflows/Approval/nobody", &bearer(READ)).await.status, 404);
    runner.shutdown().await;
    support::remove_database("console-access");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_signs_in_with_a_cookie_from_its_own_origin() {
    let (runner, engine, id) = runner("console-login").await;
    let ops = runner.ops_address().unwrap();
    let origin = ("Origin".to_owned(), format!("http://{ops}"));
    let form = ("Content-Type".to_owned(), "application/x-www-form-urlencoded".to_owned());
    // A wrong token is refused; a login from another origin too.
    let wrong = post(ops, "/admin/login", &[origin.clone(), form.clone()], b"token=nope").await;
    assert_eq!(wrong.status, 401);
    let foreign = ("Origin".to_owned(), "http://evil.example".to_owned());
    let body = format!("token={ADMIN}");
    let refused = post(ops, "/admin/login", &[foreign, form.clone()], body.as_bytes()).await;
    assert_eq!(refused.status, 403);
    let login = post(ops, "/admin/login", &[origin.clone(), form], body.as_bytes()).await;
    assert_eq!(login.status, 303, "{}", login.head);
    let cookie_line = login
        .head
        .lines()
        .find(|line| line.to_ascii_lowercase().starts_with("set-cookie:"))
        .expect("a cookie");
    assert!(cookie_line.contains("HttpOnly") && cookie_line.contains("SameSite=Strict"));
    assert!(!cookie_line.contains(ADMIN), "the cookie never holds the token: {cookie_line}");
    let cookie = cookie_line.split_once(':').unwrap().1.trim().split(';').next().unwrap();
    let with_cookie = vec![("Cookie".to_owned(), cookie.to_owned())];
    // The cookie opens the console, not the API by bearer.
    let value = cookie.split_once('=').unwrap().1;
    assert_eq!(get(ops, "/admin/api/runners", &bearer(value)).await.status, 401);
    let overview = get(ops, "/admin", &with_cookie).await;
    assert_eq!(overview.status, 200);
    assert!(overview.body.contains("Runners (1)"), "{}", overview.body);
    let page = get(ops, &format!("/admin/workflows/Approval/{id}"), &with_cookie).await;
    assert!(page.body.contains("suspended") && page.body.contains("id=\"interrupt\""));
    // An action by cookie needs the console's origin.
    let path = format!("/admin/workflows/Approval/{id}/interrupt");
    assert_eq!(post(ops, &path, &with_cookie, b"").await.status, 403, "no origin shown");
    let mut from_console = with_cookie.clone();
    from_console.push(origin);
    let interrupted = post(ops, &path, &from_console, b"").await;
    assert_eq!(interrupted.status, 303, "{}", interrupted.body);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !matches!(engine.poll::<Approval>(&id).await.unwrap(), Some(WorkflowResult::Complete(_)))
    {
        assert!(tokio::time::Instant::now() < deadline, "the interrupt ends the execution");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let page = get(ops, &format!("/admin/workflows/Approval/{id}"), &with_cookie).await;
    assert!(page.body.contains(">interrupted<"), "{}", page.body);
    runner.shutdown().await;
    support::remove_database("console-login");
}

/// Work that waits too long shows as a banner on the overview, in `/admin/api/stuck` and in
/// the `effect_cluster_stuck_backlogs` gauge: here a request written an hour ago to a shard
/// group no runner serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_work_shows_as_a_banner_and_a_gauge() {
    use cluster_core::envelope::{RawJson, Request, TraceContext};
    use cluster_core::snowflake::SnowflakeParts;
    use cluster_core::storage::{MessageStorage, SaveRequestOptions};
    use cluster_core::{Clock, EntityAddress, MachineId, ShardGroup, ShardId, Snowflake};
    use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions};

    let (runner, _engine, _id) = runner("console-stuck").await;
    let ops = runner.ops_address().unwrap();
    let calm = get(ops, "/admin/api/stuck", &bearer(READ)).await;
    assert!(calm.body.contains("\"backlogs\":[]"), "{}", calm.body);
    let messages =
        SqliteMessageStorage::open(support::database("console-stuck"), SqliteOptions::default())
            .await
            .unwrap();
    let hour_ago = cluster_core::SystemClock.now().saturating_sub(Duration::from_secs(3_600));
    let parts = SnowflakeParts { timestamp: hour_ago, machine_id: MachineId::new(7), sequence: 0 };
    let request = Request {
        request_id: Snowflake::from_parts(parts),
        address: EntityAddress {
            shard_id: ShardId::new(ShardGroup::from("unserved"), 1),
            entity_type: "Ghost".into(),
            entity_id: "g1".into(),
        },
        tag: "Haunt".into(),
        payload: RawJson::empty_object(),
        headers: RawJson::empty_object(),
        trace: TraceContext::default(),
    };
    messages.save_request(&request, &SaveRequestOptions::default()).await.unwrap();
    let stuck = get(ops, "/admin/api/stuck", &bearer(READ)).await;
    assert!(stuck.body.contains("\"entityType\":\"Ghost\""), "{}", stuck.body);
    let overview = get(ops, "/admin", &bearer(READ)).await;
    assert!(overview.body.contains("id=\"stuck\"") && overview.body.contains("Ghost"));
    let metrics = get(ops, "/metrics", &[]).await;
    assert!(metrics.body.contains("effect_cluster_stuck_backlogs 1"), "{}", metrics.body);
    messages.close().await;
    runner.shutdown().await;
    support::remove_database("console-stuck");
}

/// Without a token the admin is off: `/admin` is not served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_is_off_without_a_token() {
    let settings = support::env(
        "console-off",
        &[
            ("CLUSTER_OPS_LISTEN", "127.0.0.1:0"),
            ("CLUSTER_RPC_SECRET", "console-test-0123456789abcdef0123456789abcdef"),
        ],
    )
    .unwrap();
    let runner = Runner::start(&settings, |_| Ok(())).await.unwrap();
    let ops = runner.ops_address().unwrap();
    assert_eq!(get(ops, "/admin", &bearer(ADMIN)).await.status, 404);
    assert_eq!(get(ops, "/admin/api/runners", &bearer(ADMIN)).await.status, 404);
    runner.shutdown().await;
    support::remove_database("console-off");
    // A token without the operations server is a configuration error that names both.
    let error = support::env("console-off", &[("CLUSTER_ADMIN_TOKEN", ADMIN)]).unwrap_err();
    let message = error.to_string();
    assert!(message.contains("CLUSTER_OPS_LISTEN"), "{message}");
    assert!(!message.contains(ADMIN), "no token in an error: {message}");
}
