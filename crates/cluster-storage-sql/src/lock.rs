//! Shard lock keys shared with the reference (`effect/src/cluster/SqlRunnerStorage.ts`) and the
//! deadline every lock operation runs under.

use std::future::Future;
use std::time::Duration;

#[cfg(any(feature = "postgres", feature = "mysql"))]
use cluster_core::ShardId;
use cluster_core::error::{StorageError, StorageErrorKind};
#[cfg(feature = "postgres")]
use cluster_core::hash::fnv1a_32;

#[cfg(feature = "postgres")]
use crate::options::SqlStorageOptions;
#[cfg(any(feature = "postgres", feature = "mysql"))]
use crate::options::TablePrefix;

#[cfg(feature = "postgres")]
/// The PostgreSQL advisory lock namespace of `prefix`: FNV-1a of `effect-cluster:<prefix>`
/// (`-1455371005` for `cluster`), a permanent wire format.
pub(crate) fn advisory_namespace(prefix: &TablePrefix) -> i32 {
    fnv1a_32(&format!("effect-cluster:{prefix}"))
}

#[cfg(feature = "postgres")]
/// The PostgreSQL advisory lock number of `shard`: `(group index + 1) × 1_000_000 + shard`,
/// where the group index is the group's position among the sorted available groups.
pub(crate) fn advisory_lock_number(
    options: &SqlStorageOptions,
    shard: &ShardId,
) -> Result<i32, StorageError> {
    let group_index = options.group_index(shard.group()).ok_or_else(|| {
        StorageError::new(
            StorageErrorKind::InvalidInput,
            format!("shard {shard} belongs to no available shard group"),
        )
    })?;
    let number = i64::from(group_index + 1) * 1_000_000 + i64::from(shard.id());
    if shard.id() >= 1_000_000 {
        return Err(StorageError::new(
            StorageErrorKind::InvalidInput,
            format!("shard {shard}: shard numbers must be below 1,000,000"),
        ));
    }
    i32::try_from(number).map_err(|_| {
        StorageError::new(
            StorageErrorKind::InvalidInput,
            format!("shard {shard}: lock number over i32"),
        )
    })
}

#[cfg(feature = "mysql")]
/// The MySQL lock name of `shard`: `<prefix>.<group>:<id>`.
pub(crate) fn mysql_lock_name(prefix: &TablePrefix, shard: &ShardId) -> String {
    format!("{prefix}.{shard}")
}

/// Runs `operation` with `deadline`; running over is a [`StorageErrorKind::Timeout`].
pub(crate) async fn with_deadline<T>(
    deadline: Duration,
    what: &str,
    operation: impl Future<Output = Result<T, StorageError>>,
) -> Result<T, StorageError> {
    match tokio::time::timeout(deadline, operation).await {
        Ok(result) => result,
        Err(_) => Err(StorageError::new(
            StorageErrorKind::Timeout,
            format!("{what} did not finish within {deadline:?}"),
        )),
    }
}

#[cfg(all(test, feature = "postgres", feature = "mysql"))]
mod tests;

#[cfg(feature = "postgres")]
/// What a runner's lock session is named after, before the runner's address: PostgreSQL's
/// `application_name`. (A MySQL lock session names its runner with an identity lock instead,
/// `<prefix>:runner:<address>`: see `mysql::queries::identity_lock_name`.)
pub(crate) const SESSION_NAME_PREFIX: &str = "cluster-runner ";

#[cfg(feature = "postgres")]
/// The `application_name` that names a lock session after `address`: the one the URL
/// configured, if any, then `cluster-runner <address>`; `None` if it does not fit (PostgreSQL
/// keeps 63 bytes, and a cut name could name another runner).
pub(crate) fn session_name(
    configured: Option<&str>,
    address: &cluster_core::RunnerAddress,
) -> Option<String> {
    let name = match configured.filter(|configured| !configured.is_empty()) {
        Some(configured) => format!("{configured} {SESSION_NAME_PREFIX}{address}"),
        None => format!("{SESSION_NAME_PREFIX}{address}"),
    };
    (name.len() <= 63).then_some(name)
}

#[cfg(feature = "postgres")]
/// The holder of a lock whose session is named `name` (a runner's, if the name is one of ours)
/// and identified by `session` otherwise.
pub(crate) fn holder_of(name: Option<&str>, session: String) -> cluster_core::inspect::LockHolder {
    use cluster_core::inspect::LockHolder;
    name.and_then(|name| name.rsplit_once(SESSION_NAME_PREFIX))
        .map(|(_, address)| address)
        .and_then(|address| address.parse::<cluster_core::RunnerAddress>().ok())
        .map_or(LockHolder::Session(session), LockHolder::Runner)
}
