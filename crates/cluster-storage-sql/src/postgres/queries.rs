//! Every SQL text of the PostgreSQL backend, and its migrations.
//!
//! Texts are built once per storage, when it is made, from the validated
//! [`TablePrefix`](crate::TablePrefix) (always quoted, so mixed-case prefixes name the same tables
//! as the reference's quoted identifiers) and from configured numbers; every user value is a
//! bind parameter. Statements are prepared once per pooled connection (`prepare_cached`).
//!
//! The DDL is the reference's (effect 4.1.0 `SqlMessageStorage.migrations` and
//! `SqlRunnerStorage.migrations`, PostgreSQL dialect), and the histories are recorded as its
//! `Migrator` records them, so a database migrated by either side is recognised by the other.
//!
//! Claims, heartbeats and leases are written and compared as [`UTC_NOW`]: their columns are
//! `TIMESTAMP` without time zone, where `NOW()` would store the session's local time, which
//! jumps at daylight saving changes and differs between sessions in different zones.

use std::fmt::Write as _;

use cluster_core::error::StorageError;
use cluster_core::storage::CLAIM_WINDOW;
use postgres_types::ToSql;

use crate::options::TablePrefix;
use crate::row::inspect::{RequestFilter, waiting_since_sql};
use crate::row::{
    MESSAGE_KIND_ACK_CHUNK, MESSAGE_KIND_INTERRUPT, MESSAGE_KIND_REQUEST, REPLY_KIND_WITH_EXIT,
};

use super::classify::{column_error, driver_error};

// The claim window is spliced into the claim statement in whole seconds.
const _: () = assert!(CLAIM_WINDOW.subsec_nanos() == 0 && CLAIM_WINDOW.as_secs() > 0);
// The kinds are spliced into statements as literals; they are small constants.
const _: () = assert!(MESSAGE_KIND_ACK_CHUNK == 1 && MESSAGE_KIND_INTERRUPT == 2);
const _: () = assert!(REPLY_KIND_WITH_EXIT == 0);

/// The current time as a `TIMESTAMP` in UTC, whatever the session's `TimeZone`.
pub(crate) const UTC_NOW: &str = "(NOW() AT TIME ZONE 'UTC')";

/// What a state write of [`MessageQueries::save_replies_with_state`] does: nothing.
pub(crate) const STATE_NOTHING: i32 = 0;
/// The state write inserts the entity's row.
pub(crate) const STATE_INSERT: i32 = 1;
/// The state write updates the entity's row.
pub(crate) const STATE_UPDATE: i32 = 2;
/// The state write deletes the entity's row.
pub(crate) const STATE_DELETE: i32 = 3;

/// `<prefix>_<name>` as a quoted identifier. The prefix holds only ASCII letters, digits and
/// `_` (checked by [`TablePrefix::new`]), so quoting cannot be escaped.
pub(crate) fn quoted(prefix: &TablePrefix, name: &str) -> String {
    format!("\"{}\"", prefix.table(name))
}

/// The columns of a message insert, in the order of [`MessageQueries::insert_message_ignore`]'s
/// parameters `$1..$15`.
const MESSAGE_INSERT_COLUMNS: &str = "id, message_id, shard_id, entity_type, entity_id, kind, \
     tag, payload, headers, trace_id, span_id, sampled, request_id, reply_id, deliver_at";
const MESSAGE_INSERT_VALUES: &str =
    "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15";

/// The columns read into a `MessageRow` (`m` the message, `r` the reply at `last_reply_id`).
const MESSAGE_COLUMNS: &str = "m.id, m.shard_id, m.entity_type, m.entity_id, m.kind, m.tag, \
     m.payload, m.headers, m.trace_id, m.span_id, m.sampled, m.request_id, m.reply_id, r.id, \
     r.payload, r.sequence";

/// The statements of [`PgMessageStorage`](super::PgMessageStorage).
#[derive(Debug)]
pub(crate) struct MessageQueries {
    /// Insert a request; `RETURNING id` is empty when its `message_id` is taken.
    pub(crate) insert_message_ignore: String,
    /// Insert many requests (group commit): `$1..$15` are arrays of the insert columns;
    /// `RETURNING id` lists the inserted ones.
    pub(crate) insert_messages_ignore: String,
    /// Save many replies (group commit): `$1..$5` are arrays of `(id, kind, request_id,
    /// payload, sequence)`, one reply per request.
    pub(crate) save_replies: String,
    /// The stored request with `message_id = $1` and the reply at its `last_reply_id`.
    pub(crate) select_duplicate: String,
    /// Acknowledge the chunk `$14`, mark older acknowledgements of `$13` processed, insert.
    pub(crate) insert_ack_chunk: String,
    /// Insert an interrupt (a retried save inserts nothing).
    pub(crate) insert_interrupt: String,
    /// `$1 id, $2 kind, $3 request_id, $4 payload, $5 sequence`: a chunk and the request's
    /// `last_reply_id`, in one statement.
    pub(crate) save_chunk: String,
    /// Like `save_chunk` for a final reply: every row of the request becomes processed.
    pub(crate) save_exit: String,
    /// Locks the request row `$1` if its `last_reply_id` is `$2`.
    pub(crate) lock_if_latest: String,
    /// Deletes the final reply of `$1`.
    pub(crate) delete_exit: String,
    /// Deletes the interrupts of `$1`.
    pub(crate) delete_interrupts: String,
    /// Marks the rows of request `$1` whose latest reply is `$2` unprocessed, unclaimed,
    /// without a latest reply (the conditional reset).
    pub(crate) unprocess_request_if_latest: String,
    /// Marks every row of `$1` unprocessed, unclaimed, without a latest reply.
    pub(crate) unprocess_request: String,
    /// The id of the request with `message_id = $1`.
    pub(crate) request_id_for_message_id: String,
    /// Final replies and unacknowledged chunks of the requests `$1`.
    pub(crate) replies_for: String,
    /// Every reply of the requests `$1`.
    pub(crate) replies_for_unfiltered: String,
    /// Claims unprocessed messages of shards `$1`, due at `$2`, at most `$3` (NULL: all).
    pub(crate) claim: String,
    /// `claim` restricted to the addresses `($4, $5, $6)` (parallel arrays).
    pub(crate) claim_for_addresses: String,
    /// Unprocessed messages with ids `$1`, due at `$2`, not claimed.
    pub(crate) unprocessed_by_id: String,
    pub(crate) unprocessed_before: String,
    /// `unprocessed_by_id` and `unprocessed_before` at once: the unprocessed messages `$1` due at
    /// `$2`, each with (for a request) its entity's earlier requests due at `$2`, at most `$3`,
    /// as an array.
    pub(crate) unprocessed_ordered: String,
    /// `unprocessed_before` for the stored requests `$1` at once: each one's id, and its
    /// entity's earlier requests due at `$2`, at most `$3`, as an array.
    /// The earlier requests are a subquery of the select list, as in `unprocessed_ordered`.
    pub(crate) unprocessed_before_many: String,
    /// Releases the claims of the requests `$1`.
    pub(crate) reset_requests: String,
    /// Releases the claims of the addresses `($1, $2, $3)`.
    pub(crate) reset_addresses: String,
    /// Releases the claims of the shards `$1`.
    pub(crate) reset_shards: String,
    /// Deletes every message and reply of entity type `$1`, id `$2`.
    pub(crate) clear_address: String,
    /// Deletes at most `$3` processed requests (lowest id first) whose final reply's id is
    /// below `$1` and whose entity type starts with none of `$2`, with every message and reply
    /// of each; returns how many requests it deleted. The request rows are locked, and checked
    /// processed again once locked, so that a request reset meanwhile is kept.
    pub(crate) purge_processed: String,
    /// The processed requests whose final reply's id is below `$1`, of entity types starting
    /// with `$2`, with tag `$3` (NULL: any), with ids above `$4` (-1: any), at most `$5`, in id
    /// order: `id, shard_id, entity_type, entity_id, tag`, the final reply's `id, payload` and
    /// the request's `payload`.
    pub(crate) processed_requests: String,
    /// The read model's backlog: `$1` now (epoch ms), `$2` the stale claim age (ms), `$3`
    /// the limit.
    pub(crate) backlog: String,
    /// The read model's requests: the statement's text up to its filters (see
    /// [`requests_sql`]).
    pub(crate) requests_head: String,
    /// The `value, revision` of the state of entity type `$1`, id `$2`.
    pub(crate) load_state: String,
    /// Inserts the state `$4` of entity type `$1`, id `$2`, shard `$3` at revision 1; inserts
    /// nothing when the entity has a row (a stale write).
    pub(crate) insert_state: String,
    /// Sets the state of entity type `$1`, id `$2` to `$4` (shard `$3`) if its revision is
    /// `$5`, and moves the revision on by one.
    pub(crate) update_state: String,
    /// Deletes the state of entity type `$1`, id `$2` if its revision is `$3`.
    pub(crate) delete_state: String,
    /// Final replies with their entities' state writes, in one statement. `$1` to `$5` are
    /// the replies' columns (as in [`save_replies`](Self::save_replies)); `$6` to `$10` the
    /// state writes' entity types, ids, shards, values and expected revisions; `$11` what each
    /// write does (0 nothing, 1 insert, 2 update, 3 delete). A reply is stored only if its
    /// state write applied (or it has none). Returns the request ids of the stored replies.
    pub(crate) save_replies_with_state: String,
}

impl MessageQueries {
    #[expect(clippy::too_many_lines, reason = "a table of SQL statements, one per field")]
    pub(crate) fn new(prefix: &TablePrefix) -> MessageQueries {
        let messages = quoted(prefix, "messages");
        let replies = quoted(prefix, "replies");
        let state = quoted(prefix, ENTITY_STATE_TABLE);
        MessageQueries {
            insert_message_ignore: format!(
                "INSERT INTO {messages} ({MESSAGE_INSERT_COLUMNS}) VALUES ({MESSAGE_INSERT_VALUES}) \
                 ON CONFLICT (message_id) DO NOTHING RETURNING id"
            ),
            insert_messages_ignore: format!(
                "INSERT INTO {messages} ({MESSAGE_INSERT_COLUMNS}) \
                 SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], \
                 $5::text[], $6::int[], $7::text[], $8::text[], $9::text[], $10::text[], \
                 $11::text[], $12::bool[], $13::bigint[], $14::bigint[], $15::bigint[]) \
                 ON CONFLICT (message_id) DO NOTHING RETURNING id"
            ),
            save_replies: format!(
                "WITH input AS ( \
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::text[], \
                   $5::int[]) AS i (id, kind, request_id, payload, sequence) \
                 ), {}",
                store_replies(&messages, &replies, "input")
            ),
            select_duplicate: format!(
                "SELECT m.id, r.id, r.kind, r.payload, r.sequence FROM {messages} m \
                 LEFT JOIN {replies} r ON r.id = m.last_reply_id WHERE m.message_id = $1"
            ),
            insert_ack_chunk: format!(
                "WITH acked AS (UPDATE {replies} SET acked = TRUE WHERE id = $14), \
                 older AS ( \
                   UPDATE {messages} SET processed = TRUE \
                   WHERE processed = FALSE AND request_id = $13 AND kind = 1 AND id <> $1 \
                 ) \
                 INSERT INTO {messages} ({MESSAGE_INSERT_COLUMNS}) VALUES ({MESSAGE_INSERT_VALUES}) \
                 ON CONFLICT (id) DO NOTHING"
            ),
            insert_interrupt: format!(
                "INSERT INTO {messages} ({MESSAGE_INSERT_COLUMNS}) VALUES ({MESSAGE_INSERT_VALUES}) \
                 ON CONFLICT (id) DO NOTHING"
            ),
            save_chunk: format!(
                "WITH latest AS (UPDATE {messages} SET last_reply_id = $1 WHERE id = $3) \
                 INSERT INTO {replies} (id, kind, request_id, payload, sequence) \
                 VALUES ($1, $2, $3, $4, $5)"
            ),
            save_exit: format!(
                "WITH done AS ( \
                   UPDATE {messages} SET processed = TRUE, last_reply_id = $1 WHERE request_id = $3 \
                 ) \
                 INSERT INTO {replies} (id, kind, request_id, payload, sequence) \
                 VALUES ($1, $2, $3, $4, $5)"
            ),
            lock_if_latest: format!(
                "SELECT 1 FROM {messages} WHERE id = $1 AND last_reply_id = $2 FOR UPDATE"
            ),
            delete_exit: format!("DELETE FROM {replies} WHERE request_id = $1 AND kind = 0"),
            delete_interrupts: format!("DELETE FROM {messages} WHERE request_id = $1 AND kind = 2"),
            unprocess_request_if_latest: format!(
                "UPDATE {messages} SET processed = FALSE, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = $1 AND last_reply_id = $2"
            ),
            unprocess_request: format!(
                "UPDATE {messages} SET processed = FALSE, last_reply_id = NULL, last_read = NULL \
                 WHERE request_id = $1"
            ),
            request_id_for_message_id: format!("SELECT id FROM {messages} WHERE message_id = $1"),
            replies_for: format!(
                "SELECT id, kind, request_id, payload, sequence FROM {replies} \
                 WHERE request_id = ANY($1) AND (kind = 0 OR (kind IS NULL AND acked = FALSE)) \
                 ORDER BY rowid ASC"
            ),
            replies_for_unfiltered: format!(
                "SELECT id, kind, request_id, payload, sequence FROM {replies} \
                 WHERE request_id = ANY($1) ORDER BY rowid ASC"
            ),
            claim: claim(&messages, &replies, ""),
            claim_for_addresses: claim(
                &messages,
                &replies,
                "AND (m.shard_id, m.entity_type, m.entity_id) IN \
                 (SELECT * FROM unnest($4::text[], $5::text[], $6::text[]))",
            ),
            unprocessed_by_id: format!(
                "SELECT {MESSAGE_COLUMNS} \
                 FROM {messages} m LEFT JOIN {replies} r ON r.id = m.last_reply_id \
                 WHERE m.id = ANY($1) AND m.processed = FALSE \
                 AND (m.deliver_at IS NULL OR m.deliver_at <= $2) \
                 AND {} \
                 ORDER BY m.rowid ASC",
                no_pending_reply(&replies)
            ),
            unprocessed_before: format!(
                "SELECT m.id FROM {messages} m \
                 WHERE m.shard_id = $1 AND m.processed = FALSE AND m.kind = 0 \
                 AND m.entity_type = $2 AND m.entity_id = $3 \
                 AND m.rowid < (SELECT rowid FROM {messages} WHERE id = $4) \
                 AND (m.deliver_at IS NULL OR m.deliver_at <= $5) \
                 ORDER BY m.rowid ASC LIMIT $6"
            ),
            // Planned at almost every call (a custom plan), so kept to the joins of
            // `unprocessed_by_id`: the earlier requests are a subquery of the select list,
            // planned on its own.
            unprocessed_ordered: format!(
                "SELECT {MESSAGE_COLUMNS}, {} \
                 FROM {messages} m LEFT JOIN {replies} r ON r.id = m.last_reply_id \
                 WHERE m.id = ANY($1) AND m.processed = FALSE \
                 AND (m.deliver_at IS NULL OR m.deliver_at <= $2) \
                 AND {} \
                 ORDER BY m.rowid ASC",
                earlier_of_m(&messages),
                no_pending_reply(&replies)
            ),
            unprocessed_before_many: format!(
                "SELECT m.id, {} FROM {messages} m WHERE m.id = ANY($1)",
                earlier_of_m(&messages)
            ),
            reset_requests: reset(&messages, "request_id = ANY($1)"),
            reset_addresses: reset(
                &messages,
                "(shard_id, entity_type, entity_id) IN \
                 (SELECT * FROM unnest($1::text[], $2::text[], $3::text[]))",
            ),
            reset_shards: reset(&messages, "shard_id = ANY($1)"),
            clear_address: format!(
                "WITH gone AS ( \
                   DELETE FROM {messages} WHERE entity_type = $1 AND entity_id = $2 RETURNING id \
                 ) \
                 DELETE FROM {replies} WHERE request_id IN (SELECT id FROM gone)"
            ),
            purge_processed: format!(
                "WITH chosen AS ( \
                   SELECT m.id FROM {replies} r JOIN {messages} m ON m.id = r.request_id \
                   WHERE r.kind = 0 AND r.id < $1 AND m.kind = 0 AND m.processed = TRUE \
                   AND NOT EXISTS (SELECT 1 FROM unnest($2::text[]) AS k (p) \
                     WHERE left(m.entity_type, length(k.p)) = k.p) \
                   ORDER BY m.id ASC LIMIT $3 \
                   FOR UPDATE OF m \
                 ), \
                 gone_replies AS ( \
                   DELETE FROM {replies} WHERE request_id IN (SELECT id FROM chosen) \
                 ), \
                 gone AS ( \
                   DELETE FROM {messages} WHERE request_id IN (SELECT id FROM chosen) \
                   RETURNING kind \
                 ) \
                 SELECT count(*) FROM gone WHERE kind = 0"
            ),
            processed_requests: format!(
                "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, r.id, r.payload, \
                 m.payload \
                 FROM {replies} r JOIN {messages} m ON m.id = r.request_id \
                 WHERE r.kind = 0 AND r.id < $1 AND m.kind = 0 \
                 AND left(m.entity_type, length($2::text)) = $2::text \
                 AND ($3::text IS NULL OR m.tag = $3::text) \
                 AND m.id > $4 \
                 ORDER BY m.id ASC LIMIT $5"
            ),
            backlog: format!(
                "SELECT entity_type, shard_id, \
                 count(*) FILTER (WHERE deliver_at IS NULL OR deliver_at <= $1::bigint), \
                 count(*) FILTER (WHERE deliver_at > $1::bigint), \
                 count(*) FILTER (WHERE (deliver_at IS NULL OR deliver_at <= $1::bigint) \
                   AND last_read IS NOT NULL), \
                 count(*) FILTER (WHERE (deliver_at IS NULL OR deliver_at <= $1::bigint) \
                   AND last_read < {UTC_NOW} - $2::bigint * INTERVAL '1 millisecond'), \
                 min({waiting}) AS waiting_since \
                 FROM {messages} WHERE processed = FALSE \
                 GROUP BY entity_type, shard_id \
                 ORDER BY waiting_since ASC NULLS LAST, entity_type, shard_id \
                 LIMIT $3::bigint",
                waiting = waiting_since_sql("$1::bigint", "GREATEST")
            ),
            requests_head: requests_head(&messages, &replies),
            load_state: format!(
                "SELECT value, revision FROM {state} WHERE entity_type = $1 AND entity_id = $2"
            ),
            // `ON CONFLICT DO NOTHING`, not an error: a stale insert must not abort the
            // transaction it runs in.
            insert_state: format!(
                "INSERT INTO {state} (entity_type, entity_id, shard_id, value, revision, \
                 updated_at) VALUES ($1, $2, $3, $4, 1, {UTC_NOW}) \
                 ON CONFLICT (entity_type, entity_id) DO NOTHING"
            ),
            update_state: format!(
                "UPDATE {state} SET shard_id = $3, value = $4, revision = revision + 1, \
                 updated_at = {UTC_NOW} \
                 WHERE entity_type = $1 AND entity_id = $2 AND revision = $5"
            ),
            delete_state: format!(
                "DELETE FROM {state} WHERE entity_type = $1 AND entity_id = $2 AND revision = $3"
            ),
            save_replies_with_state: format!(
                "WITH input AS ( \
                   SELECT * FROM unnest($1::bigint[], $2::int[], $3::bigint[], $4::text[], \
                   $5::int[], $6::text[], $7::text[], $8::text[], $9::text[], $10::bigint[], \
                   $11::int[]) AS i (id, kind, request_id, payload, sequence, entity_type, \
                   entity_id, shard_id, value, expected, change) \
                 ), \
                 inserted AS ( \
                   INSERT INTO {state} (entity_type, entity_id, shard_id, value, revision, \
                   updated_at) \
                   SELECT entity_type, entity_id, shard_id, value, 1, {UTC_NOW} FROM input \
                   WHERE change = {STATE_INSERT} \
                   ON CONFLICT (entity_type, entity_id) DO NOTHING \
                   RETURNING entity_type, entity_id \
                 ), \
                 updated AS ( \
                   UPDATE {state} s SET shard_id = i.shard_id, value = i.value, \
                   revision = s.revision + 1, updated_at = {UTC_NOW} FROM input i \
                   WHERE i.change = {STATE_UPDATE} AND s.entity_type = i.entity_type \
                   AND s.entity_id = i.entity_id AND s.revision = i.expected \
                   RETURNING s.entity_type, s.entity_id \
                 ), \
                 deleted AS ( \
                   DELETE FROM {state} s USING input i \
                   WHERE i.change = {STATE_DELETE} AND s.entity_type = i.entity_type \
                   AND s.entity_id = i.entity_id AND s.revision = i.expected \
                   RETURNING s.entity_type, s.entity_id \
                 ), \
                 live AS ( \
                   SELECT i.* FROM input i WHERE i.change = {STATE_NOTHING} \
                   OR (i.entity_type, i.entity_id) IN ( \
                     SELECT * FROM inserted UNION ALL SELECT * FROM updated \
                     UNION ALL SELECT * FROM deleted) \
                 ), {} RETURNING request_id",
                store_replies(&messages, &replies, "live")
            ),
        }
    }
}

/// The end of a reply batch's statement, after its `WITH` names the rows `source` (columns
/// `id, kind, request_id, payload, sequence`): a chunk moves its request's `last_reply_id`, a
/// final reply marks its request (with its acknowledgements and interrupts) processed, and
/// every row is inserted into `replies`.
fn store_replies(messages: &str, replies: &str, source: &str) -> String {
    format!(
        "chunks AS ( \
           UPDATE {messages} m SET last_reply_id = s.id FROM {source} s \
           WHERE s.kind IS NULL AND m.id = s.request_id \
         ), \
         exits AS ( \
           UPDATE {messages} m SET processed = TRUE, last_reply_id = s.id FROM {source} s \
           WHERE s.kind = 0 AND m.request_id = s.request_id \
         ) \
         INSERT INTO {replies} (id, kind, request_id, payload, sequence) \
         SELECT id, kind, request_id, payload, sequence FROM {source}"
    )
}

/// The ids of the unprocessed requests of row `m`'s entity stored before it and due at `$2`,
/// at most `$3`, in storage order, as an array (`NULL` when there are none): a subquery of a
/// select list, for `unprocessed_before` on many rows at once.
fn earlier_of_m(messages: &str) -> String {
    format!(
        "(SELECT array_agg(b.id ORDER BY b.rowid) FROM ( \
           SELECT o.id, o.rowid FROM {messages} o \
           WHERE o.shard_id = m.shard_id AND o.processed = FALSE AND o.kind = 0 \
           AND o.entity_type = m.entity_type AND o.entity_id = m.entity_id \
           AND o.rowid < m.rowid \
           AND (o.deliver_at IS NULL OR o.deliver_at <= $2) \
           ORDER BY o.rowid ASC LIMIT $3 \
         ) b)"
    )
}

/// A request is waiting while it has a final reply or an unacknowledged chunk (then its stream
/// waits for the acknowledgement); this holds its acknowledgements and interrupts back too.
fn no_pending_reply(replies: &str) -> String {
    format!(
        "NOT EXISTS (SELECT 1 FROM {replies} p WHERE p.request_id = m.request_id \
         AND (p.kind = 0 OR p.acked = FALSE))"
    )
}

/// The claim (`effect/src/cluster/SqlMessageStorage.ts`): lock the due, unclaimed, unprocessed rows
/// in rowid order, stamp `last_read`, return them with the reply at their `last_reply_id`.
fn claim(messages: &str, replies: &str, address_filter: &str) -> String {
    let claim_window_secs = CLAIM_WINDOW.as_secs();
    let no_pending_reply = no_pending_reply(replies);
    format!(
        "WITH claimed AS ( \
           UPDATE {messages} c SET last_read = {UTC_NOW} \
           FROM ( \
             SELECT m.id FROM {messages} m \
             WHERE m.shard_id = ANY($1) {address_filter} \
             AND m.processed = FALSE \
             AND (m.last_read IS NULL \
                  OR m.last_read < {UTC_NOW} - INTERVAL '{claim_window_secs} seconds') \
             AND (m.deliver_at IS NULL OR m.deliver_at <= $2) \
             AND {no_pending_reply} \
             ORDER BY m.rowid ASC \
             LIMIT $3 \
             FOR UPDATE \
           ) AS picked \
           WHERE c.id = picked.id \
           RETURNING c.* \
         ) \
         SELECT {MESSAGE_COLUMNS} \
         FROM claimed m LEFT JOIN {replies} r ON r.id = m.last_reply_id \
         ORDER BY m.rowid ASC"
    )
}

/// Releases the claims of the unprocessed rows matching `filter`, locking them in the claim's
/// order (rowid) so that a reset and a claim cannot deadlock.
fn reset(messages: &str, filter: &str) -> String {
    format!(
        "WITH target AS ( \
           SELECT id FROM {messages} \
           WHERE processed = FALSE AND last_read IS NOT NULL AND {filter} \
           ORDER BY rowid ASC FOR UPDATE \
         ) \
         UPDATE {messages} SET last_read = NULL WHERE id IN (SELECT id FROM target)"
    )
}

/// The statements of [`PgRunnerStorage`](super::PgRunnerStorage) and its lock session.
#[derive(Debug)]
pub(crate) struct RunnerQueries {
    /// Upsert `$1 address, $2 runner, $3 healthy`, returning the machine id.
    pub(crate) register: String,
    /// Deletes `$1` and every expired runner.
    pub(crate) unregister: String,
    /// `runner, healthy` of the live runners.
    pub(crate) get_runners: String,
    /// Sets `$1`'s health to `$2`.
    pub(crate) set_health: String,
    /// Refreshes `$1`'s heartbeat.
    pub(crate) heartbeat: String,
    /// Takes the shards `$2` for `$1` where free, own or expired; returns those now held.
    pub(crate) lease_acquire: String,
    /// Extends `$1`'s leases on `$2`; returns those still held.
    pub(crate) lease_refresh: String,
    /// Deletes `$1`'s lease on `$2`.
    pub(crate) lease_release: String,
    /// Deletes every lease of `$1`.
    pub(crate) lease_release_all: String,
    /// Every runner: `machine_id, runner, healthy`, the heartbeat's age in ms and whether it
    /// is alive.
    pub(crate) runner_records: String,
    /// The lease rows of the shards `$1`: `shard_id, address`, the lease's age in ms and
    /// whether it expired.
    pub(crate) lease_rows: String,
}

impl RunnerQueries {
    pub(crate) fn new(prefix: &TablePrefix, expiration_secs: u64) -> RunnerQueries {
        let runners = quoted(prefix, "runners");
        let locks = quoted(prefix, "locks");
        let expired_before = format!("{UTC_NOW} - INTERVAL '{expiration_secs} seconds'");
        RunnerQueries {
            register: format!(
                "INSERT INTO {runners} (address, runner, last_heartbeat, healthy) \
                 VALUES ($1, $2, {UTC_NOW}, $3) \
                 ON CONFLICT (address) DO UPDATE SET runner = EXCLUDED.runner, \
                   last_heartbeat = EXCLUDED.last_heartbeat, healthy = EXCLUDED.healthy \
                 RETURNING machine_id"
            ),
            unregister: format!(
                "DELETE FROM {runners} WHERE address = $1 OR last_heartbeat < {expired_before}"
            ),
            get_runners: format!(
                "SELECT runner, healthy FROM {runners} WHERE last_heartbeat > {expired_before} \
                 ORDER BY machine_id"
            ),
            set_health: format!("UPDATE {runners} SET healthy = $2 WHERE address = $1"),
            heartbeat: format!(
                "UPDATE {runners} SET last_heartbeat = {UTC_NOW} WHERE address = $1"
            ),
            // Rows are written in one order (shard id, byte-wise) by every statement that
            // locks several lease rows, so that two runners cannot deadlock. The upsert
            // touches (and so returns) exactly the rows that are now this runner's.
            lease_acquire: format!(
                "INSERT INTO {locks} AS l (shard_id, address, acquired_at) \
                 SELECT requested.shard_id, $1, {UTC_NOW} \
                 FROM unnest($2::text[]) AS requested (shard_id) \
                 ORDER BY requested.shard_id COLLATE \"C\" \
                 ON CONFLICT (shard_id) DO UPDATE SET address = EXCLUDED.address, \
                   acquired_at = {UTC_NOW} \
                 WHERE l.address = EXCLUDED.address OR l.acquired_at < {expired_before} \
                 RETURNING l.shard_id"
            ),
            lease_refresh: format!(
                "WITH locked AS ( \
                   SELECT shard_id FROM {locks} WHERE address = $1 AND shard_id = ANY($2) \
                   ORDER BY shard_id COLLATE \"C\" FOR UPDATE \
                 ) \
                 UPDATE {locks} SET acquired_at = {UTC_NOW} \
                 WHERE address = $1 AND shard_id IN (SELECT shard_id FROM locked) \
                 RETURNING shard_id"
            ),
            lease_release: format!("DELETE FROM {locks} WHERE address = $1 AND shard_id = $2"),
            lease_release_all: format!(
                "WITH locked AS ( \
                   SELECT shard_id FROM {locks} WHERE address = $1 \
                   ORDER BY shard_id COLLATE \"C\" FOR UPDATE \
                 ) \
                 DELETE FROM {locks} WHERE address = $1 AND shard_id IN (SELECT shard_id FROM locked)"
            ),
            runner_records: format!(
                "SELECT machine_id, runner, healthy, \
                 (EXTRACT(EPOCH FROM ({UTC_NOW} - last_heartbeat)) * 1000)::bigint, \
                 last_heartbeat > {expired_before} \
                 FROM {runners} ORDER BY address"
            ),
            lease_rows: format!(
                "SELECT shard_id, address, \
                 (EXTRACT(EPOCH FROM ({UTC_NOW} - acquired_at)) * 1000)::bigint, \
                 acquired_at < {expired_before} \
                 FROM {locks} WHERE shard_id = ANY($1::text[])"
            ),
        }
    }
}

/// The read model's requests with their final replies, before their filters.
fn requests_head(messages: &str, replies: &str) -> String {
    format!(
        "SELECT m.id, m.shard_id, m.entity_type, m.entity_id, m.tag, m.payload, m.processed, \
         (m.processed = FALSE AND m.last_read IS NOT NULL), m.deliver_at, \
         EXISTS (SELECT 1 FROM {messages} i \
           WHERE i.request_id = m.id AND i.kind = {MESSAGE_KIND_INTERRUPT}), \
         r.id, r.payload \
         FROM {messages} m \
         LEFT JOIN {replies} r ON r.request_id = m.id AND r.kind = {REPLY_KIND_WITH_EXIT} \
         WHERE m.kind = {MESSAGE_KIND_REQUEST}"
    )
}

/// A parameter of a statement built at run time.
pub(crate) type Parameter = Box<dyn ToSql + Sync + Send>;

/// The read model's requests statement for `filter`, and its parameters. Only the set filters
/// are in the text: a statement with `$n IS NULL OR …` conditions gets a generic plan after a
/// few calls, which can use no index for them. So the shard filter uses the shard index, and
/// the tag `run` (written as a literal, as the partial index's condition is) uses
/// `messages_run_idx`.
pub(crate) fn requests_sql(head: &str, filter: &RequestFilter) -> (String, Vec<Parameter>) {
    let mut sql = head.to_owned();
    let mut parameters: Vec<Parameter> = Vec::new();
    let condition =
        |sql: &mut String, parameters: &mut Vec<Parameter>, text: &str, value: Parameter| {
            parameters.push(value);
            let _ = write!(sql, " AND {text} ${}", parameters.len());
        };
    if let Some(id) = filter.request_id {
        condition(&mut sql, &mut parameters, "m.id =", Box::new(id));
    }
    if let Some(shard) = &filter.shard_id {
        condition(&mut sql, &mut parameters, "m.shard_id =", Box::new(shard.clone()));
    }
    if !filter.entity_type_prefix.is_empty() {
        parameters.push(Box::new(filter.entity_type_prefix.clone()));
        let n = parameters.len();
        let _ = write!(sql, " AND left(m.entity_type, length(${n}::text)) = ${n}::text");
    }
    if let Some(entity_type) = &filter.entity_type {
        condition(&mut sql, &mut parameters, "m.entity_type =", Box::new(entity_type.clone()));
    }
    if let Some(entity_id) = &filter.entity_id {
        condition(&mut sql, &mut parameters, "m.entity_id =", Box::new(entity_id.clone()));
    }
    match filter.tag.as_deref() {
        Some("run") => sql.push_str(" AND m.tag = 'run'"),
        Some(tag) => condition(&mut sql, &mut parameters, "m.tag =", Box::new(tag.to_owned())),
        None => {}
    }
    if let Some(processed) = filter.processed {
        condition(&mut sql, &mut parameters, "m.processed =", Box::new(processed));
    }
    condition(&mut sql, &mut parameters, "m.id >", Box::new(filter.after));
    condition(&mut sql, &mut parameters, "m.id <", Box::new(filter.before));
    let direction = if filter.newest_first { "DESC" } else { "ASC" };
    parameters.push(Box::new(i64::from(filter.limit)));
    let _ = write!(sql, " ORDER BY m.id {direction} LIMIT ${}", parameters.len());
    (sql, parameters)
}

/// The advisory lock session's statements; they name no table.
pub(crate) mod advisory {
    /// On a new lock session: its backend pid, and `idle_session_timeout` set to `$1` (ms, as
    /// text) so the server ends the session of a frozen runner. Servers before PostgreSQL 14
    /// have no such setting and keep the session.
    pub(crate) const SETUP: &str = "SELECT pg_backend_pid(), \
         (SELECT set_config(name, $1, false) FROM pg_settings WHERE name = 'idle_session_timeout')";
    /// The lock numbers among `$3` that session `$2` holds in namespace `$1` (an oid).
    pub(crate) const HELD: &str = "SELECT objid FROM pg_locks \
         WHERE locktype = 'advisory' AND granted = TRUE AND classid = $1 AND objsubid = 2 \
         AND pid = $2 AND objid = ANY($3)";
    /// Tries to lock `(namespace $1, n)` for every `n` in `$2`.
    pub(crate) const TRY_LOCK: &str =
        "SELECT n, pg_try_advisory_lock($1, n) FROM unnest($2::int4[]) AS n";
    /// Releases one hold of `($1, $2)`.
    pub(crate) const UNLOCK: &str = "SELECT pg_advisory_unlock($1, $2)";
    /// Whether session `$3` still holds `(namespace oid $1, lock number $2)`.
    pub(crate) const IS_HELD: &str = "SELECT EXISTS (SELECT 1 FROM pg_locks \
         WHERE locktype = 'advisory' AND granted = TRUE AND classid = $1 AND objid = $2 \
         AND objsubid = 2 AND pid = $3)";
    /// The advisory locks of namespace `$1` (an oid) on the lock numbers `$2` (oids): the
    /// number, the holding session's pid and `application_name`.
    pub(crate) const HOLDERS: &str = "SELECT l.objid, l.pid, a.application_name \
         FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted = TRUE AND l.classid = $1 \
         AND l.objsubid = 2 AND l.objid = ANY($2)";
    /// Names the session `$1` (its `application_name`), so that a reader of `pg_locks` knows
    /// whose locks it holds.
    pub(crate) const NAME: &str = "SELECT set_config('application_name', $1, false)";
    /// A sign of life of the session: its backend pid.
    pub(crate) const ALIVE: &str = "SELECT pg_backend_pid()";
    /// Releases every advisory lock of the session.
    pub(crate) const UNLOCK_ALL: &str = "SELECT pg_advisory_unlock_all()";
}

/// One migration: its id and name as the reference's history records them (`0001_create_tables`
/// is id 1, name `create_tables`) and its statements.
#[derive(Debug)]
pub(crate) struct Migration {
    pub(crate) id: i32,
    pub(crate) name: &'static str,
    pub(crate) statements: Vec<String>,
}

/// The migrations of the message tables, recorded in `<prefix>_migrations`.
pub(crate) fn message_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let messages = quoted(prefix, "messages");
    let replies = quoted(prefix, "replies");
    let index = |name: &str| quoted(prefix, name);
    vec![
        Migration {
            id: 1,
            name: "create_tables",
            statements: vec![
                format!(
                    "CREATE TABLE IF NOT EXISTS {messages} ( \
                       id BIGINT PRIMARY KEY, \
                       rowid BIGSERIAL, \
                       message_id VARCHAR(255), \
                       shard_id VARCHAR(50) NOT NULL, \
                       entity_type VARCHAR(150) NOT NULL, \
                       entity_id VARCHAR(255) NOT NULL, \
                       kind INT NOT NULL, \
                       tag VARCHAR(50), \
                       payload TEXT, \
                       headers TEXT, \
                       trace_id VARCHAR(32), \
                       span_id VARCHAR(16), \
                       sampled BOOLEAN, \
                       processed BOOLEAN NOT NULL DEFAULT FALSE, \
                       request_id BIGINT NOT NULL, \
                       reply_id BIGINT, \
                       last_reply_id BIGINT, \
                       last_read TIMESTAMP, \
                       deliver_at BIGINT, \
                       UNIQUE (message_id) \
                     )"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {messages} \
                     (shard_id, processed, last_read, deliver_at)",
                    index("messages_shard_idx")
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {messages} (request_id)",
                    index("messages_request_id_idx")
                ),
                format!(
                    "CREATE TABLE IF NOT EXISTS {replies} ( \
                       id BIGINT PRIMARY KEY, \
                       rowid BIGSERIAL, \
                       kind INT, \
                       request_id BIGINT NOT NULL, \
                       payload TEXT NOT NULL, \
                       sequence INT, \
                       acked BOOLEAN NOT NULL DEFAULT FALSE, \
                       UNIQUE (request_id, kind), \
                       UNIQUE (request_id, sequence) \
                     )"
                ),
                format!(
                    "CREATE INDEX IF NOT EXISTS {} ON {replies} (request_id, kind, acked)",
                    index("replies_request_lookup_idx")
                ),
            ],
        },
        Migration {
            id: 2,
            name: "entity_type_size",
            statements: vec![format!(
                "ALTER TABLE {messages} ALTER COLUMN entity_type TYPE VARCHAR(150)"
            )],
        },
        Migration {
            id: 3,
            name: "pg_messages_rowid_index",
            statements: vec![format!(
                "CREATE INDEX IF NOT EXISTS {} ON {messages} (rowid)",
                index("messages_rowid_idx")
            )],
        },
    ]
}

/// An index of ours, beyond the reference's schema: created when missing (if the options allow
/// it), after the reference's migrations and without a history row.
#[derive(Debug)]
pub(crate) struct ExtraIndex {
    /// The index's name, quoted.
    pub(crate) name: String,
    pub(crate) create: String,
}

/// The indexes of ours on the message tables.
pub(crate) fn message_extra_indexes(prefix: &TablePrefix) -> Vec<ExtraIndex> {
    let messages = quoted(prefix, "messages");
    let name = quoted(prefix, "messages_unprocessed_idx");
    // The claim walks this index in its order and stops at its limit, instead of reading every
    // version of every row of the runner's shards (processed rows and dead versions pile up in
    // `messages_shard_idx` until vacuum). W3 at 16 in flight: 2,300 → 3,500 requests/s
    // (docs/performance.md).
    let create =
        format!("CREATE INDEX IF NOT EXISTS {name} ON {messages} (rowid) WHERE processed = FALSE");
    // The workflow executions (their `run` requests), newest first, for the read model: without
    // it, listing them reads every message. Only `run` requests have entries, so the hot path's
    // writes do not pay for it.
    let runs = quoted(prefix, "messages_run_idx");
    let create_runs = format!(
        "CREATE INDEX IF NOT EXISTS {runs} ON {messages} (id) \
         WHERE kind = {MESSAGE_KIND_REQUEST} AND tag = 'run'"
    );
    vec![ExtraIndex { name, create }, ExtraIndex { name: runs, create: create_runs }]
}

/// The name of our entity state table (`<prefix>_entity_state`, see
/// [`cluster_core::entity_state`]).
pub(crate) const ENTITY_STATE_TABLE: &str = "entity_state";

/// A table of ours, beyond the reference's schema: created when missing, after the reference's
/// migrations and without a history row, whatever the options say (the storage's own
/// statements need it).
#[derive(Debug)]
pub(crate) struct ExtraTable {
    /// The table's name, quoted.
    pub(crate) name: String,
    pub(crate) create: String,
}

/// The tables of ours next to the message tables: the entity state, one row per entity that
/// has state, keyed by its type and id (the columns are the messages' own).
pub(crate) fn message_extra_tables(prefix: &TablePrefix) -> Vec<ExtraTable> {
    let name = quoted(prefix, ENTITY_STATE_TABLE);
    let create = format!(
        "CREATE TABLE IF NOT EXISTS {name} ( \
           entity_type VARCHAR(150) NOT NULL, \
           entity_id VARCHAR(255) NOT NULL, \
           shard_id VARCHAR(50) NOT NULL, \
           value TEXT NOT NULL, \
           revision BIGINT NOT NULL, \
           updated_at TIMESTAMP NOT NULL, \
           PRIMARY KEY (entity_type, entity_id) \
         )"
    );
    vec![ExtraTable { name, create }]
}

/// History rows that earlier versions of this crate recorded in the reference's message history
/// for objects of their own: a migrator removes them, so that the reference's history holds
/// only the reference's migrations and a later effect release's migration of the same id runs.
pub(crate) const RETIRED_MESSAGE_MIGRATIONS: [(i32, &str); 1] =
    [(4, "pg_messages_unprocessed_index")];

/// The migrations of the runner tables, recorded in `<prefix>_runner_migrations` (the ids
/// overlap the message migrations', so the histories are separate).
pub(crate) fn runner_migrations(prefix: &TablePrefix) -> Vec<Migration> {
    let runners = quoted(prefix, "runners");
    let locks = quoted(prefix, "locks");
    vec![Migration {
        id: 1,
        name: "create_tables",
        statements: vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {runners} ( \
                   machine_id SERIAL PRIMARY KEY, \
                   address VARCHAR(255) NOT NULL, \
                   runner TEXT NOT NULL, \
                   healthy BOOLEAN NOT NULL DEFAULT TRUE, \
                   last_heartbeat TIMESTAMP NOT NULL DEFAULT NOW(), \
                   UNIQUE(address) \
                 )"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {locks} ( \
                   shard_id VARCHAR(50) PRIMARY KEY, \
                   address VARCHAR(255) NOT NULL, \
                   acquired_at TIMESTAMP NOT NULL \
                 )"
            ),
        ],
    }]
}

/// The advisory transaction lock key (second half) that serialises message migrations.
pub(crate) const MESSAGE_MIGRATION_LOCK: i32 = 0;
/// The advisory transaction lock key (second half) that serialises runner migrations.
pub(crate) const RUNNER_MIGRATION_LOCK: i32 = 1;
// Shard lock numbers start at 1_000_001, so the migration keys never collide with them.
const _: () = assert!(MESSAGE_MIGRATION_LOCK < 1_000_000 && RUNNER_MIGRATION_LOCK < 1_000_000);

/// What a migration run needs to know besides the migrations.
#[derive(Debug)]
pub(crate) struct MigrationTarget<'a> {
    /// The history table, quoted.
    pub(crate) history: String,
    /// The advisory transaction lock `(namespace, key)` held while migrating.
    pub(crate) lock: (i32, i32),
    pub(crate) migrations: &'a [Migration],
    /// History rows of ours to remove (`RETIRED_MESSAGE_MIGRATIONS`).
    pub(crate) retired: &'a [(i32, &'static str)],
    /// Tables of ours to create when missing.
    pub(crate) extra_tables: &'a [ExtraTable],
    /// Indexes of ours to create when missing (empty when the options forbid them).
    pub(crate) extra_indexes: &'a [ExtraIndex],
}

/// Runs the pending `migrations` in one transaction, as the reference's `Migrator` does:
/// ensure the history table, lock it, read the latest id, record the pending migrations, run
/// them. An advisory transaction lock taken first makes a concurrent migration of the same
/// prefix wait and then find nothing to do. Our own rows are removed from the history before
/// it is read, and our own tables and then indexes are created last, without a history row.
/// Returns the ids that were run.
pub(crate) async fn migrate(
    client: &mut tokio_postgres::Client,
    target: &MigrationTarget<'_>,
) -> Result<Vec<i32>, StorageError> {
    let history = &target.history;
    let transaction = client.transaction().await.map_err(|e| driver_error("migrate: BEGIN", e))?;
    transaction
        .execute("SELECT pg_advisory_xact_lock($1, $2)", &[&target.lock.0, &target.lock.1])
        .await
        .map_err(|e| driver_error("migrate: advisory lock", e))?;
    let ensure = format!(
        "CREATE TABLE IF NOT EXISTS {history} ( \
           migration_id integer primary key, \
           created_at timestamp with time zone not null default now(), \
           name text not null \
         )"
    );
    transaction.batch_execute(&ensure).await.map_err(|e| driver_error("migrate: history", e))?;
    // The reference's migrator takes this lock; taking it too keeps both kinds of migrator
    // apart.
    let lock = format!("LOCK TABLE {history} IN ACCESS EXCLUSIVE MODE");
    transaction.batch_execute(&lock).await.map_err(|e| driver_error("migrate: lock", e))?;
    let retire = format!("DELETE FROM {history} WHERE migration_id = $1 AND name = $2");
    for (id, name) in target.retired {
        let removed = transaction
            .execute(&retire, &[id, name])
            .await
            .map_err(|e| driver_error("migrate: retire", e))?;
        if removed > 0 {
            tracing::info!(history, id, name, "removed a history row of an earlier version");
        }
    }
    let latest_sql =
        format!("SELECT migration_id FROM {history} ORDER BY migration_id DESC LIMIT 1");
    let latest = transaction
        .query_opt(&latest_sql, &[])
        .await
        .map_err(|e| driver_error("migrate: latest", e))?
        .map(|row| row.try_get::<_, i32>(0))
        .transpose()
        .map_err(column_error)?
        .unwrap_or(0);
    let pending: Vec<&Migration> =
        target.migrations.iter().filter(|migration| migration.id > latest).collect();
    let insert = format!("INSERT INTO {history} (migration_id, name) VALUES ($1, $2)");
    for migration in &pending {
        transaction
            .execute(&insert, &[&migration.id, &migration.name])
            .await
            .map_err(|e| driver_error("migrate: record", e))?;
    }
    for migration in &pending {
        tracing::debug!(id = migration.id, name = migration.name, "running migration");
        for statement in &migration.statements {
            transaction.batch_execute(statement).await.map_err(|e| {
                driver_error(&format!("migration {:04}_{}", migration.id, migration.name), e)
            })?;
        }
    }
    for table in target.extra_tables {
        // Looked up first, as the indexes below are, so that a migration of tables that have
        // it sends no DDL at all.
        let exists: bool = transaction
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.name])
            .await
            .map_err(|e| driver_error("migrate: look up a table", e))?
            .try_get(0)
            .map_err(column_error)?;
        if !exists {
            tracing::debug!(table = table.name, "creating a table of ours");
            transaction
                .batch_execute(&table.create)
                .await
                .map_err(|e| driver_error(&format!("migrate: table {}", table.name), e))?;
        }
    }
    for index in target.extra_indexes {
        // Looked up first: `CREATE INDEX IF NOT EXISTS` locks the table against writes even
        // when the index exists.
        let exists: bool = transaction
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&index.name])
            .await
            .map_err(|e| driver_error("migrate: look up an index", e))?
            .try_get(0)
            .map_err(column_error)?;
        if !exists {
            tracing::debug!(index = index.name, "creating an index of ours");
            transaction
                .batch_execute(&index.create)
                .await
                .map_err(|e| driver_error(&format!("migrate: index {}", index.name), e))?;
        }
    }
    transaction.commit().await.map_err(|e| driver_error("migrate: COMMIT", e))?;
    Ok(pending.iter().map(|migration| migration.id).collect())
}

/// Marks a user transaction's state (`MessageTransaction::savepoint`); a later one moves it.
// language=SQL
pub(crate) const SAVEPOINT: &str = "SAVEPOINT cluster_savepoint";

/// Returns a user transaction to its savepoint, which stays (`rollback_to_savepoint`).
// language=SQL
pub(crate) const ROLLBACK_TO_SAVEPOINT: &str = "ROLLBACK TO SAVEPOINT cluster_savepoint";
