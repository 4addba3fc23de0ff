//! Durable queues (the reference's `DurableQueue`, `effect/src/workflow/DurableQueue.ts`): a
//! workflow hands an item to a pool of workers and waits for its result, durably.
//!
//! [`DurableQueue::process`] offers the item once per execution and idempotency key, however
//! often the run replays (the item id is the activity key of `DurableQueue/<name>/<key>`), and
//! awaits the deferred `DurableQueue/<name>/<item id>`, whose token travels with the item.
//! A worker ([`WorkflowEngine::register_queue_worker`]) runs each item and completes that
//! deferred with its result, a success or the typed failure (a panic is a defect), which
//! becomes the outcome of `process` in the workflow.
//!
//! On the cluster engine the items live in a persisted queue named `DurableQueue/<name>`
//! ([`QueueStorage`](cluster_core::queue_storage::QueueStorage), the reference's
//! `PersistedQueue`), not in the cluster's mailboxes: only the processes that register the
//! queue's worker take items, whichever runner owns what, and TypeScript and Rust workers can
//! share one queue table. Each item is stored as the reference's element, the JSON object
//! `{"token", "traceId", "spanId", "sampled", "payload"}`. The worker loop (`worker`) claims
//! items up to the worker's concurrency; delivery is at least once:
//!
//! - A claim counts an attempt. An item whose worker died is claimed again once its claim
//!   lapsed ([`QueueOptions::lock_expiration`]); a stopped worker releases its items without
//!   counting the attempt.
//! - When the result cannot be recorded (completing the deferred failed), the item is retried
//!   after a growing delay, until [`QueueOptions::max_attempts`].
//! - After the last attempt, and at once for an element that cannot be decoded, the item is
//!   dead-lettered: it stays in the table as failed, its workflow stays suspended until the item
//!   is requeued out of band, and a replay's offer does not revive it.
//!
//! The in-memory engine keeps its items in memory and runs each once.

use std::future::Future;
use std::marker::PhantomData;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::DecodeError;
use cluster_core::envelope::{Exit, RawJson};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::context::{DurableDeferred, WorkflowContext};
use crate::engine::{ErasedWorker, QueueWorker, WorkflowEngine, WorkflowError, encode_result};
use crate::id::{Token, activity_idempotency_key, hash_digest};

mod worker;

pub(crate) use worker::QueueWorkers;

/// A queue definition: its name, payload, result and error types, and the idempotency key of
/// a payload (one item per execution and key).
pub struct DurableQueue<P, S, E> {
    name: &'static str,
    key: fn(&P) -> String,
    types: PhantomData<fn(P) -> (S, E)>,
}

impl<P, S, E> Clone for DurableQueue<P, S, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P, S, E> Copy for DurableQueue<P, S, E> {}

impl<P, S, E> std::fmt::Debug for DurableQueue<P, S, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DurableQueue").field("name", &self.name).finish_non_exhaustive()
    }
}

impl<P, S, E> DurableQueue<P, S, E>
where
    P: Serialize + DeserializeOwned + Send + 'static,
    S: Serialize + DeserializeOwned + Send + 'static,
    E: Serialize + DeserializeOwned + Send + 'static,
{
    /// The queue `name`, whose items are keyed by `key`.
    pub const fn new(name: &'static str, key: fn(&P) -> String) -> DurableQueue<P, S, E> {
        DurableQueue { name, key, types: PhantomData }
    }

    /// The queue's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// Offers `payload` to the queue's workers (once per execution and key, whatever the
    /// replays) and waits for its result; the run suspends until a worker completes it.
    pub async fn process(&self, ctx: &WorkflowContext, payload: P) -> Result<S, E> {
        let key = (self.key)(&payload);
        let item_id = activity_idempotency_key(
            ctx.execution_id(),
            &format!("{}/{key}", persisted_name(self.name)),
            None,
        );
        let deferred =
            DurableDeferred::<S, E>::reserved(format!("{}/{item_id}", persisted_name(self.name)));
        let token = ctx.token(&deferred);
        ctx.offer(self.name, &item_id, token, &payload).await;
        ctx.await_deferred(&deferred).await
    }
}

/// The persisted queue of durable queue `name`: `DurableQueue/<name>`.
pub(crate) fn persisted_name(name: &str) -> String {
    format!("DurableQueue/{name}")
}

/// How the cluster engine's queue workers take and settle items. The defaults are the
/// reference's (`PersistedQueue.ts`: the SQL store's `pollInterval`, `lockRefreshInterval` and
/// `lockExpiration`, the factory's `maxAttempts` and retry schedule); every process working on
/// one queue should use the same lock expiration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueOptions {
    /// How often a worker with room for more items looks for them, when no offer on this engine
    /// woke it sooner (1 second).
    pub poll_interval: Duration,
    /// How often a worker renews the claims of the items it runs, and fails the items whose
    /// last attempt's claim lapsed (30 seconds).
    pub lock_refresh_interval: Duration,
    /// How long a claim hides its item without renewal (2 minutes): after it, the item of a
    /// worker that died is claimed again. Counted in whole seconds by the SQL stores.
    pub lock_expiration: Duration,
    /// The attempts an item gets before it is dead-lettered (10).
    pub max_attempts: NonZeroU32,
    /// The delay before the first retry of an item whose result could not be recorded (1
    /// second); it doubles with every attempt, up to [`retry_delay_max`](Self::retry_delay_max).
    pub retry_delay: Duration,
    /// The longest retry delay (5 minutes).
    pub retry_delay_max: Duration,
}

impl Default for QueueOptions {
    fn default() -> QueueOptions {
        QueueOptions {
            poll_interval: Duration::from_secs(1),
            lock_refresh_interval: Duration::from_secs(30),
            lock_expiration: Duration::from_secs(120),
            max_attempts: NonZeroU32::new(10).unwrap_or(NonZeroU32::MIN),
            retry_delay: Duration::from_secs(1),
            retry_delay_max: Duration::from_secs(300),
        }
    }
}

impl QueueOptions {
    /// The delay before an item that failed its `attempts`-th attempt is claimed again:
    /// `retry_delay × 2^(attempts - 1)`, at most `retry_delay_max` (the reference's
    /// exponential schedule replayed up to the persisted attempt count).
    pub fn retry_delay_after(&self, attempts: u32) -> Duration {
        let factor = 1u32.checked_shl(attempts.saturating_sub(1)).unwrap_or(u32::MAX);
        self.retry_delay.saturating_mul(factor).min(self.retry_delay_max)
    }
}

/// A queue item as stored: the reference's element (`DurableQueue.ts`, `getQueueSchema`), in
/// its field order. There are no spans here, so the trace fields are stable ids derived from
/// the item id, not sampled.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Element {
    pub(crate) token: String,
    #[serde(default)]
    pub(crate) trace_id: String,
    #[serde(default)]
    pub(crate) span_id: String,
    #[serde(default)]
    pub(crate) sampled: bool,
    pub(crate) payload: Box<RawValue>,
}

impl Element {
    /// The element of item `item_id`.
    pub(crate) fn new(
        item_id: &str,
        token: &Token,
        payload: &RawJson,
    ) -> Result<Element, WorkflowError> {
        let payload =
            RawValue::from_string(payload.json_or_null().to_owned()).map_err(|error| {
                WorkflowError::Malformed(DecodeError::new("queue item payload", error.to_string()))
            })?;
        let span = hash_digest(&format!("span:{item_id}"));
        Ok(Element {
            token: token.encode(),
            trace_id: hash_digest(&format!("trace:{item_id}")),
            span_id: span[..16].to_owned(),
            sampled: false,
            payload,
        })
    }
}

impl WorkflowEngine {
    /// Runs the items of `queue` on this engine with `worker`, at most `concurrency` at once
    /// on this engine; each item's result completes the waiting workflow. On the cluster engine
    /// only the processes that register a queue's worker take its items.
    ///
    /// # Errors
    ///
    /// [`WorkflowError::Invalid`] when the queue already has a worker here, or when the
    /// cluster engine has no queue storage.
    pub fn register_queue_worker<P, S, E, F, Fut>(
        &self,
        queue: DurableQueue<P, S, E>,
        worker: F,
        concurrency: usize,
    ) -> Result<(), WorkflowError>
    where
        P: Serialize + DeserializeOwned + Send + 'static,
        S: Serialize + DeserializeOwned + Send + 'static,
        E: Serialize + DeserializeOwned + Send + 'static,
        F: Fn(P) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<S, E>> + Send + 'static,
    {
        let worker = Arc::new(worker);
        let erased: ErasedWorker = Arc::new(move |payload: RawJson| {
            let worker = Arc::clone(&worker);
            Box::pin(async move {
                let payload = payload.decode::<P>().map_err(|error| error.to_string())?;
                // A panicking worker is a defect of its item, as a dying handler is in the
                // reference; it may panic before it returns its future too.
                let ran = cluster_core::future::guarded(|| worker(payload)).await;
                Ok(match ran {
                    Ok(result) => encode_result(result),
                    Err(_) => Exit::die_with_message("Panic", "the queue worker panicked"),
                })
            })
        });
        let concurrency = u32::try_from(concurrency.max(1)).unwrap_or(u32::MAX);
        let concurrency = NonZeroU32::new(concurrency).unwrap_or(NonZeroU32::MIN);
        let worker = QueueWorker { run: erased, concurrency };
        self.backend.register_queue_worker(queue.name, worker)
    }
}

impl WorkflowContext {
    /// Offers an item (idempotent by `item_id`); an engine failure ends the run without a
    /// result, to be replayed.
    async fn offer<P: Serialize>(
        &self,
        queue: &'static str,
        item_id: &str,
        token: Token,
        payload: &P,
    ) {
        let payload = match RawJson::encode(payload) {
            Ok(payload) => payload,
            Err(error) => {
                self.run.break_with(&WorkflowError::Malformed(error)).await;
                return;
            }
        };
        let run = &self.run;
        let hold = run.hold();
        let offered = run.engine.offer(queue, item_id, token, payload).await;
        hold.release();
        if let Err(error) = offered {
            run.break_with(&error).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::id::ExecutionId;

    #[test]
    fn elements_use_the_reference_json() {
        let token = Token {
            workflow: "W".into(),
            execution_id: ExecutionId::from_raw("e1"),
            deferred: "DurableQueue/Q/i1".into(),
        };
        let payload = RawJson::encode(&serde_json::json!({ "id": "a" })).unwrap();
        let element =
            serde_json::to_string(&Element::new("i1", &token, &payload).unwrap()).unwrap();
        let trace_id = hash_digest("trace:i1");
        let span_id = &hash_digest("span:i1")[..16];
        let expected = format!(
            r#"{{"token":"{}","traceId":"{trace_id}","spanId":"{span_id}","sampled":false,"payload":{{"id":"a"}}}}"#,
            token.encode()
        );
        assert_eq!(element, expected);
        // A TypeScript worker's element, with its own trace fields, reads the same.
        let typescript = format!(
            r#"{{"token":"{}","traceId":"0af7651916cd43dd8448eb211c80319c","spanId":"b7ad6b7169203331","sampled":true,"payload":{{"id":"a"}}}}"#,
            token.encode()
        );
        let read: Element = serde_json::from_str(&typescript).unwrap();
        assert_eq!(Token::parse(&read.token).unwrap(), token);
        assert_eq!(read.payload.get(), r#"{"id":"a"}"#);
        assert!(serde_json::from_str::<Element>(r#"{"token":"t"}"#).is_err(), "no payload");
    }

    #[test]
    fn retry_delays_double_up_to_the_maximum() {
        let options = QueueOptions::default();
        let delays: Vec<u64> =
            (1..=11).map(|attempts| options.retry_delay_after(attempts).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(options.retry_delay_after(0), Duration::from_secs(1));
        assert_eq!(options.retry_delay_after(u32::MAX), Duration::from_secs(300));
    }
}
