//! What the tests on tokio's paused clock share: a wall clock that moves with it, and
//! workflows keyed by a string payload.

use cluster_core::{Clock, Timestamp};
use serde::{Deserialize, Serialize};

/// The wall clock as tokio's paused clock moves, from a time after the snowflake epoch (ids
/// made before it all carry the epoch, and would never age).
#[derive(Debug)]
pub(crate) struct PausedClock {
    pub(crate) start: tokio::time::Instant,
}

impl Clock for PausedClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_unix_millis(1_800_000_000_000).saturating_add(self.start.elapsed())
    }
}

/// A payload that is its own idempotency key.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct Key {
    pub(crate) key: String,
}

pub(crate) fn key(key: &str) -> Key {
    Key { key: key.to_owned() }
}

/// Polls until `accept` holds for the execution's stored result (`None`: nothing stored),
/// within a minute of the paused clock.
pub(crate) async fn poll_until<W: cluster_workflow::Workflow>(
    engine: &cluster_workflow::WorkflowEngine,
    id: &cluster_workflow::ExecutionId,
    what: &str,
    accept: impl Fn(Option<&cluster_workflow::WorkflowResult>) -> bool,
) {
    for _ in 0..6_000 {
        if accept(engine.poll::<W>(id).await.unwrap().as_ref()) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Whether a stored result is complete.
pub(crate) fn complete(result: Option<&cluster_workflow::WorkflowResult>) -> bool {
    matches!(result, Some(cluster_workflow::WorkflowResult::Complete(_)))
}

/// A workflow named `$name` of [`Key`] payloads, keyed by them, with these success and error
/// types.
macro_rules! keyed {
    ($name:ident, $success:ty, $error:ty) => {
        struct $name;
        impl cluster_workflow::Workflow for $name {
            const NAME: &'static str = stringify!($name);
            type Payload = $crate::paused::Key;
            type Success = $success;
            type Error = $error;
            fn idempotency_key(payload: &$crate::paused::Key) -> String {
                payload.key.clone()
            }
        }
    };
}

pub(crate) use keyed;
