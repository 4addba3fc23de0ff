//! A runner process, configured from its environment (docs/deployment.md, "A runner binary"):
//!
//! ```sh
//! CLUSTER_STORAGE_URL=sqlite:/tmp/cluster.db CLUSTER_OPS_LISTEN=127.0.0.1:9090 \
//!     cargo run --release -p durable-cluster --features ops --example runner
//! curl -s localhost:9090/readyz
//! ```
//!
//! Replace the `Counter` entity with your own; `Runner::main` does the rest: logs, the
//! operations server, the transport, graceful shutdown on SIGTERM, and exit code 2 with one
//! line naming the variable when a setting is wrong.

use durable_cluster::{Never, Runner, entity};
use serde::{Deserialize, Serialize};

/// Adds `by` to the counter and answers the new count.
#[derive(Serialize, Deserialize)]
struct Add {
    by: u64,
}

/// A counter per entity id.
struct Counter {
    count: u64,
}

#[entity]
impl Counter {
    async fn create() -> Self {
        Counter { count: 0 }
    }

    #[rpc]
    async fn add(&mut self, add: Add) -> Result<u64, Never> {
        self.count += add.by;
        Ok(self.count)
    }
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    Runner::main(|sharding| {
        sharding.entity::<Counter>().register()?;
        Ok(())
    })
    .await
}
