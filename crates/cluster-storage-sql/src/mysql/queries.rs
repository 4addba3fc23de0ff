//! Every SQL text of the MySQL backend: the reference's DDL (migrations) and the statements of
//! the two storages, built once per table prefix so that the hot paths only bind parameters.
//!
//! Identifiers come only from the validated [`TablePrefix`] (and are quoted with backticks);
//! every value is a `?` parameter. The only literals spliced in are our own numbers (kinds,
//! the claim window, the lease expiration in seconds, the snowflake epoch), collation names
//! from [`KEY_COLLATIONS`] and, in the identity lock names ([`identity_lock_name`]), the table
//! prefix, never input.
//!
//! Claims, heartbeats and leases are written and compared in `UTC_TIMESTAMP()`, never `NOW()`:
//! `DATETIME` columns keep no time zone, and `NOW()` is the session's local time, which jumps
//! at daylight saving changes and differs between sessions in different zones. The read
//! model's ages are measured against `UTC_TIMESTAMP(6)`, in milliseconds.

use cluster_core::storage::CLAIM_WINDOW;

use crate::options::{TABLE_PREFIX_LEN_MAX, TablePrefix};
use crate::row::inspect::{RequestFilter, waiting_since_sql};
use crate::row::{
    MESSAGE_KIND_ACK_CHUNK, MESSAGE_KIND_INTERRUPT, MESSAGE_KIND_REQUEST, REPLY_KIND_WITH_EXIT,
};

/// Widths of the reference's columns (`effect/src/cluster/SqlRunnerStorage.ts`,
/// `effect/src/cluster/SqlMessageStorage.ts`), checked before writing so that a value never reaches
/// `INSERT IGNORE`, which would truncate it with a mere warning.
pub(crate) const SHARD_ID_LEN_MAX: usize = 50;
/// `entity_type VARCHAR(150)` (after migration `0002_entity_type_size`).
pub(crate) const ENTITY_TYPE_LEN_MAX: usize = 150;
/// `entity_id VARCHAR(255)`.
pub(crate) const ENTITY_ID_LEN_MAX: usize = 255;
/// `message_id VARCHAR(255)`.
pub(crate) const MESSAGE_ID_LEN_MAX: usize = 255;
/// `tag VARCHAR(50)`.
pub(crate) const TAG_LEN_MAX: usize = 50;
/// `trace_id VARCHAR(32)`.
pub(crate) const TRACE_ID_LEN_MAX: usize = 32;
/// `span_id VARCHAR(16)`.
pub(crate) const SPAN_ID_LEN_MAX: usize = 16;
/// `address VARCHAR(255)` of runners and locks.
pub(crate) const ADDRESS_LEN_MAX: usize = 255;
/// A `TEXT` column holds at most this many bytes.
pub(crate) const TEXT_BYTES_MAX: usize = 65_535;
/// MySQL and MariaDB refuse `GET_LOCK` names longer than this (in characters).
pub(crate) const LOCK_NAME_LEN_MAX: usize = 64;
/// At most this many ids, shards or names in one statement: far below the protocol's 65,535
/// placeholders, and small enough that a statement stays cheap to prepare.
pub(crate) const IN_LIST_LEN_MAX: usize = 1_000;

// Address groups bind up to three parameters per entry; stay under the 65,535 placeholders.
const _: () = assert!(IN_LIST_LEN_MAX * 3 < 65_535);

/// `name` quoted as an identifier. Prefixes are validated identifiers, so there is nothing to
/// escape; the quotes only keep reserved words apart.
fn quote(name: &str) -> String {
    format!("`{name}`")
}

/// `?, ?, …` with `n` placeholders.
pub(crate) fn placeholders(n: usize) -> String {
    let mut text = String::with_capacity(n * 3);
    for index in 0..n {
        if index > 0 {
            text.push_str(", ");
        }
        text.push('?');
    }
    text
}

/// One DDL statement of a migration.
#[derive(Clone, Debug)]
pub(crate) struct DdlStatement {
    pub(crate) sql: String,
    /// The reference ignores errors of MySQL's `CREATE INDEX` (there is no `IF NOT EXISTS`) and
    /// of the `0002` column resize; so do we, for server errors only.
    pub(crate) ignore_server_errors: bool,
}

/// A migration as effect's SQL migrator records it: `<id>_<name>`, e.g. `0001_create_tables`
/// is id 1, name `create_tables`.
#[derive(Clone, Debug)]
pub(crate) struct Migration {
    pub(crate) id: u32,
    pub(crate) name: &'static str,
    pub(crate) statements: Vec<DdlStatement>,
}

fn strict(sql: String) -> DdlStatement {
    DdlStatement { sql, ignore_server_errors: false }
}

fn lenient(sql: String) -> DdlStatement {
    DdlStatement { sql, ignore_server_errors: true }
}

/// The history table of effect's SQL migrator, MySQL dialect (`Migrator.ts`).
pub(crate) fn history_table_ddl(table: &str) -> String {
    // language=SQL
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
  migration_id INTEGER UNSIGNED NOT NULL,
  created_at TIMESTAMP NOT NULL DEFAULT CURRENT_TIMESTAMP,
  name VARCHAR(255) NOT NULL,
  PRIMARY KEY (migration_id)
)",
        quote(table)
    )
}

/// The message storage migrations (history `<prefix>_migrations`), MySQL dialect.
pub(crate) fn message_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let messages_name = prefix.table("messages");
    let replies_name = prefix.table("replies");
    let messages = quote(&messages_name);
    let replies = quote(&replies_name);
    // language=SQL
    let create_messages = format!(
        "CREATE TABLE IF NOT EXISTS {messages} (
  id BIGINT NOT NULL,
  rowid BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
  message_id VARCHAR({MESSAGE_ID_LEN_MAX}),
  shard_id VARCHAR({SHARD_ID_LEN_MAX}) NOT NULL,
  entity_type VARCHAR({ENTITY_TYPE_LEN_MAX}) NOT NULL,
  entity_id VARCHAR({ENTITY_ID_LEN_MAX}) NOT NULL,
  kind INT NOT NULL,
  tag VARCHAR({TAG_LEN_MAX}),
  payload TEXT,
  headers TEXT,
  trace_id VARCHAR({TRACE_ID_LEN_MAX}),
  span_id VARCHAR({SPAN_ID_LEN_MAX}),
  sampled BOOLEAN,
  processed BOOLEAN NOT NULL DEFAULT FALSE,
  request_id BIGINT NOT NULL,
  reply_id BIGINT,
  last_reply_id BIGINT,
  last_read DATETIME,
  deliver_at BIGINT,
  UNIQUE (id),
  UNIQUE (message_id)
)"
    );
    // language=SQL
    let create_replies = format!(
        "CREATE TABLE IF NOT EXISTS {replies} (
  id BIGINT NOT NULL,
  rowid BIGINT AUTO_INCREMENT PRIMARY KEY,
  kind INT,
  request_id BIGINT NOT NULL,
  payload TEXT NOT NULL,
  sequence INT,
  acked BOOLEAN NOT NULL DEFAULT FALSE,
  UNIQUE (id),
  UNIQUE (request_id, kind),
  UNIQUE (request_id, sequence)
)"
    );
    let shard_index = quote(&format!("{messages_name}_shard_idx"));
    let request_index = quote(&format!("{messages_name}_request_id_idx"));
    let reply_index = quote(&format!("{replies_name}_request_lookup_idx"));
    vec![
        Migration {
            id: 1,
            name: "create_tables",
            statements: vec![
                strict(create_messages),
                // language=SQL
                lenient(format!(
                    "CREATE INDEX {shard_index} ON {messages} \
                     (shard_id, processed, last_read, deliver_at)"
                )),
                // language=SQL
                lenient(format!("CREATE INDEX {request_index} ON {messages} (request_id)")),
                strict(create_replies),
                // language=SQL
                lenient(format!(
                    "CREATE INDEX {reply_index} ON {replies} (request_id, kind, acked)"
                )),
            ],
        },
        Migration {
            id: 2,
            name: "entity_type_size",
            statements: vec![lenient(format!(
                // language=SQL
                "ALTER TABLE {messages} MODIFY entity_type VARCHAR({ENTITY_TYPE_LEN_MAX}) NOT NULL"
            ))],
        },
    ]
}

/// The runner storage migrations (history `<prefix>_runner_migrations`), MySQL dialect. The
/// locks table is created in every lock mode, as the reference does.
pub(crate) fn runner_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let runners = quote(&prefix.table("runners"));
    let locks = quote(&prefix.table("locks"));
    vec![Migration {
        id: 1,
        name: "create_tables",
        statements: vec![
            // language=SQL
            strict(format!(
                "CREATE TABLE IF NOT EXISTS {runners} (
  machine_id INT AUTO_INCREMENT PRIMARY KEY,
  address VARCHAR({ADDRESS_LEN_MAX}) NOT NULL,
  runner TEXT NOT NULL,
  healthy BOOLEAN NOT NULL DEFAULT TRUE,
  last_heartbeat DATETIME NOT NULL DEFAULT CURRENT_TIMESTAMP,
  UNIQUE(address)
)"
            )),
            // language=SQL
            strict(format!(
                "CREATE TABLE IF NOT EXISTS {locks} (
  shard_id VARCHAR({SHARD_ID_LEN_MAX}) PRIMARY KEY,
  address VARCHAR({ADDRESS_LEN_MAX}) NOT NULL,
  acquired_at DATETIME NOT NULL
)"
            )),
        ],
    }]
}

/// Byte-wise collations for the columns compared for identity, best first.
///
/// The reference's columns take the database's default collation, which ignores case and
/// accents (`utf8mb4_general_ci` on MariaDB, `utf8mb4_0900_ai_ci` on MySQL 8), so entity ids
/// `Alice` and `alice` would share primary keys and rows. The first two are `NO PAD`
/// (trailing spaces count, MySQL 8 and MariaDB respectively); `utf8mb4_bin` ignores trailing
/// spaces and is only the fallback of a server that has neither.
pub(crate) const KEY_COLLATIONS: [&str; 3] =
    ["utf8mb4_0900_bin", "utf8mb4_nopad_bin", "utf8mb4_bin"];

/// A column compared for identity, as the reference declares it (a `VARCHAR`).
#[derive(Clone, Debug)]
pub(crate) struct KeyColumn {
    /// The table, unquoted.
    pub(crate) table: String,
    pub(crate) column: &'static str,
    width: usize,
    nullable: bool,
}

impl KeyColumn {
    fn new(table: &str, column: &'static str, width: usize, nullable: bool) -> KeyColumn {
        KeyColumn { table: table.to_owned(), column, width, nullable }
    }
}

/// The key columns of the message tables: the primary key and the address; and those of our
/// entity state table, which is created with them (a table made otherwise gets them too).
pub(crate) fn message_key_columns(prefix: &TablePrefix) -> Vec<KeyColumn> {
    let messages = prefix.table("messages");
    let state = prefix.table(ENTITY_STATE_TABLE);
    vec![
        KeyColumn::new(&messages, "message_id", MESSAGE_ID_LEN_MAX, true),
        KeyColumn::new(&messages, "shard_id", SHARD_ID_LEN_MAX, false),
        KeyColumn::new(&messages, "entity_type", ENTITY_TYPE_LEN_MAX, false),
        KeyColumn::new(&messages, "entity_id", ENTITY_ID_LEN_MAX, false),
        KeyColumn::new(&state, "entity_type", ENTITY_TYPE_LEN_MAX, false),
        KeyColumn::new(&state, "entity_id", ENTITY_ID_LEN_MAX, false),
        KeyColumn::new(&state, "shard_id", SHARD_ID_LEN_MAX, false),
    ]
}

/// The name of our entity state table (`<prefix>_entity_state`, see
/// [`cluster_core::entity_state`]).
pub(crate) const ENTITY_STATE_TABLE: &str = "entity_state";

/// A table of ours, beyond the reference's schema: created when missing, after the reference's
/// migrations and without a history row, with its key columns in the byte-wise collation the
/// migrator chose ([`KEY_COLLATIONS`]).
#[derive(Clone, Debug)]
pub(crate) struct ExtraTable {
    /// The table, unquoted.
    pub(crate) name: String,
    create: fn(table: &str, collation: &str) -> String,
}

impl ExtraTable {
    /// The table's `CREATE TABLE IF NOT EXISTS`, its key columns in `collation`.
    pub(crate) fn create(&self, collation: &str) -> String {
        (self.create)(&quote(&self.name), collation)
    }
}

/// The tables of ours next to the message tables: the entity state, one row per entity that
/// has state, keyed by its type and id (the columns are the messages' own). The value is a
/// `MEDIUMTEXT`; [`super::columns::state_limit`] caps it.
pub(crate) fn message_extra_tables(prefix: &TablePrefix) -> Vec<ExtraTable> {
    fn create_state(table: &str, collation: &str) -> String {
        let key = format!("CHARACTER SET utf8mb4 COLLATE {collation} NOT NULL");
        // language=SQL
        format!(
            "CREATE TABLE IF NOT EXISTS {table} (
  entity_type VARCHAR({ENTITY_TYPE_LEN_MAX}) {key},
  entity_id VARCHAR({ENTITY_ID_LEN_MAX}) {key},
  shard_id VARCHAR({SHARD_ID_LEN_MAX}) {key},
  value MEDIUMTEXT NOT NULL,
  revision BIGINT NOT NULL,
  updated_at DATETIME NOT NULL,
  PRIMARY KEY (entity_type, entity_id)
)"
        )
    }
    vec![ExtraTable { name: prefix.table(ENTITY_STATE_TABLE), create: create_state }]
}

/// The key columns of the runner tables: runner addresses and lease rows.
pub(crate) fn runner_key_columns(prefix: &TablePrefix) -> Vec<KeyColumn> {
    let runners = prefix.table("runners");
    let locks = prefix.table("locks");
    vec![
        KeyColumn::new(&runners, "address", ADDRESS_LEN_MAX, false),
        KeyColumn::new(&locks, "shard_id", SHARD_ID_LEN_MAX, false),
        KeyColumn::new(&locks, "address", ADDRESS_LEN_MAX, false),
    ]
}

/// The key columns of a persisted-queue table, as the reference's migrations leave them (its
/// `0002_upgrade_schema` widens the first two): the item id, the queue name and the claim's
/// lock.
pub(crate) fn queue_key_columns(table: &str) -> Vec<KeyColumn> {
    vec![
        KeyColumn::new(table, "id", 255, false),
        KeyColumn::new(table, "queue_name", 255, false),
        KeyColumn::new(table, "acquired_by", 36, true),
    ]
}

/// Which of [`KEY_COLLATIONS`] the server has (parameters: the collation names).
pub(crate) fn available_collations() -> String {
    // language=SQL
    format!(
        "SELECT COLLATION_NAME FROM information_schema.COLLATIONS WHERE COLLATION_NAME IN ({})",
        placeholders(KEY_COLLATIONS.len())
    )
}

/// The name and collation of every column of the table named by the parameter.
pub(crate) const COLUMN_COLLATIONS: &str = "SELECT COLUMN_NAME, COLLATION_NAME \
     FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?";

/// Declares `columns` of `table` again with `collation` (one of [`KEY_COLLATIONS`]), keeping
/// the reference's type and nullability: one rebuild of the table, rows converted.
pub(crate) fn alter_key_collation(table: &str, columns: &[&KeyColumn], collation: &str) -> String {
    let clauses: Vec<String> = columns
        .iter()
        .map(|key| {
            let null = if key.nullable { "NULL" } else { "NOT NULL" };
            format!(
                "MODIFY {} VARCHAR({}) CHARACTER SET utf8mb4 COLLATE {collation} {null}",
                quote(key.column),
                key.width
            )
        })
        .collect();
    // language=SQL
    format!("ALTER TABLE {} {}", quote(table), clauses.join(", "))
}

/// The columns of a message read: the row, then its last reply, then `rowid` (for ordering
/// across statements). [`super::message_storage`] reads them in this order.
const MESSAGE_COLUMNS: &str = "m.id, m.shard_id, m.entity_type, m.entity_id, m.kind, m.tag, \
     m.payload, m.headers, m.trace_id, m.span_id, m.sampled, m.request_id, m.reply_id, \
     r.id, r.payload, r.sequence, m.rowid";

/// The statements of the message storage for one prefix.
#[derive(Debug)]
pub(crate) struct MessageQueries {
    messages: String,
    replies: String,
    pub(crate) insert_message: String,
    pub(crate) insert_message_ignore: String,
    pub(crate) select_duplicate: String,
    pub(crate) ack_reply: String,
    pub(crate) process_older_acks: String,
    pub(crate) insert_reply: String,
    pub(crate) select_reply_owner: String,
    pub(crate) chunk_last_reply: String,
    pub(crate) exit_processed: String,
    pub(crate) delete_exit: String,
    pub(crate) delete_interrupts: String,
    pub(crate) unprocess_request: String,
    pub(crate) delete_exit_if_latest: String,
    pub(crate) unprocess_request_if_latest: String,
    pub(crate) request_id_for_message_id: String,
    pub(crate) unprocessed_before: String,
    pub(crate) clear_address_replies: String,
    pub(crate) clear_address_messages: String,
    /// The `value, revision` of the state of an entity (type, id).
    pub(crate) load_state: String,
    /// Inserts an entity's state (type, id, shard, value) at revision 1; a row already there
    /// is a duplicate key, that is a stale write.
    pub(crate) insert_state: String,
    /// Sets an entity's state (shard, value; type, id) if its revision is the last parameter,
    /// and moves the revision on by one.
    pub(crate) update_state: String,
    /// Deletes an entity's state (type, id) if its revision is the last parameter.
    pub(crate) delete_state: String,
    /// The read model's backlog: parameters now (epoch ms), the stale claim age (ms) and the
    /// limit, each bound once (a derived table names the first two). Columns: `entity_type,
    /// shard_id`, the due, scheduled, claimed and stale counts, and the wait start (epoch ms).
    pub(crate) backlog: String,
}

impl MessageQueries {
    pub(crate) fn new(prefix: &TablePrefix) -> MessageQueries {
        let messages = quote(&prefix.table("messages"));
        let replies = quote(&prefix.table("replies"));
        let state = quote(&prefix.table(ENTITY_STATE_TABLE));
        let insert_columns = "(id, message_id, shard_id, entity_type, entity_id, kind, tag, \
             payload, headers, trace_id, span_id, sampled, request_id, reply_id, deliver_at)";
        let insert_values = placeholders(15);
        let ack = MESSAGE_KIND_ACK_CHUNK;
        let interrupt = MESSAGE_KIND_INTERRUPT;
        let exit = REPLY_KIND_WITH_EXIT;
        // language=SQL
        MessageQueries {
            insert_message: format!(
                "INSERT INTO {messages} {insert_columns} VALUES ({insert_values})"
            ),
            insert_message_ignore: format!(
                "INSERT IGNORE INTO {messages} {insert_columns} VALUES ({insert_values})"
            ),
            select_duplicate: format!(
                "SELECT m.id, r.id, r.kind, r.payload, r.sequence FROM {messages} m \
                 LEFT JOIN {replies} r ON r.id = m.last_reply_id WHERE m.message_id = ?"
            ),
            ack_reply: format!("UPDATE {replies} SET acked = TRUE WHERE id = ?"),
            process_older_acks: format!(
                "UPDATE {messages} SET processed = TRUE WHERE processed = FALSE \
                 AND request_id = ? AND kind = {ack} AND id <> ?"
            ),
            insert_reply: format!(
                "INSERT INTO {replies} (id, kind, request_id, payload, sequence) \
                 VALUES (?, ?, ?, ?, ?)"
            ),
            select_reply_owner: format!("SELECT request_id, kind FROM {replies} WHERE id = ?"),
            chunk_last_reply: format!("UPDATE {messages} SET last_reply_id = ? WHERE id = ?"),
            exit_processed: format!(
                "UPDATE {messages} SET processed = TRUE, last_reply_id = ? WHERE request_id = ?"
            ),
            delete_exit: format!("DELETE FROM {replies} WHERE request_id = ? AND kind = {exit}"),
            delete_interrupts: format!(
                "DELETE FROM {messages} WHERE request_id = ? AND kind = {interrupt}"
            ),
            unprocess_request: format!(
                "UPDATE {messages} SET processed = FALSE, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = ?"
            ),
            delete_exit_if_latest: format!(
                "DELETE FROM {replies} WHERE request_id = ? AND kind = {exit} AND EXISTS \
                 (SELECT 1 FROM {messages} WHERE id = ? AND last_reply_id = ?)"
            ),
            unprocess_request_if_latest: format!(
                "UPDATE {messages} SET processed = FALSE, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = ? AND last_reply_id = ?"
            ),
            request_id_for_message_id: format!("SELECT id FROM {messages} WHERE message_id = ?"),
            unprocessed_before: format!(
                "SELECT m.id FROM {messages} m \
                 WHERE m.shard_id = ? AND m.processed = FALSE AND m.kind = 0 \
                 AND m.entity_type = ? AND m.entity_id = ? \
                 AND m.rowid < (SELECT rowid FROM {messages} WHERE id = ?) \
                 AND (m.deliver_at IS NULL OR m.deliver_at <= ?) \
                 ORDER BY m.rowid ASC LIMIT ?"
            ),
            clear_address_replies: format!(
                "DELETE FROM {replies} WHERE request_id IN \
                 (SELECT id FROM {messages} WHERE entity_type = ? AND entity_id = ?)"
            ),
            clear_address_messages: format!(
                "DELETE FROM {messages} WHERE entity_type = ? AND entity_id = ?"
            ),
            load_state: format!(
                "SELECT value, revision FROM {state} WHERE entity_type = ? AND entity_id = ?"
            ),
            // A plain `INSERT`: `INSERT IGNORE` would also turn a value that does not fit into
            // a warning. A duplicate key fails the statement only, not its transaction.
            insert_state: format!(
                "INSERT INTO {state} (entity_type, entity_id, shard_id, value, revision, \
                 updated_at) VALUES (?, ?, ?, ?, 1, UTC_TIMESTAMP())"
            ),
            update_state: format!(
                "UPDATE {state} SET shard_id = ?, value = ?, revision = revision + 1, \
                 updated_at = UTC_TIMESTAMP() \
                 WHERE entity_type = ? AND entity_id = ? AND revision = ?"
            ),
            delete_state: format!(
                "DELETE FROM {state} WHERE entity_type = ? AND entity_id = ? AND revision = ?"
            ),
            backlog: backlog_sql(&messages),
            messages,
            replies,
        }
    }

    /// Replies of `n_requests` requests, in insertion order; `unacked_only` keeps final replies
    /// and unacknowledged chunks (`replies_for`).
    pub(crate) fn replies_for(&self, n_requests: usize, unacked_only: bool) -> String {
        let replies = &self.replies;
        let exit = REPLY_KIND_WITH_EXIT;
        let filter = if unacked_only {
            format!(" AND (kind = {exit} OR (kind IS NULL AND acked = FALSE))")
        } else {
            String::new()
        };
        // language=SQL
        format!(
            "SELECT id, kind, request_id, payload, sequence, rowid FROM {replies} \
             WHERE request_id IN ({}){filter} ORDER BY rowid ASC",
            placeholders(n_requests)
        )
    }

    /// The filters every unprocessed read shares (`effect/src/cluster/SqlMessageStorage.ts`): no
    /// final reply and no unacknowledged chunk for the request, not processed, due at the `?`
    /// runner time.
    fn unprocessed_tail(&self) -> String {
        let replies = &self.replies;
        let exit = REPLY_KIND_WITH_EXIT;
        format!(
            " AND NOT EXISTS (SELECT 1 FROM {replies} x WHERE x.request_id = m.request_id \
             AND (x.kind = {exit} OR x.acked = FALSE)) \
             AND m.processed = FALSE \
             AND (m.deliver_at IS NULL OR m.deliver_at <= ?)"
        )
    }

    /// The claim read: messages of `n_shards` shards, optionally of the address groups (one
    /// entry per group: its number of entity ids), unclaimed within the claim window, in rowid
    /// order, locked for the claim's update. Parameters: shard ids, then per group shard id,
    /// entity type and entity ids, then `now`, then the limit if `limited`.
    pub(crate) fn claim_select(
        &self,
        n_shards: usize,
        address_groups: Option<&[usize]>,
        limited: bool,
    ) -> String {
        let (messages, replies) = (&self.messages, &self.replies);
        let mut sql = format!(
            "SELECT {MESSAGE_COLUMNS} FROM {messages} m \
             LEFT JOIN {replies} r ON r.id = m.last_reply_id \
             WHERE m.shard_id IN ({})",
            placeholders(n_shards)
        );
        if let Some(groups) = address_groups {
            sql.push_str(" AND (");
            sql.push_str(&address_filter("m.", groups));
            sql.push(')');
        }
        sql.push_str(&format!(
            " AND (m.last_read IS NULL OR m.last_read < UTC_TIMESTAMP() - INTERVAL {} SECOND)",
            CLAIM_WINDOW.as_secs()
        ));
        sql.push_str(&self.unprocessed_tail());
        sql.push_str(" ORDER BY m.rowid ASC");
        if limited {
            sql.push_str(" LIMIT ?");
        }
        sql.push_str(" FOR UPDATE");
        sql
    }

    /// Marks `n_ids` claimed rows read now.
    pub(crate) fn claim_update(&self, n_ids: usize) -> String {
        // language=SQL
        format!(
            "UPDATE {} SET last_read = UTC_TIMESTAMP() WHERE id IN ({})",
            self.messages,
            placeholders(n_ids)
        )
    }

    /// Unprocessed messages by id, without the claim window and without locking.
    /// Parameters: ids, then `now`.
    pub(crate) fn unprocessed_by_id(&self, n_ids: usize) -> String {
        let (messages, replies) = (&self.messages, &self.replies);
        let mut sql = format!(
            "SELECT {MESSAGE_COLUMNS} FROM {messages} m \
             LEFT JOIN {replies} r ON r.id = m.last_reply_id \
             WHERE m.id IN ({})",
            placeholders(n_ids)
        );
        sql.push_str(&self.unprocessed_tail());
        sql.push_str(" ORDER BY m.rowid ASC");
        sql
    }

    /// Inserts `n_rows` messages at once, ignoring rows whose id or primary key is taken (group
    /// commit of requests with a primary key).
    pub(crate) fn insert_messages_ignore(&self, n_rows: usize) -> String {
        let row = format!("({})", placeholders(15));
        let rows = vec![row; n_rows].join(", ");
        // language=SQL
        format!(
            "INSERT IGNORE INTO {} (id, message_id, shard_id, entity_type, entity_id, kind, tag, \
             payload, headers, trace_id, span_id, sampled, request_id, reply_id, deliver_at) \
             VALUES {rows}",
            self.messages
        )
    }

    /// The id and `rowid` stored under each of `n_keys` primary keys.
    pub(crate) fn ids_for_message_ids(&self, n_keys: usize) -> String {
        // language=SQL
        format!(
            "SELECT id, message_id, rowid FROM {} WHERE message_id IN ({})",
            self.messages,
            placeholders(n_keys)
        )
    }

    /// Releases the claims of unprocessed request rows by id.
    pub(crate) fn reset_requests(&self, n_ids: usize) -> String {
        // language=SQL
        format!(
            "UPDATE {} SET last_read = NULL WHERE processed = FALSE AND id IN ({})",
            self.messages,
            placeholders(n_ids)
        )
    }

    /// Releases the claims of unprocessed rows of `n_shards` shards.
    pub(crate) fn reset_shards(&self, n_shards: usize) -> String {
        // language=SQL
        format!(
            "UPDATE {} SET last_read = NULL WHERE processed = FALSE AND shard_id IN ({})",
            self.messages,
            placeholders(n_shards)
        )
    }

    /// The processed requests that a purge deletes (`purge_processed`), lowest id first: a
    /// final reply's id below the first parameter, an entity type that starts with none of the
    /// `n_keep` prefixes (each bound twice, see [`starts_with`]), at most the last parameter.
    /// A plain read: the rows are locked by [`purge_lock`](Self::purge_lock).
    pub(crate) fn purge_choose(&self, n_keep: usize) -> String {
        let (messages, replies) = (&self.messages, &self.replies);
        let exit = REPLY_KIND_WITH_EXIT;
        let keep: String =
            (0..n_keep).map(|_| format!(" AND NOT {}", starts_with("m.entity_type"))).collect();
        // language=SQL
        format!(
            "SELECT m.id FROM {replies} r JOIN {messages} m ON m.id = r.request_id \
             WHERE r.kind = {exit} AND r.id < ? AND m.kind = 0 AND m.processed = TRUE{keep} \
             ORDER BY m.id ASC LIMIT ?"
        )
    }

    /// Locks the `n_ids` request rows that a purge chose and that are still processed, and
    /// returns their ids: a request reset in between is kept.
    pub(crate) fn purge_lock(&self, n_ids: usize) -> String {
        // language=SQL
        format!(
            "SELECT id FROM {} WHERE id IN ({}) AND kind = 0 AND processed = TRUE FOR UPDATE",
            self.messages,
            placeholders(n_ids)
        )
    }

    /// Deletes every reply of `n_ids` requests.
    pub(crate) fn purge_replies(&self, n_ids: usize) -> String {
        // language=SQL
        format!("DELETE FROM {} WHERE request_id IN ({})", self.replies, placeholders(n_ids))
    }

    /// Deletes every message row of `n_ids` requests (the requests, their acknowledgements and
    /// interrupts).
    pub(crate) fn purge_messages(&self, n_ids: usize) -> String {
        // language=SQL
        format!("DELETE FROM {} WHERE request_id IN ({})", self.messages, placeholders(n_ids))
    }

    /// The processed requests (`processed_requests`): a final reply's id below the first
    /// parameter, an entity type that starts with the prefix (bound twice, see
    /// [`starts_with`]), the tag if `tagged`, an id above the next parameter (-1: any), at
    /// most the last, in id order. Columns: `id, shard_id, entity_type, entity_id, tag`, the
    /// final reply's `id, payload` and the request's `payload`.
    pub(crate) fn processed_requests(&self, tagged: bool) -> String {
        let (messages, replies) = (&self.messages, &self.replies);
        let exit = REPLY_KIND_WITH_EXIT;
        let prefix = starts_with("m.entity_type");
        let tag = if tagged { " AND CAST(m.tag AS BINARY) = CAST(? AS BINARY)" } else { "" };
        // language=SQL
        format!(
            "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, r.id, r.payload, \
                 m.payload \
             FROM {replies} r JOIN {messages} m ON m.id = r.request_id \
             WHERE r.kind = {exit} AND r.id < ? AND m.kind = 0 AND {prefix}{tag} \
             AND m.id > ? ORDER BY m.id ASC LIMIT ?"
        )
    }

    /// The read model's requests with their final replies (`requests`), in id order (newest
    /// first if `filter` asks). Only the filters `filter` sets appear, each with its
    /// parameters, in this order: the request id; the entity type prefix if not empty (bound
    /// twice, see [`starts_with`]); the entity type; the entity id; the tag; processed; then
    /// always `after`, `before` and the limit. Columns: `id, shard_id, entity_type,
    /// entity_id, tag, payload`, processed, claimed, `deliver_at`, interrupted, and the final
    /// reply's `id, payload`.
    ///
    /// Texts compare as binary strings, as in [`processed_requests`](Self::processed_requests):
    /// the reference's columns may keep a collation that ignores case, and `testentity` must
    /// not find `TestEntity`.
    pub(crate) fn requests(&self, filter: &RequestFilter) -> String {
        let (messages, replies) = (&self.messages, &self.replies);
        let (request, interrupt, exit) =
            (MESSAGE_KIND_REQUEST, MESSAGE_KIND_INTERRUPT, REPLY_KIND_WITH_EXIT);
        let equals = |column: &str| format!(" AND CAST({column} AS BINARY) = CAST(? AS BINARY)");
        let mut conditions = String::new();
        if filter.request_id.is_some() {
            conditions.push_str(" AND m.id = ?");
        }
        // Plain, not binary: the shard index serves it (shard ids are ASCII).
        if filter.shard_id.is_some() {
            conditions.push_str(" AND m.shard_id = ?");
        }
        if !filter.entity_type_prefix.is_empty() {
            conditions.push_str(" AND ");
            conditions.push_str(&starts_with("m.entity_type"));
        }
        if filter.entity_type.is_some() {
            conditions.push_str(&equals("m.entity_type"));
        }
        if filter.entity_id.is_some() {
            conditions.push_str(&equals("m.entity_id"));
        }
        if filter.tag.is_some() {
            conditions.push_str(&equals("m.tag"));
        }
        if filter.processed.is_some() {
            conditions.push_str(" AND m.processed = ?");
        }
        let direction = if filter.newest_first { "DESC" } else { "ASC" };
        // language=SQL
        format!(
            "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, m.payload, m.processed, \
             (m.processed = FALSE AND m.last_read IS NOT NULL), m.deliver_at, \
             EXISTS (SELECT 1 FROM {messages} i \
               WHERE i.request_id = m.id AND i.kind = {interrupt}), \
             r.id, r.payload \
             FROM {messages} m \
             LEFT JOIN {replies} r ON r.request_id = m.id AND r.kind = {exit} \
             WHERE m.kind = {request}{conditions} AND m.id > ? AND m.id < ? \
             ORDER BY m.id {direction} LIMIT ?"
        )
    }

    /// Releases the claims of unprocessed rows of the address groups.
    pub(crate) fn reset_addresses(&self, address_groups: &[usize]) -> String {
        // language=SQL
        format!(
            "UPDATE {} SET last_read = NULL WHERE processed = FALSE AND ({})",
            self.messages,
            address_filter("", address_groups)
        )
    }
}

/// Whether `column` starts with a prefix bound twice (`?` in `CHAR_LENGTH`, then `?` to
/// compare), byte for byte: as binary strings, so that no collation ignores case or accents.
fn starts_with(column: &str) -> String {
    format!("(CAST(LEFT({column}, CHAR_LENGTH(?)) AS BINARY) = CAST(? AS BINARY))")
}

/// The read model's backlog over `messages` ([`MessageQueries::backlog`]). MySQL has no
/// aggregate `FILTER`: each count is a `SUM` of a `CASE`, cast back from `DECIMAL`; and no
/// `NULLS LAST`: groups with no due message sort last by `MIN(…) IS NULL` (MariaDB refuses the
/// alias of an aggregate inside an `ORDER BY` expression, so the minimum is repeated). Claim ages
/// are measured in `UTC_TIMESTAMP(6)`, as claims are written in UTC, and compared in
/// milliseconds (the largest stale age, `i64::MAX` ms, has no microseconds in a `BIGINT`).
fn backlog_sql(messages: &str) -> String {
    let due = "(deliver_at IS NULL OR deliver_at <= p.now_ms)";
    let count =
        |condition: &str| format!("CAST(SUM(CASE WHEN {condition} THEN 1 ELSE 0 END) AS SIGNED)");
    let (n_due, n_scheduled) = (count(due), count("deliver_at > p.now_ms"));
    let n_claimed = count(&format!("{due} AND last_read IS NOT NULL"));
    let n_stale = count(&format!(
        "{due} AND TIMESTAMPDIFF(MICROSECOND, last_read, UTC_TIMESTAMP(6)) DIV 1000 \
         > p.stale_after_ms"
    ));
    // `id >> 22` shifts the id as an unsigned 64-bit number: exact, since ids are never
    // negative. The message columns are unqualified, as `waiting_since_sql` names them; the
    // parameters' derived table `p` has no column of the same name.
    let waiting = waiting_since_sql("p.now_ms", "GREATEST");
    // language=SQL
    format!(
        "SELECT entity_type, shard_id, {n_due}, {n_scheduled}, {n_claimed}, {n_stale}, \
         CAST(MIN({waiting}) AS SIGNED) AS waiting_since \
         FROM {messages} \
         CROSS JOIN (SELECT CAST(? AS SIGNED) AS now_ms, CAST(? AS SIGNED) AS stale_after_ms) p \
         WHERE processed = FALSE \
         GROUP BY entity_type, shard_id \
         ORDER BY MIN({waiting}) IS NULL, waiting_since, entity_type, shard_id \
         LIMIT ?"
    )
}

/// `(shard_id = ? AND entity_type = ? AND entity_id IN (?, …)) OR …`, one clause per group.
fn address_filter(alias: &str, address_groups: &[usize]) -> String {
    let clauses: Vec<String> = address_groups
        .iter()
        .map(|n_ids| {
            format!(
                "({alias}shard_id = ? AND {alias}entity_type = ? AND {alias}entity_id IN ({}))",
                placeholders(*n_ids)
            )
        })
        .collect();
    clauses.join(" OR ")
}

/// The statements of the runner registry and of lease locks for one prefix.
#[derive(Debug)]
pub(crate) struct RunnerQueries {
    locks: String,
    /// `DATE_SUB(UTC_TIMESTAMP(), INTERVAL <expiration> SECOND)`: the oldest live heartbeat or
    /// lease.
    expired_before: String,
    pub(crate) register: String,
    pub(crate) select_machine_id: String,
    pub(crate) unregister: String,
    pub(crate) get_runners: String,
    pub(crate) set_health: String,
    pub(crate) heartbeat: String,
    pub(crate) lease_release: String,
    pub(crate) lease_release_all: String,
    /// Every runner: `machine_id, runner, healthy`, the heartbeat's age in ms and whether it
    /// is alive.
    pub(crate) runner_records: String,
    /// Takes the identity lock of the address parameter (bound three times, see
    /// [`identity_lock_name`]) without waiting: 1 if taken.
    pub(crate) identity_take: String,
    /// Releases the identity lock of the address parameter (bound three times).
    pub(crate) identity_release: String,
    /// The registered runners whose identity lock is held: `address` and the holder's
    /// connection id, as `IS_USED_LOCK` reports it.
    pub(crate) identity_holders: String,
}

impl RunnerQueries {
    pub(crate) fn new(prefix: &TablePrefix, expiration_seconds: u64) -> RunnerQueries {
        let runners = quote(&prefix.table("runners"));
        let locks = quote(&prefix.table("locks"));
        let expired_before =
            format!("DATE_SUB(UTC_TIMESTAMP(), INTERVAL {expiration_seconds} SECOND)");
        // language=SQL
        RunnerQueries {
            register: format!(
                "INSERT INTO {runners} (address, runner, last_heartbeat, healthy) \
                 VALUES (?, ?, UTC_TIMESTAMP(), ?) ON DUPLICATE KEY UPDATE runner = VALUES(runner), \
                 last_heartbeat = VALUES(last_heartbeat), healthy = VALUES(healthy)"
            ),
            select_machine_id: format!("SELECT machine_id FROM {runners} WHERE address = ?"),
            unregister: format!(
                "DELETE FROM {runners} WHERE address = ? OR last_heartbeat < {expired_before}"
            ),
            get_runners: format!(
                "SELECT runner, healthy FROM {runners} WHERE last_heartbeat > {expired_before} \
                 ORDER BY machine_id"
            ),
            set_health: format!("UPDATE {runners} SET healthy = ? WHERE address = ?"),
            heartbeat: format!(
                "UPDATE {runners} SET last_heartbeat = UTC_TIMESTAMP() WHERE address = ?"
            ),
            lease_release: format!("DELETE FROM {locks} WHERE address = ? AND shard_id = ?"),
            lease_release_all: format!("DELETE FROM {locks} WHERE address = ?"),
            runner_records: format!(
                "SELECT machine_id, runner, healthy, \
                 TIMESTAMPDIFF(MICROSECOND, last_heartbeat, UTC_TIMESTAMP(6)) DIV 1000, \
                 last_heartbeat > {expired_before} \
                 FROM {runners} ORDER BY address"
            ),
            identity_take: format!("SELECT GET_LOCK({}, 0)", identity_lock_name(prefix, "?")),
            identity_release: format!("SELECT RELEASE_LOCK({})", identity_lock_name(prefix, "?")),
            identity_holders: {
                let held = format!("IS_USED_LOCK({})", identity_lock_name(prefix, "address"));
                format!("SELECT address, {held} FROM {runners} WHERE {held} IS NOT NULL")
            },
            locks,
            expired_before,
        }
    }

    /// Takes `n_shards` leases (parameters: shard id and address per shard, in the fixed
    /// order), each unless another runner holds it unexpired (the reference's MySQL lease SQL).
    /// `ON DUPLICATE KEY UPDATE` assigns left to right, so the second `IF` sees the new
    /// `address`: it is true exactly when the first one took or kept the row.
    pub(crate) fn lease_acquire(&self, n_shards: usize) -> String {
        let (locks, expired_before) = (&self.locks, &self.expired_before);
        let values = vec!["(?, ?, UTC_TIMESTAMP())"; n_shards].join(", ");
        // language=SQL
        format!(
            "INSERT INTO {locks} (shard_id, address, acquired_at) VALUES {values} \
             ON DUPLICATE KEY UPDATE \
             address = IF(address = VALUES(address) OR acquired_at < {expired_before}, \
             VALUES(address), address), \
             acquired_at = IF(address = VALUES(address) OR acquired_at < {expired_before}, \
             VALUES(acquired_at), acquired_at)"
        )
    }

    /// The unexpired leases of the address among `n_shards` shards (parameters: address, then
    /// shard ids).
    pub(crate) fn lease_held(&self, n_shards: usize) -> String {
        // language=SQL
        format!(
            "SELECT shard_id FROM {} WHERE address = ? AND acquired_at >= {} \
             AND shard_id IN ({})",
            self.locks,
            self.expired_before,
            placeholders(n_shards)
        )
    }

    /// Extends the address's leases among `n_shards` shards (parameters: address, shard ids).
    pub(crate) fn lease_refresh(&self, n_shards: usize) -> String {
        // language=SQL
        format!(
            "UPDATE {} SET acquired_at = UTC_TIMESTAMP() WHERE address = ? AND shard_id IN ({})",
            self.locks,
            placeholders(n_shards)
        )
    }

    /// The address's leases among `n_shards` shards, expired or not (parameters: address,
    /// shard ids).
    pub(crate) fn lease_owned(&self, n_shards: usize) -> String {
        // language=SQL
        format!(
            "SELECT shard_id FROM {} WHERE address = ? AND shard_id IN ({})",
            self.locks,
            placeholders(n_shards)
        )
    }

    /// The lease rows of `n_shards` shards (parameters: shard ids): `shard_id, address`, the
    /// lease's age in ms and whether it expired (the takeover condition of
    /// [`lease_acquire`](Self::lease_acquire)).
    pub(crate) fn lease_rows(&self, n_shards: usize) -> String {
        // language=SQL
        format!(
            "SELECT shard_id, address, \
             TIMESTAMPDIFF(MICROSECOND, acquired_at, UTC_TIMESTAMP(6)) DIV 1000, \
             acquired_at < {} \
             FROM {} WHERE shard_id IN ({})",
            self.expired_before,
            self.locks,
            placeholders(n_shards)
        )
    }
}

/// What an identity lock's name starts with, after the table prefix: `<prefix>:runner:`.
const IDENTITY_LOCK_INFIX: &str = ":runner:";

// A hashed identity lock name keeps at least 24 hex digits (96 bits) of the address's hash.
const _: () = assert!(LOCK_NAME_LEN_MAX - TABLE_PREFIX_LEN_MAX - IDENTITY_LOCK_INFIX.len() >= 24);

/// The SQL expression of the name of the *identity lock* of the runner address `address` (a
/// column or a `?`, which then appears three times): the named lock a runner's advisory lock
/// session holds so that other sessions can tell which runner a shard lock's holder is
/// (`shard_lock`).
///
/// The name is `<prefix>:runner:<address>` when that fits MySQL's 64 characters; a longer
/// address is replaced by the first hex digits of its SHA-256 that fit, after `<prefix>:runner#`
/// (at least 24 digits, the prefix having at most 32 characters): cutting the address instead
/// could give two runners one name. Neither form can be a shard lock (`<prefix>.<shard>`) or a
/// pin lock (`<prefix>:pid:<n>`), since prefixes are identifiers. Lock names compare without
/// case, so addresses that differ only in case share a name: the second session cannot take
/// it, and a reader that finds one holder for two runners names neither.
///
/// The prefix is spliced into string literals: a validated identifier, it holds no quote.
pub(crate) fn identity_lock_name(prefix: &TablePrefix, address: &str) -> String {
    let head = format!("{prefix}{IDENTITY_LOCK_INFIX}");
    let room = LOCK_NAME_LEN_MAX.saturating_sub(head.chars().count());
    let hashed = format!("{prefix}:runner#");
    format!(
        "IF(CHAR_LENGTH({address}) <= {room}, CONCAT('{head}', {address}), \
         CONCAT('{hashed}', LEFT(SHA2({address}, 256), {room})))"
    )
}

/// `SELECT IS_USED_LOCK(?), …` over `n` lock names: the connection id holding each, or NULL.
pub(crate) fn advisory_holders(n: usize) -> String {
    format!("SELECT {}", vec!["IS_USED_LOCK(?)"; n].join(", "))
}

/// `SELECT GET_LOCK(?, 0), …` over `n` lock names: 1 where the lock was taken.
pub(crate) fn advisory_try_lock(n: usize) -> String {
    format!("SELECT {}", vec!["GET_LOCK(?, 0)"; n].join(", "))
}

/// Marks a user transaction's state (`MessageTransaction::savepoint`); a later one moves it.
// language=SQL
pub(crate) const SAVEPOINT: &str = "SAVEPOINT cluster_savepoint";

/// Returns a user transaction to its savepoint, which stays (`rollback_to_savepoint`).
// language=SQL
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT cluster_savepoint";
