//! The client-only process of the fault test: persisted deposits (each with its own key) and
//! volatile echoes, sent through the cluster while runners fail, each deposit retried with its
//! key until it is answered.
//!
//! Deposits go to their ledgers in bursts (`CHAOS_BURST` consecutive deposits to one ledger),
//! and the deposits of one ledger are *stored* one after the other: deposit `n` is saved
//! (`discard`, which returns once the request is stored) only after the ledger's previous
//! deposit was, and only then awaited (`send` with the same key finds the stored request and
//! waits for its reply). So each ledger's storage order is the order of its deposits and is
//! well defined across processes (no two saves to one ledger race for their rowids), while
//! several of its deposits wait for their answers at once: the order check of
//! [`crate::runs::check_order`] is exact. The summary counts the deposits stored while an
//! earlier one to the same ledger was still unanswered (`queued_behind`).
//!
//! A deposit is sent (stored, then awaited, both retried with its key) for at most
//! `CHAOS_ANSWER_WITHIN_MS` from its first attempt to store it, if that is set; past it, the
//! deposit counts as unanswered and is never sent again. With message retention on, keep it
//! well below the retention: once retention deleted an answered request, the same key would
//! store and run the deposit again.
//!
//! Options come from the environment: `CHAOS_KEY_PREFIX`, `CHAOS_ENTITIES`, `CHAOS_BURST`,
//! `CHAOS_CONCURRENCY`, `CHAOS_SEND_FOR_MS`, `CHAOS_SETTLE_MS`, `CHAOS_ANSWER_WITHIN_MS`. The
//! summary is one JSON line on standard output.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::sync::lock;

use cluster_sharding::{CallError, Sharding};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ledger::{Deposit, Echo, Ledger, LedgerError};

/// What the client sends.
#[derive(Clone, Debug)]
pub struct WorkloadOptions {
    /// Deposit keys are `<key_prefix>-<n>`.
    pub key_prefix: String,
    /// Deposit `n` goes to ledger `ledger-<(n / burst) mod entities>` (see [`ledger_of`]).
    pub entities: u64,
    /// Consecutive deposits to one ledger.
    pub burst: u64,
    /// Deposits in flight.
    pub concurrency: usize,
    /// How long new deposits are started.
    pub send_for: Duration,
    /// How long after that the last deposits may take to be answered.
    pub settle: Duration,
    /// How long after its first attempt to store it a deposit may still be sent (stored or
    /// awaited) with its key; `None`: until the settle deadline.
    pub answer_within: Option<Duration>,
}

impl WorkloadOptions {
    /// The options from `CHAOS_*` variables, with defaults for unset ones.
    pub fn from_env() -> Result<WorkloadOptions, String> {
        let optional = |name: &str| -> Result<Option<u64>, String> {
            match std::env::var(name) {
                Ok(value) => {
                    value.parse().map(Some).map_err(|_| format!("{name}={value:?} is not a number"))
                }
                Err(_) => Ok(None),
            }
        };
        let number = |name: &str, default: u64| Ok::<_, String>(optional(name)?.unwrap_or(default));
        Ok(WorkloadOptions {
            key_prefix: std::env::var("CHAOS_KEY_PREFIX").unwrap_or_else(|_| "deposit".to_owned()),
            entities: match number("CHAOS_ENTITIES", 200)? {
                entities @ 1..=ENTITIES_MAX => entities,
                other => {
                    return Err(format!("CHAOS_ENTITIES={other} is not in 1..={ENTITIES_MAX}"));
                }
            },
            burst: number("CHAOS_BURST", 1)?.max(1),
            concurrency: usize::try_from(number("CHAOS_CONCURRENCY", 32)?.max(1))
                .map_err(|_| "CHAOS_CONCURRENCY is too large".to_owned())?,
            send_for: Duration::from_millis(number("CHAOS_SEND_FOR_MS", 20_000)?),
            settle: Duration::from_millis(number("CHAOS_SETTLE_MS", 60_000)?),
            answer_within: optional("CHAOS_ANSWER_WITHIN_MS")?.map(Duration::from_millis),
        })
    }
}

/// The most ledgers a workload spreads its deposits over.
pub const ENTITIES_MAX: u64 = 100_000;

/// The ledger entity id of deposit `n`: bursts of `burst` consecutive deposits go to one ledger,
/// the bursts to the `entities` ledgers in turn.
pub fn ledger_of(n: u64, entities: u64, burst: u64) -> String {
    format!("ledger-{}", position(n, entities, burst).0)
}

/// Deposit `n`'s ledger (its index) and how many deposits to that ledger come before it.
fn position(n: u64, entities: u64, burst: u64) -> (u64, u64) {
    let (entities, burst) = (entities.max(1), burst.max(1));
    let block = n / burst;
    (block % entities, block / entities * burst + n % burst)
}

/// What the client saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Summary {
    /// Deposits started: keys `<prefix>-0` to `<prefix>-<sent - 1>`.
    pub sent: u64,
    /// Deposits answered with success.
    pub answered: u64,
    /// Deposits answered with a typed failure (a bug: deposits cannot fail).
    pub failed: u64,
    /// Deposits never answered before the settle deadline (or within `CHAOS_ANSWER_WITHIN_MS`
    /// of their first attempt to store them).
    pub unanswered: u64,
    /// Echoes sent and answered correctly.
    pub echoes_ok: u64,
    /// Echoes answered with another number (a bug).
    pub echoes_wrong: u64,
    /// Errors seen by kind (retried deposits and failed echoes).
    pub errors: BTreeMap<String, u64>,
    /// The longest a deposit took from its first send to its answer, retries included.
    pub max_deposit_latency_ms: u64,
    /// The median of the answered deposits' latencies (as the maximum's), in milliseconds.
    #[serde(default)]
    pub p50_deposit_latency_ms: u64,
    /// The 99th percentile of the same latencies, in milliseconds.
    #[serde(default)]
    pub p99_deposit_latency_ms: u64,
    /// Deposits stored while an earlier deposit to the same ledger was not answered yet.
    pub queued_behind: u64,
}

/// The kind of a call error, for the summary.
pub fn error_kind(error: &CallError<LedgerError>) -> String {
    match error {
        CallError::Failed(_) => "failed".to_owned(),
        CallError::Defect(_) => "defect".to_owned(),
        CallError::Interrupted => "interrupted".to_owned(),
        CallError::Cluster(error) => {
            let debug = format!("{error:?}");
            debug.split([' ', '(', '{']).next().unwrap_or("cluster").to_owned()
        }
    }
}

/// The most deposit latencies kept for the percentiles (past it, the later ones are left out).
const LATENCIES_MAX: usize = 1 << 20;

#[derive(Default)]
struct Tally {
    summary: Summary,
    /// The answered deposits' latencies, in milliseconds.
    latencies: Vec<u64>,
}

/// The `per_mille` quantile (500 for the median) of `sorted`, by the nearest rank; 0 when it
/// is empty.
fn percentile(sorted: &[u64], per_mille: usize) -> u64 {
    let Some(last) = sorted.len().checked_sub(1) else { return 0 };
    let rank = (sorted.len().saturating_mul(per_mille)).div_ceil(1000);
    sorted[rank.saturating_sub(1).min(last)]
}

/// Per ledger: how many of its deposits are stored (its next deposit waits for that count),
/// and which of them are not answered yet.
struct Ledgers {
    stored: Vec<watch::Sender<u64>>,
    unanswered: Mutex<Vec<BTreeSet<u64>>>,
}

impl Ledgers {
    fn new(entities: u64) -> Ledgers {
        let count = usize::try_from(entities).unwrap_or(0);
        Ledgers {
            stored: (0..count).map(|_| watch::Sender::new(0)).collect(),
            unanswered: Mutex::new(vec![BTreeSet::new(); count]),
        }
    }

    /// The `index`-th deposit of ledger `entity` is stored; whether an earlier one of that ledger
    /// is still unanswered.
    fn stored(&self, entity: usize, index: u64) -> bool {
        let behind = {
            let mut unanswered = lock(&self.unanswered);
            let Some(waiting) = unanswered.get_mut(entity) else { return false };
            let behind = !waiting.is_empty();
            waiting.insert(index);
            behind
        };
        if let Some(stored) = self.stored.get(entity) {
            stored.send_modify(|count| *count = (*count).max(index + 1));
        }
        behind
    }

    /// The `index`-th deposit of ledger `entity` is answered (or given up).
    fn settled(&self, entity: usize, index: u64) {
        let mut unanswered = lock(&self.unanswered);
        if let Some(waiting) = unanswered.get_mut(entity) {
            waiting.remove(&index);
        }
    }
}

fn record(tally: &Mutex<Tally>, change: impl FnOnce(&mut Summary)) {
    change(&mut lock(tally).summary);
}

/// Runs the workload on `client` (a client-only runtime) and returns what it saw.
///
/// # Cancel safety
///
/// Not cancel safe: dropped, the deposits in flight stay stored for the runners.
pub async fn run(client: &Sharding, options: &WorkloadOptions) -> Summary {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let ledgers = Arc::new(Ledgers::new(options.entities));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stop_sending = started + options.send_for;
    let give_up = stop_sending + options.settle;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..options.concurrency {
        let (client, tally, next, options) =
            (client.clone(), Arc::clone(&tally), Arc::clone(&next), options.clone());
        let ledgers = Arc::clone(&ledgers);
        workers.spawn(async move {
            while Instant::now() < stop_sending {
                let n = next.fetch_add(1, Ordering::SeqCst);
                let deposit = Deposited { n, give_up, tally: &tally, ledgers: &ledgers };
                deposit.run(&client, &options).await;
            }
        });
    }
    let echoes = {
        let (client, tally, entities) = (client.clone(), Arc::clone(&tally), options.entities);
        tokio::spawn(async move { echo_until(&client, entities, stop_sending, &tally).await })
    };
    while workers.join_next().await.is_some() {}
    let _ = echoes.await;
    let (mut summary, mut latencies) = {
        let tally = lock(&tally);
        (tally.summary.clone(), tally.latencies.clone())
    };
    latencies.sort_unstable();
    summary.p50_deposit_latency_ms = percentile(&latencies, 500);
    summary.p99_deposit_latency_ms = percentile(&latencies, 990);
    // Every started deposit ends answered, failed or unanswered.
    summary.sent = next.load(Ordering::SeqCst);
    summary
}

/// One deposit on its way: stored after its ledger's previous one, then awaited.
struct Deposited<'a> {
    n: u64,
    give_up: Instant,
    tally: &'a Mutex<Tally>,
    ledgers: &'a Ledgers,
}

impl Deposited<'_> {
    async fn run(&self, client: &Sharding, options: &WorkloadOptions) {
        let (entity, index) = position(self.n, options.entities, options.burst);
        let entity = usize::try_from(entity).unwrap_or(usize::MAX);
        let ledger = client.client::<Ledger>(ledger_of(self.n, options.entities, options.burst));
        let key = format!("{}-{}", options.key_prefix, self.n);
        let first = Instant::now();
        // The last moment this deposit is sent, set at its first attempt to store it.
        let Some(last_send) = self.store(&ledger, &key, entity, index, options).await else {
            record(self.tally, |summary| summary.unanswered += 1);
            return;
        };
        self.answer(&ledger, &key, first, last_send).await;
        self.ledgers.settled(entity, index);
    }

    /// Waits until the ledger's earlier deposits are stored, then stores this one; returns the
    /// deadline of its sends (the settle deadline, or `answer_within` after the first attempt
    /// to store it, whichever comes first), or `None` if it was not stored before that.
    async fn store(
        &self,
        ledger: &cluster_sharding::EntityClient<Ledger>,
        key: &str,
        entity: usize,
        index: u64,
        options: &WorkloadOptions,
    ) -> Option<Instant> {
        let stored = self.ledgers.stored.get(entity)?;
        let mut stored = stored.subscribe();
        match tokio::time::timeout_at(self.give_up, stored.wait_for(|count| *count >= index)).await
        {
            Ok(Ok(_)) => {}
            Ok(Err(_)) | Err(_) => return None,
        }
        let last_send = options
            .answer_within
            .map_or(self.give_up, |within| self.give_up.min(Instant::now() + within));
        loop {
            let save = ledger.discard(Deposit { key: key.to_owned() });
            match tokio::time::timeout_at(last_send, save).await {
                Ok(Ok(())) => break,
                Ok(Err(error)) => {
                    let kind = format!("store: {}", error_kind(&error));
                    record(self.tally, |summary| *summary.errors.entry(kind).or_default() += 1);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => return None,
            }
        }
        if self.ledgers.stored(entity, index) {
            record(self.tally, |summary| summary.queued_behind += 1);
        }
        Some(last_send)
    }

    /// Waits for the stored deposit's answer (sent again with its key until it comes, and
    /// never after `last_send`).
    async fn answer(
        &self,
        ledger: &cluster_sharding::EntityClient<Ledger>,
        key: &str,
        first: Instant,
        last_send: Instant,
    ) {
        loop {
            let left = last_send.saturating_duration_since(Instant::now());
            if left.is_zero() {
                record(self.tally, |summary| summary.unanswered += 1);
                return;
            }
            match tokio::time::timeout(left, ledger.send(Deposit { key: key.to_owned() })).await {
                Ok(Ok(_)) => {
                    let latency = u64::try_from(first.elapsed().as_millis()).unwrap_or(u64::MAX);
                    let mut tally = lock(self.tally);
                    tally.summary.answered += 1;
                    tally.summary.max_deposit_latency_ms =
                        tally.summary.max_deposit_latency_ms.max(latency);
                    if tally.latencies.len() < LATENCIES_MAX {
                        tally.latencies.push(latency);
                    }
                    return;
                }
                Ok(Err(CallError::Failed(error))) => {
                    record(self.tally, |summary| {
                        summary.failed += 1;
                        *summary.errors.entry(format!("failed: {}", error.reason)).or_default() +=
                            1;
                    });
                    return;
                }
                Ok(Err(error)) => {
                    let kind = error_kind(&error);
                    record(self.tally, |summary| *summary.errors.entry(kind).or_default() += 1);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(_) => {
                    record(self.tally, |summary| summary.unanswered += 1);
                    return;
                }
            }
        }
    }
}

async fn echo_until(client: &Sharding, entities: u64, until: Instant, tally: &Mutex<Tally>) {
    let mut n = 0_u64;
    while Instant::now() < until {
        n += 1;
        let ledger = client.client::<Ledger>(ledger_of(n.wrapping_mul(7919), entities, 1));
        let call = ledger.send(Echo { n });
        match tokio::time::timeout(Duration::from_secs(30), call).await {
            Ok(Ok(answer)) if answer == n => record(tally, |summary| summary.echoes_ok += 1),
            Ok(Ok(_)) => record(tally, |summary| summary.echoes_wrong += 1),
            Ok(Err(error)) => {
                let kind = format!("echo: {}", error_kind(&error));
                record(tally, |summary| *summary.errors.entry(kind).or_default() += 1);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(_) => {
                record(tally, |summary| {
                    *summary.errors.entry("echo: timeout".into()).or_default() += 1
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{ledger_of, position};

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let sorted: Vec<u64> = (1..=100).collect();
        assert_eq!(super::percentile(&sorted, 500), 50);
        assert_eq!(super::percentile(&sorted, 990), 99);
        assert_eq!(super::percentile(&[7], 990), 7);
        assert_eq!(super::percentile(&[], 500), 0);
        assert_eq!(super::percentile(&[1, 2, 3], 500), 2);
    }

    #[test]
    fn bursts_go_to_the_ledgers_in_turn_and_number_each_ledgers_deposits_without_gaps() {
        let positions: Vec<(u64, u64)> = (0..12).map(|n| position(n, 3, 2)).collect();
        let expected = [
            (0, 0),
            (0, 1),
            (1, 0),
            (1, 1),
            (2, 0),
            (2, 1),
            (0, 2),
            (0, 3),
            (1, 2),
            (1, 3),
            (2, 2),
            (2, 3),
        ];
        assert_eq!(positions, expected);
        // Each ledger's deposits are numbered 0, 1, 2, … in the order of `n`: a deposit waits
        // for the one numbered just before it, which always exists and comes earlier.
        let mut next: BTreeMap<u64, u64> = BTreeMap::new();
        for n in 0..1000 {
            let (entity, index) = position(n, 7, 4);
            let expected = next.entry(entity).or_default();
            assert_eq!(index, *expected, "deposit {n}");
            *expected += 1;
        }
        assert_eq!(ledger_of(9, 3, 2), "ledger-1");
        assert_eq!(ledger_of(9, 200, 1), "ledger-9");
    }
}
