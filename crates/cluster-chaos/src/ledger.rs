//! The entity of the fault test: a ledger per entity id.
//!
//! A [`Deposit`] is persisted, deduplicated by its key, and runs in a storage transaction
//! (`WITH_TRANSACTION`). Its handler first records the run outside that transaction
//! ([`crate::runs`]: every run, committed or not), then, on PostgreSQL, writes an audit row —
//! key, entity, shard, runner, lock epoch, the run's `seq` and the database's clock — in the
//! transaction that stores its reply, so the audit holds exactly the runs whose reply was
//! stored (a fenced run rolls back). A deposit can be made to take a while in between
//! ([`set_deposit_work`]), so that faults find runs in flight.
//!
//! The lock epoch is the entity instance: an instance lives within one tenure of its shard's
//! lock on its runner (it stops before the lock is released), so two epochs of different
//! runners whose audit rows interleave on one shard mean that shard was served twice at once.
//!
//! An [`Echo`] is volatile and answers its number.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::transaction::TransactionError;
use cluster_sharding::{Entity, EntityContext, Handler, Protocol, RequestContext, Rpc};
use cluster_storage_sql::PgTransactionGuard;
use serde::{Deserialize, Serialize};

/// The ledger entity.
pub struct Ledger {
    runner: String,
    epoch: String,
    deposits: u64,
}

/// The audit table the ledgers write to, set once per process by [`set_audit_table`].
static AUDIT_TABLE: OnceLock<String> = OnceLock::new();

/// How long each deposit works between recording its run and writing its audit row, set once
/// per process by [`set_deposit_work`] (none by default).
static DEPOSIT_WORK: OnceLock<Duration> = OnceLock::new();

/// Instances created in this process, for their epochs.
static INSTANCES: AtomicU64 = AtomicU64::new(0);

/// The audit table's name (`<prefix>_chaos_audit`).
pub fn audit_table(prefix: &cluster_storage_sql::TablePrefix) -> String {
    prefix.table("chaos_audit")
}

/// Makes the ledgers of this process write their audit rows to `table`.
pub fn set_audit_table(table: String) {
    let _ = AUDIT_TABLE.set(table);
}

/// Makes every deposit of this process take `work` inside its transaction (after its run is
/// recorded, before its audit row), so that the fault test's faults find runs in flight.
pub fn set_deposit_work(work: Duration) {
    let _ = DEPOSIT_WORK.set(work);
}

/// The statement that creates the audit table (PostgreSQL).
pub fn create_audit_table_sql(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS \"{table}\" (key TEXT NOT NULL, entity TEXT NOT NULL, \
         shard TEXT NOT NULL, runner TEXT NOT NULL, epoch TEXT NOT NULL, run BIGINT, \
         at TIMESTAMPTZ NOT NULL)"
    )
}

/// Adds one to the ledger; `key` makes it one request however often it is sent.
#[derive(Serialize, Deserialize)]
pub struct Deposit {
    /// The deduplication key.
    pub key: String,
}

/// Why a deposit failed.
#[derive(Debug, Serialize, Deserialize)]
pub struct LedgerError {
    /// What went wrong.
    pub reason: String,
}

impl Rpc for Deposit {
    const TAG: &'static str = "Deposit";
    const PERSISTED: bool = true;
    const WITH_TRANSACTION: bool = true;
    type Success = u64;
    type Error = LedgerError;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A volatile request answered with its number.
#[derive(Serialize, Deserialize)]
pub struct Echo {
    /// The number.
    pub n: u64,
}

impl Rpc for Echo {
    const TAG: &'static str = "Echo";
    type Success = u64;
    type Error = LedgerError;
}

impl Entity for Ledger {
    const TYPE: &'static str = "ChaosLedger";

    async fn create(context: &EntityContext) -> Ledger {
        let runner = context
            .sharding()
            .config()
            .runner_address
            .as_ref()
            .map_or_else(|| "client".to_owned(), ToString::to_string);
        let instance = INSTANCES.fetch_add(1, Ordering::Relaxed);
        let epoch = format!("{runner}/{}/{instance}", std::process::id());
        Ledger { runner, epoch, deposits: 0 }
    }

    fn protocol(protocol: &mut Protocol<Ledger>) {
        protocol.handle::<Deposit>();
        protocol.handle::<Echo>();
    }
}

impl Handler<Deposit> for Ledger {
    async fn handle(
        &mut self,
        context: &RequestContext,
        deposit: Deposit,
    ) -> Result<u64, LedgerError> {
        let failure = |reason: String| LedgerError { reason };
        // First, before any effect: the run is recorded even if its reply never is.
        let run = match crate::runs::recorder() {
            Some(recorder) => Some(
                recorder
                    .record(&deposit.key, context.address(), context.request_id(), &self.runner)
                    .await
                    .map_err(|error| failure(format!("run not recorded: {error}")))?,
            ),
            None => None,
        };
        if let Some(work) = DEPOSIT_WORK.get().filter(|work| !work.is_zero()) {
            tokio::time::sleep(*work).await;
        }
        if let Some(table) = AUDIT_TABLE.get() {
            let client = match PgTransactionGuard::of(context).await {
                Ok(client) => Some(client),
                // The audit is PostgreSQL's only.
                Err(TransactionError::WrongBackend { .. }) => None,
                Err(error) => return Err(failure(format!("audit: {error}"))),
            };
            if let Some(client) = client {
                let address = context.address();
                let sql = format!(
                    "INSERT INTO \"{table}\" (key, entity, shard, runner, epoch, run, at) \
                     VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp())"
                );
                client
                    .execute(
                        &sql,
                        &[
                            &deposit.key,
                            &address.entity_id.as_str(),
                            &address.shard_id.to_string(),
                            &self.runner,
                            &self.epoch,
                            &run,
                        ],
                    )
                    .await
                    .map_err(|error| failure(format!("audit: {error}")))?;
            }
        }
        self.deposits += 1;
        Ok(self.deposits)
    }
}

impl Handler<Echo> for Ledger {
    async fn handle(&mut self, _: &RequestContext, echo: Echo) -> Result<u64, LedgerError> {
        Ok(echo.n)
    }
}
