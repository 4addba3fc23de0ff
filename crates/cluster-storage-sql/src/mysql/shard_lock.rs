//! Shard locks on MySQL (`effect/src/cluster/SqlRunnerStorage.ts`): every lock operation runs on
//! ONE reserved connection, not on the pool, held in a slot that is rebuilt after a failure.
//!
//! - [`LockMode::Advisory`]: `GET_LOCK` named locks, which belong to the session. On connect
//!   the session's `wait_timeout` becomes the lock expiration, so the server ends the session of
//!   a frozen runner and its locks with it; a *pin lock* (`<prefix>:pid:<random>`) read back
//!   with `IS_USED_LOCK` gives the id other sessions see as the holder (behind Vitess that is not
//!   `CONNECTION_ID()`). The first `acquire` also takes the runner's *identity lock*
//!   ([`identity_lock_name`](queries::identity_lock_name)), so that a reader of the locks
//!   ([`ShardLocks::holders`]) can tell which runner holds a shard: the session holding the
//!   shard's lock holds its runner's identity lock too.
//! - [`LockMode::Lease`]: rows in `<prefix>_locks`, with the reference's MySQL lease SQL; rows
//!   are always written in one fixed order, so two runners cannot deadlock on them.
//!
//! A session is taken out of the slot for the duration of an operation and put back only when
//! the operation succeeded. After a failure, a deadline or a cancellation it is dropped, which
//! closes its connection at once (releasing any named locks the server still attributes to
//! it); the next operation connects a new one. That is the reference's "rebuild", done lazily:
//! a failed reconnection is simply retried by the next operation.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use cluster_core::inspect::{LockHolder, ShardLock};
use cluster_core::{RunnerAddress, ShardId};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Opts, Row, Value};

use super::classify::storage_error;
use super::columns::{Columns, check_chars};
use super::connection::ClosingConn;
use super::queries::{self, IN_LIST_LEN_MAX, RunnerQueries};
use crate::lock::mysql_lock_name;
use crate::options::{LockMode, SqlStorageOptions, TablePrefix};

/// The largest `wait_timeout` MySQL accepts, in seconds (one year).
const WAIT_TIMEOUT_SECONDS_MAX: u64 = 31_536_000;
/// How long taking the pin lock may wait for a (vanishingly unlikely) namesake, in seconds.
const PIN_WAIT_SECONDS: u32 = 10;
/// Fresh pin names tried before giving up.
const PIN_ATTEMPTS_MAX: u32 = 3;
/// `RELEASE_LOCK` calls before a release gives up (a lock taken n times needs n releases).
const RELEASE_ATTEMPTS_MAX: u32 = 8;

/// A lock operation, run on the reserved session.
#[derive(Clone, Copy, Debug)]
pub(crate) enum LockCommand<'a> {
    /// Take the shards that are free; report all that are held.
    Acquire { address: &'a str, shard_ids: &'a [ShardId] },
    /// Heartbeat (with `heartbeat`), then report (leases: extend) the shards still held.
    Refresh { address: &'a str, shard_ids: &'a [ShardId], heartbeat: bool },
    /// Release one shard.
    Release { address: &'a str, shard_id: &'a ShardId },
    /// Release every shard.
    ReleaseAll { address: &'a str },
}

impl LockCommand<'_> {
    fn shard_ids(&self) -> &[ShardId] {
        match self {
            LockCommand::Acquire { shard_ids, .. } | LockCommand::Refresh { shard_ids, .. } => {
                shard_ids
            }
            LockCommand::Release { shard_id, .. } => std::slice::from_ref(*shard_id),
            LockCommand::ReleaseAll { .. } => &[],
        }
    }
}

/// The reserved lock session of one runner storage, and how to rebuild it.
pub(crate) struct ShardLocks {
    opts: Opts,
    mode: LockMode,
    prefix: TablePrefix,
    wait_timeout_seconds: u64,
    queries: Arc<RunnerQueries>,
    /// Locked for a whole operation: the one connection runs one statement at a time, so
    /// operations queue here (each under its own deadline) rather than on the socket.
    slot: tokio::sync::Mutex<Option<LockSession>>,
}

impl fmt::Debug for ShardLocks {
    /// Without the connection options, which hold the password.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShardLocks")
            .field("mode", &self.mode)
            .field("prefix", &self.prefix)
            .field("wait_timeout_seconds", &self.wait_timeout_seconds)
            .finish_non_exhaustive()
    }
}

/// A reserved connection and, in advisory mode, its pin and the runner it is named after.
struct LockSession {
    conn: ClosingConn,
    pin: Option<Pin>,
    /// The address whose identity lock the session holds, once an advisory `acquire` took it.
    named: Option<String>,
}

/// The pin lock of an advisory session and the holder id `IS_USED_LOCK` reports for it.
#[derive(Debug)]
struct Pin {
    name: String,
    session_id: u64,
}

impl ShardLocks {
    pub(crate) fn new(
        opts: Opts,
        options: &SqlStorageOptions,
        queries: Arc<RunnerQueries>,
    ) -> ShardLocks {
        ShardLocks {
            opts,
            mode: options.lock_mode,
            prefix: options.prefix.clone(),
            wait_timeout_seconds: options.expiration_seconds().clamp(1, WAIT_TIMEOUT_SECONDS_MAX),
            queries,
            slot: tokio::sync::Mutex::new(None),
        }
    }

    /// Runs `command` on the reserved session (connecting one first if there is none) and
    /// returns the shards it reports held. Bad input fails before the session is touched; any
    /// other failure drops the session.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe in the sense of the module docs: a dropped operation drops the session,
    /// which closes its connection; the next operation starts a new one.
    pub(crate) async fn run(&self, command: LockCommand<'_>) -> Result<Vec<ShardId>, StorageError> {
        let names = self.names(command.shard_ids())?;
        let mut slot = self.slot.lock().await;
        let mut session = match slot.take() {
            Some(session) => session,
            None => self.connect().await?,
        };
        match self.execute(&mut session, command, &names).await {
            Ok(held) => {
                *slot = Some(session);
                Ok(held)
            }
            Err(error) => {
                tracing::debug!(%error, "lock session dropped; the next operation reconnects");
                Err(error)
            }
        }
    }

    /// The names the shards are locked under: advisory lock names, or the lease rows' shard
    /// ids. Checked against the server's limits.
    fn names(&self, shard_ids: &[ShardId]) -> Result<Vec<String>, StorageError> {
        shard_ids
            .iter()
            .map(|shard_id| match self.mode {
                LockMode::Advisory => self.advisory_name(shard_id),
                LockMode::Lease => {
                    let name = shard_id.to_string();
                    check_chars("shard_id", &name, queries::SHARD_ID_LEN_MAX)?;
                    Ok(name)
                }
            })
            .collect()
    }

    /// The advisory lock name of `shard_id`, checked against the server's limit.
    fn advisory_name(&self, shard_id: &ShardId) -> Result<String, StorageError> {
        let name = mysql_lock_name(&self.prefix, shard_id);
        check_chars("lock name", &name, queries::LOCK_NAME_LEN_MAX)?;
        Ok(name)
    }

    async fn connect(&self) -> Result<LockSession, StorageError> {
        let conn = Conn::new(self.opts.clone())
            .await
            .map_err(|error| storage_error("lock session: connect", error))?;
        // Closed, not kept, if the setup below fails.
        let mut conn = ClosingConn::new(conn);
        let pin = match self.mode {
            LockMode::Lease => None,
            LockMode::Advisory => Some(self.set_up_advisory(conn.get()).await?),
        };
        tracing::debug!(
            connection_id = conn.get().id(),
            session_id = pin.as_ref().map(|pin| pin.session_id),
            "lock session connected"
        );
        Ok(LockSession { conn, pin, named: None })
    }

    /// Records the session's `wait_timeout`, sets it to the lock expiration and takes the pin.
    async fn set_up_advisory(&self, conn: &mut Conn) -> Result<Pin, StorageError> {
        let error = |error| storage_error("lock session: set up", error);
        let row: Option<Row> =
            conn.query_first("SELECT @@SESSION.wait_timeout").await.map_err(error)?;
        let previous = row.map(|row| Columns::new(row).int());
        tracing::debug!(
            ?previous,
            wait_timeout = self.wait_timeout_seconds,
            "lock session wait_timeout"
        );
        conn.query_drop(format!("SET SESSION wait_timeout = {}", self.wait_timeout_seconds))
            .await
            .map_err(error)?;
        take_pin(conn, &self.prefix, None).await
    }

    async fn execute(
        &self,
        session: &mut LockSession,
        command: LockCommand<'_>,
        names: &[String],
    ) -> Result<Vec<ShardId>, StorageError> {
        let conn = session.conn.get();
        let named = &mut session.named;
        match (self.mode, session.pin.as_mut()) {
            (LockMode::Advisory, Some(pin)) => match command {
                LockCommand::Acquire { address, shard_ids } => {
                    self.name_session(conn, named, address).await?;
                    advisory_acquire(conn, pin.session_id, shard_ids, names).await
                }
                LockCommand::Refresh { address, shard_ids, heartbeat } => {
                    if heartbeat {
                        self.heartbeat(conn, address).await?;
                    }
                    let holders = advisory_holders(conn, names).await?;
                    Ok(select(shard_ids, |index| holders[index] == Some(pin.session_id)))
                }
                LockCommand::Release { .. } => {
                    advisory_release(conn, pin.session_id, names).await?;
                    Ok(Vec::new())
                }
                LockCommand::ReleaseAll { .. } => {
                    conn.query_drop("SELECT RELEASE_ALL_LOCKS()")
                        .await
                        .map_err(|error| storage_error("release_all", error))?;
                    // That released the pin too: take it again. It released the identity
                    // lock as well, which the next `acquire` takes again.
                    *named = None;
                    *pin = take_pin(conn, &self.prefix, Some(pin.name.clone())).await?;
                    Ok(Vec::new())
                }
            },
            (LockMode::Advisory, None) => Err(StorageError::new(
                StorageErrorKind::Other,
                "advisory lock session without a pin",
            )),
            (LockMode::Lease, _) => self.execute_lease(conn, command, names).await,
        }
    }

    async fn execute_lease(
        &self,
        conn: &mut Conn,
        command: LockCommand<'_>,
        names: &[String],
    ) -> Result<Vec<ShardId>, StorageError> {
        match command {
            LockCommand::Acquire { address, shard_ids } => {
                let mut ordered: Vec<&String> = names.iter().collect();
                ordered.sort_by_key(|name| lease_order_key(name));
                for chunk in ordered.chunks(IN_LIST_LEN_MAX) {
                    let mut params = Vec::with_capacity(chunk.len() * 2);
                    for name in chunk {
                        params.push(Value::from(name.as_str()));
                        params.push(Value::from(address));
                    }
                    conn.exec_drop(self.queries.lease_acquire(chunk.len()), params)
                        .await
                        .map_err(|error| storage_error("acquire: take leases", error))?;
                }
                let held =
                    lease_select(conn, |n| self.queries.lease_held(n), address, names).await?;
                Ok(select(shard_ids, |index| held.contains(&names[index])))
            }
            LockCommand::Refresh { address, shard_ids, heartbeat } => {
                if heartbeat {
                    self.heartbeat(conn, address).await?;
                }
                for chunk in names.chunks(IN_LIST_LEN_MAX) {
                    let mut params = vec![Value::from(address)];
                    params.extend(chunk.iter().map(|name| Value::from(name.as_str())));
                    conn.exec_drop(self.queries.lease_refresh(chunk.len()), params)
                        .await
                        .map_err(|error| storage_error("refresh: extend leases", error))?;
                }
                let owned =
                    lease_select(conn, |n| self.queries.lease_owned(n), address, names).await?;
                Ok(select(shard_ids, |index| owned.contains(&names[index])))
            }
            LockCommand::Release { address, shard_id } => {
                let shard_id = shard_id.to_string();
                conn.exec_drop(self.queries.lease_release.as_str(), (address, shard_id))
                    .await
                    .map_err(|error| storage_error("release", error))?;
                Ok(Vec::new())
            }
            LockCommand::ReleaseAll { address } => {
                conn.exec_drop(self.queries.lease_release_all.as_str(), (address,))
                    .await
                    .map_err(|error| storage_error("release_all", error))?;
                Ok(Vec::new())
            }
        }
    }

    /// Names the session after `address` by taking its identity lock, unless it holds it
    /// already (releasing the identity lock of another address first). A lock another session
    /// holds (an old session of the runner that the server has not ended yet) is not waited
    /// for: the shards then read as held by a bare session, and the next `acquire` tries again.
    async fn name_session(
        &self,
        conn: &mut Conn,
        named: &mut Option<String>,
        address: &str,
    ) -> Result<(), StorageError> {
        if named.as_deref() == Some(address) {
            return Ok(());
        }
        if let Some(previous) = named.take() {
            let params = (previous.as_str(), previous.as_str(), previous.as_str());
            conn.exec_drop(self.queries.identity_release.as_str(), params)
                .await
                .map_err(|error| storage_error("acquire: release the identity lock", error))?;
        }
        let row: Option<Row> = conn
            .exec_first(self.queries.identity_take.as_str(), (address, address, address))
            .await
            .map_err(|error| storage_error("acquire: take the identity lock", error))?;
        let taken = match row {
            Some(row) => Columns::new(row).int().map_err(malformed)?,
            None => None,
        };
        if taken == Some(1) {
            *named = Some(address.to_owned());
        } else {
            tracing::debug!(address, "the identity lock is held by another session");
        }
        Ok(())
    }

    /// The lock mode.
    pub(crate) fn mode(&self) -> LockMode {
        self.mode
    }

    /// Who holds the advisory locks of `shard_ids`, read on `conn` (a pool connection, not the
    /// lock session, which stays free for the runner's own lock operations): one `IS_USED_LOCK`
    /// per shard, then, if any is held, the holders of the registered runners' identity locks
    /// name the runners. A holder that holds no runner's identity lock is a bare session.
    pub(crate) async fn holders(
        &self,
        conn: &mut Conn,
        shard_ids: &[ShardId],
    ) -> Result<Vec<ShardLock>, StorageError> {
        let shard_ids: Vec<ShardId> =
            shard_ids.iter().cloned().collect::<BTreeSet<ShardId>>().into_iter().collect();
        let names: Vec<String> = shard_ids
            .iter()
            .map(|shard_id| self.advisory_name(shard_id))
            .collect::<Result<_, StorageError>>()?;
        let holders = advisory_holders(conn, &names).await?;
        if holders.iter().all(Option::is_none) {
            return Ok(Vec::new());
        }
        let rows: Vec<Row> = conn
            .exec(self.queries.identity_holders.as_str(), ())
            .await
            .map_err(|error| storage_error("shard_locks: runner identities", error))?;
        // The runner of each holder; `None` for a holder two runners' names point to (names
        // that compare equal without case, or share a hash), which names neither.
        let mut runners: BTreeMap<u64, Option<RunnerAddress>> = BTreeMap::new();
        for row in rows {
            let mut columns = Columns::new(row);
            let (address, holder) = (columns.text(), columns.int());
            let (Ok(Some(address)), Ok(Some(holder))) = (address, holder) else { continue };
            match (address.parse::<RunnerAddress>(), u64::try_from(holder)) {
                (Ok(address), Ok(holder)) => {
                    runners
                        .entry(holder)
                        .and_modify(|runner| *runner = None)
                        .or_insert(Some(address));
                }
                _ => tracing::warn!(%address, "skipping a runner whose address cannot be read"),
            }
        }
        let locks = shard_ids
            .into_iter()
            .zip(holders)
            .filter_map(|(shard_id, holder)| {
                let holder = holder?;
                let holder = match runners.get(&holder) {
                    Some(Some(address)) => LockHolder::Runner(address.clone()),
                    _ => LockHolder::Session(format!("MySQL connection {holder}")),
                };
                Some(ShardLock { shard_id, holder, lease_age: None, expired: false })
            })
            .collect();
        Ok(locks)
    }

    async fn heartbeat(&self, conn: &mut Conn, address: &str) -> Result<(), StorageError> {
        conn.exec_drop(self.queries.heartbeat.as_str(), (address,))
            .await
            .map_err(|error| storage_error("refresh: heartbeat", error))
    }
}

/// The shards at the indexes `keep` accepts, in request order.
fn select(shard_ids: &[ShardId], keep: impl Fn(usize) -> bool) -> Vec<ShardId> {
    shard_ids
        .iter()
        .enumerate()
        .filter(|(index, _)| keep(*index))
        .map(|(_, id)| id.clone())
        .collect()
}

/// The order lease rows are written in: the locks table's primary key, whose byte-wise
/// collation (see `migrate_runners`) orders like the UTF-8 bytes, which is what the index scans
/// of `refresh` and `release_all` follow too.
fn lease_order_key(name: &str) -> &[u8] {
    name.as_bytes()
}

/// Takes the pin lock (`name`, or a fresh random one) and reads the holder id the server
/// reports for it.
async fn take_pin(
    conn: &mut Conn,
    prefix: &TablePrefix,
    name: Option<String>,
) -> Result<Pin, StorageError> {
    for _ in 0..PIN_ATTEMPTS_MAX {
        let name = name.clone().unwrap_or_else(|| format!("{prefix}:pid:{}", random_u64()));
        check_chars("pin lock name", &name, queries::LOCK_NAME_LEN_MAX)?;
        let row: Option<Row> = conn
            .exec_first("SELECT GET_LOCK(?, ?), IS_USED_LOCK(?)", (&name, PIN_WAIT_SECONDS, &name))
            .await
            .map_err(|error| storage_error("lock session: take the pin", error))?;
        let Some(row) = row else { continue };
        let mut columns = Columns::new(row);
        let taken = columns.int().map_err(malformed)?;
        let holder = columns.int().map_err(malformed)?;
        if let (Some(1), Some(holder)) = (taken, holder) {
            let session_id = u64::try_from(holder)
                .map_err(|_| malformed(DecodeError::new("IS_USED_LOCK", "negative id")))?;
            return Ok(Pin { name, session_id });
        }
    }
    Err(StorageError::new(
        StorageErrorKind::Unavailable,
        format!("lock session: could not take a pin lock in {PIN_ATTEMPTS_MAX} attempts"),
    ))
}

/// A random number for pin names, from the standard library's randomly keyed hasher (only
/// uniqueness matters; no determinism is lost, the name never influences behaviour).
fn random_u64() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let counter = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    RandomState::new().hash_one(counter)
}

fn malformed(error: DecodeError) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "unexpected lock function result", error)
}

/// The holder id of each named lock (`IS_USED_LOCK`), `None` where it is free.
async fn advisory_holders(
    conn: &mut Conn,
    names: &[String],
) -> Result<Vec<Option<u64>>, StorageError> {
    let mut holders = Vec::with_capacity(names.len());
    for chunk in names.chunks(IN_LIST_LEN_MAX) {
        let row: Option<Row> = conn
            .exec_first(queries::advisory_holders(chunk.len()), chunk.to_vec())
            .await
            .map_err(|error| storage_error("lock holders", error))?;
        let mut columns =
            Columns::new(row.ok_or_else(|| malformed(DecodeError::new("IS_USED_LOCK", "no row")))?);
        for _ in chunk {
            let holder = columns.int().map_err(malformed)?;
            holders.push(holder.and_then(|holder| u64::try_from(holder).ok()));
        }
    }
    Ok(holders)
}

/// One `IS_USED_LOCK` pass over all requested shards finds those this session holds, then
/// `GET_LOCK(name, 0)` tries the rest without waiting (`effect/src/cluster/SqlRunnerStorage.ts`).
async fn advisory_acquire(
    conn: &mut Conn,
    session_id: u64,
    shard_ids: &[ShardId],
    names: &[String],
) -> Result<Vec<ShardId>, StorageError> {
    let holders = advisory_holders(conn, names).await?;
    let mut held: Vec<bool> = holders.iter().map(|holder| *holder == Some(session_id)).collect();
    let to_take: Vec<usize> = (0..names.len()).filter(|index| !held[*index]).collect();
    for chunk in to_take.chunks(IN_LIST_LEN_MAX) {
        let params: Vec<Value> =
            chunk.iter().map(|index| Value::from(names[*index].as_str())).collect();
        let row: Option<Row> = conn
            .exec_first(queries::advisory_try_lock(chunk.len()), params)
            .await
            .map_err(|error| storage_error("acquire: GET_LOCK", error))?;
        let mut columns =
            Columns::new(row.ok_or_else(|| malformed(DecodeError::new("GET_LOCK", "no row")))?);
        for index in chunk {
            held[*index] = columns.int().map_err(malformed)? == Some(1);
        }
    }
    Ok(select(shard_ids, |index| held[index]))
}

/// `RELEASE_LOCK` until `IS_USED_LOCK` no longer reports this session (a lock taken twice is
/// released twice), at most [`RELEASE_ATTEMPTS_MAX`] times.
async fn advisory_release(
    conn: &mut Conn,
    session_id: u64,
    names: &[String],
) -> Result<(), StorageError> {
    for name in names {
        let mut released = false;
        for _ in 0..RELEASE_ATTEMPTS_MAX {
            conn.exec_drop("SELECT RELEASE_LOCK(?)", (name.as_str(),))
                .await
                .map_err(|error| storage_error("release: RELEASE_LOCK", error))?;
            let holders = advisory_holders(conn, std::slice::from_ref(name)).await?;
            if holders.first().copied().flatten() != Some(session_id) {
                released = true;
                break;
            }
        }
        if !released {
            return Err(StorageError::new(
                StorageErrorKind::Other,
                format!("release: {name} still held after {RELEASE_ATTEMPTS_MAX} releases"),
            ));
        }
    }
    Ok(())
}

/// Runs a lease `SELECT shard_id …` (`sql(n)` with the address, then `n` shard ids) over all
/// names and returns the shard ids it found.
async fn lease_select(
    conn: &mut Conn,
    sql: impl Fn(usize) -> String,
    address: &str,
    names: &[String],
) -> Result<BTreeSet<String>, StorageError> {
    let mut found = BTreeSet::new();
    for chunk in names.chunks(IN_LIST_LEN_MAX) {
        let mut params = vec![Value::from(address)];
        params.extend(chunk.iter().map(|name| Value::from(name.as_str())));
        let rows: Vec<Row> = conn
            .exec(sql(chunk.len()), params)
            .await
            .map_err(|error| storage_error("leases held", error))?;
        for row in rows {
            if let Some(shard_id) = Columns::new(row).text().map_err(malformed)? {
                found.insert(shard_id);
            }
        }
    }
    Ok(found)
}
