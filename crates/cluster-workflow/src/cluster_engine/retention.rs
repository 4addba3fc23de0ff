//! Workflow retention: a cluster singleton that deletes completed executions, with every
//! request and reply of theirs (activities, deferreds, resumes, durable clocks), once they
//! completed longer ago than [`workflow_retention`](cluster_core::ShardingConfig::workflow_retention).
//!
//! A sweep pages through the `run` requests of `Workflow/…` entities answered before the
//! cutoff ([`MessageStorage::processed_requests`]), and deletes an execution when:
//!
//! - its stored result is `Complete` (a suspended execution is kept, however old);
//! - and it has no parent, or its parent completed or was deleted already: a parent that
//!   replays asks its children for their results again, and a deleted child would run again.
//!
//! An execution goes as a whole ([`MessageStorage::clear_address`] on its entity and on its
//! durable clocks' entity), so nothing of it is left half deleted. Pages are small and paused
//! between, and each call has a deadline, as message retention's batches
//! (`cluster_core::retention`).

use std::sync::Weak;
use std::time::Duration;

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::retention::{
    CALL_DEADLINE, PAUSE_MIN, ProcessedQuery, ProcessedRequest, replied_before, sweep_interval,
};
use cluster_core::{EntityAddress, EntityType};
use cluster_sharding::{Rpc, SingletonContext};
use tokio::time::timeout;

use super::requests::{ResultJson, RunRpc};
use super::{CLOCK_ENTITY, ClusterEngine};
use crate::id::ExecutionId;
use crate::result::WorkflowResult;

/// The singleton's name.
pub(super) const WORKFLOW_RETENTION: &str = "WorkflowRetention";

/// How many `run` requests one page reads.
const PAGE: u32 = 100;

/// Runs the sweeps until `cancellation` fires or the engine is gone: the singleton's body.
pub(super) async fn run(
    engine: Weak<ClusterEngine>,
    retention: Duration,
    context: SingletonContext,
) {
    tracing::info!(retention = ?retention, "workflow retention started on this runner");
    loop {
        let Some(engine) = engine.upgrade() else { return };
        sweep(&engine, retention, &context).await;
        drop(engine);
        if !context.pause(sweep_interval(retention)).await {
            return;
        }
    }
}

/// One sweep over the executions answered before the cutoff; returns how many it deleted. A
/// page or a deletion that fails or takes longer than [`CALL_DEADLINE`] ends it (a failed
/// deletion only skips its execution).
async fn sweep(engine: &ClusterEngine, retention: Duration, context: &SingletonContext) -> u64 {
    let cancellation = context.cancellation();
    let Ok(sharding) = engine.sharding() else { return 0 };
    let cutoff = replied_before(sharding.clock().now().saturating_sub(retention));
    drop(sharding);
    let mut query = ProcessedQuery {
        entity_type_prefix: "Workflow/".to_owned(),
        tag: Some(<RunRpc as Rpc>::TAG.to_owned()),
        replied_before: cutoff,
        after: None,
        limit: PAGE,
    };
    let mut deleted = 0;
    loop {
        let started = tokio::time::Instant::now();
        let page = tokio::select! {
            () = cancellation.cancelled() => break,
            page = timeout(CALL_DEADLINE, engine.storage.processed_requests(&query)) => page,
        };
        let page = match page {
            Ok(Ok(page)) => page,
            Ok(Err(error)) => {
                tracing::warn!(%error, deleted, "workflow retention page failed; the next sweep tries again");
                break;
            }
            Err(_) => {
                tracing::warn!(deadline = ?CALL_DEADLINE, deleted, "workflow retention page timed out; the next sweep tries again");
                break;
            }
        };
        for request in &page {
            if cancellation.is_cancelled() {
                break;
            }
            match timeout(CALL_DEADLINE, purge_if_done(engine, request)).await {
                Ok(Ok(true)) => {
                    deleted += 1;
                    crate::metrics::execution_deleted();
                }
                Ok(Ok(false)) => {}
                Ok(Err(error)) => {
                    tracing::warn!(%error, execution_id = %request.address.entity_id, "workflow retention could not delete an execution; the next sweep tries again");
                }
                Err(_) => {
                    tracing::warn!(deadline = ?CALL_DEADLINE, execution_id = %request.address.entity_id, "workflow retention timed out deleting an execution; the next sweep tries again");
                    return deleted;
                }
            }
        }
        query.after = page.last().map(|request| request.request_id);
        if page.len() < PAGE as usize || query.after.is_none() {
            break;
        }
        if !context.pause(started.elapsed().max(PAUSE_MIN)).await {
            break;
        }
    }
    if deleted > 0 {
        tracing::debug!(deleted, "workflow retention deleted completed executions");
    }
    deleted
}

/// Deletes the execution of `request` (a `run` request) if it completed and its parent, if
/// any, did too or is gone; whether it did.
async fn purge_if_done(
    engine: &ClusterEngine,
    request: &ProcessedRequest,
) -> Result<bool, crate::engine::WorkflowError> {
    let entity_type = request.address.entity_type.as_str();
    let Some(workflow) = entity_type.strip_prefix("Workflow/") else { return Ok(false) };
    if entity_type == CLOCK_ENTITY || !completed(&request.reply.exit) {
        return Ok(false);
    }
    // A payload that cannot be read might name a parent: keep the execution.
    let Some(payload) = &request.payload else { return Ok(false) };
    if let Some(parent) = parent_of(payload) {
        let execution_id = ExecutionId::from_raw(parent.execution_id.as_str());
        let parent_result = engine.run_result(&parent.workflow_name, &execution_id).await?;
        let parent_running = match parent_result {
            None => false,
            Some((_, Some((_, WorkflowResult::Complete(_))))) => false,
            Some(_) => true,
        };
        if parent_running {
            return Ok(false);
        }
    }
    // The clocks first: if the second deletion fails or is cut off, the execution's `run`
    // request is still there, and the next sweep deletes both again.
    let storage = &engine.storage;
    let clocks =
        EntityAddress { entity_type: EntityType::from(CLOCK_ENTITY), ..request.address.clone() };
    storage.clear_address(&clocks).await.map_err(super::storage_error)?;
    storage.clear_address(&request.address).await.map_err(super::storage_error)?;
    tracing::debug!(workflow, execution_id = %request.address.entity_id, "workflow retention deleted an execution");
    Ok(true)
}

/// Whether a `run` request's final reply is a completed result. A failure reply (a result that
/// could not be stored) completes the execution too, as the engine reads it.
fn completed(exit: &Exit) -> bool {
    match exit {
        Exit::Success(value) => value
            .decode::<ResultJson>()
            .is_ok_and(|result| matches!(result.0, WorkflowResult::Complete(_))),
        Exit::Failure(_) => true,
    }
}

/// The parent named in a `run` request's payload, if any.
fn parent_of(payload: &RawJson) -> Option<super::requests::ParentJson> {
    let run: RunRpc = payload.decode().ok()?;
    run.split().1
}
