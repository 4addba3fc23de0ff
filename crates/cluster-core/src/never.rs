//! [`Never`]: the error type of requests and steps that cannot fail.

use serde::{Deserialize, Serialize};

/// An error type with no values, for requests and workflow steps that cannot fail.
///
/// It serializes as nothing can: no value of it exists. Use it as `Rpc::Error` or as an
/// activity's error type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Never {}

impl std::fmt::Display for Never {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {}
    }
}

impl std::error::Error for Never {}

/// No value matches `Never`: its schema is `false`, JSON Schema's schema that matches nothing.
#[cfg(feature = "schemars")]
impl schemars::JsonSchema for Never {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Never".into()
    }

    fn inline_schema() -> bool {
        true
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        false.into()
    }
}
