//! The engine contract ([`Backend`]) on the cluster: runs, activities, deferreds, clocks and
//! interrupts as requests of the execution's entity.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use cluster_core::Snowflake;
use cluster_core::backoff::Backoff;
use cluster_core::envelope::{Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_core::sync::lock;
use cluster_sharding::{CallError, EntityContext, Rpc};
use tokio::sync::oneshot;

use super::activation::{ActivityStart, WorkflowEntity};
use super::requests::{ActivityRpc, ClockRpc, DeferredRpc, ExitJson, ResultJson, RunRpc};
use super::{
    ClusterEngine, INTERRUPT_SIGNAL, INTERRUPT_UNSAFE, cluster_error, defect_exit, entity_options,
    with_retries,
};
use crate::definition::WorkflowOptions;
use crate::engine::QueueWorker;
use crate::engine::{
    ActivityBody, ActivityStep, Backend, Parent, Registration, ResumeMode, WorkflowError,
};
use crate::id::{ExecutionId, Token};
use crate::result::WorkflowResult;
use crate::run::{Run, RunKind};

impl ClusterEngine {
    pub(super) async fn complete(
        &self,
        from: Option<&Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> Result<(), WorkflowError> {
        if let Some(from) = from
            && from.execution_id == token.execution_id
            && token.deferred != INTERRUPT_SIGNAL
        {
            // A run does not wake itself for a completion it made.
            from.update(|state| state.completed.insert(token.deferred.clone()));
        }
        tracing::debug!(workflow = %token.workflow, execution_id = %token.execution_id, deferred = %token.deferred, "deferred completed");
        self.client(&token.workflow, &token.execution_id)?
            .discard(DeferredRpc { name: token.deferred, exit: ExitJson(exit) })
            .await
            .map_err(cluster_error)
    }

    pub(super) async fn interrupt_execution(
        &self,
        workflow: &str,
        execution_id: &ExecutionId,
        hard: bool,
    ) -> Result<(), WorkflowError> {
        let Some((request_id, result)) = self.run_result(workflow, execution_id).await? else {
            return Ok(());
        };
        if matches!(result, Some((_, WorkflowResult::Complete(_)))) {
            return Ok(());
        }
        let token = |deferred: &str| Token {
            workflow: workflow.to_owned(),
            execution_id: execution_id.clone(),
            deferred: deferred.to_owned(),
        };
        // The unsafe mark goes first: the signal's wake must find it.
        let signals: &[&str] =
            if hard { &[INTERRUPT_UNSAFE, INTERRUPT_SIGNAL] } else { &[INTERRUPT_SIGNAL] };
        for signal in signals {
            self.complete(None, token(signal), Exit::void()).await?;
            // Stored: an activation of the execution on this runner sees it at its next step
            // without waiting for its delivery (its value is always `void`, so the cache cannot
            // disagree with the first completion stored).
            if let Some(activation) = self.activation(execution_id) {
                activation.state().stored_signal(signal);
            }
        }
        if hard {
            let address = self.address(workflow, execution_id)?;
            self.sharding()?.interrupt_request(&address, request_id).await.map_err(|error| {
                WorkflowError::cluster_from("interrupting a request failed", error)
            })?;
        }
        Ok(())
    }

    /// The request of activity `name`/`attempt` of `run`'s execution, if it was stored.
    async fn activity_request_id(
        &self,
        run: &Run,
        name: &str,
        attempt: u32,
    ) -> Result<Option<Snowflake>, WorkflowError> {
        let key = format!("{name}/{attempt}");
        self.request_id(run.workflow, &run.execution_id, ActivityRpc::TAG, &key).await
    }

    /// The stored result of activity `name`/`attempt`, or a suspension when it has none.
    ///
    /// A stored request without a final reply is waited for: an earlier run cut off while the
    /// activity's result was being written leaves it so, and that result, once stored, is the
    /// activity's (its compensation must be registered). Every stored request gets a final
    /// reply from this owner (`Suspended` when no caller waits), so the wait ends; it gives up
    /// only when the runner shuts down.
    async fn stored_activity_result(
        &self,
        run: &Run,
        name: &str,
        attempt: u32,
    ) -> Result<WorkflowResult, WorkflowError> {
        let Some(request_id) = self.activity_request_id(run, name, attempt).await? else {
            return Ok(WorkflowResult::suspended());
        };
        let mut backoff = Backoff::doubling(Duration::from_millis(10), Duration::from_secs(1));
        let stored = loop {
            if let Some((_, exit)) = self.final_reply(request_id).await? {
                break exit;
            }
            if self.pause(backoff.next_delay()).await.is_err() {
                return Err(WorkflowError::cluster(
                    "the runner stopped while an activity's result was written",
                ));
            }
        };
        match stored {
            Exit::Success(value) => match value.decode() {
                Ok(ResultJson(result @ WorkflowResult::Complete(_))) => Ok(result),
                _ => Ok(WorkflowResult::suspended()),
            },
            // The result could not be stored (`ReplyNotStored`): the defect is the exit.
            failure @ Exit::Failure(_) => Ok(WorkflowResult::Complete(failure)),
        }
    }

    /// Runs activity `name`/`attempt` through its request: the handler gives the go (with the
    /// request's storage transaction for a transactional activity), the body runs here (inside
    /// the run), and the handler stores its result as the reply.
    async fn run_activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> Result<WorkflowResult, WorkflowError> {
        let ActivityStep { name, attempt, transactional } = step;
        let activation = self
            .activation(&run.execution_id)
            .ok_or_else(|| WorkflowError::cluster("the execution is not active on this runner"))?;
        let key = (name.to_owned(), attempt);
        let mut execute = Some(execute);
        loop {
            if !run.state().interrupted && activation.interrupt_cached() {
                // A pending interrupt starts no new activity.
                return self.stored_activity_result(run, name, attempt).await;
            }
            let (go, gone) = oneshot::channel();
            activation.state().wait_for_go(key.clone(), go);
            let client = self.client(run.workflow, &run.execution_id)?;
            let request =
                ActivityRpc { name: name.to_owned(), attempt, with_transaction: transactional };
            let reply = client.send(request);
            tokio::pin!(reply);
            let awaits = activation.state().activity_awaits();
            let activity_run = Run::with_awaits(
                run.workflow,
                run.execution_id.clone(),
                RunKind::Activity(attempt),
                run.options,
                Arc::clone(&run.engine),
                awaits,
            );
            let interrupted = run.state().interrupted;
            activity_run.update(|state| state.interrupted = interrupted);
            // Whether this call's body handed a result (not a suspension) to the handler.
            let handed = AtomicBool::new(false);
            let body = async {
                match (gone.await, execute.take()) {
                    (Ok(ActivityStart { done, transaction }), Some(execute)) => {
                        let result = execute(activity_run, transaction).await;
                        let complete = !result.is_suspended();
                        if done.send(result).is_ok() {
                            handed.store(complete, Ordering::Release);
                        }
                    }
                    _ => std::future::pending::<()>().await,
                }
            };
            let reply = tokio::select! {
                reply = &mut reply => reply,
                () = body => reply.await,
            };
            let reply = match reply {
                Ok(reply) => reply,
                Err(CallError::Defect(defect)) => {
                    tracing::warn!(activity = name, attempt, execution_id = %run.execution_id, %defect, "the activity's result is a defect");
                    ResultJson(WorkflowResult::Complete(defect_exit(defect)))
                }
                Err(error) => return Err(cluster_error(error)),
            };
            let not_run = activation.state().not_run(&key);
            match reply.0 {
                WorkflowResult::Suspended { .. } if handed.load(Ordering::Acquire) => {
                    // The body's result was handed over but not stored (its writes failed), and
                    // a redelivery of the request, finding no caller, answered `Suspended`.
                    // Nothing would wake this run: it breaks off, and the replay runs the
                    // activity again (it has no stored result).
                    return Err(WorkflowError::cluster(format!(
                        "the result of activity {name}/{attempt} was not stored"
                    )));
                }
                WorkflowResult::Suspended { .. } if not_run && execute.is_some() => {
                    // A stored suspension of an attempt that did not run here: reset it and
                    // call again.
                    let Some(request_id) = self.activity_request_id(run, name, attempt).await?
                    else {
                        continue;
                    };
                    let sharding = &self.sharding()?;
                    with_retries(|| async {
                        sharding.reset(request_id, None).await.map_err(|error| {
                            WorkflowError::cluster_from("failed to reset an activity", error)
                        })
                    })
                    .await?;
                }
                result => return Ok(result),
            }
        }
    }
}

impl Backend for ClusterEngine {
    fn register(&self, registration: Registration) -> Result<(), WorkflowError> {
        {
            let mut registrations = lock(&self.registrations);
            if registrations.contains_key(registration.name) {
                tracing::warn!(
                    workflow = registration.name,
                    "workflow already registered: ignoring the duplicate definition"
                );
                return Err(WorkflowError::Invalid(format!(
                    "workflow {} is already registered",
                    registration.name
                )));
            }
            registrations.insert(registration.name, registration.clone());
        }
        self.define(registration.name, &registration.options);
        let entity_type = Self::entity_type(registration.name);
        let Some(engine) = self.me.upgrade() else {
            return Err(WorkflowError::Invalid("the workflow engine is gone".into()));
        };
        let factory =
            move |context: &EntityContext| WorkflowEntity::activate(context, Arc::clone(&engine));
        self.sharding()?
            .entity()
            .named(entity_type.clone())
            .options(entity_options())
            .factory(factory)
            .register()
            .map_err(|error| WorkflowError::Register {
                entity_type: entity_type.to_string(),
                source: Arc::new(error),
            })
    }

    fn define(&self, workflow: &'static str, options: &WorkflowOptions) {
        lock(&self.definitions).entry(workflow.to_owned()).or_insert_with(|| options.clone());
    }

    fn activity<'a>(
        &'a self,
        run: &'a Arc<Run>,
        step: ActivityStep<'a>,
        execute: ActivityBody<'a>,
    ) -> BoxFuture<'a, Result<WorkflowResult, WorkflowError>> {
        Box::pin(self.run_activity(run, step, execute))
    }

    fn deferred_result<'a>(
        &'a self,
        run: &'a Arc<Run>,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<Exit>, WorkflowError>> {
        Box::pin(async move {
            match self.activation(&run.execution_id) {
                Some(activation) => activation.deferred(name).await,
                None => self.stored_deferred(run.workflow, &run.execution_id, name).await,
            }
        })
    }

    fn deferred_done<'a>(
        &'a self,
        from: Option<&'a Arc<Run>>,
        token: Token,
        exit: Exit,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.complete(from, token, exit))
    }

    fn schedule_clock<'a>(
        &'a self,
        run: &'a Arc<Run>,
        clock: &'a str,
        duration: Duration,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(async move {
            let now = self.sharding()?.clock().now().unix_millis();
            #[expect(
                clippy::cast_possible_truncation,
                reason = "a wake-up time in milliseconds fits an i64"
            )]
            let wake_up = now.saturating_add((duration.as_secs_f64() * 1000.0).ceil() as i64);
            let request = ClockRpc {
                name: clock.to_owned(),
                workflow_name: run.workflow.to_owned(),
                wake_up,
            };
            self.clock_client(run.workflow, &run.execution_id)?
                .discard(request)
                .await
                .map_err(cluster_error)
        })
    }

    fn execute<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        payload: RawJson,
        parent: Option<Parent>,
        discard: bool,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>> {
        Box::pin(async move {
            let request = RunRpc::new(&payload, parent.as_ref())?;
            let client = self.client(workflow, execution_id)?;
            if discard {
                client.discard(request).await.map_err(cluster_error)?;
                return Ok(None);
            }
            match client.send(request).await {
                Ok(result) => Ok(Some(result.0)),
                Err(CallError::Defect(defect)) => {
                    Ok(Some(WorkflowResult::Complete(defect_exit(defect))))
                }
                Err(error) => Err(cluster_error(error)),
            }
        })
    }

    fn execution_exists<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<bool, WorkflowError>> {
        Box::pin(async move {
            let run = self.request_id(workflow, execution_id, RunRpc::TAG, "").await?;
            Ok(run.is_some())
        })
    }

    fn poll<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<Option<WorkflowResult>, WorkflowError>> {
        Box::pin(async move {
            let result = self.run_result(workflow, execution_id).await?;
            Ok(result.and_then(|(_, result)| result).map(|(_, result)| result))
        })
    }

    fn interrupt<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
        hard: bool,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.interrupt_execution(workflow, execution_id, hard))
    }

    fn resume<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(self.resume_execution(workflow, execution_id, ResumeMode::Explicit))
    }

    fn await_complete<'a>(
        &'a self,
        workflow: &'a str,
        execution_id: &'a ExecutionId,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            // Only an execution active on this runner can be watched; elsewhere the caller
            // polls on its schedule.
            let Some(activation) = self.activation(execution_id) else {
                return std::future::pending().await;
            };
            let mut runs = activation.runs.subscribe();
            drop(activation);
            loop {
                if runs.changed().await.is_err() {
                    return std::future::pending().await;
                }
                // The reply is stored just after the run's handler returns.
                let mut backoff =
                    Backoff::doubling(Duration::from_millis(10), Duration::from_millis(1_280));
                for _ in 0..8 {
                    match self.poll(workflow, execution_id).await {
                        Ok(Some(WorkflowResult::Complete(_))) => return,
                        Ok(Some(WorkflowResult::Suspended { .. })) => break,
                        _ => {}
                    }
                    tokio::time::sleep(backoff.next_delay()).await;
                }
            }
        })
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        // The runtime owns the runs (`Sharding::shutdown` hands them off); the queue workers
        // are this engine's.
        Box::pin(self.queues.shutdown())
    }

    fn offer<'a>(
        &'a self,
        queue: &'a str,
        item_id: &'a str,
        token: Token,
        payload: RawJson,
    ) -> BoxFuture<'a, Result<(), WorkflowError>> {
        Box::pin(async move { self.queues.offer(queue, item_id, &token, &payload).await })
    }

    fn register_queue_worker(
        &self,
        queue: &'static str,
        worker: QueueWorker,
    ) -> Result<(), WorkflowError> {
        let me = self.me.clone();
        let stopped = Arc::new(move || me.upgrade().is_none_or(|engine| engine.is_shutdown()));
        let backend: Weak<dyn Backend> = self.me.clone();
        self.queues.register(queue, worker, backend, stopped)
    }
}
