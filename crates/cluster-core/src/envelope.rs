//! Envelopes, replies and exits in domain form (`effect/src/cluster/Envelope.ts`).
//!
//! An [`Envelope`] is what travels to an entity: a [`Request`], an [`AckChunk`] (stream
//! backpressure) or an [`Interrupt`]. A [`Reply`] is what comes back: a [`Chunk`] of a streamed
//! response or the final [`WithExit`]. Payloads, headers and reply values are [`RawJson`], the
//! reference's opaque hole: encoded once by the caller, stored and shipped as is, decoded once by
//! the handler. This is the level at which storage and transport work; the typed request and
//! response types live above it.
//!
//! The reference's JSON form of all of these is in [`crate::encoded`].

use std::borrow::Cow;
use std::fmt;
use std::sync::OnceLock;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::error::DecodeError;
use crate::ids::{EntityAddress, Tag};
use crate::snowflake::Snowflake;

/// An already-encoded JSON value, passed through untouched (the reference's `OpaqueHole`).
///
/// It can also be *undefined*, the JavaScript value a void request or response carries: an
/// undefined field is left out of the encoded object (and becomes `null` inside an array), as
/// `JSON.stringify` does, so that TypeScript peers decode it as they expect.
#[derive(Clone, Default)]
pub struct RawJson(Repr);

/// Where the JSON text of a [`RawJson`] lives.
#[derive(Clone, Default)]
enum Repr {
    #[default]
    Undefined,
    /// A constant (`{}`, `null`): cloned and dropped without an allocation; every request
    /// without headers carries one.
    Static(&'static RawValue),
    Owned(Box<RawValue>),
}

/// `json`, a constant JSON text, as a value: parsed once into `cell` (borrowed when it parses,
/// which it always does, else copied), then cloned, which copies a reference.
fn constant(cell: &'static OnceLock<RawJson>, json: &'static str) -> RawJson {
    cell.get_or_init(|| match serde_json::from_str::<&'static RawValue>(json) {
        Ok(raw) => RawJson(Repr::Static(raw)),
        Err(_) => RawJson::from_json(json.to_owned()).unwrap_or_default(),
    })
    .clone()
}

impl RawJson {
    /// The undefined value.
    pub const fn undefined() -> RawJson {
        RawJson(Repr::Undefined)
    }

    /// JSON `null`.
    pub fn null() -> RawJson {
        static NULL: OnceLock<RawJson> = OnceLock::new();
        constant(&NULL, "null")
    }

    /// An empty JSON object, `{}`: the headers of a request that has none.
    pub fn empty_object() -> RawJson {
        static EMPTY_OBJECT: OnceLock<RawJson> = OnceLock::new();
        constant(&EMPTY_OBJECT, "{}")
    }

    /// `json` after checking that it is one well-formed JSON value.
    pub fn from_json(json: String) -> Result<RawJson, DecodeError> {
        RawValue::from_string(json)
            .map(|raw| RawJson(Repr::Owned(raw)))
            .map_err(|error| DecodeError::new("JSON value", error.to_string()))
    }

    /// `value` encoded as JSON.
    pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<RawJson, DecodeError> {
        serde_json::value::to_raw_value(value)
            .map(|raw| RawJson(Repr::Owned(raw)))
            .map_err(|error| DecodeError::new("JSON value", error.to_string()))
    }

    /// The value decoded as `T`; undefined decodes as `null` would.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, DecodeError> {
        serde_json::from_str(self.json_or_null())
            .map_err(|error| DecodeError::new("JSON value", error.to_string()))
    }

    /// Whether this is the undefined value.
    pub fn is_undefined(&self) -> bool {
        matches!(self.0, Repr::Undefined)
    }

    /// The JSON text, or `None` for undefined.
    pub fn json(&self) -> Option<&str> {
        self.raw().map(RawValue::get)
    }

    /// The JSON text, with undefined written as `null`.
    pub fn json_or_null(&self) -> &str {
        self.json().unwrap_or("null")
    }

    pub(crate) fn from_raw(raw: Box<RawValue>) -> RawJson {
        RawJson(Repr::Owned(raw))
    }

    pub(crate) fn raw(&self) -> Option<&RawValue> {
        match &self.0 {
            Repr::Undefined => None,
            Repr::Static(raw) => Some(raw),
            Repr::Owned(raw) => Some(raw),
        }
    }
}

impl PartialEq for RawJson {
    fn eq(&self, other: &RawJson) -> bool {
        self.json() == other.json()
    }
}

impl Eq for RawJson {}

impl fmt::Debug for RawJson {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.json() {
            Some(json) => write!(f, "RawJson({json})"),
            None => f.write_str("RawJson(undefined)"),
        }
    }
}

/// Trace context carried by a request (all three are set together by the reference).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceContext {
    /// The trace id.
    pub trace_id: Option<String>,
    /// The span id.
    pub span_id: Option<String>,
    /// Whether the trace is sampled.
    pub sampled: Option<bool>,
}

/// A request to an entity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// The request's id, a fresh snowflake per call.
    pub request_id: Snowflake,
    /// The entity it is addressed to.
    pub address: EntityAddress,
    /// The RPC's tag, such as `Increment`.
    pub tag: Tag,
    /// The encoded request payload.
    pub payload: RawJson,
    /// The encoded headers, a JSON object of strings (`{}` when there are none).
    pub headers: RawJson,
    /// Tracing context.
    pub trace: TraceContext,
}

/// A caller's acknowledgement of a streamed chunk; the entity produces the next chunk after it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AckChunk {
    /// The envelope's own id.
    pub id: Snowflake,
    /// The entity the request was addressed to.
    pub address: EntityAddress,
    /// The streaming request.
    pub request_id: Snowflake,
    /// The chunk being acknowledged.
    pub reply_id: Snowflake,
}

/// A caller's interruption of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interrupt {
    /// The envelope's own id.
    pub id: Snowflake,
    /// The entity the request was addressed to.
    pub address: EntityAddress,
    /// The request to interrupt.
    pub request_id: Snowflake,
}

/// What is delivered to an entity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Envelope {
    /// A request.
    Request(Request),
    /// An acknowledgement of a streamed chunk.
    AckChunk(AckChunk),
    /// An interruption of a request.
    Interrupt(Interrupt),
}

impl Envelope {
    /// The entity the envelope is addressed to.
    pub fn address(&self) -> &EntityAddress {
        match self {
            Envelope::Request(request) => &request.address,
            Envelope::AckChunk(ack) => &ack.address,
            Envelope::Interrupt(interrupt) => &interrupt.address,
        }
    }

    /// The request the envelope belongs to.
    pub fn request_id(&self) -> Snowflake {
        match self {
            Envelope::Request(request) => request.request_id,
            Envelope::AckChunk(ack) => ack.request_id,
            Envelope::Interrupt(interrupt) => interrupt.request_id,
        }
    }

    /// The envelope's own id (a request's id is its request id).
    pub fn id(&self) -> Snowflake {
        match self {
            Envelope::Request(request) => request.request_id,
            Envelope::AckChunk(ack) => ack.id,
            Envelope::Interrupt(interrupt) => interrupt.id,
        }
    }
}

/// One reason of a failure [`Cause`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CauseReason {
    /// An expected failure: the RPC's own error, encoded.
    Fail(RawJson),
    /// A defect: an unexpected error, encoded (an `Error` is `{"name", "message"}`).
    Die(RawJson),
    /// An interruption, with the interrupting fiber's id if the reference recorded one.
    Interrupt {
        /// The reference's fiber id; Rust senders leave it empty.
        fiber_id: Option<i64>,
    },
}

/// Why a request failed: one or more reasons.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause(pub Vec<CauseReason>);

impl Cause {
    /// Whether the cause has at least one reason and all of them are interruptions (the
    /// reference's `hasInterruptsOnly`).
    pub fn has_interrupts_only(&self) -> bool {
        !self.0.is_empty()
            && self.0.iter().all(|reason| matches!(reason, CauseReason::Interrupt { .. }))
    }

    /// Whether any reason is an interruption.
    pub fn has_interrupts(&self) -> bool {
        self.0.iter().any(|reason| matches!(reason, CauseReason::Interrupt { .. }))
    }
}

/// How a request ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Exit {
    /// It succeeded with an encoded value (undefined for a void response).
    Success(RawJson),
    /// It failed.
    Failure(Cause),
}

impl Exit {
    /// Success with no value (the reference's `Exit.void`, whose JSON value is `null`).
    pub fn void() -> Exit {
        Exit::Success(RawJson::null())
    }

    /// Failure with the RPC's own encoded error.
    pub fn fail(error: RawJson) -> Exit {
        Exit::Failure(Cause(vec![CauseReason::Fail(error)]))
    }

    /// Failure with an encoded defect.
    pub fn die(defect: RawJson) -> Exit {
        Exit::Failure(Cause(vec![CauseReason::Die(defect)]))
    }

    /// Failure with a defect encoded like a JavaScript `Error`: `{"name":…,"message":…}`.
    pub fn die_with_message(name: &str, message: &str) -> Exit {
        #[derive(Serialize)]
        struct ErrorJson<'a> {
            name: &'a str,
            message: &'a str,
        }
        let defect =
            RawJson::encode(&ErrorJson { name, message }).unwrap_or_else(|_| RawJson::null());
        Exit::die(defect)
    }

    /// Failure by interruption.
    pub fn interrupt() -> Exit {
        Exit::Failure(Cause(vec![CauseReason::Interrupt { fiber_id: None }]))
    }

    /// Whether this is a success.
    pub fn is_success(&self) -> bool {
        matches!(self, Exit::Success(_))
    }
}

/// The final reply of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WithExit {
    /// The request it answers.
    pub request_id: Snowflake,
    /// The reply's own id.
    pub id: Snowflake,
    /// How the request ended.
    pub exit: Exit,
}

/// A chunk of a streamed response: one or more encoded values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunk {
    request_id: Snowflake,
    id: Snowflake,
    sequence: u32,
    values: Vec<RawJson>,
}

impl Chunk {
    /// A chunk of `values`, the `sequence`-th of the request; `None` if `values` is empty.
    pub fn new(
        request_id: Snowflake,
        id: Snowflake,
        sequence: u32,
        values: Vec<RawJson>,
    ) -> Option<Chunk> {
        (!values.is_empty()).then_some(Chunk { request_id, id, sequence, values })
    }

    /// The reference's `Chunk.emptyFrom`: id 0, sequence 0, one undefined value.
    pub fn empty_from(request_id: Snowflake) -> Chunk {
        Chunk { request_id, id: Snowflake::new(0), sequence: 0, values: vec![RawJson::undefined()] }
    }

    /// The request it belongs to.
    pub fn request_id(&self) -> Snowflake {
        self.request_id
    }

    /// The chunk's own id.
    pub fn id(&self) -> Snowflake {
        self.id
    }

    /// Its position in the stream, counting from 0.
    pub fn sequence(&self) -> u32 {
        self.sequence
    }

    /// The values, never empty.
    pub fn values(&self) -> &[RawJson] {
        &self.values
    }

    /// The same chunk for another request id (duplicate-request rewriting).
    pub fn with_request_id(mut self, request_id: Snowflake) -> Chunk {
        self.request_id = request_id;
        self
    }
}

/// A reply to a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// The final reply.
    WithExit(WithExit),
    /// A chunk of a streamed response.
    Chunk(Chunk),
}

impl Reply {
    /// The request it answers.
    pub fn request_id(&self) -> Snowflake {
        match self {
            Reply::WithExit(with_exit) => with_exit.request_id,
            Reply::Chunk(chunk) => chunk.request_id,
        }
    }

    /// The reply's own id.
    pub fn id(&self) -> Snowflake {
        match self {
            Reply::WithExit(with_exit) => with_exit.id,
            Reply::Chunk(chunk) => chunk.id,
        }
    }

    /// Whether this is the final reply.
    pub fn is_final(&self) -> bool {
        matches!(self, Reply::WithExit(_))
    }

    /// The final reply standing for a stored reply that cannot be decoded: a defect naming
    /// `MalformedMessage`, with the stored ids, so the caller gets an answer instead of a hang.
    pub fn malformed(request_id: Snowflake, id: Snowflake, error: &DecodeError) -> Reply {
        Reply::WithExit(WithExit {
            request_id,
            id,
            exit: Exit::die_with_message("MalformedMessage", &error.to_string()),
        })
    }
}

/// The longest primary key stored as is; longer keys are stored as their SHA-256
/// (`effect/src/cluster/Sharding.ts`).
pub const MESSAGE_ID_LENGTH_MAX: usize = 255;

/// The storage key of a request with a primary key: `<entity type>/<entity id>/<tag>/<key>`.
///
/// Two requests with the same storage key are one request: the second save is a duplicate.
pub fn primary_key(address: &EntityAddress, tag: &str, key: &str) -> String {
    format!("{}/{}/{tag}/{key}", address.entity_type, address.entity_id.as_str())
}

/// The `message_id` column value of a primary key: the key itself when it has at most
/// [`MESSAGE_ID_LENGTH_MAX`] UTF-16 code units (the reference's `length`), else its lowercase
/// hex SHA-256. Digests never contain `/` while composed keys always do, so they cannot clash.
pub fn message_id(primary_key: &str) -> Cow<'_, str> {
    if primary_key.encode_utf16().count() <= MESSAGE_ID_LENGTH_MAX {
        return Cow::Borrowed(primary_key);
    }
    let digest = Sha256::digest(primary_key.as_bytes());
    let mut hex = String::with_capacity(64);
    for byte in digest {
        hex.push(char::from_digit(u32::from(byte >> 4), 16).unwrap_or('0'));
        hex.push(char::from_digit(u32::from(byte & 0xf), 16).unwrap_or('0'));
    }
    Cow::Owned(hex)
}

#[cfg(test)]
mod tests;
