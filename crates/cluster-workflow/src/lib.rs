//! Durable workflows: async functions whose steps are memoized, so that an execution survives
//! restarts, owner changes and long waits.
//!
//! A workflow is a [`Workflow`] definition (name, payload, success and error types, an
//! idempotency key) and a body registered on a [`WorkflowEngine`]. The body works through its
//! [`WorkflowContext`]: [activities](WorkflowContext::activity) (run once, then replayed from
//! their stored result), [durable deferreds](WorkflowContext::await_deferred) completed by
//! anyone holding a [`Token`], [durable sleep](WorkflowContext::sleep),
//! [races](WorkflowContext::race), [child workflows](WorkflowContext::child), and
//! [compensations](WorkflowContext::with_compensation) that run exactly once if the execution
//! fails.
//!
//! ```
//! use cluster_workflow::{Workflow, WorkflowEngine};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! struct Double { key: String, value: u64 }
//!
//! struct Doubler;
//! impl Workflow for Doubler {
//!     const NAME: &'static str = "Doubler";
//!     type Payload = Double;
//!     type Success = u64;
//!     type Error = String;
//!     fn idempotency_key(payload: &Double) -> String { payload.key.clone() }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let engine = WorkflowEngine::memory();
//! Doubler::register(&engine, |ctx, payload| async move {
//!     let doubled: u64 = ctx
//!         .activity("double", async |_| Ok::<_, String>(payload.value * 2))
//!         .await?;
//!     Ok(doubled)
//! })
//! .unwrap();
//! let value = engine.execute::<Doubler>(Double { key: "a".into(), value: 21 }).await.unwrap();
//! assert_eq!(value, 42);
//! # }
//! ```
//!
//! How a run maps onto futures: the engine owns the body's future and drops it
//! at a suspension or interrupt point; a replay runs the body again from the top. Code
//! outside activities must be deterministic (the same steps with the same names in the same
//! order on every replay). The semantics follow effect 4.1.0's workflow engine
//! (`effect/src/workflow/`), with the choices of its open questions written down in
//! `docs/workflows.md`.

mod capability;
mod cluster_engine;
mod context;
mod definition;
mod engine;
mod id;
pub mod inspect;
mod memory;
pub mod metrics;
mod name;
mod queue;
mod result;
mod run;

pub use capability::{TOKEN_KEY_BYTES_MIN, TokenKey, TokenKeyError};
pub use cluster_engine::{
    CLOCK_ENTITY, ClusterOptions, INTERRUPT_SIGNAL, INTERRUPT_UNSAFE, PARENT_KEY,
};
pub use context::{
    ActivityCall, ActivityContext, ActivityError, DEFAULT_IN_MEMORY_SLEEP_THRESHOLD,
    DurableDeferred, InterruptRetry, Never, WorkflowContext,
};
pub use definition::{RetrySchedule, WorkflowOptions};
pub use engine::{ClusterFailure, ExecuteError, Workflow, WorkflowEngine, WorkflowError};
pub use id::{ExecutionId, Token, TokenError, activity_idempotency_key, hash_digest};
pub use name::{RESERVED_ACTIVITY_PREFIXES, RESERVED_DEFERRED_PREFIXES, ReservedName};
pub use queue::{DurableQueue, QueueOptions};
pub use result::{FailureCause, WorkflowResult};
pub use run::RunExit;
