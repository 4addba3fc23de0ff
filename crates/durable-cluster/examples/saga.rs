//! A saga: reserve the stock, charge the card, ship the parcel, each step with a
//! compensation. Shipping fails, so the completed steps are undone in reverse order, once.
//!
//! ```text
//! cargo run -p durable-cluster --features workflow --example saga
//! ```
//!
//! It runs the durable (cluster) engine on one runner with a SQLite file, executes the
//! workflow, prints what happened and checks it: the execution fails with the shipping error,
//! the charge is refunded and then the reservation released (each exactly once), and executing
//! the same order again returns the stored failure without running any step again.

use std::process::ExitCode;
use std::sync::{Arc, Mutex};

use durable_cluster::RunnerAddress;
use durable_cluster::ShardingConfig;
use durable_cluster::SingleRunner;
use durable_cluster::cluster_core::sync::lock;
use durable_cluster::workflow::{ExecuteError, Workflow, WorkflowContext, WorkflowEngine};
use serde::{Deserialize, Serialize};

/// An order to check out.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Order {
    id: String,
    item: String,
    amount_cents: u64,
}

/// Why a checkout failed.
#[derive(Debug, Serialize, Deserialize)]
enum CheckoutError {
    OutOfStock,
    CardDeclined,
    NoCourier(String),
}

/// The checkout saga.
struct Checkout;

impl Workflow for Checkout {
    const NAME: &'static str = "Checkout";
    type Payload = Order;
    type Success = String;
    type Error = CheckoutError;

    fn idempotency_key(order: &Order) -> String {
        order.id.clone()
    }
}

/// What the saga did, in order (the example's stand-in for real services).
#[derive(Clone, Default)]
struct Journal(Arc<Mutex<Vec<String>>>);

impl Journal {
    fn note(&self, entry: String) {
        #[expect(clippy::print_stdout, reason = "the example narrates what happens")]
        {
            println!("  {entry}");
        }
        lock(&self.0).push(entry);
    }

    fn entries(&self) -> Vec<String> {
        lock(&self.0).clone()
    }
}

/// The saga's body: three activities, each compensated once it succeeded. Activity bodies
/// borrow what they use; a compensation, which runs after the body ends, owns its copy.
async fn checkout(
    ctx: WorkflowContext,
    order: Order,
    journal: Journal,
) -> Result<String, CheckoutError> {
    let undo = journal.clone();
    let hold: String = ctx
        .activity("reserve", async |_| {
            journal.note(format!("reserve {}: hold-1", order.item));
            Ok::<_, CheckoutError>("hold-1".to_owned())
        })
        .compensate(move |hold, _| async move { undo.note(format!("release reservation {hold}")) })
        .await?;
    let undo = journal.clone();
    let payment: String = ctx
        .activity("charge", async |_| {
            journal.note(format!("charge {} cents: payment-7", order.amount_cents));
            Ok::<_, CheckoutError>("payment-7".to_owned())
        })
        .compensate(move |payment, cause| async move {
            let why = match cause.error::<CheckoutError>() {
                Some(error) => format!("{error:?}"),
                None => "a defect or an interrupt".to_owned(),
            };
            undo.note(format!("refund {payment} (because {why})"));
        })
        .await?;
    let parcel: String = ctx
        .activity("ship", async |_| {
            journal.note("ship: no courier available".to_owned());
            Err(CheckoutError::NoCourier("no courier available".to_owned()))
        })
        .await?;
    Ok(format!("{hold}/{payment}/{parcel}"))
}

async fn run() -> Result<(), String> {
    let path = std::env::temp_dir().join(format!("saga-example-{}.db", std::process::id()));
    let config = ShardingConfig {
        runner_address: Some(RunnerAddress::new("127.0.0.1", 34_100)),
        ..ShardingConfig::default()
    };
    let sharding = SingleRunner::sqlite(&path, config).await.map_err(|error| error.to_string())?;
    let engine = WorkflowEngine::cluster(&sharding).map_err(|error| error.to_string())?;
    let journal = Journal::default();
    let body_journal = journal.clone();
    Checkout::register(&engine, move |ctx, order| checkout(ctx, order, body_journal.clone()))
        .map_err(|error| error.to_string())?;

    let order = Order { id: "order-42".into(), item: "teapot".into(), amount_cents: 2_500 };
    say("executing the saga:");
    let first = engine.execute::<Checkout>(order.clone()).await;
    say(&format!("outcome: {first:?}"));
    let expected = [
        "reserve teapot: hold-1",
        "charge 2500 cents: payment-7",
        "ship: no courier available",
        "refund payment-7 (because NoCourier(\"no courier available\"))",
        "release reservation hold-1",
    ];
    let checked = match first {
        Err(ExecuteError::Failed(CheckoutError::NoCourier(_))) if journal.entries() == expected => {
            say("executing the same order again (it is stored):");
            let again = engine.execute::<Checkout>(order).await;
            say(&format!("outcome: {again:?}"));
            match again {
                Err(ExecuteError::Failed(CheckoutError::NoCourier(_)))
                    if journal.entries() == expected =>
                {
                    Ok(())
                }
                other => Err(format!(
                    "the second execution ran steps or differed: {other:?}, {:?}",
                    journal.entries()
                )),
            }
        }
        other => Err(format!("unexpected outcome {other:?} with journal {:?}", journal.entries())),
    };
    sharding.shutdown().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    checked
}

#[expect(clippy::print_stdout, reason = "the example narrates what happens")]
fn say(line: &str) {
    println!("{line}");
}

#[tokio::main]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => {
            say("saga: the compensations ran in reverse order, once");
            ExitCode::SUCCESS
        }
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the example reports its failure")]
            {
                eprintln!("saga: {error}");
            }
            ExitCode::FAILURE
        }
    }
}
