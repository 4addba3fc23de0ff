//! Every run of a deposit's handler, committed or not, and the fault test's checks on them.
//!
//! A deposit's audit row (see [`crate::ledger`]) is written in the transaction that stores its
//! reply, so it shows only the run whose reply was committed: a run whose reply was fenced or
//! rolled back, or whose process died first, leaves no audit row. So each run of the
//! [`Deposit`](crate::ledger::Deposit) handler first records itself in `<prefix>_chaos_runs`,
//! outside the request's transaction: an autocommit insert on a small pool of the process's
//! own, with the deposit's key, entity, shard and request id, the runner's name, its process
//! number (1 for the runner's first process, 2 after a restart), the pid and the database's
//! clock. The row's `seq` comes from the table's sequence and orders all runs.
//!
//! The handler goes on only once its row is committed, so a run that had any effect (an audit
//! row, a stored reply) has its row even if its process is killed right after. Recording is
//! bounded ([`RECORD_DEADLINE`], retried within it, idempotent by a per-run token); a run that
//! cannot record itself fails its deposit with a [`RecordError`], which fails the test instead
//! of hiding a run.
//!
//! At the end, [`check_reruns`] attributes every run that was not committed to a fault of its
//! own process, and [`check_order`] compares each ledger's first runs with its storage order.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::{EntityAddress, Snowflake};
use cluster_storage_sql::TablePrefix;
use tokio::time::Instant;

#[cfg(test)]
mod tests;

/// How long a run may take to record itself before its deposit fails.
pub const RECORD_DEADLINE: Duration = Duration::from_secs(10);

/// The pause between two attempts to record a run.
const RECORD_RETRY_PAUSE: Duration = Duration::from_millis(100);

/// The connections of a process's recording pool.
const RECORD_POOL_SIZE: usize = 4;

/// The runs table's name (`<prefix>_chaos_runs`).
pub fn runs_table(prefix: &TablePrefix) -> String {
    prefix.table("chaos_runs")
}

/// The statement that creates the runs table (PostgreSQL).
pub fn create_runs_table_sql(table: &str) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS \"{table}\" (seq BIGSERIAL PRIMARY KEY, \
         token TEXT NOT NULL UNIQUE, key TEXT NOT NULL, entity TEXT NOT NULL, \
         shard TEXT NOT NULL, request_id BIGINT NOT NULL, runner TEXT NOT NULL, \
         address TEXT NOT NULL, process INT NOT NULL, first_process BOOLEAN NOT NULL, \
         pid BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL)"
    )
}

/// The statement that takes a mark of the runs' sequence: a run recorded after it has a
/// larger `seq`, one recorded before it a smaller one.
pub fn mark_sql(table: &str) -> String {
    format!("SELECT nextval(pg_get_serial_sequence('\"{table}\"', 'seq'))")
}

/// Why a run could not record itself, or the recorder could not start.
#[derive(Debug)]
pub enum RecordError {
    /// The recorder's pool could not be built.
    Pool(String),
    /// The request id does not fit a `BIGINT`.
    RequestId(Snowflake),
    /// No attempt succeeded within [`RECORD_DEADLINE`].
    Deadline {
        /// Attempts made.
        attempts: u32,
        /// The error of the last attempt that failed before the deadline, if one did.
        last_error: Option<String>,
    },
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Pool(error) => write!(f, "recording pool: {error}"),
            RecordError::RequestId(id) => write!(f, "request id {id} does not fit a BIGINT"),
            RecordError::Deadline { attempts, last_error } => write!(
                f,
                "not recorded within {RECORD_DEADLINE:?} ({attempts} attempts, last error: {})",
                last_error.as_deref().unwrap_or("none, every attempt was cut off")
            ),
        }
    }
}

impl std::error::Error for RecordError {}

/// Records the runs of this process's handlers (see the module doc).
pub struct RunRecorder {
    pool: deadpool_postgres::Pool,
    insert: String,
    runner: String,
    process: u32,
    pid: u32,
    /// Runs recorded by this process so far, for the runs' tokens.
    count: AtomicU64,
}

impl fmt::Debug for RunRecorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunRecorder")
            .field("runner", &self.runner)
            .field("process", &self.process)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

impl RunRecorder {
    /// A recorder writing to `table` of the PostgreSQL database at `url` for process
    /// `process` (1 for the first) of runner `runner`. Connects lazily.
    pub fn new(
        url: &str,
        table: &str,
        runner: String,
        process: u32,
    ) -> Result<RunRecorder, RecordError> {
        let pool_error =
            |error: cluster_core::error::StorageError| RecordError::Pool(error.to_string());
        let config = cluster_storage_sql::postgres::parse_config(url).map_err(pool_error)?;
        let pool =
            cluster_storage_sql::postgres::pool(config, RECORD_POOL_SIZE).map_err(pool_error)?;
        let insert = format!(
            "INSERT INTO \"{table}\" (token, key, entity, shard, request_id, runner, address, \
             process, first_process, pid, at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, clock_timestamp()) \
             ON CONFLICT (token) DO UPDATE SET token = EXCLUDED.token RETURNING seq"
        );
        let pid = std::process::id();
        Ok(RunRecorder { pool, insert, runner, process, pid, count: AtomicU64::new(0) })
    }

    /// Records one run of `key` on `address` (the runner's `runner_address` is `address_of`)
    /// and returns its `seq`, once the row is committed; tries again after failures until
    /// [`RECORD_DEADLINE`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped call may or may not have recorded the run (the handler it
    /// belongs to has done nothing else yet).
    pub async fn record(
        &self,
        key: &str,
        address: &EntityAddress,
        request_id: Snowflake,
        runner_address: &str,
    ) -> Result<i64, RecordError> {
        let request = request_id.to_i64().ok_or(RecordError::RequestId(request_id))?;
        let n = self.count.fetch_add(1, Ordering::Relaxed);
        let token = format!("{}/{}/{n}", self.runner, self.pid);
        let shard = address.shard_id.to_string();
        let process = i32::try_from(self.process).unwrap_or(i32::MAX);
        let first_process = self.process == 1;
        let pid = i64::from(self.pid);
        let deadline = Instant::now() + RECORD_DEADLINE;
        let mut attempts = 0;
        let mut last_error = None;
        loop {
            attempts += 1;
            let attempt = async {
                let client = self.pool.get().await.map_err(|error| error.to_string())?;
                let row = client
                    .query_one(
                        &self.insert,
                        &[
                            &token,
                            &key,
                            &address.entity_id.as_str(),
                            &shard,
                            &request,
                            &self.runner,
                            &runner_address,
                            &process,
                            &first_process,
                            &pid,
                        ],
                    )
                    .await
                    .map_err(|error| error.to_string())?;
                row.try_get::<_, i64>(0).map_err(|error| error.to_string())
            };
            match tokio::time::timeout_at(deadline, attempt).await {
                Ok(Ok(seq)) => return Ok(seq),
                Ok(Err(error)) => last_error = Some(error),
                Err(_) => return Err(RecordError::Deadline { attempts, last_error }),
            }
            if Instant::now() + RECORD_RETRY_PAUSE >= deadline {
                return Err(RecordError::Deadline { attempts, last_error });
            }
            tokio::time::sleep(RECORD_RETRY_PAUSE).await;
        }
    }
}

/// One recorded run of a deposit's handler.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// Its place in the order of all runs.
    pub seq: i64,
    /// The deposit's key.
    pub key: String,
    /// The ledger's entity id.
    pub entity: String,
    /// The stored request's id.
    pub request_id: i64,
    /// The runner's name (`runner-1`).
    pub runner: String,
    /// The runner's process (1 for its first).
    pub process: u32,
    /// The process's pid.
    pub pid: u32,
}

/// A process of the run: the runner's name, its process number and its pid.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ProcessId {
    /// The runner's name.
    pub runner: String,
    /// 1 for the runner's first process.
    pub process: u32,
    /// The pid.
    pub pid: u32,
}

impl fmt::Display for ProcessId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (process {}, pid {})", self.runner, self.process, self.pid)
    }
}

impl Run {
    fn ran_in(&self, process: &ProcessId) -> bool {
        self.runner == process.runner && self.process == process.process && self.pid == process.pid
    }
}

/// What the orchestrator did to a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL: every run of the process came before it.
    Kill,
    /// SIGSTOP, then SIGCONT. A resumed process may still start a handler of a shard it lost
    /// before it learns so (its reply is fenced): its runs recorded before `runs_until`, a mark
    /// taken a lock expiration after SIGCONT, belong to the freeze.
    Freeze {
        /// The mark after which the process's runs are its own again.
        runs_until: i64,
    },
    /// SIGTERM: a graceful stop, which hands the shards off and must not make anything run
    /// twice.
    Terminate,
    /// The process started and joined: its shards come from the others, gracefully.
    Join,
}

/// A fault injected into one process, with marks of the runs' sequence around it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// What was done.
    pub kind: FaultKind,
    /// To which process.
    pub process: ProcessId,
    /// A mark taken just before the fault.
    pub began: i64,
    /// A mark taken once it was over (after the signal was sent, the process exited, or it
    /// registered).
    pub ended: i64,
}

impl Fault {
    /// How the summary names the fault.
    pub fn label(&self) -> String {
        let what = match self.kind {
            FaultKind::Kill => "SIGKILL",
            FaultKind::Freeze { .. } => "SIGSTOP",
            FaultKind::Terminate => "SIGTERM",
            FaultKind::Join => "join of",
        };
        format!("{what} {} (process {})", self.process.runner, self.process.process)
    }

    /// Whether this fault explains that `run` was not the committed run of its deposit, whose
    /// committed run is `committed` (a `seq`): the run was in this process, the process was
    /// killed or frozen (and the run came before the freeze's end of `runs_until`), and the
    /// deposit was committed only after the fault began.
    pub fn excuses(&self, run: &Run, committed: i64) -> bool {
        if !run.ran_in(&self.process) || committed <= self.began {
            return false;
        }
        match self.kind {
            FaultKind::Kill => true,
            FaultKind::Freeze { runs_until } => run.seq < runs_until,
            FaultKind::Terminate | FaultKind::Join => false,
        }
    }
}

impl Fault {
    /// Whether this freeze explains that `rerun`, in another process, was not committed: the
    /// committed run `committed` started in the frozen process before the freeze began, and
    /// `rerun` started after it began.
    ///
    /// Fencing confirms a shard's lock before a final reply is written, and nothing checks it
    /// again in the write: a freeze between the two lets the resumed runner store its reply
    /// after the new owner took the shard and ran the request again. The database keeps one
    /// reply (the new owner's run waits for the frozen transaction and is rolled back, or its
    /// reply conflicts), so the deposit is answered once, but its handler ran twice without a
    /// crash of the second runner. The summary counts these apart ("late commit after ...");
    /// fencing at write time, checked by the database in the write, will remove them.
    pub fn commits_late(&self, committed: &Run, rerun: &Run) -> bool {
        match self.kind {
            FaultKind::Freeze { .. } => {
                committed.ran_in(&self.process)
                    && committed.seq < self.began
                    && rerun.seq > self.began
                    && !rerun.ran_in(&self.process)
            }
            FaultKind::Kill | FaultKind::Terminate | FaultKind::Join => false,
        }
    }
}

/// What [`check_reruns`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reruns {
    /// Runs recorded.
    pub runs: usize,
    /// Deposits that ran at least once.
    pub deposits: usize,
    /// Runs beyond each deposit's first.
    pub reruns: usize,
    /// Runs not committed and explained by a fault, per fault label.
    pub excused: BTreeMap<String, usize>,
    /// Runs not committed and explained by no fault (each one a violation).
    pub unexcused: usize,
    /// What each violation was (at most [`SHOWN`] of them are kept).
    pub violations: Vec<String>,
}

/// How many violations a check keeps to show.
pub const SHOWN: usize = 20;

/// Checks that every run of a deposit other than its committed one is excused by a fault of
/// its own process ([`Fault::excuses`]). `committed` holds, per deposit key, the `seq`s of the
/// runs whose audit row was committed (one, when all is well).
pub fn check_reruns(
    runs: &[Run],
    committed: &BTreeMap<String, BTreeSet<i64>>,
    faults: &[Fault],
) -> Reruns {
    let mut per_key: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        per_key.entry(run.key.as_str()).or_default().push(run);
    }
    let mut found = Reruns { runs: runs.len(), deposits: per_key.len(), ..Reruns::default() };
    let violation = |found: &mut Reruns, text: String| {
        found.unexcused += 1;
        if found.violations.len() < SHOWN {
            found.violations.push(text);
        }
    };
    let none = BTreeSet::new();
    for (key, mut key_runs) in per_key {
        key_runs.sort_by_key(|run| run.seq);
        found.reruns += key_runs.len() - 1;
        let commits = committed.get(key).unwrap_or(&none);
        let answer = commits.last().copied();
        for run in key_runs.iter().filter(|run| !commits.contains(&run.seq)) {
            let process =
                ProcessId { runner: run.runner.clone(), process: run.process, pid: run.pid };
            let Some(answer) = answer else {
                violation(
                    &mut found,
                    format!("{key}: run #{} in {process}: no run of it was committed", run.seq),
                );
                continue;
            };
            if let Some(fault) = faults.iter().find(|fault| fault.excuses(run, answer)) {
                *found.excused.entry(fault.label()).or_default() += 1;
                continue;
            }
            let committed_run = key_runs.iter().find(|other| other.seq == answer);
            if let Some(fault) = committed_run.and_then(|committed| {
                faults.iter().find(|fault| fault.commits_late(committed, run))
            }) {
                *found
                    .excused
                    .entry(format!("late commit after {}", fault.label()))
                    .or_default() += 1;
                continue;
            }
            let of_process: Vec<String> = faults
                .iter()
                .filter(|fault| fault.process == process)
                .map(|fault| format!("{} at #{}..#{}", fault.label(), fault.began, fault.ended))
                .collect();
            let faults_seen =
                if of_process.is_empty() { "none".to_owned() } else { of_process.join(", ") };
            let committed_in = key_runs
                .iter()
                .find(|other| other.seq == answer)
                .map_or_else(String::new, |other| format!(" in {}", other.runner));
            violation(
                &mut found,
                format!(
                    "{key}: run #{} in {process} was not committed (run #{answer}{committed_in} \
                     was) and no kill or freeze of that process explains it (its faults: \
                     {faults_seen})",
                    run.seq
                ),
            );
        }
    }
    found
}

/// A stored request, as [`check_order`] needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredRequest {
    /// Its place in storage order.
    pub rowid: i64,
    /// Its id (the runs' `request_id`).
    pub id: i64,
    /// Its entity id.
    pub entity: String,
}

/// What [`check_order`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Order {
    /// Ledgers with at least two requests that ran.
    pub entities: usize,
    /// Requests compared with the one stored before them on their ledger.
    pub pairs: usize,
    /// Requests that ran but are no longer stored because retention deleted their deposit.
    pub purged: usize,
    /// Inversions and runs of unknown requests.
    pub violations: Vec<String>,
    /// How many violations there were (only [`SHOWN`] are kept).
    pub violation_count: usize,
}

/// Checks that, on each entity, the requests' first runs come in their storage order (rowid):
/// the runtime delivers the requests of one entity in storage order, and a ledger runs one
/// deposit at a time, so a request's first run comes after the first run of every request
/// stored before it for the same entity. Requests that never ran are left to the other checks.
///
/// A run of a request that is not stored is a violation unless its deposit's key is in
/// `purged`, the deposits that retention deleted whole (audited before the retention window,
/// no request and no reply left: see [`crate::retention`]); such requests are counted, and the
/// requests stored around them are still compared.
pub fn check_order(requests: &[StoredRequest], runs: &[Run], purged: &BTreeSet<String>) -> Order {
    let mut first: BTreeMap<i64, &Run> = BTreeMap::new();
    for run in runs {
        let entry = first.entry(run.request_id).or_insert(run);
        if run.seq < entry.seq {
            *entry = run;
        }
    }
    let mut found = Order::default();
    let violation = |found: &mut Order, text: String| {
        found.violation_count += 1;
        if found.violations.len() < SHOWN {
            found.violations.push(text);
        }
    };
    let known: BTreeSet<i64> = requests.iter().map(|request| request.id).collect();
    for (id, run) in &first {
        if known.contains(id) {
            continue;
        }
        if purged.contains(&run.key) {
            found.purged += 1;
        } else {
            violation(
                &mut found,
                format!("{}: run #{} of request {id}, not stored", run.key, run.seq),
            );
        }
    }
    let mut per_entity: BTreeMap<&str, Vec<&StoredRequest>> = BTreeMap::new();
    for request in requests {
        per_entity.entry(request.entity.as_str()).or_default().push(request);
    }
    for (entity, mut stored) in per_entity {
        stored.sort_by_key(|request| request.rowid);
        let ran: Vec<(&StoredRequest, &Run)> = stored
            .iter()
            .filter_map(|request| first.get(&request.id).map(|run| (*request, *run)))
            .collect();
        if ran.len() < 2 {
            continue;
        }
        found.entities += 1;
        for pair in ran.windows(2) {
            let [(earlier, earlier_run), (later, later_run)] = pair else { continue };
            found.pairs += 1;
            if later_run.seq < earlier_run.seq {
                violation(
                    &mut found,
                    format!(
                        "{entity}: {} (rowid {}) first ran at #{}, before {} (rowid {}, stored \
                         earlier) first ran at #{}",
                        later_run.key,
                        later.rowid,
                        later_run.seq,
                        earlier_run.key,
                        earlier.rowid,
                        earlier_run.seq
                    ),
                );
            }
        }
    }
    found
}
