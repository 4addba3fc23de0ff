//! The entity of the fault test: a ledger per entity id.
//!
//! A [`Deposit`] is persisted, deduplicated by its key, and runs in a storage transaction
//! (`WITH_TRANSACTION`). Its handler first records the run outside that transaction
//! ([`crate::runs`]: every run, committed or not), then, on PostgreSQL, writes an audit row —
//! key, entity, shard, runner, lock epoch, the run's `seq` and the database's clock — in the
//! transaction that stores its reply, so the audit holds exactly the runs whose reply was
//! stored (a fenced run rolls back). A deposit can be made to take a while in between
//! ([`LedgerDependencies::deposit_work`]), so that faults find runs in flight.
//!
//! What a ledger writes to and how it works come from [`LedgerDependencies`], handed to every
//! instance by the factory it is registered with ([`Ledger::factory`] and
//! `Sharding::entity` with a factory), not from process globals.
//!
//! The lock epoch is the entity instance: an instance lives within one tenure of its shard's
//! lock on its runner (it stops before the lock is released), so two epochs of different
//! runners whose audit rows interleave on one shard mean that shard was served twice at once.
//!
//! A ledger's count of deposits is its durable state: it commits in the same transaction as
//! each deposit's reply and audit row, so after every fault it equals the ledger's audit rows
//! (the fault test checks it).
//!
//! An [`Echo`] is volatile and answers its number.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::transaction::TransactionError;
use cluster_sharding::{EntityContext, RequestContext, entity};
use cluster_storage_sql::PgTransactionGuard;
use serde::{Deserialize, Serialize};

use crate::runs::RunRecorder;

/// What the ledgers of one runner share. The default audits nothing, records no run and
/// does not wait: a plain ledger.
#[derive(Debug, Default)]
pub struct LedgerDependencies {
    /// The audit table (PostgreSQL) each deposit writes its row to, if the test audits.
    pub audit_table: Option<String>,
    /// How long each deposit works inside its transaction, after its run is recorded and
    /// before its audit row, so that the fault test's faults find runs in flight.
    pub deposit_work: Duration,
    /// Records every run of a deposit, if the test checks them ([`crate::runs`]).
    pub recorder: Option<RunRecorder>,
    /// Instances created so far, for their epochs.
    instances: AtomicU64,
}

/// The ledger entity.
pub struct Ledger {
    runner: String,
    epoch: String,
    deposits: u64,
    dependencies: Arc<LedgerDependencies>,
}

impl Ledger {
    /// The factory to register ledgers with (`Sharding::entity(..).factory`): every instance
    /// shares `dependencies`.
    pub fn factory(
        dependencies: LedgerDependencies,
    ) -> impl Fn(&EntityContext) -> Ledger + Send + Sync + 'static {
        let dependencies = Arc::new(dependencies);
        move |context| Ledger::new(context, Arc::clone(&dependencies))
    }

    fn new(context: &EntityContext, dependencies: Arc<LedgerDependencies>) -> Ledger {
        let runner = context
            .sharding()
            .config()
            .runner_address
            .as_ref()
            .map_or_else(|| "client".to_owned(), ToString::to_string);
        let instance = dependencies.instances.fetch_add(1, Ordering::Relaxed);
        let epoch = format!("{runner}/{}/{instance}", std::process::id());
        Ledger { runner, epoch, deposits: 0, dependencies }
    }
}

/// The audit table's name (`<prefix>_chaos_audit`).
pub fn audit_table(prefix: &cluster_storage_sql::TablePrefix) -> String {
    prefix.table("chaos_audit")
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

/// A volatile request answered with its number.
#[derive(Serialize, Deserialize)]
pub struct Echo {
    /// The number.
    pub n: u64,
}

#[entity(name = "ChaosLedger", state = deposits)]
impl Ledger {
    /// Adds one to the ledger, once per key, in the transaction that stores its reply (with the
    /// count, the ledger's durable state).
    #[rpc(persisted, primary_key = key, with_transaction)]
    async fn deposit(
        &mut self,
        context: &RequestContext,
        deposit: Deposit,
    ) -> Result<u64, LedgerError> {
        let failure = |reason: String| LedgerError { reason };
        let dependencies = &self.dependencies;
        // First, before any effect: the run is recorded even if its reply never is.
        let run = match &dependencies.recorder {
            Some(recorder) => Some(
                recorder
                    .record(&deposit.key, context.address(), context.request_id(), &self.runner)
                    .await
                    .map_err(|error| failure(format!("run not recorded: {error}")))?,
            ),
            None => None,
        };
        if !dependencies.deposit_work.is_zero() {
            tokio::time::sleep(dependencies.deposit_work).await;
        }
        if let Some(table) = &dependencies.audit_table {
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

    /// Answers the echo's number.
    #[rpc]
    async fn echo(&mut self, echo: Echo) -> Result<u64, LedgerError> {
        Ok(echo.n)
    }
}
