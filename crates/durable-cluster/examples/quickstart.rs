//! The quickstart: a durable `Account` entity on a SQLite file.
//!
//! ```text
//! cargo run --release --example quickstart
//! ```
//!
//! A deposit is persisted: it is stored before it runs, and its key makes it run once however
//! often it is sent, across restarts too. The balance is durable state (`state = balance`): it
//! is committed with each deposit's reply, so a new runner on the same file starts from it.
//! `crash_restart` shows the same after a kill.

use durable_cluster::{Never, ShardingConfig, SingleRunner, entity};
use serde::{Deserialize, Serialize};

/// Adds `amount`; `key` makes it one deposit however often it is sent.
#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    amount: u64,
}

struct Account {
    balance: u64,
}

#[entity(state = balance)]
impl Account {
    async fn create() -> Self {
        Account { balance: 0 }
    }

    #[rpc(persisted, primary_key = key)]
    async fn deposit(&mut self, deposit: Deposit) -> Result<u64, Never> {
        self.balance += deposit.amount;
        Ok(self.balance)
    }

    #[rpc]
    async fn balance(&self) -> Result<u64, Never> {
        Ok(self.balance)
    }
}

#[tokio::main]
#[expect(clippy::print_stdout, reason = "the quickstart tells what it did")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::temp_dir().join(format!("quickstart-{}.db", std::process::id()));
    let sharding = SingleRunner::sqlite(&path, ShardingConfig::default()).await?;
    sharding.entity::<Account>().register()?;
    let accounts = Account::client(&sharding);
    let first = || Deposit { key: "first".to_owned(), amount: 5 };
    assert_eq!(accounts.deposit("alice", first()).await?, 5);
    assert_eq!(accounts.deposit("alice", first()).await?, 5, "the same key runs once");
    sharding.shutdown().await;

    // A new runner on the same file answers the stored deposit without running it again, and
    // starts from the stored balance.
    let sharding = SingleRunner::sqlite(&path, ShardingConfig::default()).await?;
    sharding.entity::<Account>().register()?;
    let accounts = Account::client(&sharding);
    assert_eq!(accounts.deposit("alice", first()).await?, 5);
    assert_eq!(accounts.balance("alice").await?, 5, "the balance survived the restart");
    let second = Deposit { key: "second".to_owned(), amount: 2 };
    assert_eq!(accounts.deposit("alice", second).await?, 7);
    assert_eq!(accounts.balance("alice").await?, 7);
    sharding.shutdown().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    println!("the stored deposit was answered once, and the balance kept, across the restart");
    Ok(())
}
