//! The frame codec: postcard, plus the conversions between [`crate::frame`] wire forms and the
//! domain types of `cluster-core`.
//!
//! # Choice of format (measured)
//!
//! Measured on this crate's own [`Frame`] types (release build, one core of the 2-core
//! development machine, 200,000 encode+decode round trips each) with a realistic `Request`
//! frame (entity id of 42 bytes, a 67-byte JSON payload, `{}` headers, a full trace context)
//! and a realistic final reply (`WithExit` success with `{"value":42}`):
//!
//! | format                         | request size | request round trip | reply size | reply round trip |
//! | ------------------------------ | -----------: | -----------------: | ---------: | ---------------: |
//! | postcard 1.2 (`use-std`)       |        209 B |             685 ns |       37 B |           171 ns |
//! | bincode 2.0 (serde, standard)  |        209 B |             724 ns |       38 B |           202 ns |
//! | serde_json 1                   |        421 B |            1562 ns |      138 B |           521 ns |
//!
//! postcard and bincode are equally compact (both use varints) and within noise of each other
//! in speed; both are about half the size of JSON and twice as fast. postcard is chosen because
//! its wire format is specified and stable since 1.0, it has the smallest dependency footprint
//! (`cobs` only, no default features), and bincode's maintenance status is uncertain. The JSON
//! payload holes are carried as strings in every format, so the difference is the envelope
//! around them.
//!
//! A frame that decodes structurally but not into a domain value (a payload that is not JSON,
//! shard number 0, an empty chunk) is a [`DecodeError`] for its own call only; a frame that does
//! not decode at all closes the connection (see [`crate::conn`]).

use std::borrow::Cow;

use cluster_core::envelope::{
    AckChunk, Cause, CauseReason, Chunk, Envelope, Exit, Interrupt, RawJson, Reply, Request,
    TraceContext, WithExit,
};
use cluster_core::error::{ClusterError, DecodeError};
use cluster_core::ids::{
    EntityAddress, EntityId, EntityType, RunnerAddress, ShardGroup, ShardId, Tag,
};
use cluster_core::snowflake::Snowflake;

use crate::frame::{
    Frame, WireAddress, WireEnvelope, WireError, WireExit, WireReason, WireReply, WireRequest,
};

/// `frame` encoded, or why not: postcard failed (it has no failure path for these types, but
/// the error is kept rather than unwrapped) or the result exceeds `max_frame_bytes`.
///
/// The bytes are written into one allocation sized from the frame's strings
/// ([`Frame::size_hint`]), not grown from empty.
pub(crate) fn encode(frame: &Frame<'_>, max_frame_bytes: u32) -> Result<Vec<u8>, DecodeError> {
    let bytes =
        postcard::serialize_with_flavor(frame, Presized(Vec::with_capacity(frame.size_hint())))
            .map_err(|error| DecodeError::new("rpc frame", error.to_string()))?;
    if u32::try_from(bytes.len()).map_or(true, |len| len > max_frame_bytes) {
        return Err(DecodeError::new(
            "rpc frame",
            format!("a frame of {} bytes exceeds the limit of {max_frame_bytes}", bytes.len()),
        ));
    }
    Ok(bytes)
}

/// postcard's output into a vector allocated beforehand.
struct Presized(Vec<u8>);

impl postcard::ser_flavors::Flavor for Presized {
    type Output = Vec<u8>;

    fn try_push(&mut self, byte: u8) -> postcard::Result<()> {
        self.0.push(byte);
        Ok(())
    }

    fn try_extend(&mut self, bytes: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(bytes);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<Vec<u8>> {
        Ok(self.0)
    }
}

/// The frame in `bytes`, its strings borrowed from them; trailing bytes are an error.
pub(crate) fn decode(bytes: &[u8]) -> Result<Frame<'_>, DecodeError> {
    let (frame, rest) = postcard::take_from_bytes::<Frame<'_>>(bytes)
        .map_err(|error| DecodeError::new("rpc frame", error.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::new("rpc frame", format!("{} trailing bytes", rest.len())));
    }
    Ok(frame)
}

/// The most names of one kind a connection keeps (see [`Names`]).
const NAMES_MAX: usize = 64;

/// The longest name a connection keeps (the reference's columns hold at most 150 bytes of an
/// entity type, 50 of a tag or a shard id).
const NAME_BYTES_MAX: usize = 256;

/// The shard groups, entity types and tags a connection has decoded, kept so that the next
/// frame naming them shares them rather than allocating them again (a connection sees few).
/// Bounded: past [`NAMES_MAX`] of a kind, or past [`NAME_BYTES_MAX`] bytes, a new name is
/// allocated each time, as any other.
#[derive(Default)]
pub(crate) struct Names {
    groups: Vec<ShardGroup>,
    types: Vec<EntityType>,
    tags: Vec<Tag>,
}

/// The name `name` among `known`, added when it is new and there is room.
fn intern<T>(known: &mut Vec<T>, name: &str) -> T
where
    T: AsRef<str> + Clone + for<'s> From<&'s str>,
{
    if let Some(found) = known.iter().find(|known| known.as_ref() == name) {
        return found.clone();
    }
    let made = T::from(name);
    if known.len() < NAMES_MAX && name.len() <= NAME_BYTES_MAX {
        known.push(made.clone());
    }
    made
}

fn raw_out(raw: &RawJson) -> Option<Cow<'_, str>> {
    raw.json().map(Cow::Borrowed)
}

fn raw_in(raw: Option<Cow<'_, str>>) -> Result<RawJson, DecodeError> {
    match raw {
        None => Ok(RawJson::undefined()),
        Some(json) => RawJson::from_json(json.into_owned()),
    }
}

pub(crate) fn address_out(address: &EntityAddress) -> WireAddress<'_> {
    WireAddress {
        group: Cow::Borrowed(address.shard_id.group().as_str()),
        shard: address.shard_id.id(),
        entity_type: Cow::Borrowed(address.entity_type.as_str()),
        entity_id: Cow::Borrowed(address.entity_id.as_str()),
    }
}

pub(crate) fn address_in(
    names: &mut Names,
    address: &WireAddress<'_>,
) -> Result<EntityAddress, DecodeError> {
    if address.shard == 0 {
        return Err(DecodeError::new("entity address", "shard numbers start at 1"));
    }
    Ok(EntityAddress {
        shard_id: ShardId::new(intern(&mut names.groups, &address.group), address.shard),
        entity_type: intern(&mut names.types, &address.entity_type),
        entity_id: EntityId::from(&*address.entity_id),
    })
}

pub(crate) fn request_out(request: &Request) -> WireRequest<'_> {
    WireRequest {
        request_id: request.request_id.get(),
        address: address_out(&request.address),
        tag: Cow::Borrowed(&request.tag),
        payload: raw_out(&request.payload),
        headers: raw_out(&request.headers),
        trace_id: request.trace.trace_id.as_deref().map(Cow::Borrowed),
        span_id: request.trace.span_id.as_deref().map(Cow::Borrowed),
        sampled: request.trace.sampled,
    }
}

pub(crate) fn request_in(
    names: &mut Names,
    request: WireRequest<'_>,
) -> Result<Request, DecodeError> {
    Ok(Request {
        request_id: Snowflake::new(request.request_id),
        address: address_in(names, &request.address)?,
        tag: intern(&mut names.tags, &request.tag),
        payload: raw_in(request.payload)?,
        headers: raw_in(request.headers)?,
        trace: TraceContext {
            trace_id: request.trace_id.map(Cow::into_owned),
            span_id: request.span_id.map(Cow::into_owned),
            sampled: request.sampled,
        },
    })
}

pub(crate) fn envelope_out(envelope: &Envelope) -> WireEnvelope<'_> {
    match envelope {
        Envelope::Request(request) => WireEnvelope::Request(request_out(request)),
        Envelope::AckChunk(ack) => WireEnvelope::AckChunk {
            id: ack.id.get(),
            address: address_out(&ack.address),
            request_id: ack.request_id.get(),
            reply_id: ack.reply_id.get(),
        },
        Envelope::Interrupt(interrupt) => WireEnvelope::Interrupt {
            id: interrupt.id.get(),
            address: address_out(&interrupt.address),
            request_id: interrupt.request_id.get(),
        },
    }
}

pub(crate) fn envelope_in(
    names: &mut Names,
    envelope: WireEnvelope<'_>,
) -> Result<Envelope, DecodeError> {
    Ok(match envelope {
        WireEnvelope::Request(request) => Envelope::Request(request_in(names, request)?),
        WireEnvelope::AckChunk { id, address, request_id, reply_id } => {
            Envelope::AckChunk(AckChunk {
                id: Snowflake::new(id),
                address: address_in(names, &address)?,
                request_id: Snowflake::new(request_id),
                reply_id: Snowflake::new(reply_id),
            })
        }
        WireEnvelope::Interrupt { id, address, request_id } => Envelope::Interrupt(Interrupt {
            id: Snowflake::new(id),
            address: address_in(names, &address)?,
            request_id: Snowflake::new(request_id),
        }),
    })
}

pub(crate) fn reply_out(reply: &Reply) -> WireReply<'_> {
    match reply {
        Reply::WithExit(with_exit) => WireReply::WithExit {
            request_id: with_exit.request_id.get(),
            id: with_exit.id.get(),
            exit: match &with_exit.exit {
                Exit::Success(value) => WireExit::Success(raw_out(value)),
                Exit::Failure(cause) => WireExit::Failure(
                    cause
                        .0
                        .iter()
                        .map(|reason| match reason {
                            CauseReason::Fail(error) => WireReason::Fail(raw_out(error)),
                            CauseReason::Die(defect) => WireReason::Die(raw_out(defect)),
                            CauseReason::Interrupt { fiber_id } => WireReason::Interrupt(*fiber_id),
                        })
                        .collect(),
                ),
            },
        },
        Reply::Chunk(chunk) => WireReply::Chunk {
            request_id: chunk.request_id().get(),
            id: chunk.id().get(),
            sequence: chunk.sequence(),
            values: chunk.values().iter().map(raw_out).collect(),
        },
    }
}

pub(crate) fn reply_in(reply: WireReply<'_>) -> Result<Reply, DecodeError> {
    match reply {
        WireReply::WithExit { request_id, id, exit } => {
            let exit = match exit {
                WireExit::Success(value) => Exit::Success(raw_in(value)?),
                WireExit::Failure(reasons) => Exit::Failure(Cause(
                    reasons
                        .into_iter()
                        .map(|reason| {
                            Ok(match reason {
                                WireReason::Fail(error) => CauseReason::Fail(raw_in(error)?),
                                WireReason::Die(defect) => CauseReason::Die(raw_in(defect)?),
                                WireReason::Interrupt(fiber_id) => {
                                    CauseReason::Interrupt { fiber_id }
                                }
                            })
                        })
                        .collect::<Result<Vec<_>, DecodeError>>()?,
                )),
            };
            Ok(Reply::WithExit(WithExit {
                request_id: Snowflake::new(request_id),
                id: Snowflake::new(id),
                exit,
            }))
        }
        WireReply::Chunk { request_id, id, sequence, values } => {
            let values = values.into_iter().map(raw_in).collect::<Result<Vec<_>, _>>()?;
            Chunk::new(Snowflake::new(request_id), Snowflake::new(id), sequence, values)
                .map(Reply::Chunk)
                .ok_or_else(|| DecodeError::new("reply", "a chunk has at least one value"))
        }
    }
}

/// What the client makes of a server's error.
pub(crate) enum ServerError {
    /// A typed error, returned as is.
    Typed(ClusterError),
    /// A defect: mapped by the caller according to the request's persistence.
    Defect(String),
    /// The server refused the call for lack of capacity: transient.
    Overloaded,
}

pub(crate) fn error_out(error: &ClusterError) -> WireError<'_> {
    match error {
        ClusterError::EntityNotAssignedToRunner { address } => {
            WireError::EntityNotAssignedToRunner(address_out(address))
        }
        ClusterError::MailboxFull { address } => WireError::MailboxFull(address_out(address)),
        ClusterError::AlreadyProcessingMessage { envelope_id, address } => {
            WireError::AlreadyProcessingMessage {
                envelope_id: envelope_id.get(),
                address: address_out(address),
            }
        }
        ClusterError::Abandoned { address, request_id } => {
            WireError::Abandoned { address: address_out(address), request_id: request_id.get() }
        }
        ClusterError::RunnerUnavailable { address } => WireError::RunnerUnavailable {
            host: Cow::Borrowed(address.host()),
            port: address.port(),
        },
        ClusterError::RunnerNotRegistered { address } => WireError::RunnerNotRegistered {
            host: Cow::Borrowed(address.host()),
            port: address.port(),
        },
        // Storage and decoding failures of the server are not part of the protocol's error set
        // (the reference's neither): they travel as defects.
        other => WireError::Defect(Cow::Owned(other.to_string())),
    }
}

pub(crate) fn error_in(
    names: &mut Names,
    error: WireError<'_>,
) -> Result<ServerError, DecodeError> {
    Ok(ServerError::Typed(match error {
        WireError::EntityNotAssignedToRunner(address) => {
            ClusterError::EntityNotAssignedToRunner { address: address_in(names, &address)? }
        }
        WireError::MailboxFull(address) => {
            ClusterError::MailboxFull { address: address_in(names, &address)? }
        }
        WireError::AlreadyProcessingMessage { envelope_id, address } => {
            ClusterError::AlreadyProcessingMessage {
                envelope_id: Snowflake::new(envelope_id),
                address: address_in(names, &address)?,
            }
        }
        WireError::Abandoned { address, request_id } => ClusterError::Abandoned {
            address: address_in(names, &address)?,
            request_id: Snowflake::new(request_id),
        },
        WireError::RunnerUnavailable { host, port } => {
            ClusterError::RunnerUnavailable { address: RunnerAddress::new(host.into_owned(), port) }
        }
        WireError::RunnerNotRegistered { host, port } => ClusterError::RunnerNotRegistered {
            address: RunnerAddress::new(host.into_owned(), port),
        },
        WireError::Defect(message) => return Ok(ServerError::Defect(message.into_owned())),
        WireError::Overloaded => return Ok(ServerError::Overloaded),
    }))
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use cluster_core::envelope::{RawJson, Request, TraceContext};
    use cluster_core::ids::{EntityAddress, EntityId, EntityType, ShardGroup, ShardId, Tag};
    use cluster_core::snowflake::Snowflake;

    use crate::frame::Frame;

    fn request(entity: &str) -> Request {
        Request {
            request_id: Snowflake::new(7),
            address: EntityAddress {
                shard_id: ShardId::new(ShardGroup::from("default"), 3),
                entity_type: EntityType::from("Counter"),
                entity_id: EntityId::from(entity),
            },
            tag: "Increment".into(),
            payload: RawJson::from_json(r#"{"by":1}"#.to_owned()).unwrap(),
            headers: RawJson::from_json("{}".to_owned()).unwrap(),
            trace: TraceContext::default(),
        }
    }

    /// A decoded frame's strings point into the frame's bytes: the domain values made from it
    /// are the only copies.
    #[test]
    fn decoding_borrows_the_strings_from_the_frame() {
        let request = request("entity-1");
        let frame =
            Frame::Request { call: 1, request: super::request_out(&request), persisted: true };
        let bytes = super::encode(&frame, 1 << 20).unwrap();
        assert!(bytes.len() <= frame.size_hint(), "one allocation holds the frame");
        let Frame::Request { request: wire, .. } = super::decode(&bytes).unwrap() else {
            panic!("not a request")
        };
        for text in [&wire.address.group, &wire.address.entity_id, &wire.tag] {
            assert!(matches!(text, Cow::Borrowed(_)), "{text} was copied");
        }
        assert!(matches!(wire.payload, Some(Cow::Borrowed(_))), "the payload was copied");
        let mut names = super::Names::default();
        assert_eq!(super::request_in(&mut names, wire).unwrap(), request);
    }

    /// The names a connection has seen are shared by the next requests naming them.
    #[test]
    fn names_are_shared_between_frames() {
        let mut names = super::Names::default();
        let mut decoded = Vec::new();
        for entity in ["a", "b"] {
            let request = request(entity);
            let frame =
                Frame::Request { call: 1, request: super::request_out(&request), persisted: false };
            let bytes = super::encode(&frame, 1 << 20).unwrap();
            let Frame::Request { request: wire, .. } = super::decode(&bytes).unwrap() else {
                panic!("not a request")
            };
            decoded.push(super::request_in(&mut names, wire).unwrap());
        }
        let [first, second] = &decoded[..] else { panic!("two requests") };
        assert!(std::ptr::eq(
            first.address.entity_type.as_str(),
            second.address.entity_type.as_str()
        ));
        assert!(std::ptr::eq(
            first.address.shard_id.group().as_str(),
            second.address.shard_id.group().as_str()
        ));
        assert!(std::ptr::eq(first.tag.as_str(), second.tag.as_str()));
        assert_eq!(second.address.entity_id.as_str(), "b");
    }

    /// Past the bound, new names are still decoded, just not kept.
    #[test]
    fn the_names_kept_are_bounded() {
        let mut types: Vec<EntityType> = Vec::new();
        for n in 0..super::NAMES_MAX + 10 {
            let name = format!("Type{n}");
            assert_eq!(super::intern(&mut types, &name).as_str(), name);
        }
        assert_eq!(types.len(), super::NAMES_MAX);
        let mut tags: Vec<Tag> = Vec::new();
        let long = "t".repeat(super::NAME_BYTES_MAX + 1);
        assert_eq!(super::intern(&mut tags, &long).as_str(), long);
        assert!(tags.is_empty(), "a name past the length bound is not kept");
    }
}
