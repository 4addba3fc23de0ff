//! The background checkpointer of the message worker's database.
//!
//! In WAL mode every commit appends the pages it changed to the write-ahead log, and a
//! checkpoint copies them back into the database file (and fsyncs it). SQLite runs that
//! checkpoint on the committing connection once the log passes 1,000 pages, so the message
//! worker, the one thread every save goes through, spent about a seventh of its time copying
//! pages instead of committing (measured with `perf` on the W2 benchmark, docs/performance.md).
//!
//! Here a second connection on a thread of its own runs passive checkpoints (they never block
//! the writer, nor wait for it) at most once per interval after the writer signals a commit,
//! and the writer's own automatic checkpoint is moved out to [`WRITER_AUTOCHECKPOINT_PAGES`],
//! where it only bounds the log if this thread falls behind.

use std::path::Path;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

use super::options::SqliteOptions;

/// The writer's automatic checkpoint threshold while a checkpointer runs (SQLite's default is
/// 1,000 pages): the log stays bounded even if the checkpointer cannot keep up.
pub(super) const WRITER_AUTOCHECKPOINT_PAGES: u32 = 10_000;

/// The handle the writer keeps: nudges the checkpointer after commits; stops and joins it when
/// dropped.
pub(super) struct Checkpointer {
    nudges: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Opens the checkpointer's connection to `path` and starts its thread, which checkpoints
    /// at most once per `interval`.
    pub(super) fn spawn(
        path: &Path,
        options: &SqliteOptions,
        interval: Duration,
    ) -> rusqlite::Result<Checkpointer> {
        let connection = Connection::open(path)?;
        // A passive checkpoint never waits for a lock; the timeout only covers opening.
        connection.busy_timeout(options.busy_timeout)?;
        connection.pragma_update(None, "synchronous", options.synchronous.pragma_value())?;
        // One pending nudge is enough: nudges while a checkpoint runs collapse into it.
        let (nudges, received) = sync_channel(1);
        let thread = std::thread::Builder::new()
            .name("cluster-sqlite-checkpoint".to_owned())
            .spawn(move || run(&connection, &received, interval))
            .map_err(|error| {
                rusqlite::Error::SqliteFailure(
                    rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_CANTOPEN),
                    Some(format!("cannot start the checkpoint thread: {error}")),
                )
            })?;
        Ok(Checkpointer { nudges: Some(nudges), thread: Some(thread) })
    }

    /// Tells the checkpointer that the log grew; never blocks.
    pub(super) fn nudge(&self) {
        if let Some(nudges) = &self.nudges {
            let _ = nudges.try_send(());
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        // Disconnecting ends the thread after its current checkpoint, if any; joining means its
        // connection is closed when the writer reports itself closed.
        self.nudges = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Checkpoints after each nudge, resting `interval` between checkpoints; returns when the
/// writer is gone.
fn run(connection: &Connection, nudges: &Receiver<()>, interval: Duration) {
    let mut pending = false;
    loop {
        if !pending && nudges.recv().is_err() {
            return;
        }
        pending = false;
        checkpoint(connection);
        // Rest, remembering a nudge that comes meanwhile (one at the very end stays in the
        // channel for the next `recv`); leave at once when the writer goes.
        // A configured interval may be past what an instant holds: capped, it is never.
        let now = tokio::time::Instant::now();
        let rest_until =
            now.checked_add(interval).unwrap_or_else(|| now + cluster_core::clock::FAR_FUTURE);
        loop {
            let left = rest_until.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match nudges.recv_timeout(left) {
                Ok(()) => pending = true,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

/// One passive checkpoint: copies what it can without waiting for readers or the writer.
fn checkpoint(connection: &Connection) {
    let result = connection.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        Ok((row.get::<_, i64>(0)?, row.get::<_, i64>(1)?, row.get::<_, i64>(2)?))
    });
    match result {
        Ok((busy, log_frames, checkpointed)) => {
            tracing::trace!(busy, log_frames, checkpointed, "sqlite background checkpoint");
        }
        Err(error) => tracing::debug!(%error, "sqlite background checkpoint failed"),
    }
}
