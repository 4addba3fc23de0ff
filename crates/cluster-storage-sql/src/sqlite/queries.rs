//! Every SQL text of the SQLite backend, built once per connection from the validated table
//! prefix, plus the migrations (the reference's SQLite DDL,
//! `effect/src/cluster/SqlRunnerStorage.ts` and `effect/src/cluster/SqlMessageStorage.ts`) and the
//! small helpers that bind lists and read columns leniently.
//!
//! Identifiers come only from [`TablePrefix`]; every value is a bound parameter. A list (ids,
//! shards, entity ids) is bound as one JSON array and expanded with `json_each`, so a statement's
//! text does not depend on the list's length and stays in the prepared statement cache.

use std::fmt::Write as _;

use cluster_core::storage::CLAIM_WINDOW;
use rusqlite::types::ValueRef;
use rusqlite::{Connection, OptionalExtension};

use crate::options::TablePrefix;
use crate::row::inspect::{RequestFilter, waiting_since_sql};
use crate::row::{MESSAGE_KIND_INTERRUPT, MESSAGE_KIND_REQUEST, REPLY_KIND_WITH_EXIT};

// The claim window is spelled `DATETIME('now', '-10 minute')` in the claim query, as in the
// reference; it must stay the contract's window.
const _: () = assert!(CLAIM_WINDOW.as_secs() == 10 * 60);

/// The columns of a message row as read, joined with its last reply (`MessageRow`).
const MESSAGE_COLUMNS: &str = "m.id, m.shard_id, m.entity_type, m.entity_id, m.kind, m.tag, \
     m.payload, m.headers, m.trace_id, m.span_id, m.sampled, m.request_id, m.reply_id, \
     r.id, r.payload, r.sequence";

/// The SQL of the message storage on one prefix.
#[derive(Debug)]
pub(super) struct MessageQueries {
    pub(super) messages: String,
    pub(super) replies: String,
    pub(super) select_duplicate: String,
    pub(super) insert_message: String,
    pub(super) insert_message_ignore: String,
    pub(super) ack_reply: String,
    pub(super) process_older_acks: String,
    pub(super) chunk_last_reply: String,
    pub(super) exit_processed: String,
    pub(super) insert_reply: String,
    pub(super) delete_exit: String,
    pub(super) delete_interrupts: String,
    pub(super) unprocess_request: String,
    pub(super) delete_exit_if_latest: String,
    pub(super) unprocess_request_if_latest: String,
    pub(super) request_id_for_message_id: String,
    pub(super) replies_for: String,
    pub(super) replies_for_unfiltered: String,
    pub(super) claim_update: String,
    pub(super) unprocessed_by_id: String,
    pub(super) unprocessed_before: String,
    pub(super) reset_requests: String,
    pub(super) reset_shards: String,
    pub(super) clear_address_replies: String,
    pub(super) clear_address_messages: String,
    /// `?1` replied before, `?2` keep prefixes (JSON), `?3` limit: the ids of the processed
    /// requests that a purge deletes, lowest first.
    pub(super) purge_choose: String,
    /// `?1` request ids (JSON): deletes their replies.
    pub(super) purge_replies: String,
    /// `?1` request ids (JSON): deletes their message rows.
    pub(super) purge_messages: String,
    /// `?1` replied before, `?2` entity type prefix, `?3` tag (NULL: any), `?4` after (-1:
    /// any), `?5` limit: `id, shard_id, entity_type, entity_id, tag` of processed requests and
    /// their final reply's `id, payload`, then the request's `payload`, in id order.
    pub(super) processed_requests: String,
    /// The read model's backlog: `?1` now (epoch ms), `?2` the stale claim modifier (such as
    /// `-60.000 seconds`), `?3` the limit.
    pub(super) backlog: String,
    /// The read model's requests: the statement's text up to its filters (see
    /// [`requests_sql`]).
    pub(super) requests_head: String,
    /// `?1` entity type, `?2` entity id: the state's `value, revision`.
    pub(super) load_state: String,
    /// `?1` type, `?2` id, `?3` shard, `?4` value: a new row at revision 1, or nothing when
    /// the entity has one (a stale write).
    pub(super) insert_state: String,
    /// `?1` type, `?2` id, `?3` shard, `?4` value, `?5` expected revision.
    pub(super) update_state: String,
    /// `?1` type, `?2` id, `?3` expected revision.
    pub(super) delete_state: String,
}

impl MessageQueries {
    #[expect(clippy::too_many_lines, reason = "a table of SQL statements, one per field")]
    pub(super) fn new(prefix: &TablePrefix) -> MessageQueries {
        let m = prefix.table("messages");
        let r = prefix.table("replies");
        let s = prefix.table(ENTITY_STATE_TABLE);
        let duplicate = format!(
            "SELECT m.id, r.id, r.kind, r.payload, r.sequence FROM {m} m \
             LEFT JOIN {r} r ON r.id = m.last_reply_id"
        );
        let insert_columns = "(id, message_id, shard_id, entity_type, entity_id, kind, tag, \
             payload, headers, trace_id, span_id, sampled, request_id, reply_id, deliver_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)";
        MessageQueries {
            select_duplicate: format!("{duplicate} WHERE m.message_id = ?1"),
            insert_message: format!("INSERT INTO {m} {insert_columns}"),
            insert_message_ignore: format!("INSERT OR IGNORE INTO {m} {insert_columns}"),
            ack_reply: format!("UPDATE {r} SET acked = 1 WHERE id = ?1"),
            process_older_acks: format!(
                "UPDATE {m} SET processed = 1 WHERE processed = 0 AND request_id = ?1 AND kind = 1"
            ),
            chunk_last_reply: format!("UPDATE {m} SET last_reply_id = ?1 WHERE id = ?2"),
            exit_processed: format!(
                "UPDATE {m} SET processed = 1, last_reply_id = ?1 WHERE request_id = ?2"
            ),
            insert_reply: format!(
                "INSERT INTO {r} (id, kind, request_id, payload, sequence) \
                 VALUES (?1, ?2, ?3, ?4, ?5)"
            ),
            delete_exit: format!("DELETE FROM {r} WHERE request_id = ?1 AND kind = 0"),
            delete_interrupts: format!("DELETE FROM {m} WHERE request_id = ?1 AND kind = 2"),
            unprocess_request: format!(
                "UPDATE {m} SET processed = 0, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = ?1"
            ),
            delete_exit_if_latest: format!(
                "DELETE FROM {r} WHERE request_id = ?1 AND kind = 0 \
                 AND EXISTS (SELECT 1 FROM {m} WHERE id = ?1 AND last_reply_id = ?2)"
            ),
            unprocess_request_if_latest: format!(
                "UPDATE {m} SET processed = 0, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = ?1 AND last_reply_id = ?2"
            ),
            request_id_for_message_id: format!("SELECT id FROM {m} WHERE message_id = ?1"),
            replies_for: format!(
                "SELECT id, kind, request_id, payload, sequence FROM {r} \
                 WHERE request_id IN (SELECT value FROM json_each(?1)) \
                 AND (kind = 0 OR (kind IS NULL AND acked = 0)) \
                 ORDER BY rowid ASC"
            ),
            replies_for_unfiltered: format!(
                "SELECT id, kind, request_id, payload, sequence FROM {r} \
                 WHERE request_id IN (SELECT value FROM json_each(?1)) \
                 ORDER BY rowid ASC"
            ),
            claim_update: format!(
                "UPDATE {m} SET last_read = CURRENT_TIMESTAMP \
                 WHERE id IN (SELECT value FROM json_each(?1))"
            ),
            // The id is the rowid here (`INTEGER PRIMARY KEY`): the claim's order.
            // Through the shard index (the rowid range `id < ?4` would walk the whole table),
            // and without a bound `LIMIT`: SQLite plans with a bound limit's value, so every new
            // binding would prepare the statement again. The caller stops at its limit.
            unprocessed_before: format!(
                "SELECT id FROM {m} INDEXED BY {m}_shard_idx \
                 WHERE shard_id = ?1 AND processed = 0 AND kind = 0 \
                 AND entity_type = ?2 AND entity_id = ?3 AND +id < ?4 \
                 AND (deliver_at IS NULL OR deliver_at <= ?5) \
                 ORDER BY id ASC"
            ),
            unprocessed_by_id: format!(
                "SELECT {MESSAGE_COLUMNS} FROM {m} m LEFT JOIN {r} r ON r.id = m.last_reply_id \
                 WHERE m.id IN (SELECT value FROM json_each(?1)) \
                 AND NOT EXISTS (SELECT 1 FROM {r} WHERE request_id = m.request_id \
                   AND (kind = 0 OR acked = 0)) \
                 AND m.processed = 0 \
                 AND (m.deliver_at IS NULL OR m.deliver_at <= ?2) \
                 ORDER BY m.rowid ASC"
            ),
            reset_requests: format!(
                "UPDATE {m} SET last_read = NULL WHERE processed = 0 \
                 AND id IN (SELECT value FROM json_each(?1))"
            ),
            reset_shards: format!(
                "UPDATE {m} SET last_read = NULL WHERE processed = 0 \
                 AND shard_id IN (SELECT value FROM json_each(?1))"
            ),
            clear_address_replies: format!(
                "DELETE FROM {r} WHERE request_id IN \
                 (SELECT id FROM {m} WHERE entity_type = ?1 AND entity_id = ?2)"
            ),
            clear_address_messages: format!(
                "DELETE FROM {m} WHERE entity_type = ?1 AND entity_id = ?2"
            ),
            purge_choose: format!(
                "SELECT m.id FROM {r} r JOIN {m} m ON m.id = r.request_id \
                 WHERE r.kind = 0 AND r.id < ?1 AND m.kind = 0 AND m.processed = 1 \
                 AND NOT EXISTS (SELECT 1 FROM json_each(?2) k \
                   WHERE substr(m.entity_type, 1, length(k.value)) = k.value) \
                 ORDER BY m.id ASC LIMIT ?3"
            ),
            purge_replies: format!(
                "DELETE FROM {r} WHERE request_id IN (SELECT value FROM json_each(?1))"
            ),
            purge_messages: format!(
                "DELETE FROM {m} WHERE request_id IN (SELECT value FROM json_each(?1))"
            ),
            processed_requests: format!(
                "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, r.id, r.payload, \
                 m.payload \
                 FROM {r} r JOIN {m} m ON m.id = r.request_id \
                 WHERE r.kind = 0 AND r.id < ?1 AND m.kind = 0 \
                 AND substr(m.entity_type, 1, length(?2)) = ?2 \
                 AND (?3 IS NULL OR m.tag = ?3) \
                 AND m.id > ?4 \
                 ORDER BY m.id ASC LIMIT ?5"
            ),
            backlog: format!(
                "SELECT entity_type, shard_id, \
                 SUM(CASE WHEN deliver_at IS NULL OR deliver_at <= ?1 THEN 1 ELSE 0 END), \
                 SUM(CASE WHEN deliver_at > ?1 THEN 1 ELSE 0 END), \
                 SUM(CASE WHEN (deliver_at IS NULL OR deliver_at <= ?1) \
                   AND last_read IS NOT NULL THEN 1 ELSE 0 END), \
                 SUM(CASE WHEN (deliver_at IS NULL OR deliver_at <= ?1) \
                   AND last_read < datetime('now', ?2) THEN 1 ELSE 0 END), \
                 MIN({waiting}) AS waiting_since \
                 FROM {m} WHERE processed = 0 \
                 GROUP BY entity_type, shard_id \
                 ORDER BY waiting_since IS NULL, waiting_since, entity_type, shard_id \
                 LIMIT ?3",
                waiting = waiting_since_sql("?1", "MAX")
            ),
            requests_head: requests_head(&m, &r),
            load_state: format!(
                "SELECT value, revision FROM {s} WHERE entity_type = ?1 AND entity_id = ?2"
            ),
            // `DO NOTHING`, not an error: a stale insert must not fail the group commit or
            // the user transaction it runs in.
            insert_state: format!(
                "INSERT INTO {s} (entity_type, entity_id, shard_id, value, revision, updated_at) \
                 VALUES (?1, ?2, ?3, ?4, 1, CURRENT_TIMESTAMP) \
                 ON CONFLICT (entity_type, entity_id) DO NOTHING"
            ),
            update_state: format!(
                "UPDATE {s} SET shard_id = ?3, value = ?4, revision = revision + 1, \
                 updated_at = CURRENT_TIMESTAMP \
                 WHERE entity_type = ?1 AND entity_id = ?2 AND revision = ?5"
            ),
            delete_state: format!(
                "DELETE FROM {s} WHERE entity_type = ?1 AND entity_id = ?2 AND revision = ?3"
            ),
            messages: m,
            replies: r,
        }
    }

    /// The claim query (`effect/src/cluster/SqlMessageStorage.ts`) over the shards in `?1`, due at
    /// `?2`, at most `?3` rows (`-1`: no limit), with `n_address_groups` address clauses whose
    /// parameters start at `?4` (three per clause: shard, entity type, entity ids as JSON).
    pub(super) fn claim_select(&self, n_address_groups: usize) -> String {
        let MessageQueries { messages: m, replies: r, .. } = self;
        let address_filter = address_filter("m.", n_address_groups, 4);
        format!(
            "SELECT {MESSAGE_COLUMNS} FROM {m} m LEFT JOIN {r} r ON r.id = m.last_reply_id \
             WHERE m.shard_id IN (SELECT value FROM json_each(?1)) \
             {address_filter} \
             AND NOT EXISTS (SELECT 1 FROM {r} WHERE request_id = m.request_id \
               AND (kind = 0 OR acked = 0)) \
             AND m.processed = 0 \
             AND (m.last_read IS NULL OR m.last_read < DATETIME('now', '-10 minute')) \
             AND (m.deliver_at IS NULL OR m.deliver_at <= ?2) \
             ORDER BY m.rowid ASC \
             LIMIT ?3"
        )
    }

    /// `reset_addresses` with `n_address_groups` clauses whose parameters start at `?1`.
    pub(super) fn reset_addresses(&self, n_address_groups: usize) -> String {
        let address_filter = address_filter("", n_address_groups, 1);
        format!(
            "UPDATE {} SET last_read = NULL WHERE processed = 0 {address_filter}",
            self.messages
        )
    }
}

/// `AND ((shard_id = ? AND entity_type = ? AND entity_id IN (…)) OR …)`, the reference's
/// grouped address filter, with parameters numbered from `first_parameter`.
fn address_filter(alias: &str, n_groups: usize, first_parameter: usize) -> String {
    if n_groups == 0 {
        return String::new();
    }
    let mut filter = String::from("AND (");
    for group_idx in 0..n_groups {
        let p = first_parameter + group_idx * 3;
        if group_idx > 0 {
            filter.push_str(" OR ");
        }
        let _ = write!(
            filter,
            "({alias}shard_id = ?{p} AND {alias}entity_type = ?{} \
             AND {alias}entity_id IN (SELECT value FROM json_each(?{})))",
            p + 1,
            p + 2
        );
    }
    filter.push(')');
    filter
}

/// The read model's requests with their final replies, before their filters.
fn requests_head(m: &str, r: &str) -> String {
    format!(
        "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, m.payload, m.processed, \
         (m.processed = 0 AND m.last_read IS NOT NULL), m.deliver_at, \
         EXISTS (SELECT 1 FROM {m} i WHERE i.request_id = m.id AND i.kind = {interrupt}), \
         r.id, r.payload \
         FROM {m} m LEFT JOIN {r} r ON r.request_id = m.id AND r.kind = {with_exit} \
         WHERE m.kind = {request}",
        interrupt = MESSAGE_KIND_INTERRUPT,
        with_exit = REPLY_KIND_WITH_EXIT,
        request = MESSAGE_KIND_REQUEST,
    )
}

/// The read model's requests statement for `filter`, and its parameters: only the set filters
/// are in the text, so that SQLite (which plans a statement once, without its values) uses
/// the index each one allows: the shard index for a shard, `messages_run_idx` for the tag
/// `run` (written as a literal, as the partial index's condition is).
pub(super) fn requests_sql(
    head: &str,
    filter: &RequestFilter,
) -> (String, Vec<rusqlite::types::Value>) {
    use rusqlite::types::Value;
    let mut sql = head.to_owned();
    let mut parameters = Vec::new();
    let condition = |sql: &mut String, parameters: &mut Vec<Value>, text: &str, value: Value| {
        parameters.push(value);
        let _ = write!(sql, " AND {text} ?{}", parameters.len());
    };
    if let Some(id) = filter.request_id {
        condition(&mut sql, &mut parameters, "m.id =", Value::Integer(id));
    }
    if let Some(shard) = &filter.shard_id {
        condition(&mut sql, &mut parameters, "m.shard_id =", Value::Text(shard.clone()));
    }
    if !filter.entity_type_prefix.is_empty() {
        parameters.push(Value::Text(filter.entity_type_prefix.clone()));
        let n = parameters.len();
        let _ = write!(sql, " AND substr(m.entity_type, 1, length(?{n})) = ?{n}");
    }
    if let Some(entity_type) = &filter.entity_type {
        condition(&mut sql, &mut parameters, "m.entity_type =", Value::Text(entity_type.clone()));
    }
    if let Some(entity_id) = &filter.entity_id {
        condition(&mut sql, &mut parameters, "m.entity_id =", Value::Text(entity_id.clone()));
    }
    match filter.tag.as_deref() {
        Some("run") => sql.push_str(" AND m.tag = 'run'"),
        Some(tag) => condition(&mut sql, &mut parameters, "m.tag =", Value::Text(tag.to_owned())),
        None => {}
    }
    if let Some(processed) = filter.processed {
        condition(&mut sql, &mut parameters, "m.processed =", Value::Integer(i64::from(processed)));
    }
    condition(&mut sql, &mut parameters, "m.id >", Value::Integer(filter.after));
    condition(&mut sql, &mut parameters, "m.id <", Value::Integer(filter.before));
    let direction = if filter.newest_first { "DESC" } else { "ASC" };
    parameters.push(Value::Integer(i64::from(filter.limit)));
    let _ = write!(sql, " ORDER BY m.id {direction} LIMIT ?{}", parameters.len());
    (sql, parameters)
}

/// The SQL of the runner registry and the shard lock leases on one prefix. `?` parameters named
/// `expiration` take a `datetime` modifier such as `-30 seconds`.
#[derive(Debug)]
pub(super) struct RunnerQueries {
    pub(super) register: String,
    pub(super) unregister: String,
    pub(super) get_runners: String,
    pub(super) set_health: String,
    pub(super) heartbeat: String,
    pub(super) lease_acquire: String,
    pub(super) lease_held: String,
    pub(super) lease_refresh: String,
    pub(super) lease_release: String,
    pub(super) lease_release_all: String,
    /// Every runner: `machine_id, runner, healthy`, the heartbeat's age in ms and whether it
    /// is alive (`?1`: the expiration modifier).
    pub(super) runner_records: String,
    /// The lease rows of the shards `?2` (JSON): `shard_id, address`, the lease's age in ms
    /// and whether it expired (`?1`: the expiration modifier).
    pub(super) lease_rows: String,
}

impl RunnerQueries {
    pub(super) fn new(prefix: &TablePrefix) -> RunnerQueries {
        let runners = prefix.table("runners");
        let locks = prefix.table("locks");
        RunnerQueries {
            register: format!(
                "INSERT INTO {runners} (address, runner, last_heartbeat, healthy) \
                 VALUES (?1, ?2, CURRENT_TIMESTAMP, ?3) \
                 ON CONFLICT(address) DO UPDATE SET \
                   runner = excluded.runner, \
                   last_heartbeat = excluded.last_heartbeat, \
                   healthy = excluded.healthy \
                 RETURNING machine_id"
            ),
            // ?2: the expiration modifier.
            unregister: format!(
                "DELETE FROM {runners} WHERE address = ?1 \
                 OR last_heartbeat < datetime(CURRENT_TIMESTAMP, ?2)"
            ),
            // ?1: the expiration modifier.
            get_runners: format!(
                "SELECT runner, healthy FROM {runners} \
                 WHERE last_heartbeat > datetime(CURRENT_TIMESTAMP, ?1)"
            ),
            set_health: format!("UPDATE {runners} SET healthy = ?2 WHERE address = ?1"),
            heartbeat: format!(
                "UPDATE {runners} SET last_heartbeat = CURRENT_TIMESTAMP WHERE address = ?1"
            ),
            // ?1: address, ?2: shard ids (JSON), ?3: expiration in seconds. A shard is taken
            // unless another runner holds a lease on it that is at most the expiration old.
            lease_acquire: format!(
                "INSERT INTO {locks} (shard_id, address, acquired_at) \
                 SELECT source.value, ?1, CURRENT_TIMESTAMP FROM json_each(?2) AS source \
                 WHERE NOT EXISTS ( \
                   SELECT 1 FROM {locks} \
                   WHERE shard_id = source.value \
                   AND address != ?1 \
                   AND (strftime('%s', CURRENT_TIMESTAMP) - strftime('%s', acquired_at)) <= ?3 \
                 ) \
                 ON CONFLICT(shard_id) DO UPDATE \
                 SET address = ?1, acquired_at = CURRENT_TIMESTAMP"
            ),
            // ?1: address, ?2: expiration modifier, ?3: shard ids (JSON).
            lease_held: format!(
                "SELECT shard_id FROM {locks} \
                 WHERE address = ?1 \
                 AND acquired_at >= datetime(CURRENT_TIMESTAMP, ?2) \
                 AND shard_id IN (SELECT value FROM json_each(?3))"
            ),
            lease_refresh: format!(
                "UPDATE {locks} SET acquired_at = CURRENT_TIMESTAMP \
                 WHERE address = ?1 AND shard_id IN (SELECT value FROM json_each(?2)) \
                 RETURNING shard_id"
            ),
            lease_release: format!("DELETE FROM {locks} WHERE address = ?1 AND shard_id = ?2"),
            lease_release_all: format!("DELETE FROM {locks} WHERE address = ?1"),
            runner_records: format!(
                "SELECT machine_id, runner, healthy, \
                 CAST((julianday('now') - julianday(last_heartbeat)) * 86400000 AS INTEGER), \
                 last_heartbeat > datetime(CURRENT_TIMESTAMP, ?1) \
                 FROM {runners} ORDER BY address"
            ),
            lease_rows: format!(
                "SELECT shard_id, address, \
                 CAST((julianday('now') - julianday(acquired_at)) * 86400000 AS INTEGER), \
                 acquired_at < datetime(CURRENT_TIMESTAMP, ?1) \
                 FROM {locks} WHERE shard_id IN (SELECT value FROM json_each(?2)) \
                 ORDER BY shard_id"
            ),
        }
    }
}

/// The SQL of one connection: both storages' statements, whichever the worker serves.
#[derive(Debug)]
pub(super) struct Statements {
    pub(super) prefix: TablePrefix,
    pub(super) message: MessageQueries,
    pub(super) runner: RunnerQueries,
}

impl Statements {
    pub(super) fn new(prefix: &TablePrefix) -> Statements {
        Statements {
            prefix: prefix.clone(),
            message: MessageQueries::new(prefix),
            runner: RunnerQueries::new(prefix),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Migrations
// ---------------------------------------------------------------------------------------------

/// Which migration history to bring up to date.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MigrationSet {
    /// `<prefix>_messages` and `<prefix>_replies`, history `<prefix>_migrations`.
    Messages,
    /// `<prefix>_runners` and `<prefix>_locks`, history `<prefix>_runner_migrations`.
    Runners,
}

/// One migration: the reference's id and name, and its SQLite statements (empty where the
/// reference's migration does nothing on SQLite; it is still recorded, so a TypeScript runner
/// sharing the file sees the same history).
struct Migration {
    id: i64,
    name: &'static str,
    statements: Vec<String>,
}

impl MigrationSet {
    fn history_table(self, prefix: &TablePrefix) -> String {
        match self {
            MigrationSet::Messages => prefix.table("migrations"),
            MigrationSet::Runners => prefix.table("runner_migrations"),
        }
    }

    fn migrations(self, prefix: &TablePrefix) -> Vec<Migration> {
        match self {
            MigrationSet::Messages => message_migrations(prefix),
            MigrationSet::Runners => runner_migrations(prefix),
        }
    }

    /// The tables and indexes of ours next to the set's tables, created when missing after
    /// its migrations, without a history row.
    fn extra_tables(self, prefix: &TablePrefix) -> Vec<String> {
        match self {
            MigrationSet::Messages => message_extra_tables(prefix),
            MigrationSet::Runners => Vec::new(),
        }
    }
}

/// The name of our entity state table (`<prefix>_entity_state`, see
/// [`cluster_core::entity_state`]).
const ENTITY_STATE_TABLE: &str = "entity_state";

/// The entity state: one row per entity that has state, keyed by its type and id (the
/// columns are the messages' own; times are UTC, as `CURRENT_TIMESTAMP` writes them).
fn message_extra_tables(prefix: &TablePrefix) -> Vec<String> {
    let s = prefix.table(ENTITY_STATE_TABLE);
    let m = prefix.table("messages");
    vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {s} (
          entity_type TEXT NOT NULL,
          entity_id TEXT NOT NULL,
          shard_id TEXT NOT NULL,
          value TEXT NOT NULL,
          revision INTEGER NOT NULL,
          updated_at TEXT NOT NULL,
          PRIMARY KEY (entity_type, entity_id)
        )"
        ),
        // The workflow executions (their `run` requests), newest first, for the read model:
        // without it, listing them reads every message. Only `run` requests have entries, so the
        // hot path's writes do not pay for it.
        format!(
            "CREATE INDEX IF NOT EXISTS {m}_run_idx ON {m} (id) \
         WHERE kind = {MESSAGE_KIND_REQUEST} AND tag = 'run'"
        ),
    ]
}

fn message_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let m = prefix.table("messages");
    let r = prefix.table("replies");
    let create_tables = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {m} (
              id INTEGER PRIMARY KEY,
              message_id TEXT,
              shard_id TEXT NOT NULL,
              entity_type TEXT NOT NULL,
              entity_id TEXT NOT NULL,
              kind INTEGER NOT NULL,
              tag TEXT,
              payload TEXT,
              headers TEXT,
              trace_id TEXT,
              span_id TEXT,
              sampled BOOLEAN,
              processed BOOLEAN NOT NULL DEFAULT FALSE,
              request_id INTEGER NOT NULL,
              reply_id INTEGER,
              last_reply_id INTEGER,
              last_read TEXT,
              deliver_at INTEGER,
              UNIQUE (message_id)
            )"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {m}_shard_idx \
             ON {m} (shard_id, processed, last_read, deliver_at)"
        ),
        format!("CREATE INDEX IF NOT EXISTS {m}_request_id_idx ON {m} (request_id)"),
        format!(
            "CREATE TABLE IF NOT EXISTS {r} (
              id INTEGER PRIMARY KEY,
              kind INTEGER,
              request_id INTEGER NOT NULL,
              payload TEXT NOT NULL,
              sequence INTEGER,
              acked BOOLEAN NOT NULL DEFAULT FALSE,
              UNIQUE (request_id, kind),
              UNIQUE (request_id, sequence)
            )"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {r}_request_lookup_idx ON {r} (request_id, kind, acked)"
        ),
    ];
    vec![
        Migration { id: 1, name: "create_tables", statements: create_tables },
        // Resizes entity_type on the other dialects; SQLite's TEXT has no size.
        Migration { id: 2, name: "entity_type_size", statements: Vec::new() },
        // PostgreSQL only.
        Migration { id: 3, name: "pg_messages_rowid_index", statements: Vec::new() },
    ]
}

fn runner_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let runners = prefix.table("runners");
    let locks = prefix.table("locks");
    let create_tables = vec![
        format!(
            "CREATE TABLE IF NOT EXISTS {runners} (
              machine_id INTEGER PRIMARY KEY AUTOINCREMENT,
              address TEXT NOT NULL,
              runner TEXT NOT NULL,
              healthy INTEGER NOT NULL DEFAULT 1,
              last_heartbeat DATETIME NOT NULL DEFAULT (CURRENT_TIMESTAMP),
              UNIQUE(address)
            )"
        ),
        format!(
            "CREATE TABLE IF NOT EXISTS {locks} (
              shard_id TEXT PRIMARY KEY,
              address TEXT NOT NULL,
              acquired_at DATETIME NOT NULL
            )"
        ),
    ];
    vec![Migration { id: 1, name: "create_tables", statements: create_tables }]
}

/// Brings `set` up to date the way effect's SQL migrator does (`effect/src/sql/Migrator.ts`), so
/// either side recognises the other's history: the history table has `migration_id`, `created_at`,
/// `name`; in one transaction, the migrations above the latest recorded id are recorded first and
/// then run; a concurrent migrator that recorded them first makes this one a no-op. Returns the ids
/// that ran.
///
/// Then, on every call and without a history row, the set's tables of ours are created if they
/// are missing (`CREATE TABLE IF NOT EXISTS`, which concurrent migrators may all run).
pub(super) fn migrate(
    connection: &Connection,
    prefix: &TablePrefix,
    set: MigrationSet,
) -> rusqlite::Result<Vec<i64>> {
    let history = set.history_table(prefix);
    connection.execute_batch(&format!(
        "CREATE TABLE IF NOT EXISTS {history} (
          migration_id integer PRIMARY KEY NOT NULL,
          created_at datetime NOT NULL DEFAULT current_timestamp,
          name VARCHAR(255) NOT NULL
        )"
    ))?;
    let result = immediate(connection, |connection| {
        let latest: i64 = connection
            .query_row(
                &format!("SELECT migration_id FROM {history} ORDER BY migration_id DESC LIMIT 1"),
                [],
                |row| row.get(0),
            )
            .optional()?
            .unwrap_or(0);
        let required: Vec<Migration> =
            set.migrations(prefix).into_iter().filter(|migration| migration.id > latest).collect();
        let insert = format!("INSERT INTO {history} (migration_id, name) VALUES (?1, ?2)");
        for migration in &required {
            connection.execute(&insert, rusqlite::params![migration.id, migration.name])?;
        }
        for migration in &required {
            for statement in &migration.statements {
                connection.execute_batch(statement)?;
            }
        }
        Ok(required.iter().map(|migration| migration.id).collect())
    });
    let ran = match result {
        // Another migrator recorded the same ids first (the reference's "Locked").
        Err(error) if is_unique_violation(&error) => Vec::new(),
        other => other?,
    };
    for table in set.extra_tables(prefix) {
        connection.execute_batch(&table)?;
    }
    Ok(ran)
}

// ---------------------------------------------------------------------------------------------
// Transactions
// ---------------------------------------------------------------------------------------------

/// Runs `body` in a `BEGIN IMMEDIATE` transaction: the write lock is taken up front (waiting up
/// to the busy timeout), so a read followed by a write never fails on a lock upgrade. Commits
/// on success, rolls back on failure.
pub(super) fn immediate<T>(
    connection: &Connection,
    body: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    connection.prepare_cached("BEGIN IMMEDIATE")?.execute([])?;
    let result = body(connection).and_then(|value| {
        connection.prepare_cached("COMMIT")?.execute([])?;
        Ok(value)
    });
    if result.is_err() {
        rollback(connection);
    }
    result
}

/// Rolls back the open transaction, if any. A failed rollback leaves nothing to do: SQLite has
/// then already rolled back, or the connection is broken and its next statement says so.
pub(super) fn rollback(connection: &Connection) {
    if !connection.is_autocommit() {
        let _ = connection.execute_batch("ROLLBACK");
    }
}

/// Runs `body` under a savepoint of the open transaction; on failure its changes are undone and
/// the transaction goes on.
pub(super) fn savepoint<T>(
    connection: &Connection,
    body: impl FnOnce(&Connection) -> rusqlite::Result<T>,
) -> rusqlite::Result<Result<T, rusqlite::Error>> {
    connection.prepare_cached("SAVEPOINT cluster_save")?.execute([])?;
    match body(connection) {
        Ok(value) => {
            connection.prepare_cached("RELEASE cluster_save")?.execute([])?;
            Ok(Ok(value))
        }
        Err(error) => {
            connection.prepare_cached("ROLLBACK TO cluster_save")?.execute([])?;
            connection.prepare_cached("RELEASE cluster_save")?.execute([])?;
            Ok(Err(error))
        }
    }
}

/// Whether `error` is a `UNIQUE` or `PRIMARY KEY` violation.
pub(super) fn is_unique_violation(error: &rusqlite::Error) -> bool {
    matches!(
        error,
        rusqlite::Error::SqliteFailure(failure, _)
            if failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE
                || failure.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_PRIMARYKEY
    )
}

// ---------------------------------------------------------------------------------------------
// Binding lists, reading columns
// ---------------------------------------------------------------------------------------------

/// A JSON array of integers, for `json_each`.
pub(super) fn json_integers(values: impl IntoIterator<Item = i64>) -> String {
    let mut json = String::from("[");
    for (value_idx, value) in values.into_iter().enumerate() {
        if value_idx > 0 {
            json.push(',');
        }
        let _ = write!(json, "{value}");
    }
    json.push(']');
    json
}

/// A JSON array of strings, for `json_each`.
pub(super) fn json_strings<S: AsRef<str>>(values: impl IntoIterator<Item = S>) -> String {
    let mut json = String::from("[");
    for (value_idx, value) in values.into_iter().enumerate() {
        if value_idx > 0 {
            json.push(',');
        }
        json.push('"');
        for c in value.as_ref().chars() {
            match c {
                '"' => json.push_str("\\\""),
                '\\' => json.push_str("\\\\"),
                c if u32::from(c) < 0x20 => {
                    let _ = write!(json, "\\u{:04x}", u32::from(c));
                }
                c => json.push(c),
            }
        }
        json.push('"');
    }
    json.push(']');
    json
}

/// A text column read whatever it holds: a row written by something else (or damaged) must
/// become a malformed message, never a failed query.
pub(super) fn text(value: ValueRef<'_>) -> Option<String> {
    match value {
        ValueRef::Null => None,
        ValueRef::Text(bytes) | ValueRef::Blob(bytes) => {
            Some(String::from_utf8_lossy(bytes).into_owned())
        }
        ValueRef::Integer(integer) => Some(integer.to_string()),
        ValueRef::Real(real) => Some(real.to_string()),
    }
}

/// An integer column read whatever it holds: `None` for `NULL`, `Some(unreadable)` for a value
/// that is not an integer.
pub(super) fn integer(value: ValueRef<'_>, unreadable: i64) -> Option<i64> {
    match value {
        ValueRef::Null => None,
        ValueRef::Integer(integer) => Some(integer),
        ValueRef::Text(bytes) => Some(
            std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.trim().parse().ok())
                .unwrap_or(unreadable),
        ),
        ValueRef::Real(_) | ValueRef::Blob(_) => Some(unreadable),
    }
}

/// A small integer column (kinds, sequences), as [`integer`].
pub(super) fn small_integer(value: ValueRef<'_>, unreadable: i32) -> Option<i32> {
    integer(value, i64::from(unreadable)).map(|value| i32::try_from(value).unwrap_or(unreadable))
}

/// Marks a user transaction's state (`MessageTransaction::savepoint`); a later one moves it.
// language=SQL
pub(crate) const SAVEPOINT: &str = "SAVEPOINT cluster_savepoint";

/// Returns a user transaction to its savepoint, which stays (`rollback_to_savepoint`).
// language=SQL
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT cluster_savepoint";
