//! What a run leaves: a [`WorkflowResult`] (`Complete` with the execution's exit, or
//! `Suspended`), stored as the reply of the execution's `run` request in the reference's JSON
//! form (`effect/src/workflow/Workflow.ts`), and the typed view of a failure cause
//! ([`FailureCause`]) that compensations and finalizers receive.

use cluster_core::DecodeError;
use cluster_core::encoded::JsonForm;
use cluster_core::envelope::{Cause, CauseReason, Exit, RawJson};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;

/// The latest result of an execution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkflowResult {
    /// The execution ended with this exit; it never runs again.
    Complete(Exit),
    /// The last run suspended: it waits for a deferred, a clock, a child or an explicit resume.
    Suspended {
        /// Why, when a step suspended with a cause.
        cause: Option<Cause>,
        /// The execution's own `suspend_on_failure` fired: only an explicit resume or an
        /// interrupt moves it on.
        failed: bool,
    },
}

impl WorkflowResult {
    /// A plain suspension.
    pub fn suspended() -> WorkflowResult {
        WorkflowResult::Suspended { cause: None, failed: false }
    }

    /// Whether this is a suspension.
    pub fn is_suspended(&self) -> bool {
        matches!(self, WorkflowResult::Suspended { .. })
    }

    /// The reference's JSON form: `{"_tag":"Complete","exit":…}` or
    /// `{"_tag":"Suspended"[,"cause":[…]][,"failed":true]}`.
    pub fn to_json(&self) -> String {
        match self {
            WorkflowResult::Complete(exit) => {
                format!(r#"{{"_tag":"Complete","exit":{}}}"#, exit.to_json())
            }
            WorkflowResult::Suspended { cause, failed } => {
                let mut out = String::from(r#"{"_tag":"Suspended""#);
                if let Some(cause) = cause {
                    out.push_str(r#","cause":"#);
                    out.push_str(&cause_json(cause));
                }
                if *failed {
                    out.push_str(r#","failed":true"#);
                }
                out.push('}');
                out
            }
        }
    }

    /// Reads the JSON form.
    ///
    /// # Errors
    ///
    /// [`DecodeError`] when the text is not a result.
    pub fn from_json(json: &str) -> Result<WorkflowResult, DecodeError> {
        #[derive(Deserialize)]
        struct Wire<'a> {
            #[serde(rename = "_tag")]
            tag: String,
            #[serde(borrow)]
            exit: Option<&'a RawValue>,
            #[serde(borrow)]
            cause: Option<&'a RawValue>,
            failed: Option<bool>,
        }
        let wire: Wire<'_> = serde_json::from_str(json)
            .map_err(|error| DecodeError::new("workflow result", error.to_string()))?;
        match wire.tag.as_str() {
            "Complete" => {
                let exit = wire
                    .exit
                    .ok_or_else(|| DecodeError::new("workflow result", "missing `exit`"))?;
                Ok(WorkflowResult::Complete(Exit::from_json(exit.get())?))
            }
            "Suspended" => {
                let cause = match wire.cause {
                    None => None,
                    Some(cause) => {
                        let exit = format!(r#"{{"_tag":"Failure","cause":{}}}"#, cause.get());
                        match Exit::from_json(&exit)? {
                            Exit::Failure(cause) => Some(cause),
                            Exit::Success(_) => None,
                        }
                    }
                };
                Ok(WorkflowResult::Suspended { cause, failed: wire.failed.unwrap_or(false) })
            }
            other => Err(DecodeError::new("workflow result", format!("unknown `_tag` {other:?}"))),
        }
    }
}

/// The JSON array of a cause's reasons.
fn cause_json(cause: &Cause) -> String {
    let exit = Exit::Failure(cause.clone()).to_json();
    serde_json::from_str::<serde_json::Value>(&exit)
        .ok()
        .and_then(|mut value| value.get_mut("cause").map(serde_json::Value::take))
        .map_or_else(|| "[]".to_owned(), |cause| cause.to_string())
}

/// The interrupt reason of a cause.
pub(crate) fn interrupt_reason() -> CauseReason {
    CauseReason::Interrupt { fiber_id: None }
}

/// A cause with its interrupts removed when it has other reasons (the reference's filter).
pub(crate) fn filter_interrupts(cause: Cause) -> Cause {
    if cause.has_interrupts_only() {
        return cause;
    }
    Cause(
        cause
            .0
            .into_iter()
            .filter(|reason| !matches!(reason, CauseReason::Interrupt { .. }))
            .collect(),
    )
}

/// The reference's `Cause.squash` as a defect: the first typed error or defect, else an
/// interrupt message.
pub(crate) fn squash(cause: &Cause) -> RawJson {
    for reason in &cause.0 {
        match reason {
            CauseReason::Fail(error) | CauseReason::Die(error) => return error.clone(),
            CauseReason::Interrupt { .. } => {}
        }
    }
    let exit = Exit::die_with_message("InterruptedException", "Interrupted");
    match exit {
        Exit::Failure(Cause(mut reasons)) => match reasons.pop() {
            Some(CauseReason::Die(defect)) => defect,
            _ => RawJson::null(),
        },
        Exit::Success(_) => RawJson::null(),
    }
}

/// Why an execution failed, as its compensations and workflow finalizers see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureCause(pub Cause);

impl FailureCause {
    /// Whether an interrupt is among the reasons (an interrupted execution).
    pub fn is_interrupted(&self) -> bool {
        self.0.has_interrupts()
    }

    /// The typed error, when the failure is one and it decodes as `E`.
    pub fn error<E: DeserializeOwned>(&self) -> Option<E> {
        self.0.0.iter().find_map(|reason| match reason {
            CauseReason::Fail(error) => error.decode().ok(),
            _ => None,
        })
    }

    /// The defect's JSON, when the failure is a defect.
    pub fn defect(&self) -> Option<&str> {
        self.0.0.iter().find_map(|reason| match reason {
            CauseReason::Die(defect) => Some(defect.json_or_null()),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_use_the_reference_json() {
        let cases = [
            (
                WorkflowResult::Complete(Exit::Success(RawJson::encode(&2).unwrap())),
                r#"{"_tag":"Complete","exit":{"_tag":"Success","value":2}}"#,
            ),
            (
                WorkflowResult::Complete(Exit::fail(RawJson::encode("boom").unwrap())),
                r#"{"_tag":"Complete","exit":{"_tag":"Failure","cause":[{"_tag":"Fail","error":"boom"}]}}"#,
            ),
            (WorkflowResult::suspended(), r#"{"_tag":"Suspended"}"#),
        ];
        for (result, json) in cases {
            assert_eq!(result.to_json(), json);
            assert_eq!(WorkflowResult::from_json(json).unwrap(), result);
        }
        let failed = WorkflowResult::Suspended {
            cause: Some(Cause(vec![CauseReason::Die(RawJson::encode("boom").unwrap())])),
            failed: true,
        };
        let json = failed.to_json();
        assert!(json.starts_with(r#"{"_tag":"Suspended","cause":[{"_tag":"Die""#), "{json}");
        assert!(json.ends_with(r#","failed":true}"#), "{json}");
        assert_eq!(WorkflowResult::from_json(&json).unwrap(), failed);
        for bad in ["", "{}", r#"{"_tag":"Complete"}"#, r#"{"_tag":"Other"}"#] {
            assert!(WorkflowResult::from_json(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn interrupts_are_filtered_only_beside_other_reasons() {
        let fail = CauseReason::Fail(RawJson::encode("e").unwrap());
        let mixed = Cause(vec![interrupt_reason(), fail.clone()]);
        assert_eq!(filter_interrupts(mixed), Cause(vec![fail]));
        let only = Cause(vec![interrupt_reason()]);
        assert_eq!(filter_interrupts(only.clone()), only);
    }
}
