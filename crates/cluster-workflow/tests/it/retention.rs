//! Workflow retention on the cluster engine (in-memory storage, tokio's paused clock): a
//! completed execution is deleted once it is older than `workflow_retention`, so its id runs
//! again; a completed child is kept while its parent has not completed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cluster_core::{Clock, ShardingConfig};
use cluster_sharding::Sharding;
use cluster_testkit::memory::MemoryMessageStorage;
use cluster_workflow::{
    DurableDeferred, Never, Workflow, WorkflowContext, WorkflowEngine, WorkflowResult,
};

use crate::cluster::config;
use crate::paused::{Key, PausedClock, complete, key, keyed, poll_until};

keyed!(Job, u32, Never);
keyed!(Elder, String, Never);
keyed!(Kid, u32, Never);

const RETENTION: Duration = Duration::from_secs(10);

fn go() -> DurableDeferred<String> {
    DurableDeferred::new("go").unwrap()
}

async fn engine(runs: &Arc<AtomicU32>) -> WorkflowEngine {
    let clock: Arc<dyn Clock> = Arc::new(PausedClock { start: tokio::time::Instant::now() });
    let storage = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let config = ShardingConfig { workflow_retention: Some(RETENTION), ..config() };
    let sharding = Sharding::standalone(config, storage).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    let job_runs = Arc::clone(runs);
    Job::register(&engine, move |ctx: WorkflowContext, _: Key| {
        let runs = Arc::clone(&job_runs);
        async move {
            ctx.activity("count", move |_| {
                let runs = Arc::clone(&runs);
                async move { Ok::<_, Never>(runs.fetch_add(1, Ordering::SeqCst) + 1) }
            })
            .await
        }
    })
    .unwrap();
    Kid::register(&engine, |_: WorkflowContext, _: Key| async { Ok(7) }).unwrap();
    Elder::register(&engine, |ctx: WorkflowContext, payload: Key| async move {
        let kid = ctx.child::<Kid>(key(&format!("{}-kid", payload.key))).await?;
        let go = ctx.await_deferred(&go()).await.unwrap_or_else(|never| match never {});
        Ok(format!("{kid}:{go}"))
    })
    .unwrap();
    engine
}

#[tokio::test(start_paused = true)]
async fn completed_executions_are_deleted_after_the_retention() {
    let runs = Arc::new(AtomicU32::new(0));
    let engine = engine(&runs).await;
    let elder = engine.execute_discard::<Elder>(key("e")).await.unwrap();
    let kid = Kid::execution_id(&key("e-kid"));
    poll_until::<Kid>(&engine, &kid, "the kid completes", complete).await;
    poll_until::<Elder>(&engine, &elder, "the elder suspends", |result| {
        result.is_some_and(WorkflowResult::is_suspended)
    })
    .await;
    // Started after the kid: a sweep that deleted it went past the kid.
    assert_eq!(engine.execute::<Job>(key("j")).await.unwrap(), 1);
    assert_eq!(engine.execute::<Job>(key("j")).await.unwrap(), 1, "the stored result");
    tokio::time::sleep(RETENTION * 3).await;
    let job = Job::execution_id(&key("j"));
    poll_until::<Job>(&engine, &job, "the job is deleted", |result| result.is_none()).await;
    assert!(complete(engine.poll::<Kid>(&kid).await.unwrap().as_ref()), "kept for its parent");
    assert!(engine.poll::<Elder>(&elder).await.unwrap().is_some(), "a suspended one is kept");
    // Deleted, the job's id runs again.
    assert_eq!(engine.execute::<Job>(key("j")).await.unwrap(), 2);
    // Once the elder completed and the retention passed, both go.
    engine
        .complete(&go().token_for::<Elder>(&elder), Ok::<_, Never>("go".to_owned()))
        .await
        .unwrap();
    poll_until::<Elder>(&engine, &elder, "the elder completes", complete).await;
    tokio::time::sleep(RETENTION * 3).await;
    poll_until::<Elder>(&engine, &elder, "the elder is deleted", |result| result.is_none()).await;
    poll_until::<Kid>(&engine, &kid, "the kid is deleted", |result| result.is_none()).await;
    engine.shutdown().await;
}
