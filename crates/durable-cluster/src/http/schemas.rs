//! Payload, success and error schemas in the gateway's OpenAPI document (feature `schemars`):
//! the application names the request types and workflows whose types derive
//! `schemars::JsonSchema`, and their routes are documented with those schemas instead of open
//! ones (`{}`).
//!
//! One generator makes every schema, so a type used by several routes is one component under
//! `#/components/schemas/`, and two types of the same name get distinct names. The schemas
//! are of what the types deserialize (schemars' default contract): a field with a serde
//! default is optional in them.

use std::sync::Mutex;

use cluster_sharding::{Handler, Rpc, StreamHandler, StreamRpc};
use schemars::{JsonSchema, SchemaGenerator, generate::SchemaSettings};

use super::HttpGateway;
use super::openapi::{Documents, OperationSchemas};

/// The generator of a gateway's schemas, behind a lock: the gateway is shared between
/// threads and a generator cannot be.
pub(super) struct Generator(Mutex<SchemaGenerator>);

impl Default for Generator {
    fn default() -> Generator {
        let mut settings = SchemaSettings::draft2020_12();
        // OpenAPI 3.1's schemas are JSON Schema 2020-12, referenced from the components.
        settings.definitions_path = "/components/schemas".into();
        settings.meta_schema = None;
        Generator(Mutex::new(settings.into_generator()))
    }
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator").finish_non_exhaustive()
    }
}

impl HttpGateway {
    /// Documents the routes of the request type `R` of the entity type `E` with the schemas of
    /// its payload, its success and its error (`Never` as an error is documented as no error).
    #[must_use]
    pub fn schemas<E, R>(self) -> HttpGateway
    where
        E: Handler<R>,
        R: Rpc + JsonSchema,
        R::Success: JsonSchema,
        R::Error: JsonSchema,
    {
        let void = std::any::TypeId::of::<R::Success>() == std::any::TypeId::of::<()>();
        let documents = Documents::Rpc(E::TYPE.to_owned(), R::TAG.to_owned());
        self.with_schemas(documents, |generator| OperationSchemas {
            payload: Some(generator.subschema_for::<R>().to_value()),
            success: (!void).then(|| generator.subschema_for::<R::Success>().to_value()),
            error: Some(generator.subschema_for::<R::Error>().to_value()),
            item: None,
        })
    }

    /// Documents the route of the streaming request type `R` of the entity type `E` with the
    /// schemas of its payload, its items and its error.
    #[must_use]
    pub fn stream_schemas<E, R>(self) -> HttpGateway
    where
        E: StreamHandler<R>,
        R: StreamRpc + JsonSchema,
        R::Item: JsonSchema,
        R::Error: JsonSchema,
    {
        let documents = Documents::Rpc(E::TYPE.to_owned(), R::TAG.to_owned());
        self.with_schemas(documents, |generator| OperationSchemas {
            payload: Some(generator.subschema_for::<R>().to_value()),
            success: None,
            error: Some(generator.subschema_for::<R::Error>().to_value()),
            item: Some(generator.subschema_for::<R::Item>().to_value()),
        })
    }

    /// Documents the routes of the workflow `W` with the schemas of its payload, its success
    /// and its error.
    #[cfg(feature = "workflow")]
    #[must_use]
    pub fn workflow_schemas<W>(self) -> HttpGateway
    where
        W: cluster_workflow::Workflow,
        W::Payload: JsonSchema,
        W::Success: JsonSchema,
        W::Error: JsonSchema,
    {
        self.with_schemas(Documents::Workflow(W::NAME.to_owned()), |generator| OperationSchemas {
            payload: Some(generator.subschema_for::<W::Payload>().to_value()),
            success: Some(generator.subschema_for::<W::Success>().to_value()),
            error: Some(generator.subschema_for::<W::Error>().to_value()),
            item: None,
        })
    }

    /// Records the schemas `make` gives for the routes of `documents`, and the components they
    /// refer to.
    fn with_schemas(
        mut self,
        documents: Documents,
        make: impl FnOnce(&mut SchemaGenerator) -> OperationSchemas,
    ) -> HttpGateway {
        let mut generator = cluster_core::sync::lock(&self.generator.0);
        let schemas = make(&mut generator);
        let definitions = generator.take_definitions(true);
        drop(generator);
        self.documented.definitions.extend(definitions);
        self.documented.operations.insert(documents, schemas);
        self
    }
}
