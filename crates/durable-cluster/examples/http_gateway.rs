//! An HTTP gateway in front of an entity, with a bearer token: one runner on a SQLite file and
//! the `Counter` entity served over HTTP (see docs/http.md for the curl lines).
//!
//! ```text
//! export CLUSTER_HTTP_BEARER_TOKEN=$(openssl rand -hex 16)
//! cargo run -p durable-cluster --features http,schemars --example http_gateway
//! curl -s -H "authorization: Bearer $CLUSTER_HTTP_BEARER_TOKEN" --json '{"amount":2}' \
//!   http://127.0.0.1:8080/api/increment/c1
//! ```
//!
//! It listens on `GATEWAY_LISTEN` (default `127.0.0.1:8080`) until Ctrl-C, with the limits and
//! the token of the `CLUSTER_HTTP_*` variables (`HttpConfig::from_env`), and does not start
//! without a token. Its OpenAPI document, with the request types' schemas, is at
//! `/api/openapi.json`.

use std::process::ExitCode;

use durable_cluster::http::{HttpConfig, HttpGateway};
use durable_cluster::{Never, ShardingConfig, SingleRunner, entity};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A counter.
struct Counter {
    count: i64,
}

/// Adds `amount` to the count: `POST /api/increment/{id}` with `{"amount": n}` (the path
/// segment is the request type's tag in lowercase).
#[derive(Serialize, Deserialize, JsonSchema)]
struct Increment {
    amount: i64,
}

/// Reads the count: `POST /api/get/{id}` with an empty body.
#[derive(Serialize, Deserialize, JsonSchema)]
struct Get;

/// Why an `Increment` was refused, in the reference's tagged error form; the gateway answers
/// both with 422 instead of the reference's 500 (`HttpGateway::error_status`).
#[derive(Debug, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "_tag")]
enum Refused {
    /// The amount is negative.
    NegativeAmount { amount: i64 },
    /// The count would overflow.
    Overflow { count: i64 },
}

#[entity]
impl Counter {
    async fn create() -> Self {
        Counter { count: 0 }
    }

    /// Adds to the count, refusing a negative amount and an overflow.
    #[rpc]
    async fn increment(&mut self, add: Increment) -> Result<i64, Refused> {
        if add.amount < 0 {
            return Err(Refused::NegativeAmount { amount: add.amount });
        }
        self.count =
            self.count.checked_add(add.amount).ok_or(Refused::Overflow { count: self.count })?;
        Ok(self.count)
    }

    /// The count.
    #[rpc]
    async fn get(&self, _: Get) -> Result<i64, Never> {
        Ok(self.count)
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    // The limits and the bearer token of `CLUSTER_HTTP_*`; the token is required here.
    let config = HttpConfig::from_env()?;
    if config.bearer_token.is_none() {
        return Err(
            "set CLUSTER_HTTP_BEARER_TOKEN (at least 32 characters: openssl rand -hex 16)".into()
        );
    }
    let path = std::env::temp_dir().join(format!("http-gateway-{}.db", std::process::id()));
    let sharding = SingleRunner::sqlite(&path, ShardingConfig::default()).await?;
    sharding.entity::<Counter>().register()?;
    let gateway = HttpGateway::new(sharding.clone())
        .entity::<Counter>()
        .schemas::<Counter, Increment>()
        .schemas::<Counter, Get>()
        .error_status("NegativeAmount", 422)?
        .error_status("Overflow", 422)?
        // Every route, the OpenAPI document included, needs the token.
        .configured(&config)
        .router();
    let app = axum::Router::new().nest("/api", gateway);
    let listen = std::env::var("GATEWAY_LISTEN").unwrap_or_else(|_| "127.0.0.1:8080".to_owned());
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    say(&format!("http_gateway: listening on {}", listener.local_addr()?));
    // Not `axum::serve`: it has no header or idle timeout and no connection limit.
    let stopped = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    durable_cluster::http::serve(listener, app, config.limits, stopped).await;
    sharding.shutdown().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(())
}

#[expect(clippy::print_stdout, reason = "the example says where it listens")]
fn say(line: &str) {
    println!("{line}");
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the example reports its failure")]
            {
                eprintln!("http_gateway: {error}");
            }
            ExitCode::FAILURE
        }
    }
}
