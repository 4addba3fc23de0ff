//! Durable queues (the reference's `DurableQueue`, reference/workflow.md §1.7): a workflow
//! hands an item to a pool of workers and waits for its result, durably.
//!
//! [`DurableQueue::process`] offers the item once per execution and idempotency key, however
//! often the run replays (the item id is the activity key of `DurableQueue/<name>/<key>`), and
//! awaits the deferred `DurableQueue/<name>/<item id>`, whose token travels with the item.
//! A worker ([`WorkflowEngine::register_queue_worker`]) runs each item and completes that
//! deferred with its result, a success or the typed failure, which becomes the outcome of
//! `process` in the workflow. Delivery is at least once: an item whose worker died is run
//! again.
//!
//! On the cluster engine the queue is the entity type `DurableQueue/<name>` (one entity per
//! item, its `offer` request keyed by the item id), so items are stored with the cluster's
//! messages, spread over the runners that register the worker, and survive restarts.

use std::future::Future;
use std::marker::PhantomData;
use std::sync::Arc;

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::context::{DurableDeferred, WorkflowContext};
use crate::engine::{WorkflowEngine, WorkflowError, encode_result};
use crate::id::{Token, activity_idempotency_key};

/// A worker type-erased for an engine: decodes the item's payload, runs, encodes the result.
pub(crate) type ErasedWorker = Arc<dyn Fn(RawJson) -> BoxFuture<'static, Exit> + Send + Sync>;

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
            &format!("DurableQueue/{}/{key}", self.name),
            None,
        );
        let deferred =
            DurableDeferred::<S, E>::new(format!("DurableQueue/{}/{item_id}", self.name));
        let token = ctx.token(&deferred);
        ctx.offer(self.name, &item_id, token, &payload).await;
        ctx.await_deferred(&deferred).await
    }
}

impl WorkflowEngine {
    /// Runs the items of `queue` on this engine with `worker`, at most `concurrency` at once
    /// on this runner; each item's result completes the waiting workflow.
    ///
    /// # Errors
    ///
    /// [`WorkflowError::Invalid`] when the queue already has a worker here.
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
        let permits = Arc::new(tokio::sync::Semaphore::new(concurrency.max(1)));
        let erased: ErasedWorker = Arc::new(move |payload: RawJson| {
            let (worker, permits) = (Arc::clone(&worker), Arc::clone(&permits));
            Box::pin(async move {
                let Ok(_permit) = permits.acquire_owned().await else {
                    return Exit::interrupt();
                };
                match payload.decode::<P>() {
                    Ok(payload) => encode_result(worker(payload).await),
                    Err(error) => Exit::die_with_message("MalformedPayload", &error.to_string()),
                }
            })
        });
        self.backend.register_queue_worker(queue.name, erased)
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
                self.run.break_with(&error).await;
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
