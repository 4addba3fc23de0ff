//! One runner that owns every shard, with its shard locks held in a [`RunnerStorage`]
//! (reference `SingleRunner`): a complete deployment for one process.
//!
//! At start it registers itself in the runner registry, takes the lock of every shard of its
//! groups and fails if another live runner holds any (two processes on one database must not
//! both deliver); it refreshes the locks every shard lock interval, and at shutdown, once its
//! entities have stopped, releases them and unregisters. Several runners sharing the shards
//! (membership, rebalancing, handoff) are the multi-runner runtime's job.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::error::{ConfigError, StorageError};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::{Clock, Runner, RunnerAddress, ShardId};

use crate::persisted::all_shards;
use crate::sharding::Sharding;

/// Why a single runner did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A storage operation failed.
    #[error("storage error while starting: {0}")]
    Storage(#[from] StorageError),
    /// A runner needs an address (`runner_address` is `None`: a client-only configuration).
    #[error("a runner needs a runner address")]
    NoRunnerAddress,
    /// A built-in entity or singleton could not be registered.
    #[error("could not register a built-in: {0}")]
    Register(String),
    /// Another live runner holds some of the shards.
    #[error("{held} of {total} shards are locked by another runner")]
    ShardsHeld {
        /// How many shards could not be locked.
        held: usize,
        /// How many shards the runner needs.
        total: usize,
    },
}

/// Shards and registration a single runner holds, released at shutdown.
pub(crate) struct HeldLocks {
    runners: Arc<dyn RunnerStorage>,
    address: RunnerAddress,
    shards: Vec<ShardId>,
}

impl HeldLocks {
    /// Refreshes the locks every `interval` until `sharding` shuts down; a lost lock is
    /// reported (only a misconfigured second runner on the same database can take it).
    pub(crate) async fn refresh(self: Arc<HeldLocks>, sharding: Sharding, interval: Duration) {
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = sharding.shutdown_token().cancelled() => return,
            }
            match self.runners.refresh(&self.address, &self.shards).await {
                Ok(held) if held.len() == self.shards.len() => {}
                Ok(held) => tracing::error!(
                    held = held.len(),
                    total = self.shards.len(),
                    "shard locks were lost to another runner"
                ),
                Err(error) => tracing::warn!(%error, "could not refresh the shard locks"),
            }
        }
    }

    /// Releases every lock and unregisters the runner (errors are logged: locks expire).
    pub(crate) async fn release(&self) {
        if let Err(error) = self.runners.release_all(&self.address).await {
            tracing::warn!(%error, "could not release the shard locks; they expire");
        }
        if let Err(error) = self.runners.unregister(&self.address).await {
            tracing::warn!(%error, "could not unregister the runner");
        }
    }
}

impl Sharding {
    /// A single runner on `messages`, holding every shard's lock in `runners` (see the module
    /// docs), with its storage read loop started.
    pub async fn with_storages(
        config: cluster_core::ShardingConfig,
        clock: Arc<dyn Clock>,
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
    ) -> Result<Sharding, StartError> {
        config.validate()?;
        let address = config.runner_address.clone().ok_or(StartError::NoRunnerAddress)?;
        let groups = config.shard_groups().assigned;
        let runner = Runner::new(
            address.clone(),
            groups.iter().cloned().collect(),
            config.runner_shard_weight,
        );
        let machine_id = runners.register(&runner, true).await?;
        let shards = all_shards(&groups, config.shards_per_group);
        let acquired = runners.acquire(&address, &shards).await?;
        if acquired.len() < shards.len() {
            // Give back what was taken: the other runner keeps the rest.
            let _ = runners.release_all(&address).await;
            return Err(StartError::ShardsHeld {
                held: shards.len() - acquired.len(),
                total: shards.len(),
            });
        }
        let interval = config.shard_lock_interval();
        let locks = Arc::new(HeldLocks { runners, address, shards });
        let sharding = Sharding::with_storage(config, clock, messages).await?;
        sharding.set_machine_id(machine_id);
        sharding.hold_locks(Arc::clone(&locks));
        sharding.spawn_owned(locks.refresh(sharding.clone(), interval));
        Ok(sharding)
    }
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use std::path::Path;
    use std::sync::Arc;

    use cluster_core::{ShardingConfig, SystemClock};
    use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage};
    use cluster_storage_sql::{SqlStorageOptions, TablePrefix};

    use super::StartError;
    use crate::sharding::Sharding;

    /// One-call constructors of a single runner.
    #[derive(Debug)]
    pub struct SingleRunner;

    impl SingleRunner {
        /// A runner on the SQLite file at `path` (created if needed), with the reference's
        /// table prefix, the system clock and no transport: one process is a complete
        /// deployment. The file's messages survive restarts; see [`Sharding::with_storages`].
        ///
        /// A persisted request is saved to the file before it is delivered; sent again with
        /// the same primary key (after a crash, say), it is answered from the file without
        /// running again:
        ///
        /// ```
        /// use std::sync::atomic::{AtomicU64, Ordering};
        ///
        /// use cluster_core::ShardingConfig;
        /// use cluster_sharding::{
        ///     Entity, EntityContext, EntityOptions, Handler, Protocol, RequestContext, Rpc,
        ///     SingleRunner,
        /// };
        /// use serde::{Deserialize, Serialize};
        ///
        /// static RUNS: AtomicU64 = AtomicU64::new(0);
        ///
        /// struct Account {
        ///     balance: u64,
        /// }
        ///
        /// #[derive(Serialize, Deserialize)]
        /// struct Deposit {
        ///     key: String,
        ///     amount: u64,
        /// }
        ///
        /// impl Rpc for Deposit {
        ///     const TAG: &'static str = "Deposit";
        ///     const PERSISTED: bool = true;
        ///     type Success = u64;
        ///     type Error = String;
        ///
        ///     fn primary_key(&self) -> Option<String> {
        ///         Some(self.key.clone())
        ///     }
        /// }
        ///
        /// impl Entity for Account {
        ///     const TYPE: &'static str = "Account";
        ///
        ///     async fn create(_context: &EntityContext) -> Account {
        ///         Account { balance: 0 }
        ///     }
        ///
        ///     fn protocol(protocol: &mut Protocol<Account>) {
        ///         protocol.handle::<Deposit>();
        ///     }
        /// }
        ///
        /// impl Handler<Deposit> for Account {
        ///     async fn handle(&mut self, _: &RequestContext, deposit: Deposit)
        ///     -> Result<u64, String> {
        ///         RUNS.fetch_add(1, Ordering::SeqCst);
        ///         self.balance += deposit.amount;
        ///         Ok(self.balance)
        ///     }
        /// }
        ///
        /// # #[tokio::main(flavor = "current_thread")]
        /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
        /// let path = std::env::temp_dir().join(format!("doc-runner-{}.db", std::process::id()));
        /// let sharding = SingleRunner::sqlite(&path, ShardingConfig::default()).await?;
        /// sharding.register::<Account>(EntityOptions::default())?;
        ///
        /// let account = sharding.client::<Account>("alice");
        /// let deposit = || Deposit { key: "deposit-1".into(), amount: 10 };
        /// assert_eq!(account.send(deposit()).await?, 10);
        /// // The same key again: the stored reply, and the handler does not run again.
        /// assert_eq!(account.send(deposit()).await?, 10);
        /// assert_eq!(RUNS.load(Ordering::SeqCst), 1);
        ///
        /// sharding.shutdown().await;
        /// # for suffix in ["", "-wal", "-shm"] {
        /// #     let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        /// # }
        /// # Ok(())
        /// # }
        /// ```
        pub async fn sqlite(
            path: impl AsRef<Path>,
            config: ShardingConfig,
        ) -> Result<Sharding, StartError> {
            let options = SqlStorageOptions::from_config(&config, TablePrefix::default());
            let messages =
                SqliteMessageStorage::open(path.as_ref(), SqliteOptions::new(options.clone()))
                    .await?;
            let runners =
                SqliteRunnerStorage::open(path.as_ref(), SqliteOptions::new(options)).await?;
            Sharding::with_storages(
                config,
                Arc::new(SystemClock),
                Arc::new(messages),
                Arc::new(runners),
            )
            .await
        }
    }
}

#[cfg(feature = "sqlite")]
pub use sqlite::SingleRunner;
