//! The gateway's OpenAPI 3.1 document (`GET /openapi.json`), in the shape of the reference's
//! (`OpenApi.fromApi` over the entity and workflow proxy groups): one tag per entity type or
//! workflow, operation ids `<group>.<Tag>` and `<group>.<Tag>Discard`, the path parameter
//! `entityId`, the statuses the gateway answers with, and the cluster errors as components
//! under the reference's names.
//!
//! The payload, success and error schemas of a request type are open (`{}`): the runtime knows
//! their JSON, not their schema; unless the application documented them from `schemars`
//! (feature `schemars`, `http/schemas.rs`), which puts them in place of the open ones.

use std::collections::BTreeMap;

use serde_json::Value;
use utoipa::openapi::path::{OperationBuilder, ParameterBuilder, ParameterIn};
use utoipa::openapi::request_body::RequestBodyBuilder;
use utoipa::openapi::schema::{AnyOfBuilder, OneOfBuilder, SchemaType};
use utoipa::openapi::{
    ComponentsBuilder, ContentBuilder, HttpMethod, InfoBuilder, ObjectBuilder, OpenApi,
    OpenApiBuilder, PathItem, PathsBuilder, Ref, RefOr, Required, ResponseBuilder, Schema, Type,
};

/// What the document needs of one routed request type.
pub(super) struct EntityOperation<'a> {
    pub(super) group: &'a str,
    pub(super) prefix: &'a [String],
    pub(super) tag: &'a str,
    pub(super) void_success: bool,
    pub(super) stream: bool,
}

/// What the document needs of one workflow.
pub(super) struct WorkflowOperation<'a> {
    pub(super) prefix: &'a [String],
    pub(super) name: &'a str,
}

/// The schemas of one request type or workflow, as JSON Schemas; `None` leaves a schema open.
#[derive(Debug, Default)]
pub(super) struct OperationSchemas {
    pub(super) payload: Option<Value>,
    /// The success (not for a void success or a stream).
    pub(super) success: Option<Value>,
    pub(super) error: Option<Value>,
    /// A stream's item.
    pub(super) item: Option<Value>,
}

/// What a set of documented schemas is for.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Documents {
    /// The request type of an entity type: its type and its tag.
    Rpc(String, String),
    /// A workflow, by name.
    Workflow(String),
}

/// The schemas the application documented, and the components they refer to.
#[derive(Debug, Default)]
pub(super) struct Documented {
    pub(super) operations: BTreeMap<Documents, OperationSchemas>,
    pub(super) definitions: serde_json::Map<String, Value>,
}

/// The reference's component names of the cluster errors.
const MAILBOX_FULL: &str = "_effect_cluster_ClusterError_MailboxFullEncoded";
const ALREADY_PROCESSING: &str = "_effect_cluster_ClusterError_AlreadyProcessingMessageEncoded";
const PERSISTENCE: &str = "_effect_cluster_ClusterError_PersistenceErrorEncoded";
const NOT_ASSIGNED: &str = "_effect_cluster_ClusterError_EntityNotAssignedToRunnerEncoded";
const ADDRESS: &str = "_effect_cluster_EntityAddressEncoded";
/// The gateway's decoding error (400).
const SCHEMA_ERROR: &str = "HttpApiSchemaError";

/// The document of `entities` and `workflows`, with `errors` (a `_tag` and its status) as
/// extra responses and the `documented` schemas in place of open ones.
pub(super) fn document(
    title: &str,
    entities: &[EntityOperation<'_>],
    workflows: &[WorkflowOperation<'_>],
    errors: &[(String, u16)],
    documented: &Documented,
) -> Value {
    let document = open_document(title, entities, workflows, errors);
    // A document of strings, numbers and maps always serializes.
    let mut document = serde_json::to_value(document).unwrap_or_default();
    for operation in entities {
        let key = Documents::Rpc(operation.group.to_owned(), operation.tag.to_owned());
        let Some(schemas) = documented.operations.get(&key) else { continue };
        let path = entity_path(operation);
        place(&mut document, &path, schemas);
        if !operation.stream {
            // A discard answers no success and no typed error.
            let discard =
                OperationSchemas { payload: schemas.payload.clone(), ..Default::default() };
            place(&mut document, &format!("{path}/discard"), &discard);
        }
    }
    for workflow in workflows {
        let key = Documents::Workflow(workflow.name.to_owned());
        let Some(schemas) = documented.operations.get(&key) else { continue };
        let base = workflow_path(workflow);
        place(&mut document, &base, schemas);
        let discard = OperationSchemas { payload: schemas.payload.clone(), ..Default::default() };
        place(&mut document, &format!("{base}/discard"), &discard);
    }
    if let Some(components) =
        document.pointer_mut("/components/schemas").and_then(Value::as_object_mut)
    {
        for (name, schema) in &documented.definitions {
            // The cluster errors keep the reference's schemas.
            components.entry(name.clone()).or_insert_with(|| schema.clone());
        }
    }
    document
}

/// Puts `schemas` in place of the open schemas of the `POST` operation at `path`: the request
/// body, the success (or a stream's item) and the typed error (the first of the 500 answer's
/// `anyOf`, or its whole schema for a workflow). An error that matches nothing (`false`, a
/// `Never`) is left out of the `anyOf`.
fn place(document: &mut Value, path: &str, schemas: &OperationSchemas) {
    let Some(operation) = document
        .get_mut("paths")
        .and_then(|paths| paths.get_mut(path))
        .and_then(|item| item.get_mut("post"))
    else {
        return;
    };
    let mut set = |pointer: &str, schema: &Option<Value>| {
        if let (Some(slot), Some(schema)) = (operation.pointer_mut(pointer), schema) {
            *slot = schema.clone();
        }
    };
    set("/requestBody/content/application~1json/schema", &schemas.payload);
    set("/responses/200/content/application~1json/schema", &schemas.success);
    set(
        "/responses/200/content/application~1x-ndjson/schema/oneOf/0/properties/item",
        &schemas.item,
    );
    let Some(error) = &schemas.error else { return };
    let Some(failed) = operation.pointer_mut("/responses/500/content/application~1json/schema")
    else {
        return;
    };
    match failed.get_mut("anyOf").and_then(Value::as_array_mut) {
        // The typed error's slot is the first; the cluster errors follow.
        Some(any_of) if any_of.is_empty() => {}
        Some(any_of) if *error == Value::Bool(false) => {
            any_of.remove(0);
        }
        Some(any_of) => any_of[0] = error.clone(),
        None => *failed = error.clone(),
    }
}

/// The document with open schemas.
fn open_document(
    title: &str,
    entities: &[EntityOperation<'_>],
    workflows: &[WorkflowOperation<'_>],
    errors: &[(String, u16)],
) -> OpenApi {
    let mut paths = PathsBuilder::new();
    for operation in entities {
        let path = entity_path(operation);
        let call = entity_operation(operation, false, errors);
        paths = paths.path(path.clone(), PathItem::new(HttpMethod::Post, call));
        if operation.stream {
            // A stream has no discard route.
            continue;
        }
        let discard = entity_operation(operation, true, errors);
        paths = paths.path(format!("{path}/discard"), PathItem::new(HttpMethod::Post, discard));
    }
    for workflow in workflows {
        let base = workflow_path(workflow);
        for (suffix, operation) in [
            ("", workflow_execute(workflow, errors)),
            ("/discard", workflow_discard(workflow)),
            ("/resume", workflow_by_id(workflow, "Resume", no_content())),
            ("/poll", workflow_by_id(workflow, "Poll", polled())),
            ("/interrupt", workflow_by_id(workflow, "Interrupt", no_content())),
        ] {
            let item = PathItem::new(HttpMethod::Post, operation);
            paths = paths.path(format!("{base}{suffix}"), item);
        }
    }
    if !workflows.is_empty() {
        for (suffix, id) in [("", "deferred.Complete"), ("/fail", "deferred.Fail")] {
            let token = ParameterBuilder::new()
                .name("token")
                .parameter_in(ParameterIn::Path)
                .required(Required::True)
                .schema(Some(string()));
            let operation = OperationBuilder::new()
                .tag("deferred")
                .operation_id(Some(id))
                .parameter(token)
                .request_body(Some(json_body(any()).build()))
                .response("204", no_content())
                .response("403", forbidden())
                .response(
                    "404",
                    ResponseBuilder::new()
                        .description("No such execution, or a workflow not served here"),
                );
            let operation = gateway_answers(operation);
            let path = format!("/deferred/{{token}}{suffix}");
            paths = paths.path(path, PathItem::new(HttpMethod::Post, operation));
        }
    }
    OpenApiBuilder::new()
        .info(InfoBuilder::new().title(title).version("0.0.1").build())
        .paths(paths.build())
        .components(Some(components()))
        .build()
}

/// `/{prefix}/{segment}`.
fn path_of(prefix: &[String], segment: &str) -> String {
    prefix.iter().map(|part| format!("/{part}")).chain([format!("/{segment}")]).collect()
}

/// `/{prefix}/{tag in lowercase}/{entityId}`: a request type's call route.
fn entity_path(operation: &EntityOperation<'_>) -> String {
    format!("{}/{{entityId}}", path_of(operation.prefix, &operation.tag.to_lowercase()))
}

/// `/{prefix}/{name in lowercase}`: a workflow's execute route.
fn workflow_path(workflow: &WorkflowOperation<'_>) -> String {
    path_of(workflow.prefix, &workflow.name.to_lowercase())
}

/// An open schema (`{}`): any JSON.
fn any() -> Schema {
    Schema::Object(ObjectBuilder::new().schema_type(SchemaType::AnyValue).build())
}

fn string() -> Schema {
    Schema::Object(ObjectBuilder::new().schema_type(Type::String).build())
}

fn json_body(schema: Schema) -> RequestBodyBuilder {
    RequestBodyBuilder::new()
        .content("application/json", ContentBuilder::new().schema(Some(schema)).build())
        .required(Some(Required::True))
}

/// A line of a stream's NDJSON answer: an item, or the end.
fn line() -> Schema {
    let item = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("item", any())
        .required("item")
        .build();
    let ends = ["complete", "failed", "defect", "interrupted"];
    let end_kind = ObjectBuilder::new().schema_type(Type::String).enum_values(Some(ends));
    let end = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("end", end_kind)
        .property("error", any())
        .required("end")
        .build();
    Schema::OneOf(OneOfBuilder::new().item(item).item(end).build())
}

/// `anyOf` the typed error (open) and the cluster errors named.
fn errors_of(typed: bool, cluster: &[&str]) -> Schema {
    let mut any_of = AnyOfBuilder::new();
    if typed {
        any_of = any_of.item(any());
    }
    for name in cluster {
        any_of = any_of.item(Ref::from_schema_name(*name));
    }
    Schema::AnyOf(any_of.build())
}

/// The operation of a request type's route or of its discard route.
fn entity_operation(
    operation: &EntityOperation<'_>,
    discard: bool,
    errors: &[(String, u16)],
) -> OperationBuilder {
    let id = if discard {
        format!("{}.{}Discard", operation.group, operation.tag)
    } else {
        format!("{}.{}", operation.group, operation.tag)
    };
    let entity_id = ParameterBuilder::new()
        .name("entityId")
        .parameter_in(ParameterIn::Path)
        .required(Required::True)
        .schema(Some(string()));
    let mut built = OperationBuilder::new()
        .tag(operation.group)
        .operation_id(Some(id))
        .parameter(entity_id)
        .request_body(Some(json_body(any()).build()));
    if discard {
        let failed = errors_of(false, &[MAILBOX_FULL, ALREADY_PROCESSING, PERSISTENCE]);
        built = built.response("204", no_content());
        built = built.response("500", error_response(failed));
        return gateway_answers(built);
    }
    let success = if operation.stream {
        // One line or event per item, then the end (see `http/stream.rs`).
        ResponseBuilder::new()
            .description("The items, then the end")
            .content("application/x-ndjson", ContentBuilder::new().schema(Some(line())).build())
            .content("text/event-stream", ContentBuilder::new().schema(Some(string())).build())
    } else if operation.void_success {
        no_content()
    } else {
        json_answer("Success", any())
    };
    let failed = errors_of(true, &[MAILBOX_FULL, ALREADY_PROCESSING, PERSISTENCE, NOT_ASSIGNED]);
    built = built.response("200", success).response("500", error_response(failed));
    gateway_answers(with_error_statuses(built, errors))
}

/// The gateway's own answers, beyond the reference's: 400 (the body does not decode as the
/// payload, with the decoding error, or an id holds a control character), 408 (the body was
/// not sent within the body-read timeout), 413 (the body is over the limit), 415 (not JSON, or
/// no content type) and 504 (the call took longer than the request timeout).
fn gateway_answers(operation: OperationBuilder) -> OperationBuilder {
    let decode = json_answer(
        "The body does not decode as the payload, or an id holds a control character",
        Ref::from_schema_name(SCHEMA_ERROR),
    );
    operation
        .response("400", decode)
        .response("408", ResponseBuilder::new().description("The body was not sent in time"))
        .response("413", ResponseBuilder::new().description("The body is over the limit"))
        .response(
            "415",
            ResponseBuilder::new().description("The content type is not application/json"),
        )
        .response("504", ResponseBuilder::new().description("The call timed out"))
}

/// An answer with a JSON body of `schema`.
fn json_answer(description: &str, schema: impl Into<RefOr<Schema>>) -> ResponseBuilder {
    ResponseBuilder::new()
        .description(description)
        .content("application/json", ContentBuilder::new().schema(Some(schema)).build())
}

/// A 500 (or another error status) answer with `schema`.
fn error_response(schema: Schema) -> ResponseBuilder {
    json_answer("Error", schema)
}

/// The statuses given to error tags, as extra responses.
fn with_error_statuses(
    mut operation: OperationBuilder,
    errors: &[(String, u16)],
) -> OperationBuilder {
    for (tag, status) in errors {
        operation = operation.response(status.to_string(), error_response(any()).description(tag));
    }
    operation
}

fn workflow_execute(
    workflow: &WorkflowOperation<'_>,
    errors: &[(String, u16)],
) -> OperationBuilder {
    let operation = OperationBuilder::new()
        .tag(workflow.name)
        .operation_id(Some(format!("{0}.{0}", workflow.name)))
        .request_body(Some(json_body(any()).build()))
        .response("200", json_answer("Success", any()))
        .response("500", error_response(any()));
    gateway_answers(with_error_statuses(operation, errors))
}

fn workflow_discard(workflow: &WorkflowOperation<'_>) -> OperationBuilder {
    let started = json_answer("The execution id", string());
    let operation = OperationBuilder::new()
        .tag(workflow.name)
        .operation_id(Some(format!("{0}.{0}Discard", workflow.name)))
        .request_body(Some(json_body(any()).build()))
        .response("200", started);
    gateway_answers(operation)
}

/// A workflow route refused for want of a capability (a signed token or execution handle)
/// or of the authorizer's consent.
fn forbidden() -> ResponseBuilder {
    ResponseBuilder::new().description("No valid capability for this execution")
}

fn no_content() -> ResponseBuilder {
    ResponseBuilder::new().description("<No Content>")
}

fn polled() -> ResponseBuilder {
    json_answer("The stored result, or null", any())
}

/// An operation whose body names an execution (`{"executionId": ...}`).
fn workflow_by_id(
    workflow: &WorkflowOperation<'_>,
    operation: &str,
    answer: ResponseBuilder,
) -> OperationBuilder {
    let body = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("executionId", string())
        .required("executionId")
        .property("token", string())
        .build();
    let status = if operation == "Poll" { "200" } else { "204" };
    let operation = OperationBuilder::new()
        .tag(workflow.name)
        .operation_id(Some(format!("{0}.{0}{operation}", workflow.name)))
        .request_body(Some(json_body(Schema::Object(body)).build()))
        .response(status, answer)
        .response("403", forbidden());
    gateway_answers(operation)
}

/// A tagged error object: `_tag` with `tag` and the `fields`.
fn tagged(tag: &str, fields: Vec<(&str, utoipa::openapi::RefOr<Schema>)>) -> Schema {
    let tag_schema = ObjectBuilder::new().schema_type(Type::String).enum_values(Some([tag]));
    let mut object = ObjectBuilder::new().schema_type(Type::Object).property("_tag", tag_schema);
    object = object.required("_tag");
    for (name, schema) in fields {
        object = object.property(name, schema).required(name);
    }
    Schema::Object(object.build())
}

/// The cluster errors and the entity address, as the reference encodes them.
fn components() -> utoipa::openapi::Components {
    let integer = ObjectBuilder::new().schema_type(Type::Integer).build();
    let shard = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("group", string())
        .property("id", integer)
        .required("group")
        .required("id")
        .build();
    let address = ObjectBuilder::new()
        .schema_type(Type::Object)
        .property("shardId", shard)
        .property("entityType", string())
        .property("entityId", string())
        .required("shardId")
        .required("entityType")
        .required("entityId")
        .build();
    let address_ref = || Ref::from_schema_name(ADDRESS).into();
    ComponentsBuilder::new()
        .schema(ADDRESS, Schema::Object(address))
        .schema(MAILBOX_FULL, tagged("MailboxFull", vec![("address", address_ref())]))
        .schema(
            ALREADY_PROCESSING,
            tagged(
                "AlreadyProcessingMessage",
                vec![("envelopeId", string().into()), ("address", address_ref())],
            ),
        )
        .schema(PERSISTENCE, tagged("PersistenceError", vec![("cause", any().into())]))
        .schema(NOT_ASSIGNED, tagged("EntityNotAssignedToRunner", vec![("address", address_ref())]))
        .schema(SCHEMA_ERROR, tagged(SCHEMA_ERROR, vec![("message", string().into())]))
        .build()
}
