//! Effect's SQL migrator (`Migrator.ts`), MySQL dialect, guarded by `GET_LOCK`: the migrations of
//! the message, runner and queue tables, and the byte-wise collation of their key columns.

use std::time::Duration;

use cluster_core::error::{DecodeError, StorageError, StorageErrorKind};
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Pool, Row, Value};
use tracing::Instrument;

use super::classify::{ER_DUP_ENTRY, storage_error};
use super::columns::Columns;
use super::connection::ClosingConn;
use super::queries;
use crate::options::TablePrefix;

/// How long a migration waits for another process's migration of the same tables.
const MIGRATION_LOCK_WAIT: Duration = Duration::from_secs(60);

/// Creates or upgrades the message storage tables (`<prefix>_messages`, `<prefix>_replies`),
/// recording the migrations in `<prefix>_migrations` as effect's SQL migrator does. Idempotent;
/// concurrent callers are serialised by a `GET_LOCK` on the history table's name.
///
/// Then, on every call and without a history row, our entity state table
/// (`<prefix>_entity_state`) is created if it is missing, and the columns compared for identity
/// (`message_id`, `shard_id`, `entity_type`, `entity_id`) get a byte-wise collation if they do
/// not have it: the reference's tables ignore case and accents. Converting existing tables
/// rebuilds them once.
///
/// # Cancel safety
///
/// Not cancel safe, but idempotent: every statement is `IF NOT EXISTS` or has its errors
/// ignored, and a migration is recorded only after it ran, so running again completes it. A
/// dropped call closes its connection, which releases the migration lock.
pub async fn migrate_messages(pool: &Pool, prefix: &TablePrefix) -> Result<(), StorageError> {
    let history = prefix.table("migrations");
    let migrations = queries::message_migrations(prefix);
    let tables = queries::message_extra_tables(prefix);
    run_migrations(pool, &history, migrations, tables, queries::message_key_columns(prefix)).await
}

/// Creates or upgrades the runner storage tables (`<prefix>_runners`, `<prefix>_locks`),
/// recording the migrations in `<prefix>_runner_migrations` (a separate history, because the
/// ids overlap with the message storage's). Idempotent and serialised like
/// [`migrate_messages`], and gives runner addresses and lease rows a byte-wise collation as
/// [`migrate_messages`] does for messages.
///
/// # Cancel safety
///
/// As [`migrate_messages`].
pub async fn migrate_runners(pool: &Pool, prefix: &TablePrefix) -> Result<(), StorageError> {
    let history = prefix.table("runner_migrations");
    let migrations = queries::runner_migrations(prefix);
    run_migrations(pool, &history, migrations, Vec::new(), queries::runner_key_columns(prefix))
        .await
}

/// Effect's migrator, MySQL dialect: ensure the history table, then run every migration newer
/// than the latest recorded one and record it (`migration_id`, `name`).
///
/// Effect records the pending ids first, inside a transaction, and treats a duplicate key as
/// "another process is migrating". MySQL commits implicitly at every DDL statement, so that
/// transaction protects nothing there; we hold a `GET_LOCK` instead and record each migration
/// after it ran. The history rows are the same, so either migrator can run after the other.
/// Our `extra_tables` and the key columns' collation are ours and are not recorded there.
pub(crate) async fn run_migrations(
    pool: &Pool,
    history: &str,
    migrations: Vec<queries::Migration>,
    extra_tables: Vec<queries::ExtraTable>,
    key_columns: Vec<queries::KeyColumn>,
) -> Result<(), StorageError> {
    let span = tracing::debug_span!("mysql.migrate", history);
    migrate_under_lock(pool, history, migrations, &extra_tables, key_columns).instrument(span).await
}

async fn migrate_under_lock(
    pool: &Pool,
    history: &str,
    migrations: Vec<queries::Migration>,
    extra_tables: &[queries::ExtraTable],
    key_columns: Vec<queries::KeyColumn>,
) -> Result<(), StorageError> {
    let conn = pool.get_conn().await.map_err(|error| storage_error("migrate: connect", error))?;
    // Dropped on any error or cancellation: the connection is closed rather than returned to
    // the pool still holding the migration lock.
    let mut conn = ClosingConn::new(conn);
    let lock_name = format!("{history}:migrate");
    conn.get()
        .query_drop(queries::history_table_ddl(history))
        .await
        .map_err(|error| storage_error("migrate: create the history table", error))?;
    let taken: Option<Option<i64>> = conn
        .get()
        .exec_first("SELECT GET_LOCK(?, ?)", (lock_name.as_str(), MIGRATION_LOCK_WAIT.as_secs()))
        .await
        .map_err(|error| storage_error("migrate: take the migration lock", error))?;
    if taken != Some(Some(1)) {
        return Err(StorageError::new(
            StorageErrorKind::Timeout,
            format!("migrate: another process held {lock_name} for {MIGRATION_LOCK_WAIT:?}"),
        ));
    }
    let latest: Option<Option<i64>> = conn
        .get()
        .query_first(format!("SELECT MAX(migration_id) FROM `{history}`"))
        .await
        .map_err(|error| storage_error("migrate: read the history", error))?;
    let latest = latest.flatten().unwrap_or(0);
    for migration in migrations.into_iter().filter(|m| i64::from(m.id) > latest) {
        run_migration(conn.get(), history, &migration).await?;
    }
    // After the reference's migrations, whose `0002` declares `entity_type` again without a
    // collation.
    let collation = key_collation(conn.get()).await?;
    for table in extra_tables {
        // `IF NOT EXISTS`: a no-op (a note) when the table is there.
        conn.get()
            .query_drop(table.create(collation))
            .await
            .map_err(|error| storage_error(&format!("migrate: table {}", table.name), error))?;
    }
    ensure_key_collations(conn.get(), collation, &key_columns).await?;
    conn.get()
        .exec_drop("SELECT RELEASE_LOCK(?)", (lock_name.as_str(),))
        .await
        .map_err(|error| storage_error("migrate: release the migration lock", error))?;
    // Clean: back to the pool.
    drop(conn.into_inner());
    Ok(())
}

async fn run_migration(
    conn: &mut Conn,
    history: &str,
    migration: &queries::Migration,
) -> Result<(), StorageError> {
    let id = migration.id;
    let name = migration.name;
    tracing::debug!(history, id, name, "running migration");
    for statement in &migration.statements {
        match conn.query_drop(statement.sql.as_str()).await {
            Ok(()) => {}
            Err(mysql_async::Error::Server(error)) if statement.ignore_server_errors => {
                // The reference ignores these (an index that already exists, a column that is
                // already resized).
                tracing::debug!(history, id, code = error.code, "ignored: {}", error.message);
            }
            Err(error) => {
                return Err(storage_error(&format!("migration {id:04}_{name} failed"), error));
            }
        }
    }
    let record = format!("INSERT INTO `{history}` (migration_id, name) VALUES (?, ?)");
    match conn.exec_drop(record, (id, name)).await {
        Ok(()) => Ok(()),
        // Recorded meanwhile by a migrator that does not take our lock (effect's own).
        Err(mysql_async::Error::Server(error)) if error.code == ER_DUP_ENTRY => Ok(()),
        Err(error) => Err(storage_error("migrate: record the migration", error)),
    }
}

/// The best byte-wise collation the server has ([`queries::KEY_COLLATIONS`]).
async fn key_collation(conn: &mut Conn) -> Result<&'static str, StorageError> {
    let names: Vec<Value> = queries::KEY_COLLATIONS.iter().map(|name| Value::from(*name)).collect();
    let rows: Vec<Row> = conn
        .exec(queries::available_collations(), names)
        .await
        .map_err(|error| storage_error("migrate: read the collations", error))?;
    let mut available = Vec::with_capacity(rows.len());
    for row in rows {
        available.extend(Columns::new(row).text().map_err(malformed_catalog)?);
    }
    queries::KEY_COLLATIONS.into_iter().find(|name| available.iter().any(|a| a == name)).ok_or_else(
        || {
            StorageError::new(
                StorageErrorKind::Other,
                "migrate: the server has no byte-wise utf8mb4 collation",
            )
        },
    )
}

/// Declares every key column that lacks it with `collation`, one `ALTER TABLE` per table.
/// Columns that have it are left alone, so this is a catalog read on every call but the first.
async fn ensure_key_collations(
    conn: &mut Conn,
    collation: &str,
    key_columns: &[queries::KeyColumn],
) -> Result<(), StorageError> {
    let mut tables: Vec<&str> = key_columns.iter().map(|key| key.table.as_str()).collect();
    tables.dedup();
    for table in tables {
        let rows: Vec<Row> = conn
            .exec(queries::COLUMN_COLLATIONS, (table,))
            .await
            .map_err(|error| storage_error("migrate: read the column collations", error))?;
        let mut current = Vec::with_capacity(rows.len());
        for row in rows {
            let mut columns = Columns::new(row);
            let name = columns.text().map_err(malformed_catalog)?;
            current.push((name, columns.text().map_err(malformed_catalog)?));
        }
        let stale: Vec<&queries::KeyColumn> = key_columns
            .iter()
            .filter(|key| key.table == table)
            .filter(|key| {
                !current.iter().any(|(name, current)| {
                    name.as_deref() == Some(key.column) && current.as_deref() == Some(collation)
                })
            })
            .collect();
        if stale.is_empty() {
            continue;
        }
        let columns: Vec<&str> = stale.iter().map(|key| key.column).collect();
        tracing::info!(
            table,
            ?columns,
            collation,
            "declaring key columns with a byte-wise collation"
        );
        conn.query_drop(queries::alter_key_collation(table, &stale, collation))
            .await
            .map_err(|error| storage_error(&format!("migrate: collation of {table}"), error))?;
    }
    Ok(())
}

/// A catalog row that cannot be read.
fn malformed_catalog(error: DecodeError) -> StorageError {
    StorageError::with_source(StorageErrorKind::Malformed, "migrate: unreadable catalog row", error)
}
