//! The HTTP gateway's path, header and body decoding: arbitrary requests to a gateway in
//! front of an entity whose requests never fail. No request may answer a server error (5xx).
#![no_main]

use std::sync::OnceLock;

use axum::body::Body;
use axum::http::Request;
use durable_cluster::http::HttpGateway;
use durable_cluster::{Never, Sharding, ShardingConfig, entity};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use serde::{Deserialize, Serialize};
use tower::ServiceExt;

struct Echo;

#[derive(Serialize, Deserialize)]
struct Say {
    text: String,
    times: u8,
}

#[derive(Serialize, Deserialize)]
struct Ping;

#[entity]
impl Echo {
    async fn create() -> Self {
        Echo
    }

    #[rpc]
    async fn say(&self, say: Say) -> Result<String, Never> {
        Ok(say.text.repeat(usize::from(say.times.min(4))))
    }

    #[rpc]
    async fn ping(&self, _: Ping) -> Result<(), Never> {
        Ok(())
    }
}

#[derive(Arbitrary, Debug)]
struct Call {
    method: u8,
    path: String,
    content_type: u8,
    body: Vec<u8>,
}

/// One runtime and one gateway for the whole run.
fn gateway() -> &'static (tokio::runtime::Runtime, axum::Router) {
    static GATEWAY: OnceLock<(tokio::runtime::Runtime, axum::Router)> = OnceLock::new();
    GATEWAY.get_or_init(|| {
        let runtime =
            tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
        let router = runtime.block_on(async {
            let sharding =
                Sharding::volatile(ShardingConfig::default()).start().await.expect("a runtime");
            sharding.entity::<Echo>().register().expect("registered");
            HttpGateway::new(sharding).entity::<Echo>().router()
        });
        (runtime, router)
    })
}

libfuzzer_sys::fuzz_target!(|call: Call| {
    let method = ["GET", "POST", "PUT", "DELETE", "OPTIONS", "HEAD"][usize::from(call.method % 6)];
    let content_type = [
        "application/json",
        "application/json; charset=utf-8",
        "text/plain",
        "application/x-ndjson",
    ][usize::from(call.content_type % 4)];
    let path = if call.path.starts_with('/') { call.path } else { format!("/{}", call.path) };
    let Ok(request) = Request::builder()
        .method(method)
        .uri(path.as_str())
        .header("content-type", content_type)
        .header("accept", "application/json")
        .body(Body::from(call.body))
    else {
        return;
    };
    let (runtime, router) = gateway();
    let response = runtime.block_on(router.clone().oneshot(request)).expect("axum never fails");
    assert!(!response.status().is_server_error(), "{method} {path} answered {}", response.status());
});
