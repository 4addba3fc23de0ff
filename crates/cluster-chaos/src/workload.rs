//! The client-only process of the fault test: persisted deposits (each with its own key) and
//! volatile echoes, sent through the cluster while runners fail, each deposit retried with its
//! key until it is answered.
//!
//! Options come from the environment: `CHAOS_KEY_PREFIX`, `CHAOS_ENTITIES`,
//! `CHAOS_CONCURRENCY`, `CHAOS_SEND_FOR_MS`, `CHAOS_SETTLE_MS`. The summary is one JSON line
//! on standard output.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use cluster_sharding::{CallError, Sharding};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::ledger::{Deposit, Echo, Ledger, LedgerError};

/// What the client sends.
#[derive(Clone, Debug)]
pub struct WorkloadOptions {
    /// Deposit keys are `<key_prefix>-<n>`.
    pub key_prefix: String,
    /// Deposit `n` goes to ledger `ledger-<n mod entities>`.
    pub entities: u64,
    /// Deposits in flight.
    pub concurrency: usize,
    /// How long new deposits are started.
    pub send_for: Duration,
    /// How long after that the last deposits may take to be answered.
    pub settle: Duration,
}

impl WorkloadOptions {
    /// The options from `CHAOS_*` variables, with defaults for unset ones.
    pub fn from_env() -> Result<WorkloadOptions, String> {
        let number = |name: &str, default: u64| -> Result<u64, String> {
            match std::env::var(name) {
                Ok(value) => value.parse().map_err(|_| format!("{name}={value:?} is not a number")),
                Err(_) => Ok(default),
            }
        };
        Ok(WorkloadOptions {
            key_prefix: std::env::var("CHAOS_KEY_PREFIX").unwrap_or_else(|_| "deposit".to_owned()),
            entities: number("CHAOS_ENTITIES", 200)?.max(1),
            concurrency: usize::try_from(number("CHAOS_CONCURRENCY", 32)?.max(1))
                .map_err(|_| "CHAOS_CONCURRENCY is too large".to_owned())?,
            send_for: Duration::from_millis(number("CHAOS_SEND_FOR_MS", 20_000)?),
            settle: Duration::from_millis(number("CHAOS_SETTLE_MS", 60_000)?),
        })
    }
}

/// The ledger entity id of deposit `n`.
pub fn ledger_of(n: u64, entities: u64) -> String {
    format!("ledger-{}", n % entities.max(1))
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
    /// Deposits never answered before the settle deadline.
    pub unanswered: u64,
    /// Echoes sent and answered correctly.
    pub echoes_ok: u64,
    /// Echoes answered with another number (a bug).
    pub echoes_wrong: u64,
    /// Errors seen by kind (retried deposits and failed echoes).
    pub errors: BTreeMap<String, u64>,
    /// The longest a deposit took from its first send to its answer, retries included.
    pub max_deposit_latency_ms: u64,
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

#[derive(Default)]
struct Tally {
    summary: Summary,
}

fn record(tally: &Mutex<Tally>, change: impl FnOnce(&mut Summary)) {
    change(&mut tally.lock().unwrap_or_else(PoisonError::into_inner).summary);
}

/// Runs the workload on `client` (a client-only runtime) and returns what it saw.
///
/// # Cancel safety
///
/// Not cancel safe: dropped, the deposits in flight stay stored for the runners.
pub async fn run(client: &Sharding, options: &WorkloadOptions) -> Summary {
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let stop_sending = started + options.send_for;
    let give_up = stop_sending + options.settle;
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..options.concurrency {
        let (client, tally, next, options) =
            (client.clone(), Arc::clone(&tally), Arc::clone(&next), options.clone());
        workers.spawn(async move {
            while Instant::now() < stop_sending {
                let n = next.fetch_add(1, Ordering::SeqCst);
                deposit(&client, &options, n, give_up, &tally).await;
            }
        });
    }
    let echoes = {
        let (client, tally, entities) = (client.clone(), Arc::clone(&tally), options.entities);
        tokio::spawn(async move { echo_until(&client, entities, stop_sending, &tally).await })
    };
    while workers.join_next().await.is_some() {}
    let _ = echoes.await;
    let mut summary = tally.lock().unwrap_or_else(PoisonError::into_inner).summary.clone();
    // Every started deposit ends answered, failed or unanswered.
    summary.sent = next.load(Ordering::SeqCst);
    summary
}

async fn deposit(
    client: &Sharding,
    options: &WorkloadOptions,
    n: u64,
    give_up: Instant,
    tally: &Mutex<Tally>,
) {
    let ledger = client.client::<Ledger>(ledger_of(n, options.entities));
    let key = format!("{}-{n}", options.key_prefix);
    let first = Instant::now();
    loop {
        let left = give_up.saturating_duration_since(Instant::now());
        if left.is_zero() {
            record(tally, |summary| summary.unanswered += 1);
            return;
        }
        match tokio::time::timeout(left, ledger.send(Deposit { key: key.clone() })).await {
            Ok(Ok(_)) => {
                let latency = u64::try_from(first.elapsed().as_millis()).unwrap_or(u64::MAX);
                record(tally, |summary| {
                    summary.answered += 1;
                    summary.max_deposit_latency_ms = summary.max_deposit_latency_ms.max(latency);
                });
                return;
            }
            Ok(Err(CallError::Failed(error))) => {
                record(tally, |summary| {
                    summary.failed += 1;
                    *summary.errors.entry(format!("failed: {}", error.reason)).or_default() += 1;
                });
                return;
            }
            Ok(Err(error)) => {
                let kind = error_kind(&error);
                record(tally, |summary| *summary.errors.entry(kind).or_default() += 1);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) => {
                record(tally, |summary| summary.unanswered += 1);
                return;
            }
        }
    }
}

async fn echo_until(client: &Sharding, entities: u64, until: Instant, tally: &Mutex<Tally>) {
    let mut n = 0_u64;
    while Instant::now() < until {
        n += 1;
        let ledger = client.client::<Ledger>(ledger_of(n.wrapping_mul(7919), entities));
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
