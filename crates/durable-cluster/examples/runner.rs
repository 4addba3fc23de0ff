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

use durable_cluster::{
    Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc, Runner,
};
use serde::{Deserialize, Serialize};

/// A counter per entity id.
struct Counter {
    count: u64,
}

/// Adds `by` to the counter and answers the new count.
#[derive(Serialize, Deserialize)]
struct Add {
    by: u64,
}

impl Rpc for Add {
    const TAG: &'static str = "Add";
    type Success = u64;
    type Error = Never;
}

impl Entity for Counter {
    const TYPE: &'static str = "Counter";

    async fn create(_context: &EntityContext) -> Counter {
        Counter { count: 0 }
    }

    fn protocol(protocol: &mut Protocol<Counter>) {
        protocol.handle::<Add>();
    }
}

impl Handler<Add> for Counter {
    async fn handle(&mut self, _context: &RequestContext, add: Add) -> Result<u64, Never> {
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
