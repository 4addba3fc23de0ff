//! The reference's JSON form of envelopes, replies, exits and runner records
//! (`effect/src/cluster/Envelope.ts`).
//!
//! These are the only serde-encoded forms of the domain types: [`JsonForm`]
//! writes and reads them byte-compatibly with effect 4.1.0, so a row or frame written by a
//! TypeScript runner is read here and the other way round. Field order is the reference's;
//! snowflakes are decimal strings; payloads and values are passed through as raw JSON text and
//! never re-encoded; an undefined hole is left out of its object, as `JSON.stringify` does.
//!
//! Decoding is lenient where the reference is (unknown fields are ignored, snowflakes may also be
//! JSON integers) and strict where a wrong value would corrupt routing (shard numbers, tags).

use serde::de::{self, Deserializer};
use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::value::RawValue;

use crate::envelope::{
    AckChunk, Cause, CauseReason, Chunk, Envelope, Exit, Interrupt, RawJson, Reply, Request,
    TraceContext, WithExit,
};
use crate::error::DecodeError;
use crate::ids::{
    EntityAddress, EntityId, EntityType, Runner, RunnerAddress, RunnerWeight, ShardGroup, ShardId,
};
use crate::snowflake::Snowflake;

/// A domain type with a JSON form shared with the reference.
pub trait JsonForm: Sized {
    /// The JSON text.
    fn to_json(&self) -> String;

    /// The value read from JSON text; malformed input is a [`DecodeError`], never a panic.
    fn from_json(json: &str) -> Result<Self, DecodeError>;
}

macro_rules! json_form {
    ($type:ty, $ser:ident, $wire:ty, $what:literal) => {
        impl JsonForm for $type {
            fn to_json(&self) -> String {
                // Serializing these structures writes strings, numbers and already-valid raw
                // JSON into a Vec: it has no failure path.
                serde_json::to_string(&$ser(self)).expect(concat!($what, " always serializes"))
            }

            fn from_json(json: &str) -> Result<$type, DecodeError> {
                let wire: $wire = serde_json::from_str(json)
                    .map_err(|error| DecodeError::new($what, error.to_string()))?;
                wire.into_domain()
            }
        }
    };
}

json_form!(Envelope, EnvelopeOut, EnvelopeWire, "envelope");
json_form!(Reply, ReplyOut, ReplyWire, "reply");
json_form!(Exit, ExitOut, ExitWire, "exit");
json_form!(Runner, RunnerOut, RunnerWire, "runner");

/// A JSON array of raw values, as stored in a chunk reply's `payload` column. An undefined value
/// is written as `null`, as `JSON.stringify` does inside arrays.
pub fn values_to_json(values: &[RawJson]) -> String {
    let values: Vec<RawOut<'_>> = values.iter().map(RawOut).collect();
    serde_json::to_string(&values).expect("raw values always serialize")
}

/// The raw values of a JSON array (a chunk reply's `payload` column), each kept as written.
pub fn values_from_json(json: &str) -> Result<Vec<RawJson>, DecodeError> {
    let values: Vec<Box<RawValue>> = serde_json::from_str(json)
        .map_err(|error| DecodeError::new("chunk values", error.to_string()))?;
    Ok(values.into_iter().map(RawJson::from_raw).collect())
}

// --- Writing -----------------------------------------------------------------------------------

struct SnowflakeOut(Snowflake);

impl Serialize for SnowflakeOut {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(&self.0)
    }
}

struct RawOut<'a>(&'a RawJson);

impl Serialize for RawOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0.raw() {
            Some(raw) => raw.serialize(serializer),
            // Only reached inside arrays: JSON.stringify writes undefined elements as null.
            None => serializer.serialize_unit(),
        }
    }
}

struct AddressOut<'a>(&'a EntityAddress);

impl Serialize for AddressOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct ShardIdOut<'a> {
            group: &'a str,
            id: u32,
        }
        let mut out = serializer.serialize_struct("EntityAddress", 3)?;
        let shard_id = &self.0.shard_id;
        out.serialize_field(
            "shardId",
            &ShardIdOut { group: shard_id.group().as_str(), id: shard_id.id() },
        )?;
        out.serialize_field("entityType", self.0.entity_type.as_str())?;
        out.serialize_field("entityId", self.0.entity_id.as_str())?;
        out.end()
    }
}

/// Writes `value` under `key` unless it is undefined.
fn field_raw<S: SerializeStruct>(
    out: &mut S,
    key: &'static str,
    value: &RawJson,
) -> Result<(), S::Error> {
    if value.is_undefined() {
        out.skip_field(key)
    } else {
        out.serialize_field(key, &RawOut(value))
    }
}

struct EnvelopeOut<'a>(&'a Envelope);

impl Serialize for EnvelopeOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Envelope::Request(request) => {
                let mut out = serializer.serialize_struct("Request", 9)?;
                out.serialize_field("_tag", "Request")?;
                out.serialize_field("requestId", &SnowflakeOut(request.request_id))?;
                out.serialize_field("address", &AddressOut(&request.address))?;
                out.serialize_field("tag", &*request.tag)?;
                field_raw(&mut out, "payload", &request.payload)?;
                field_raw(&mut out, "headers", &request.headers)?;
                let trace = &request.trace;
                if let Some(trace_id) = &trace.trace_id {
                    out.serialize_field("traceId", trace_id)?;
                }
                if let Some(span_id) = &trace.span_id {
                    out.serialize_field("spanId", span_id)?;
                }
                if let Some(sampled) = trace.sampled {
                    out.serialize_field("sampled", &sampled)?;
                }
                out.end()
            }
            Envelope::AckChunk(ack) => {
                let mut out = serializer.serialize_struct("AckChunk", 5)?;
                out.serialize_field("_tag", "AckChunk")?;
                out.serialize_field("id", &SnowflakeOut(ack.id))?;
                out.serialize_field("address", &AddressOut(&ack.address))?;
                out.serialize_field("requestId", &SnowflakeOut(ack.request_id))?;
                out.serialize_field("replyId", &SnowflakeOut(ack.reply_id))?;
                out.end()
            }
            Envelope::Interrupt(interrupt) => {
                let mut out = serializer.serialize_struct("Interrupt", 4)?;
                out.serialize_field("_tag", "Interrupt")?;
                out.serialize_field("id", &SnowflakeOut(interrupt.id))?;
                out.serialize_field("address", &AddressOut(&interrupt.address))?;
                out.serialize_field("requestId", &SnowflakeOut(interrupt.request_id))?;
                out.end()
            }
        }
    }
}

struct ReasonOut<'a>(&'a CauseReason);

impl Serialize for ReasonOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut out = serializer.serialize_struct("Reason", 2)?;
        match self.0 {
            CauseReason::Fail(error) => {
                out.serialize_field("_tag", "Fail")?;
                field_raw(&mut out, "error", error)?;
            }
            CauseReason::Die(defect) => {
                out.serialize_field("_tag", "Die")?;
                field_raw(&mut out, "defect", defect)?;
            }
            CauseReason::Interrupt { fiber_id } => {
                out.serialize_field("_tag", "Interrupt")?;
                out.serialize_field("fiberId", fiber_id)?;
            }
        }
        out.end()
    }
}

struct ExitOut<'a>(&'a Exit);

impl Serialize for ExitOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut out = serializer.serialize_struct("Exit", 2)?;
        match self.0 {
            Exit::Success(value) => {
                out.serialize_field("_tag", "Success")?;
                field_raw(&mut out, "value", value)?;
            }
            Exit::Failure(cause) => {
                out.serialize_field("_tag", "Failure")?;
                let reasons: Vec<ReasonOut<'_>> = cause.0.iter().map(ReasonOut).collect();
                out.serialize_field("cause", &reasons)?;
            }
        }
        out.end()
    }
}

struct ReplyOut<'a>(&'a Reply);

impl Serialize for ReplyOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Reply::WithExit(with_exit) => {
                let mut out = serializer.serialize_struct("WithExit", 4)?;
                out.serialize_field("_tag", "WithExit")?;
                out.serialize_field("requestId", &SnowflakeOut(with_exit.request_id))?;
                out.serialize_field("id", &SnowflakeOut(with_exit.id))?;
                out.serialize_field("exit", &ExitOut(&with_exit.exit))?;
                out.end()
            }
            Reply::Chunk(chunk) => {
                let mut out = serializer.serialize_struct("Chunk", 5)?;
                out.serialize_field("_tag", "Chunk")?;
                out.serialize_field("requestId", &SnowflakeOut(chunk.request_id()))?;
                out.serialize_field("id", &SnowflakeOut(chunk.id()))?;
                out.serialize_field("sequence", &chunk.sequence())?;
                let values: Vec<RawOut<'_>> = chunk.values().iter().map(RawOut).collect();
                out.serialize_field("values", &values)?;
                out.end()
            }
        }
    }
}

struct RunnerOut<'a>(&'a Runner);

impl Serialize for RunnerOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct AddressOut<'a> {
            host: &'a str,
            port: u16,
        }
        let runner = self.0;
        let mut out = serializer.serialize_struct("Runner", 3)?;
        out.serialize_field(
            "address",
            &AddressOut { host: runner.address.host(), port: runner.address.port() },
        )?;
        let groups: Vec<&str> = runner.groups.iter().map(ShardGroup::as_str).collect();
        out.serialize_field("groups", &groups)?;
        out.serialize_field("weight", &WeightOut(runner.weight.get()))?;
        out.end()
    }
}

/// A number written as JavaScript does: integral values without a fraction (`1`, not `1.0`).
struct WeightOut(f64);

impl Serialize for WeightOut {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        const SAFE_INTEGER_MAX: f64 = 9_007_199_254_740_991.0;
        let weight = self.0;
        if weight.fract() == 0.0 && weight.abs() <= SAFE_INTEGER_MAX {
            #[expect(
                clippy::cast_possible_truncation,
                reason = "an integral value within ±2^53 converts exactly"
            )]
            let integral = weight as i64;
            serializer.serialize_i64(integral)
        } else {
            serializer.serialize_f64(weight)
        }
    }
}

// --- Reading -----------------------------------------------------------------------------------

/// A snowflake read from a decimal string (the reference's form) or a JSON integer.
struct SnowflakeIn(Snowflake);

impl<'de> Deserialize<'de> for SnowflakeIn {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<SnowflakeIn, D::Error> {
        struct Visitor;
        impl de::Visitor<'_> for Visitor {
            type Value = SnowflakeIn;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a snowflake as a decimal string")
            }

            fn visit_str<E: de::Error>(self, value: &str) -> Result<SnowflakeIn, E> {
                value.parse().map(SnowflakeIn).map_err(E::custom)
            }

            fn visit_u64<E: de::Error>(self, value: u64) -> Result<SnowflakeIn, E> {
                Ok(SnowflakeIn(Snowflake::new(value)))
            }

            fn visit_i64<E: de::Error>(self, value: i64) -> Result<SnowflakeIn, E> {
                Snowflake::from_i64(value)
                    .map(SnowflakeIn)
                    .ok_or_else(|| E::custom("a snowflake cannot be negative"))
            }
        }
        deserializer.deserialize_any(Visitor)
    }
}

/// A present field read as raw JSON, so that `null` is kept as a value (absent = undefined).
fn raw_present<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Box<RawValue>>, D::Error> {
    Box::<RawValue>::deserialize(deserializer).map(Some)
}

fn raw_json(raw: Option<Box<RawValue>>) -> RawJson {
    raw.map_or_else(RawJson::undefined, RawJson::from_raw)
}

fn required<T>(value: Option<T>, what: &'static str, field: &str) -> Result<T, DecodeError> {
    value.ok_or_else(|| DecodeError::new(what, format!("missing field `{field}`")))
}

#[derive(Deserialize)]
struct ShardIdWire {
    group: String,
    id: i64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AddressWire {
    shard_id: ShardIdWire,
    entity_type: String,
    entity_id: String,
}

impl AddressWire {
    fn into_domain(self, what: &'static str) -> Result<EntityAddress, DecodeError> {
        let id = u32::try_from(self.shard_id.id)
            .ok()
            .filter(|id| *id >= 1)
            .ok_or_else(|| DecodeError::new(what, "the shard number must be a positive integer"))?;
        Ok(EntityAddress {
            shard_id: ShardId::new(ShardGroup::from(self.shard_id.group), id),
            entity_type: EntityType::from(self.entity_type),
            entity_id: EntityId::from(self.entity_id),
        })
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct EnvelopeWire {
    #[serde(rename = "_tag")]
    kind: String,
    request_id: Option<SnowflakeIn>,
    id: Option<SnowflakeIn>,
    address: Option<AddressWire>,
    tag: Option<String>,
    #[serde(default, deserialize_with = "raw_present")]
    payload: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "raw_present")]
    headers: Option<Box<RawValue>>,
    trace_id: Option<String>,
    span_id: Option<String>,
    sampled: Option<bool>,
    reply_id: Option<SnowflakeIn>,
}

impl EnvelopeWire {
    fn into_domain(self) -> Result<Envelope, DecodeError> {
        const WHAT: &str = "envelope";
        let address = required(self.address, WHAT, "address")?.into_domain(WHAT)?;
        let request_id = required(self.request_id, WHAT, "requestId")?.0;
        match self.kind.as_str() {
            "Request" => Ok(Envelope::Request(Request {
                request_id,
                address,
                tag: required(self.tag, WHAT, "tag")?.into(),
                payload: raw_json(self.payload),
                headers: raw_json(self.headers),
                trace: TraceContext {
                    trace_id: self.trace_id,
                    span_id: self.span_id,
                    sampled: self.sampled,
                },
            })),
            "AckChunk" => Ok(Envelope::AckChunk(AckChunk {
                id: required(self.id, WHAT, "id")?.0,
                address,
                request_id,
                reply_id: required(self.reply_id, WHAT, "replyId")?.0,
            })),
            "Interrupt" => Ok(Envelope::Interrupt(Interrupt {
                id: required(self.id, WHAT, "id")?.0,
                address,
                request_id,
            })),
            other => Err(DecodeError::new(WHAT, format!("unknown `_tag` {other:?}"))),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReasonWire {
    #[serde(rename = "_tag")]
    kind: String,
    #[serde(default, deserialize_with = "raw_present")]
    error: Option<Box<RawValue>>,
    #[serde(default, deserialize_with = "raw_present")]
    defect: Option<Box<RawValue>>,
    #[serde(default)]
    fiber_id: Option<i64>,
}

#[derive(Deserialize)]
struct ExitWire {
    #[serde(rename = "_tag")]
    kind: String,
    #[serde(default, deserialize_with = "raw_present")]
    value: Option<Box<RawValue>>,
    cause: Option<Vec<ReasonWire>>,
}

impl ExitWire {
    fn into_domain(self) -> Result<Exit, DecodeError> {
        const WHAT: &str = "exit";
        match self.kind.as_str() {
            "Success" => Ok(Exit::Success(raw_json(self.value))),
            "Failure" => {
                let reasons = required(self.cause, WHAT, "cause")?
                    .into_iter()
                    .map(|reason| match reason.kind.as_str() {
                        "Fail" => Ok(CauseReason::Fail(raw_json(reason.error))),
                        "Die" => Ok(CauseReason::Die(raw_json(reason.defect))),
                        "Interrupt" => Ok(CauseReason::Interrupt { fiber_id: reason.fiber_id }),
                        other => {
                            Err(DecodeError::new(WHAT, format!("unknown cause `_tag` {other:?}")))
                        }
                    })
                    .collect::<Result<Vec<CauseReason>, DecodeError>>()?;
                Ok(Exit::Failure(Cause(reasons)))
            }
            other => Err(DecodeError::new(WHAT, format!("unknown `_tag` {other:?}"))),
        }
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ReplyWire {
    #[serde(rename = "_tag")]
    kind: String,
    request_id: SnowflakeIn,
    id: SnowflakeIn,
    exit: Option<ExitWire>,
    sequence: Option<u32>,
    values: Option<Vec<Box<RawValue>>>,
}

impl ReplyWire {
    fn into_domain(self) -> Result<Reply, DecodeError> {
        const WHAT: &str = "reply";
        match self.kind.as_str() {
            "WithExit" => Ok(Reply::WithExit(WithExit {
                request_id: self.request_id.0,
                id: self.id.0,
                exit: required(self.exit, WHAT, "exit")?.into_domain()?,
            })),
            "Chunk" => {
                let values: Vec<RawJson> = required(self.values, WHAT, "values")?
                    .into_iter()
                    .map(RawJson::from_raw)
                    .collect();
                let sequence = required(self.sequence, WHAT, "sequence")?;
                Chunk::new(self.request_id.0, self.id.0, sequence, values)
                    .map(Reply::Chunk)
                    .ok_or_else(|| DecodeError::new(WHAT, "a chunk needs at least one value"))
            }
            other => Err(DecodeError::new(WHAT, format!("unknown `_tag` {other:?}"))),
        }
    }
}

#[derive(Deserialize)]
struct RunnerAddressWire {
    host: String,
    port: u16,
}

#[derive(Deserialize)]
struct RunnerWire {
    address: RunnerAddressWire,
    groups: Vec<String>,
    weight: f64,
}

impl RunnerWire {
    fn into_domain(self) -> Result<Runner, DecodeError> {
        let weight = RunnerWeight::new(self.weight)
            .ok_or_else(|| DecodeError::new("runner", "the weight must be a finite number"))?;
        Ok(Runner::new(
            RunnerAddress::new(self.address.host, self.address.port),
            self.groups.into_iter().map(ShardGroup::from).collect(),
            weight,
        ))
    }
}

#[cfg(test)]
mod tests;
