//! The requests of the workflow and clock entities, in the reference's JSON forms
//! (`effect/src/cluster/ClusterWorkflowEngine.ts`): `run`, `activity`, `deferred`, `resume` and
//! the clock's `run`.

use cluster_core::envelope::{Exit, RawJson};
use cluster_core::{DecodeError, Timestamp};
use cluster_sharding::{Rpc, Uninterruptible};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::value::RawValue;

use super::PARENT_KEY;
use crate::context::Never;
use crate::engine::{Parent, WorkflowError};
use crate::result::WorkflowResult;

/// A [`WorkflowResult`] as a reply value.
#[derive(Clone, Debug)]
pub(crate) struct ResultJson(pub(super) WorkflowResult);

/// An [`Exit`] as a value.
#[derive(Clone, Debug)]
pub(crate) struct ExitJson(pub(super) Exit);

/// Serde through a type's own JSON text (embedded as is, not quoted).
macro_rules! json_text_serde {
    ($wrapper:ident, $to:expr, $from:expr) => {
        impl Serialize for $wrapper {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let raw = RawValue::from_string($to(&self.0)).map_err(serde::ser::Error::custom)?;
                raw.serialize(serializer)
            }
        }

        impl<'de> Deserialize<'de> for $wrapper {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                let raw = Box::<RawValue>::deserialize(deserializer)?;
                $from(raw.get()).map($wrapper).map_err(D::Error::custom)
            }
        }
    };
}

json_text_serde!(ResultJson, WorkflowResult::to_json, WorkflowResult::from_json);
json_text_serde!(
    ExitJson,
    <Exit as cluster_core::encoded::JsonForm>::to_json,
    <Exit as cluster_core::encoded::JsonForm>::from_json
);

/// The parent of a child, as stored in the child's `run` payload.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct ParentJson {
    pub(super) workflow_name: String,
    pub(super) execution_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) detached: Option<bool>,
}

/// `run`: the workflow's payload fields, and the parent under [`PARENT_KEY`].
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
pub(crate) struct RunRpc(pub(super) serde_json::Map<String, serde_json::Value>);

impl RunRpc {
    pub(super) fn new(payload: &RawJson, parent: Option<&Parent>) -> Result<RunRpc, WorkflowError> {
        let fields: serde_json::Map<String, serde_json::Value> =
            payload.decode().map_err(|_| {
                WorkflowError::Malformed(DecodeError::new(
                    "workflow payload",
                    "a workflow payload must encode as a JSON object for the cluster engine",
                ))
            })?;
        let mut fields = fields;
        if let Some(parent) = parent {
            let parent = ParentJson {
                workflow_name: parent.workflow.to_owned(),
                execution_id: parent.execution_id.as_str().to_owned(),
                detached: parent.detached.then_some(true),
            };
            let parent = serde_json::to_value(parent).map_err(|error| {
                WorkflowError::Malformed(DecodeError::new("parent", error.to_string()))
            })?;
            fields.insert(PARENT_KEY.to_owned(), parent);
        }
        Ok(RunRpc(fields))
    }

    /// The workflow's payload and the parent.
    pub(super) fn split(mut self) -> (RawJson, Option<ParentJson>) {
        let parent =
            self.0.remove(PARENT_KEY).and_then(|parent| serde_json::from_value(parent).ok());
        let payload = RawJson::encode(&self.0).unwrap_or_else(|_| RawJson::empty_object());
        (payload, parent)
    }
}

impl Rpc for RunRpc {
    const TAG: &'static str = "run";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ResultJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(String::new())
    }
}

/// `activity`: one attempt of an activity.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ActivityRpc {
    pub(super) name: String,
    pub(super) attempt: u32,
    #[serde(default)]
    pub(super) with_transaction: bool,
}

impl Rpc for ActivityRpc {
    const TAG: &'static str = "activity";
    const PERSISTED: bool = true;
    // A caller that goes away (a race's loser, a run cut off) is seen by the handler as a
    // closed channel, which stores `Suspended` so that the activity runs again when called.
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Client;
    // `withTransaction` in the payload puts the handler (which hands the body the
    // transaction) and the saved result in one storage transaction, as the reference's
    // `ClusterSchema.Dynamic` annotation of its `activity` request does.
    const WITH_TRANSACTION_PER_REQUEST: bool = true;
    type Success = ResultJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(format!("{}/{}", self.name, self.attempt))
    }

    fn with_transaction(&self) -> bool {
        self.with_transaction
    }
}

/// `deferred`: a completion of a deferred.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct DeferredRpc {
    pub(super) name: String,
    pub(super) exit: ExitJson,
}

impl Rpc for DeferredRpc {
    const TAG: &'static str = "deferred";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ExitJson;
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.name.clone())
    }
}

/// `resume`: a wake, from a child (keyed by its execution id) or without one.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ResumeRpc {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) child_execution_id: Option<String>,
}

impl Rpc for ResumeRpc {
    const TAG: &'static str = "resume";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Server;
    type Success = ();
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.child_execution_id.clone().unwrap_or_default())
    }
}

/// The clock entity's `run`: wake deferred `DurableClock/<name>` at `wake_up` (epoch ms).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct ClockRpc {
    pub(super) name: String,
    pub(super) workflow_name: String,
    pub(super) wake_up: i64,
}

impl Rpc for ClockRpc {
    const TAG: &'static str = "run";
    const PERSISTED: bool = true;
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::Both;
    type Success = ();
    type Error = Never;

    fn primary_key(&self) -> Option<String> {
        Some(self.name.clone())
    }

    fn deliver_at(&self) -> Option<Timestamp> {
        Some(Timestamp::from_unix_millis(self.wake_up))
    }
}
