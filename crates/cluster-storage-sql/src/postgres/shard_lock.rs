//! The shard locks of [`PgRunnerStorage`](super::PgRunnerStorage), held on one reserved lock
//! session (`effect/src/cluster/SqlRunnerStorage.ts`, "PostgreSQL, advisory mode" and "Row-lease
//! mode").
//!
//! The session is a connection of its own, not from the pool, kept in a slot and rebuilt after a
//! failure: advisory locks belong to a session, so the session *is* the lock holder. On connect
//! it reads its `pg_backend_pid()` (its identity in `pg_locks`) and sets `idle_session_timeout`
//! to the shard lock expiration, so the server ends the session of a frozen runner and its
//! locks are released. In lease mode the same session carries the lease statements.
//!
//! Every operation runs under the lock deadline (`shard_lock_interval`). A failure or a deadline
//! discards the session it used: its connection task is aborted at once, which closes the
//! socket, so the server ends the session and releases whatever it held; the next operation
//! connects a new one. Since a new session holds nothing, a refresh after a rebuild reports the
//! locks as lost instead of hiding the loss, and `acquire` retries once on a new session (an
//! idle session may have been ended by the server).
//!
//! # Confirmations
//!
//! A confirmation (the fencing check before a final reply) is asked for about every reply.
//! Reading `pg_locks` costs the server a snapshot of every lock it holds, so in advisory mode a
//! confirmation reads it only when it must:
//!
//! - each session remembers the locks it was seen to hold, by `pg_locks` or by a successful
//!   `pg_try_advisory_lock`, and forgets a lock before it unlocks it;
//! - a session-level advisory lock ends only with an unlock, which this session alone can issue,
//!   or with the session;
//! - so a confirmation asks the session for a sign of life (its backend pid) and answers with
//!   the remembered locks.
//!
//! A session that does not answer is discarded, as after any failure: nothing is confirmed.
//! The periodic refresh still reads `pg_locks`, and replaces what the session remembers.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::error::StorageError;
use cluster_core::inspect::ShardLock;
use cluster_core::sync::lock;
use cluster_core::{RunnerAddress, ShardId};
use tokio::task::JoinHandle;

use crate::lock::{
    advisory_lock_number, advisory_namespace, holder_of, session_name, with_deadline,
};
use crate::options::{LockMode, SqlStorageOptions};

use super::classify::{column_error, driver_error};
use super::connection::{self, PgConfig};
use super::queries::{RunnerQueries, advisory};

/// The largest `idle_session_timeout` PostgreSQL accepts, in milliseconds.
const IDLE_SESSION_TIMEOUT_MS_MAX: u128 = 2_147_483_647;

/// How often `release` unlocks one advisory lock before it falls back to unlocking all (a lock
/// taken several times by one session is held until unlocked as many times).
const UNLOCK_ATTEMPTS_MAX: u32 = 5;

/// The shard locks of one runner storage: the lock session slot and the lock statements.
pub(crate) struct ShardLocks {
    connect_config: PgConfig,
    mode: LockMode,
    options: SqlStorageOptions,
    namespace: i32,
    queries: Arc<RunnerQueries>,
    /// `idle_session_timeout` of the lock session, in milliseconds, as text for `set_config`.
    idle_session_timeout_ms: String,
    /// The current lock session; `None` before the first operation and after a discard.
    slot: Mutex<Option<Arc<LockSession>>>,
    /// Serialises connecting, so that concurrent operations open one session, not several.
    connecting: tokio::sync::Mutex<()>,
}

/// One lock session: a dedicated connection and its backend pid.
struct LockSession {
    client: tokio_postgres::Client,
    pid: i32,
    /// The advisory lock numbers this session was seen to hold, and has not unlocked since.
    /// Updated while the session's turn is held.
    known: Mutex<BTreeSet<i32>>,
    /// The runner the session is named after (its `application_name`), once an `acquire`
    /// named it.
    named: Mutex<Option<RunnerAddress>>,
    /// [`advisory::ALIVE`], prepared once: a confirmation is then one round trip, with no
    /// parsing or planning.
    alive: tokio_postgres::Statement,
    /// Operations on the session take turns. The advisory check-then-lock of `acquire` and the
    /// unlock loop of `release` are several statements; interleaving two of them could take a
    /// lock twice (a session-level lock is re-entrant and counted).
    turn: tokio::sync::Mutex<()>,
    connection: JoinHandle<()>,
}

impl Drop for LockSession {
    fn drop(&mut self) {
        // Closing the socket ends the server session, which releases its advisory locks.
        self.connection.abort();
    }
}

impl LockSession {
    /// Records what `pg_locks` or a lock attempt showed: of `asked`, the session holds `held`.
    fn remember(&self, asked: &[i32], held: &BTreeSet<i32>) {
        let mut known = lock(&self.known);
        for number in asked {
            if held.contains(number) {
                known.insert(*number);
            } else {
                known.remove(number);
            }
        }
    }
}

/// The session an operation used, so that a failure or a deadline can discard exactly that one.
type Used = Mutex<Option<Arc<LockSession>>>;

impl fmt::Debug for ShardLocks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardLocks")
            .field("mode", &self.mode)
            .field("namespace", &self.namespace)
            .field("session_pid", &self.session_pid())
            .finish_non_exhaustive()
    }
}

impl ShardLocks {
    pub(crate) fn new(
        connect_config: PgConfig,
        options: &SqlStorageOptions,
        queries: Arc<RunnerQueries>,
    ) -> ShardLocks {
        let expiration = options.shard_lock_expiration;
        let expiration_ms = expiration.as_millis()
            + u128::from(!expiration.subsec_nanos().is_multiple_of(1_000_000));
        ShardLocks {
            connect_config,
            mode: options.lock_mode,
            options: options.clone(),
            namespace: advisory_namespace(&options.prefix),
            queries,
            idle_session_timeout_ms: expiration_ms.min(IDLE_SESSION_TIMEOUT_MS_MAX).to_string(),
            slot: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
        }
    }

    /// The advisory lock namespace (the first key) of these locks.
    pub(crate) fn namespace(&self) -> i32 {
        self.namespace
    }

    /// The backend pid of the current lock session, if one is open.
    pub(crate) fn session_pid(&self) -> Option<i32> {
        self.current().map(|session| session.pid)
    }

    /// The deadline of every lock operation.
    pub(crate) fn deadline(&self) -> Duration {
        self.options.shard_lock_interval
    }

    /// Locks the shards that are free; returns those held now (new and already held), in the
    /// order asked.
    pub(crate) async fn acquire(
        &self,
        address: &RunnerAddress,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardId>, StorageError> {
        let numbers = self.lock_numbers(shard_ids)?;
        let used = Used::default();
        let operation = async {
            match self.acquire_once(&used, address, shard_ids, &numbers).await {
                Ok(held) => Ok(held),
                Err(error) => {
                    tracing::debug!(%error, "acquire failed; retrying on a new lock session");
                    self.discard(&used);
                    self.acquire_once(&used, address, shard_ids, &numbers).await
                }
            }
        };
        self.bounded("acquire", &used, operation).await
    }

    /// Refreshes the heartbeat of `address` on the lock session (with `heartbeat`) and reports
    /// which of `shard_ids` it still holds (leases are extended). Never takes a lock.
    pub(crate) async fn refresh(
        &self,
        address: &RunnerAddress,
        shard_ids: &[ShardId],
        heartbeat: bool,
    ) -> Result<Vec<ShardId>, StorageError> {
        let numbers = self.lock_numbers(shard_ids)?;
        let used = Used::default();
        let operation = async {
            let session = self.session(&used).await?;
            let _turn = session.turn.lock().await;
            let address_text = address.to_string();
            if heartbeat {
                session
                    .client
                    .execute(self.queries.heartbeat.as_str(), &[&address_text])
                    .await
                    .map_err(|error| driver_error("refresh: heartbeat", error))?;
            }
            match self.mode {
                LockMode::Advisory => self.held(&session, shard_ids, &numbers).await,
                LockMode::Lease => {
                    let shards = shard_texts(shard_ids);
                    let rows = session
                        .client
                        .query(self.queries.lease_refresh.as_str(), &[&address_text, &shards])
                        .await
                        .map_err(|error| driver_error("refresh", error))?;
                    Ok(in_request_order(shard_ids, &returned_shards(&rows)?))
                }
            }
        };
        self.bounded("refresh", &used, operation).await
    }

    /// Reports which of `shard_ids` the lock session still holds, as `refresh` without the
    /// heartbeat does; in advisory mode, from a sign of life of the session (see the module
    /// documentation).
    pub(crate) async fn confirm(
        &self,
        address: &RunnerAddress,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardId>, StorageError> {
        if self.mode == LockMode::Lease {
            return self.refresh(address, shard_ids, false).await;
        }
        let numbers = self.lock_numbers(shard_ids)?;
        let used = Used::default();
        let operation = async {
            let session = self.session(&used).await?;
            let _turn = session.turn.lock().await;
            let pid: i32 = session
                .client
                .query_one(&session.alive, &[])
                .await
                .map_err(|error| driver_error("confirm", error))?
                .try_get(0)
                .map_err(column_error)?;
            if pid != session.pid {
                return Err(StorageError::new(
                    cluster_core::error::StorageErrorKind::Unavailable,
                    "the lock session answered with another backend",
                ));
            }
            let known = lock(&session.known);
            Ok(shard_ids
                .iter()
                .zip(&numbers)
                .filter(|(_, number)| known.contains(number))
                .map(|(shard_id, _)| shard_id.clone())
                .collect())
        };
        self.bounded("confirm", &used, operation).await
    }

    /// Releases one lock, verified.
    pub(crate) async fn release(
        &self,
        address: &RunnerAddress,
        shard_id: &ShardId,
    ) -> Result<(), StorageError> {
        let numbers = self.lock_numbers(std::slice::from_ref(shard_id))?;
        if self.mode == LockMode::Advisory && self.current().is_none() {
            // Without a live session nothing is held: a closed session released its locks.
            return Ok(());
        }
        let used = Used::default();
        let operation = async {
            let session = self.session(&used).await?;
            let _turn = session.turn.lock().await;
            match (self.mode, numbers.first()) {
                (LockMode::Advisory, Some(&number)) => self.unlock(&session, number).await,
                _ => {
                    let address = address.to_string();
                    let shard = shard_id.to_string();
                    session
                        .client
                        .execute(self.queries.lease_release.as_str(), &[&address, &shard])
                        .await
                        .map(drop)
                        .map_err(|error| driver_error("release", error))
                }
            }
        };
        self.bounded("release", &used, operation).await
    }

    /// Releases every lock of `address`.
    pub(crate) async fn release_all(&self, address: &RunnerAddress) -> Result<(), StorageError> {
        if self.mode == LockMode::Advisory && self.current().is_none() {
            return Ok(());
        }
        let used = Used::default();
        let operation = async {
            let session = self.session(&used).await?;
            let _turn = session.turn.lock().await;
            let result = match self.mode {
                LockMode::Advisory => {
                    lock(&session.known).clear();
                    session.client.execute(advisory::UNLOCK_ALL, &[]).await
                }
                LockMode::Lease => {
                    let address = address.to_string();
                    session
                        .client
                        .execute(self.queries.lease_release_all.as_str(), &[&address])
                        .await
                }
            };
            result.map(drop).map_err(|error| driver_error("release_all", error))
        };
        self.bounded("release_all", &used, operation).await
    }

    /// The advisory lock numbers of `shard_ids` (empty in lease mode, which needs none). A
    /// shard outside the configured groups is invalid input, found before any statement runs.
    fn lock_numbers(&self, shard_ids: &[ShardId]) -> Result<Vec<i32>, StorageError> {
        match self.mode {
            LockMode::Advisory => shard_ids
                .iter()
                .map(|shard_id| advisory_lock_number(&self.options, shard_id))
                .collect(),
            LockMode::Lease => Ok(Vec::new()),
        }
    }

    async fn acquire_once(
        &self,
        used: &Used,
        address: &RunnerAddress,
        shard_ids: &[ShardId],
        numbers: &[i32],
    ) -> Result<Vec<ShardId>, StorageError> {
        let session = self.session(used).await?;
        let _turn = session.turn.lock().await;
        match self.mode {
            LockMode::Advisory => {
                self.name_session(&session, address).await?;
                let held = self.held_numbers(&session, numbers).await?;
                let wanted: BTreeSet<i32> =
                    numbers.iter().copied().filter(|number| !held.contains(number)).collect();
                let mut now_held = held;
                if !wanted.is_empty() {
                    let wanted: Vec<i32> = wanted.into_iter().collect();
                    let rows = session
                        .client
                        .query(advisory::TRY_LOCK, &[&self.namespace, &wanted])
                        .await
                        .map_err(|error| driver_error("acquire: try lock", error))?;
                    for row in rows {
                        let number: i32 = row.try_get(0).map_err(column_error)?;
                        let locked: bool = row.try_get(1).map_err(column_error)?;
                        if locked {
                            now_held.insert(number);
                        }
                    }
                }
                session.remember(numbers, &now_held);
                Ok(shard_ids
                    .iter()
                    .zip(numbers)
                    .filter(|(_, number)| now_held.contains(number))
                    .map(|(shard_id, _)| shard_id.clone())
                    .collect())
            }
            LockMode::Lease => {
                let address = address.to_string();
                let shards = shard_texts(shard_ids);
                let rows = session
                    .client
                    .query(self.queries.lease_acquire.as_str(), &[&address, &shards])
                    .await
                    .map_err(|error| driver_error("acquire", error))?;
                Ok(in_request_order(shard_ids, &returned_shards(&rows)?))
            }
        }
    }

    /// Names `session` after `address` (its `application_name`), once: a reader of `pg_locks`
    /// then knows which runner holds its locks ([`holders`](ShardLocks::holders)).
    async fn name_session(
        &self,
        session: &LockSession,
        address: &RunnerAddress,
    ) -> Result<(), StorageError> {
        if lock(&session.named).as_ref() == Some(address) {
            return Ok(());
        }
        let configured = self.connect_config.driver().get_application_name();
        if let Some(name) = session_name(configured, address) {
            session
                .client
                .execute(advisory::NAME, &[&name])
                .await
                .map_err(|error| driver_error("acquire: name the lock session", error))?;
        } else {
            tracing::debug!(%address, "the address is too long to name the lock session after");
        }
        *lock(&session.named) = Some(address.clone());
        Ok(())
    }

    /// The lock mode.
    pub(crate) fn mode(&self) -> LockMode {
        self.mode
    }

    /// Who holds the advisory locks of `shard_ids`, read on `pool` (not on the lock session,
    /// which stays free for the runner's own lock operations).
    pub(crate) async fn holders(
        &self,
        pool: &deadpool_postgres::Pool,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardLock>, StorageError> {
        let numbers: BTreeMap<u32, &ShardId> = shard_ids
            .iter()
            .map(|shard_id| {
                let number = advisory_lock_number(&self.options, shard_id)?;
                Ok((number.cast_unsigned(), shard_id))
            })
            .collect::<Result<_, StorageError>>()?;
        let oids: Vec<u32> = numbers.keys().copied().collect();
        let params: [&(dyn postgres_types::ToSql + Sync); 2] =
            [&self.namespace.cast_unsigned(), &oids];
        let rows = super::connection::pooled_query(pool, "shard_locks", advisory::HOLDERS, &params)
            .await?;
        let mut locks = Vec::with_capacity(rows.len());
        for row in rows {
            let oid: u32 = row.try_get(0).map_err(column_error)?;
            let pid: i32 = row.try_get(1).map_err(column_error)?;
            let name: Option<String> = row.try_get(2).map_err(column_error)?;
            let Some(shard_id) = numbers.get(&oid) else { continue };
            locks.push(ShardLock {
                shard_id: (*shard_id).clone(),
                holder: holder_of(name.as_deref(), format!("PostgreSQL backend {pid}")),
                lease_age: None,
                expired: false,
            });
        }
        locks.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
        Ok(locks)
    }

    /// The shards among `shard_ids` whose advisory locks `session` holds.
    async fn held(
        &self,
        session: &LockSession,
        shard_ids: &[ShardId],
        numbers: &[i32],
    ) -> Result<Vec<ShardId>, StorageError> {
        let held = self.held_numbers(session, numbers).await?;
        session.remember(numbers, &held);
        Ok(shard_ids
            .iter()
            .zip(numbers)
            .filter(|(_, number)| held.contains(number))
            .map(|(shard_id, _)| shard_id.clone())
            .collect())
    }

    /// The lock numbers among `numbers` that `session` holds, from `pg_locks`.
    async fn held_numbers(
        &self,
        session: &LockSession,
        numbers: &[i32],
    ) -> Result<BTreeSet<i32>, StorageError> {
        // pg_locks shows the signed keys as unsigned oids; lock numbers are positive.
        let oids: Vec<u32> =
            numbers.iter().filter_map(|&number| u32::try_from(number).ok()).collect();
        let rows = session
            .client
            .query(advisory::HELD, &[&self.namespace.cast_unsigned(), &session.pid, &oids])
            .await
            .map_err(|error| driver_error("held locks", error))?;
        let mut held = BTreeSet::new();
        for row in rows {
            let oid: u32 = row.try_get(0).map_err(column_error)?;
            if let Ok(number) = i32::try_from(oid) {
                held.insert(number);
            }
        }
        Ok(held)
    }

    /// Unlocks `number` until `pg_locks` no longer shows it held by the session, at most
    /// [`UNLOCK_ATTEMPTS_MAX`] times, then unlocks everything.
    async fn unlock(&self, session: &LockSession, number: i32) -> Result<(), StorageError> {
        // Forgotten first: from here on, the lock is not confirmed.
        lock(&session.known).remove(&number);
        let oid = number.cast_unsigned();
        for _ in 0..UNLOCK_ATTEMPTS_MAX {
            session
                .client
                .execute(advisory::UNLOCK, &[&self.namespace, &number])
                .await
                .map_err(|error| driver_error("release: unlock", error))?;
            let still_held: bool = session
                .client
                .query_one(
                    advisory::IS_HELD,
                    &[&self.namespace.cast_unsigned(), &oid, &session.pid],
                )
                .await
                .map_err(|error| driver_error("release: check", error))?
                .try_get(0)
                .map_err(column_error)?;
            if !still_held {
                return Ok(());
            }
        }
        tracing::warn!(number, "advisory lock still held after unlocking; unlocking all");
        lock(&session.known).clear();
        session
            .client
            .execute(advisory::UNLOCK_ALL, &[])
            .await
            .map(drop)
            .map_err(|error| driver_error("release: unlock all", error))
    }

    /// Runs `operation` under the lock deadline; on any failure (a deadline included) the
    /// session it used is discarded, so the next operation starts on a new one.
    async fn bounded<T>(
        &self,
        what: &str,
        used: &Used,
        operation: impl Future<Output = Result<T, StorageError>>,
    ) -> Result<T, StorageError> {
        let result = with_deadline(self.deadline(), what, operation).await;
        if let Err(error) = &result {
            tracing::debug!(%error, what, "lock operation failed; discarding its lock session");
            self.discard(used);
        }
        result
    }

    fn current(&self) -> Option<Arc<LockSession>> {
        let slot = lock(&self.slot);
        slot.as_ref().filter(|session| !session.client.is_closed()).cloned()
    }

    /// The current session, or a new one if there is none or it was closed (for example by
    /// `idle_session_timeout`); recorded in `used`.
    async fn session(&self, used: &Used) -> Result<Arc<LockSession>, StorageError> {
        let session = match self.current() {
            Some(session) => session,
            None => {
                let _connecting = self.connecting.lock().await;
                match self.current() {
                    Some(session) => session,
                    None => {
                        let session = Arc::new(self.connect().await?);
                        let mut slot = lock(&self.slot);
                        *slot = Some(Arc::clone(&session));
                        session
                    }
                }
            }
        };
        *lock(used) = Some(Arc::clone(&session));
        Ok(session)
    }

    async fn connect(&self) -> Result<LockSession, StorageError> {
        let (client, connection) = connection::connect(&self.connect_config)
            .await
            .map_err(|error| driver_error("lock session: connect", error))?;
        let setup = async {
            let pid = match self.mode {
                LockMode::Lease => 0,
                LockMode::Advisory => {
                    let row = client
                        .query_one(advisory::SETUP, &[&self.idle_session_timeout_ms])
                        .await
                        .map_err(|error| driver_error("lock session: setup", error))?;
                    row.try_get::<_, i32>(0).map_err(column_error)?
                }
            };
            let alive = client
                .prepare(advisory::ALIVE)
                .await
                .map_err(|error| driver_error("lock session: setup", error))?;
            Ok::<_, StorageError>((pid, alive))
        };
        let (pid, alive) = match setup.await {
            Ok(setup) => setup,
            Err(error) => {
                connection.abort();
                return Err(error);
            }
        };
        tracing::debug!(pid, "lock session opened");
        Ok(LockSession {
            client,
            pid,
            known: Mutex::new(BTreeSet::new()),
            named: Mutex::new(None),
            alive,
            turn: tokio::sync::Mutex::new(()),
            connection,
        })
    }

    /// Drops the session recorded in `used` from the slot (if it is still the current one) and
    /// closes its connection.
    fn discard(&self, used: &Used) {
        let Some(session) = lock(used).take() else {
            return;
        };
        let mut slot = lock(&self.slot);
        if slot.as_ref().is_some_and(|current| Arc::ptr_eq(current, &session)) {
            *slot = None;
        }
        drop(slot);
        session.connection.abort();
    }
}

fn shard_texts(shard_ids: &[ShardId]) -> Vec<String> {
    shard_ids.iter().map(ShardId::to_string).collect()
}

fn returned_shards(rows: &[tokio_postgres::Row]) -> Result<BTreeSet<String>, StorageError> {
    rows.iter().map(|row| row.try_get::<_, String>(0).map_err(column_error)).collect()
}

/// The shards of `shard_ids` (in that order) whose text is in `held`.
fn in_request_order(shard_ids: &[ShardId], held: &BTreeSet<String>) -> Vec<ShardId> {
    shard_ids.iter().filter(|shard_id| held.contains(&shard_id.to_string())).cloned().collect()
}
