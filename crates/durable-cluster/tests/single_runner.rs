//! `SingleRunner::sqlite`: one runner on a SQLite file, restarted on the same file.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use durable_cluster::{
    Entity, EntityContext, Handler, Never, Protocol, RequestContext, Rpc, RunnerAddress,
    ShardingConfig, SingleRunner, StartError,
};
use serde::{Deserialize, Serialize};

/// Handler runs, over every runner of this test binary.
static RUNS: AtomicU64 = AtomicU64::new(0);

struct Account {
    balance: u64,
}

#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    amount: u64,
}

impl Rpc for Deposit {
    const TAG: &'static str = "Deposit";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl Entity for Account {
    const TYPE: &'static str = "Account";

    async fn create(_context: &EntityContext) -> Account {
        Account { balance: 0 }
    }

    fn protocol(protocol: &mut Protocol<Account>) {
        protocol.handle::<Deposit>();
    }
}

impl Handler<Deposit> for Account {
    async fn handle(&mut self, _: &RequestContext, deposit: Deposit) -> Result<u64, Never> {
        RUNS.fetch_add(1, Ordering::SeqCst);
        self.balance += deposit.amount;
        Ok(self.balance)
    }
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(20),
        entity_reply_poll_interval: Duration::from_millis(20),
        ..ShardingConfig::default()
    }
}

fn remove(path: &std::path::Path) {
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_runner_restarts_on_its_file_and_answers_from_it() {
    let path = std::env::temp_dir().join(format!("facade-single-{}.db", std::process::id()));
    remove(&path);
    let first = SingleRunner::sqlite(&path, config()).await.unwrap();
    first.entity::<Account>().register().unwrap();
    let deposit = || Deposit { key: "a".to_owned(), amount: 3 };
    assert_eq!(first.client::<Account>("single").send(deposit()).await.unwrap(), 3);
    // Another runner on the same file while the first holds the shards is refused.
    let other = ShardingConfig {
        runner_address: Some(RunnerAddress::new("localhost", 34_999)),
        ..config()
    };
    let refused = SingleRunner::sqlite(&path, other).await;
    assert!(
        matches!(refused, Err(StartError::ShardsHeld { .. })),
        "a second runner started: {refused:?}"
    );
    first.shutdown().await;
    // The same runner (same address) starts again on the file at once.
    let second = SingleRunner::sqlite(&path, config()).await.unwrap();
    second.entity::<Account>().register().unwrap();
    let again = second.client::<Account>("single").send(deposit()).await;
    assert_eq!(again.unwrap(), 3, "answered from the file");
    assert_eq!(RUNS.load(Ordering::SeqCst), 1, "the handler ran once");
    second.shutdown().await;
    remove(&path);
}

#[tokio::test]
async fn a_file_that_cannot_be_opened_is_a_storage_error() {
    let path = std::env::temp_dir().join("facade-no-such-dir").join("nested").join("x.db");
    let started = SingleRunner::sqlite(&path, config()).await;
    assert!(matches!(started, Err(StartError::Storage(_))), "started: {started:?}");
}
