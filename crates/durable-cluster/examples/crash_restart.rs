//! Persisted requests survive a crash: one runner on a SQLite file, an abrupt stop, a restart.
//!
//! ```text
//! cargo run --release --example crash_restart
//! ```
//!
//! 1. A runner starts in a child process on a SQLite file and registers the `Account` entity.
//!    It sends 40 persisted deposits (each with its own key) to 4 accounts: they are stored
//!    first, then delivered by the runner's storage read loop, one at a time per account.
//! 2. Part-way, the child process is killed: no shutdown, no cleanup. The deposits it had not
//!    answered stay in the file, some of them claimed.
//! 3. A new runner starts on the same file, takes the shards (releasing the dead runner's
//!    claims) and answers the rest.
//! 4. Every deposit is sent again with its key: each is answered from storage, and the file
//!    holds exactly one final reply per deposit.
//! 5. Each account's balance is durable state, committed with each deposit's reply: it is the
//!    sum of its deposits, each counted once, though the kill cut some of them short.

use std::process::{Command, ExitCode};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use durable_cluster::cluster_core::envelope::primary_key;
use durable_cluster::storage::MessageStorage;
use durable_cluster::storage::sqlite::{SqliteMessageStorage, SqliteOptions};
use durable_cluster::{Entity, Never, Rpc, Sharding, SingleRunner, entity};
use durable_cluster::{EntityAddress, EntityId, EntityType, ShardGroup, ShardingConfig};
use serde::{Deserialize, Serialize};

type Error = Box<dyn std::error::Error>;

const ACCOUNTS: u64 = 4;
const DEPOSITS: u64 = 40;
/// How many deposits the first runner answers before it is killed (at least).
const ANSWERED_BEFORE_KILL: usize = 12;

/// Adds `amount` to the balance; `key` makes it one request however often it is sent.
#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    amount: u64,
}

/// Handler runs in this process.
static RUNS: AtomicUsize = AtomicUsize::new(0);

/// An account's balance.
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
        // Slow enough that the first runner is killed with deposits still waiting.
        tokio::time::sleep(Duration::from_millis(25)).await;
        self.balance += deposit.amount;
        RUNS.fetch_add(1, Ordering::SeqCst);
        Ok(self.balance)
    }
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(200),
        ..ShardingConfig::default()
    }
}

/// One call starts a runner on the file: it registers, takes every shard's lock (the killed
/// runner had the same address, so its locks are this runner's to take) and reads the file's
/// stored messages.
async fn start(path: &str) -> Result<Sharding, Error> {
    let sharding = SingleRunner::sqlite(path, config()).await?;
    sharding.entity::<Account>().register()?;
    Ok(sharding)
}

fn account(n: u64) -> String {
    format!("account-{}", n % ACCOUNTS)
}

fn deposit(n: u64) -> Deposit {
    Deposit { key: format!("deposit-{n}"), amount: n }
}

/// The storage key of deposit `n` (what the runtime deduplicates on).
fn stored_key(n: u64) -> String {
    let entity_id = account(n);
    let address = EntityAddress {
        shard_id: config().shard_id(&entity_id, &ShardGroup::default_group()),
        entity_type: EntityType::from(Account::TYPE),
        entity_id: EntityId::from(entity_id),
    };
    primary_key(&address, Deposit::TAG, &deposit(n).key)
}

/// How many final replies the file holds for each deposit.
async fn final_replies(storage: &dyn MessageStorage) -> Result<Vec<usize>, Error> {
    let mut counts = Vec::new();
    for n in 0..DEPOSITS {
        let count = match storage.request_id_for_primary_key(&stored_key(n)).await? {
            Some(id) => storage
                .replies_for_unfiltered(&[id])
                .await?
                .iter()
                .filter(|reply| reply.is_final())
                .count(),
            None => 0,
        };
        counts.push(count);
    }
    Ok(counts)
}

/// The first runner (the child process): send every deposit, then work until killed.
async fn first_runner(path: &str) -> Result<(), Error> {
    let sharding = start(path).await?;
    let accounts = Account::client(&sharding);
    for n in 0..DEPOSITS {
        accounts.discard(account(n), deposit(n)).await?;
    }
    std::future::pending::<()>().await;
    Ok(())
}

async fn crash_restart() -> Result<(), Error> {
    let path = std::env::temp_dir().join(format!("crash-restart-{}.db", std::process::id()));
    let path = path.to_str().ok_or("the temporary directory is not UTF-8")?.to_owned();
    say(&format!("runner 1 (a child process) on {path}"));
    let mut child =
        Command::new(std::env::current_exe()?).arg("--first-runner").arg(&path).spawn()?;
    // Watch the file from here, as another process would.
    while !std::path::Path::new(&path).exists() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let observer = SqliteMessageStorage::open(&path, SqliteOptions::default()).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let answered = loop {
        let answered = final_replies(&observer).await?.iter().filter(|count| **count > 0).count();
        if answered >= ANSWERED_BEFORE_KILL {
            break answered;
        }
        if tokio::time::Instant::now() > deadline {
            let _ = child.kill();
            return Err("runner 1 answered too few deposits within a minute".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    child.kill()?;
    child.wait()?;
    say(&format!("runner 1 killed after answering {answered} of {DEPOSITS} deposits"));

    say("runner 2 on the same file");
    let second = start(&path).await?;
    let accounts = Account::client(&second);
    for n in 0..DEPOSITS {
        accounts.deposit(account(n), deposit(n)).await?;
    }
    let mut balances = Vec::new();
    for id in 0..ACCOUNTS {
        let stored = second.client::<Account>(account(id)).stored_state::<u64>().await?;
        let expected: u64 = (0..DEPOSITS).filter(|n| n % ACCOUNTS == id).sum();
        balances.push((stored.map(|(balance, _)| balance), expected));
    }
    second.shutdown().await;
    let replies = final_replies(&observer).await?;
    observer.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{path}{suffix}"));
    }
    say(&format!(
        "runner 2 ran {} deposits and answered all {DEPOSITS} sent again from storage",
        RUNS.load(Ordering::SeqCst)
    ));
    if replies.iter().any(|count| *count != 1) {
        return Err(format!("final replies per deposit: {replies:?}").into());
    }
    say(&format!("every one of the {DEPOSITS} deposits has exactly one final reply"));
    if balances.iter().any(|(stored, expected)| *stored != Some(*expected)) {
        return Err(format!("stored and expected balances: {balances:?}").into());
    }
    say(&format!("each of the {ACCOUNTS} balances counts its deposits once: {balances:?}"));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let result = match (args.get(1).map(String::as_str), args.get(2)) {
        (Some("--first-runner"), Some(path)) => first_runner(path).await,
        _ => crash_restart().await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            say(&format!("crash_restart failed: {error}"));
            ExitCode::FAILURE
        }
    }
}

#[expect(clippy::print_stdout, reason = "the example tells what it does")]
fn say(line: &str) {
    println!("{line}");
}
