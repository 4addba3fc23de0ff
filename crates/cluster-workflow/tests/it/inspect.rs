//! The workflow read model on the cluster engine (in-memory storage, tokio's paused clock):
//! executions listed by workflow, status and start time, paged; one execution's timeline of
//! activities, sleeps, deferreds and interrupts.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::Clock;
use cluster_core::envelope::Exit;
use cluster_core::storage::MessageStorage;
use cluster_sharding::Sharding;
use cluster_testkit::memory::MemoryMessageStorage;
use cluster_workflow::inspect::{
    self, ExecutionQuery, ExecutionStatus, ExecutionSummary, StepKind, StepOutcome,
};
use cluster_workflow::{
    DurableDeferred, Never, Workflow, WorkflowContext, WorkflowEngine, WorkflowResult,
};

use crate::cluster::config;
use crate::paused::{Key, PausedClock, complete, key, keyed, poll_until};

keyed!(Steps, String, Never);
keyed!(Boom, u32, String);
keyed!(Stuck, u32, Never);

fn go() -> DurableDeferred<String> {
    DurableDeferred::new("go").unwrap()
}

async fn engine() -> (WorkflowEngine, Arc<dyn MessageStorage>) {
    let clock: Arc<dyn Clock> = Arc::new(PausedClock { start: tokio::time::Instant::now() });
    let storage = Arc::new(MemoryMessageStorage::new(Arc::clone(&clock)));
    let shared: Arc<dyn MessageStorage> = storage.clone();
    let sharding = Sharding::standalone(config(), storage).clock(clock).start().await.unwrap();
    let engine = WorkflowEngine::cluster(&sharding).unwrap();
    Steps::register(&engine, |ctx: WorkflowContext, _: Key| async move {
        let count = ctx.activity("count", |_| async { Ok::<_, Never>(3_u32) }).await?;
        ctx.sleep_with_threshold("nap", Duration::from_secs(5), Duration::ZERO).await;
        let go = ctx.await_deferred(&go()).await.unwrap_or_else(|never| match never {});
        Ok(format!("{count}:{go}"))
    })
    .unwrap();
    Boom::register(&engine, |_: WorkflowContext, _: Key| async { Err("boom".to_owned()) }).unwrap();
    Stuck::register(&engine, |ctx: WorkflowContext, _: Key| async move {
        let value = ctx
            .await_deferred(&DurableDeferred::<u32>::new("never").unwrap())
            .await
            .unwrap_or_else(|never| match never {});
        Ok(value)
    })
    .unwrap();
    (engine, shared)
}

fn suspended(result: Option<&WorkflowResult>) -> bool {
    result.is_some_and(WorkflowResult::is_suspended)
}

fn statuses(executions: &[ExecutionSummary]) -> Vec<(String, ExecutionStatus)> {
    executions.iter().map(|summary| (summary.workflow.clone(), summary.status)).collect()
}

#[tokio::test(start_paused = true)]
async fn executions_are_listed_by_status_and_paged() {
    let (engine, storage) = engine().await;
    let steps = engine.execute_discard::<Steps>(key("s")).await.unwrap();
    poll_until::<Steps>(&engine, &steps, "the steps wait for go", suspended).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let boom = engine.execute_discard::<Boom>(key("b")).await.unwrap();
    poll_until::<Boom>(&engine, &boom, "the boom fails", complete).await;
    tokio::time::sleep(Duration::from_millis(5)).await;
    let stuck = engine.execute_discard::<Stuck>(key("x")).await.unwrap();
    poll_until::<Stuck>(&engine, &stuck, "the stuck one suspends", suspended).await;
    engine.interrupt::<Stuck>(&stuck).await.unwrap();
    poll_until::<Stuck>(&engine, &stuck, "the stuck one is interrupted", complete).await;

    let page = inspect::executions(&*storage, &ExecutionQuery::newest(10)).await.unwrap();
    assert_eq!(
        statuses(&page.executions),
        [
            ("Stuck".to_owned(), ExecutionStatus::Interrupted),
            ("Boom".to_owned(), ExecutionStatus::Failed),
            ("Steps".to_owned(), ExecutionStatus::Suspended),
        ]
    );
    assert_eq!(page.next, None);
    let first = &page.executions[2];
    assert_eq!(first.execution_id, steps.as_str());
    assert!(first.started <= first.updated.unwrap(), "{first:?}");
    assert!(!first.suspended_on_failure);

    // Filters: status, workflow, execution id, start time.
    let only = |query: ExecutionQuery| {
        let storage = Arc::clone(&storage);
        async move { statuses(&inspect::executions(&*storage, &query).await.unwrap().executions) }
    };
    let newest = ExecutionQuery::newest(10);
    let failed = ExecutionQuery { status: Some(ExecutionStatus::Failed), ..newest.clone() };
    assert_eq!(only(failed).await, [("Boom".to_owned(), ExecutionStatus::Failed)]);
    let by_name = ExecutionQuery { workflow: Some("Steps".into()), ..newest.clone() };
    assert_eq!(only(by_name).await, [("Steps".to_owned(), ExecutionStatus::Suspended)]);
    let by_id = ExecutionQuery { execution_id: Some(boom.as_str().into()), ..newest.clone() };
    assert_eq!(only(by_id).await, [("Boom".to_owned(), ExecutionStatus::Failed)]);
    let later = page.executions[1].started;
    let since = ExecutionQuery { started_from: Some(later), ..newest.clone() };
    assert_eq!(only(since).await.len(), 2);
    let until = ExecutionQuery { started_until: Some(later), ..newest.clone() };
    assert_eq!(only(until).await, [("Steps".to_owned(), ExecutionStatus::Suspended)]);

    // Pages of one, newest first.
    let mut query = ExecutionQuery::newest(1);
    let mut seen = Vec::new();
    loop {
        let page = inspect::executions(&*storage, &query).await.unwrap();
        seen.extend(statuses(&page.executions));
        let Some(next) = page.next else { break };
        query.cursor = Some(next);
    }
    assert_eq!(seen, statuses(&inspect::executions(&*storage, &newest).await.unwrap().executions));
    assert!(inspect::executions(&*storage, &ExecutionQuery::newest(0)).await.is_err());

    // Completing the deferred completes the execution.
    engine
        .complete(&go().token_for::<Steps>(&steps), Ok::<_, Never>("go".to_owned()))
        .await
        .unwrap();
    poll_until::<Steps>(&engine, &steps, "the steps complete", complete).await;
    let completed = ExecutionQuery { status: Some(ExecutionStatus::Completed), ..newest };
    assert_eq!(only(completed).await, [("Steps".to_owned(), ExecutionStatus::Completed)]);
}

#[tokio::test(start_paused = true)]
async fn an_executions_timeline_lists_its_steps_in_order() {
    let (engine, storage) = engine().await;
    let steps = engine.execute_discard::<Steps>(key("s")).await.unwrap();
    poll_until::<Steps>(&engine, &steps, "the steps wait for go", suspended).await;
    engine
        .complete(&go().token_for::<Steps>(&steps), Ok::<_, Never>("go".to_owned()))
        .await
        .unwrap();
    poll_until::<Steps>(&engine, &steps, "the steps complete", complete).await;

    let detail = inspect::execution(&*storage, "Steps", steps.as_str()).await.unwrap().unwrap();
    assert_eq!(detail.summary.status, ExecutionStatus::Completed);
    let Some(WorkflowResult::Complete(Exit::Success(value))) = &detail.summary.result else {
        panic!("a completed result: {:?}", detail.summary.result)
    };
    assert_eq!(value.json(), Some(r#""3:go""#));
    assert!(detail.payload.is_some());
    let kinds: Vec<(&str, &str)> =
        detail.steps.iter().map(|step| (step.kind.as_str(), step.name.as_str())).collect();
    assert_eq!(kinds, [("activity", "count"), ("sleep", "nap"), ("deferred", "go")]);
    assert_eq!(detail.steps[0].kind, StepKind::Activity { attempt: 1 });
    for step in &detail.steps {
        assert!(matches!(step.outcome, StepOutcome::Done(Exit::Success(_))), "{step:?}");
        assert!(step.answered.is_some_and(|answered| answered >= step.sent), "{step:?}");
    }
    let StepKind::Sleep { wake_at } = detail.steps[1].kind else { unreachable!() };
    assert!(wake_at >= detail.steps[1].sent.saturating_add(Duration::from_secs(5)));

    // An interrupt is a step of its own.
    let stuck = engine.execute_discard::<Stuck>(key("x")).await.unwrap();
    poll_until::<Stuck>(&engine, &stuck, "the stuck one suspends", suspended).await;
    engine.interrupt::<Stuck>(&stuck).await.unwrap();
    poll_until::<Stuck>(&engine, &stuck, "the stuck one is interrupted", complete).await;
    let detail = inspect::execution(&*storage, "Stuck", stuck.as_str()).await.unwrap().unwrap();
    assert_eq!(detail.summary.status, ExecutionStatus::Interrupted);
    assert!(detail.steps.iter().any(|step| step.kind == StepKind::Interrupt), "{detail:?}");
    assert_eq!(inspect::execution(&*storage, "Stuck", "nobody").await.unwrap(), None);
}
