//! The connection worker: one OS thread per SQLite connection, fed by a bounded channel of a
//! closed [`Command`] enum, each command carrying a oneshot reply (the
//! shape of sqlx-sqlite's `worker.rs`).
//!
//! `rusqlite` blocks, and a blocking call on the tokio executor stalls every task of that
//! thread; `spawn_blocking` per query would pay a thread hand-off per statement and gives no
//! place to batch. A dedicated thread owns the connection, runs commands in arrival order, and is
//! where group commit happens: queued saves are drained into one transaction.
//!
//! Failure turns into errors, never hangs: if the thread dies (a panic in a user statement, or
//! [`Worker::shutdown`]) its receiver is dropped, queued commands and their reply senders with
//! it, so every waiting and future caller gets [`StorageErrorKind::Unavailable`].

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use cluster_core::error::{StorageError, StorageErrorKind};
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use super::checkpointer::{self, Checkpointer};
use super::lock_ops::{self, LockOp};
use super::message_ops::{self, MessageOp, TransactionOp, Write};
use super::options::SqliteOptions;
use super::queries::{self, MigrationSet, Statements};
use super::queue_ops::{self, QueueOp};
use super::runner_ops::{self, RunnerOp};
use super::state::{Responder, TransactionState, WorkerState, classify};

/// Everything a worker does. Closed: a worker is a state machine over these, not a closure
/// runner (only [`TransactionOp::Call`] carries a user's statement, inside its transaction).
pub(super) enum Command {
    /// A message save; consecutive queued saves share one transaction (group commit).
    Write(Box<Write>),
    /// Any other message storage operation.
    Message(MessageOp),
    /// A runner registry operation.
    Runner(RunnerOp),
    /// A shard lock lease operation.
    Lock(LockOp),
    /// A persisted queue operation.
    Queue(QueueOp),
    /// A step of a user transaction (transaction workers only).
    Transaction(TransactionOp),
    /// Bring a migration history up to date; replies with the ids that ran.
    Migrate { set: MigrationSet, reply: Responder<Vec<i64>> },
    /// Close the connection and stop; replies once the connection is closed.
    Shutdown { reply: oneshot::Sender<()> },
}

/// A handle on a worker thread: cheap to clone; the thread stops when the last handle is
/// dropped (after finishing the commands already queued) or on [`Worker::shutdown`].
#[derive(Clone)]
pub(super) struct Worker {
    sender: mpsc::Sender<Command>,
    name: Arc<str>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.name)
            .field("closed", &self.sender.is_closed())
            .finish()
    }
}

impl Worker {
    /// Opens a connection to `path` on a new thread named `cluster-sqlite-<role>` and waits
    /// until it is ready (WAL mode, busy timeout, `synchronous` set).
    ///
    /// The thread's `JoinHandle` is not kept: joining would block the executor.
    /// [`Worker::shutdown`] awaits the thread's own acknowledgement that the connection is
    /// closed instead.
    pub(super) async fn spawn(
        path: &Path,
        options: &SqliteOptions,
        role: &str,
    ) -> Result<Worker, StorageError> {
        Worker::spawn_with(path, options, role, false).await
    }

    /// [`Worker::spawn`] for the message worker, whose database gets a background checkpointer
    /// unless [`SqliteOptions::checkpoint_interval`] is `None`.
    pub(super) async fn spawn_writer(
        path: &Path,
        options: &SqliteOptions,
    ) -> Result<Worker, StorageError> {
        Worker::spawn_with(path, options, "messages", true).await
    }

    async fn spawn_with(
        path: &Path,
        options: &SqliteOptions,
        role: &str,
        writer: bool,
    ) -> Result<Worker, StorageError> {
        let name: Arc<str> = Arc::from(format!("cluster-sqlite-{role}"));
        let (sender, receiver) = mpsc::channel(options.command_queue_len_max.get());
        let (ready_sender, ready) = oneshot::channel();
        let path = path.to_path_buf();
        let path_for_log = path.display().to_string();
        let thread_options = options.clone();
        std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || match open(&path, &thread_options, writer) {
                Ok(state) => {
                    if ready_sender.send(Ok(())).is_ok() {
                        run(state, receiver);
                    }
                }
                Err(error) => {
                    let _ = ready_sender.send(Err(classify("open", error)));
                }
            })
            .map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::Unavailable,
                    "cannot start a SQLite worker thread",
                    error,
                )
            })?;
        ready.await.map_err(|_| worker_gone("open"))??;
        tracing::debug!(worker = %name, path = %path_for_log, "sqlite worker started");
        Ok(Worker { sender, name })
    }

    /// Sends the command `make` builds and waits for its result.
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped after the command was queued, the command still runs; only its
    /// result is lost.
    pub(super) async fn call<T>(
        &self,
        operation: &'static str,
        make: impl FnOnce(Responder<T>) -> Command,
    ) -> Result<T, StorageError> {
        let (reply, result) = oneshot::channel();
        self.sender.send(make(reply)).await.map_err(|_| worker_gone(operation))?;
        result.await.map_err(|_| worker_gone(operation))?
    }

    /// Queues `command` without waiting; `false` if the channel is full or the worker is gone.
    pub(super) fn try_send(&self, command: Command) -> bool {
        self.sender.try_send(command).is_ok()
    }

    /// Asks the worker to close its connection and stop, and waits until it has (commands
    /// queued before are run first; later ones fail as unavailable).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the worker stops whether or not the future is awaited to the end.
    pub(super) async fn shutdown(&self) {
        let (reply, closed) = oneshot::channel();
        if self.sender.send(Command::Shutdown { reply }).await.is_ok() {
            let _ = closed.await;
        }
    }
}

/// Opens and configures a connection; the message `writer`'s with its checkpointer.
fn open(path: &Path, options: &SqliteOptions, writer: bool) -> rusqlite::Result<WorkerState> {
    let connection = Connection::open(path)?;
    connection.busy_timeout(options.busy_timeout)?;
    let journal_mode: String =
        connection.pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))?;
    if !journal_mode.eq_ignore_ascii_case("wal") {
        // An in-memory database answers `memory`; anything else on a file is worth a word.
        tracing::warn!(%journal_mode, path = %path.display(), "sqlite did not switch to WAL mode");
    }
    connection.pragma_update(None, "synchronous", options.synchronous.pragma_value())?;
    connection.set_prepared_statement_cache_capacity(64);
    let checkpointer = match options.checkpoint_interval {
        Some(interval) if writer => {
            let checkpointer = Checkpointer::spawn(path, options, interval)?;
            connection.pragma_update(
                None,
                "wal_autocheckpoint",
                checkpointer::WRITER_AUTOCHECKPOINT_PAGES,
            )?;
            Some(checkpointer)
        }
        _ => None,
    };
    let expiration_seconds =
        i64::try_from(options.storage.expiration_seconds()).unwrap_or(i64::MAX);
    Ok(WorkerState {
        connection,
        statements: Statements::new(&options.storage.prefix),
        expiration_seconds,
        expiration_modifier: format!("-{expiration_seconds} seconds"),
        group_commit_len_max: options.group_commit_len_max.get(),
        transaction: TransactionState::Idle,
        checkpointer,
    })
}

/// The worker loop: runs commands in arrival order until every handle is dropped or a
/// shutdown arrives.
fn run(mut state: WorkerState, mut receiver: mpsc::Receiver<Command>) {
    let mut pending: Option<Command> = None;
    loop {
        let command = match pending.take() {
            Some(command) => command,
            None => match receiver.blocking_recv() {
                Some(command) => command,
                None => break,
            },
        };
        match command {
            Command::Write(save) => {
                let (batch, reads) = drain_batch(&state, *save, &mut receiver, &mut pending);
                for read in reads {
                    message_ops::run_operation(&state, read);
                }
                message_ops::run_writes(&state, batch);
                if let Some(checkpointer) = &state.checkpointer {
                    checkpointer.nudge();
                }
            }
            Command::Message(operation) => message_ops::run_operation(&state, operation),
            Command::Runner(operation) => runner_ops::run_operation(&state, operation),
            Command::Lock(operation) => lock_ops::run_operation(&state, operation),
            Command::Queue(operation) => queue_ops::run_operation(&state, operation),
            Command::Transaction(operation) => {
                message_ops::run_transaction_operation(&mut state, operation);
            }
            Command::Migrate { set, reply } => {
                let result = queries::migrate(&state.connection, &state.statements.prefix, set)
                    .map_err(|error| classify("migrate", error));
                tracing::debug!(?set, ?result, "sqlite migrations");
                let _ = reply.send(result);
            }
            Command::Shutdown { reply } => {
                // Its connection closes first, so the writer's is the last one (which
                // checkpoints what is left and removes the log).
                drop(state.checkpointer.take());
                queries::rollback(&state.connection);
                if let Err((_, error)) = state.connection.close() {
                    tracing::warn!(%error, "closing a sqlite connection failed");
                }
                drop(receiver);
                let _ = reply.send(());
                return;
            }
        }
    }
    queries::rollback(&state.connection);
}

/// Takes the saves queued behind `first` into one group commit, up to the group's limit.
///
/// Reads queued among them are taken too and returned apart, to run before the batch: a read
/// that ended the batch would cut the queue into groups of a few saves, each paying its own
/// commit (a workflow activation's lookup of a stored interrupt, one per execution among its
/// eight saves, kept W4's groups at about ten saves with 128 executions in flight). The reads
/// and the saves were all in flight together, so either order is one their callers could have
/// seen. Any other command ends the batch and waits in `pending`, in its place.
fn drain_batch(
    state: &WorkerState,
    first: Write,
    receiver: &mut mpsc::Receiver<Command>,
    pending: &mut Option<Command>,
) -> (Vec<Write>, Vec<MessageOp>) {
    let mut batch = vec![first];
    let mut reads = Vec::new();
    while batch.len() < state.group_commit_len_max {
        match receiver.try_recv() {
            Ok(Command::Write(save)) => batch.push(*save),
            Ok(Command::Message(op))
                if op.is_read() && reads.len() < state.group_commit_len_max =>
            {
                reads.push(op);
            }
            Ok(other) => {
                *pending = Some(other);
                break;
            }
            Err(_) => break,
        }
    }
    (batch, reads)
}

/// The error of a caller whose worker is gone.
pub(super) fn worker_gone(operation: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::Unavailable,
        format!("sqlite {operation}: the connection worker has stopped"),
    )
}
