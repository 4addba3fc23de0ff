//! The wire form of the protocol: one [`Frame`] per length-delimited message.
//!
//! These are the only serde types of the crate: explicit wire forms, converted
//! to and from the domain types of `cluster-core` in [`crate::codec`]. Strings are `Cow` so that
//! encoding borrows from the domain value and decoding borrows from the frame's bytes (the
//! connection's read buffer): the domain value is the only copy made. Payloads, headers and
//! reply values are the caller's JSON text, shipped as is (`None` is the undefined value).
//!
//! Versioning: the handshake carries [`crate::handshake::PROTOCOL_VERSION`]; any change to these
//! types (even reordering variants, which changes their postcard tags) bumps it.

use std::borrow::Cow;

use serde::{Deserialize, Deserializer, Serialize};

/// One message on a connection. `call` is chosen by the client, unique among its calls in
/// flight on that connection; every server frame answers one call.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum Frame<'a> {
    /// Client: the `Ping` RPC, answered by [`Frame::Done`] without reaching the handler.
    Ping {
        /// The call id.
        call: u64,
    },
    /// Client: the `Notify` RPC.
    Notify {
        /// The call id.
        call: u64,
        /// The envelope to deliver.
        #[serde(borrow)]
        envelope: WireEnvelope<'a>,
        /// Whether the envelope is stored.
        persisted: bool,
    },
    /// Client: the `Effect` and `Stream` RPCs, answered by [`Frame::Reply`] frames ending with
    /// a final reply, or by [`Frame::Failed`].
    Request {
        /// The call id.
        call: u64,
        /// The request.
        #[serde(borrow)]
        request: WireRequest<'a>,
        /// Whether the request is stored.
        persisted: bool,
    },
    /// Client: the `Envelope` RPC (an `AckChunk` or `Interrupt`).
    Envelope {
        /// The call id.
        call: u64,
        /// The envelope to deliver.
        #[serde(borrow)]
        envelope: WireEnvelope<'a>,
        /// Whether the envelope is stored.
        persisted: bool,
    },
    /// Client: the caller of `call` went away; the server drops the request's reply stream.
    Cancel {
        /// The call id.
        call: u64,
    },
    /// Server: a void call (`Ping`, `Notify`, `Envelope`) succeeded.
    Done {
        /// The call id.
        call: u64,
    },
    /// Server: a reply of a request; the call ends with its final reply.
    Reply {
        /// The call id.
        call: u64,
        /// The reply.
        #[serde(borrow)]
        reply: WireReply<'a>,
    },
    /// Server: the call failed; this ends it.
    Failed {
        /// The call id.
        call: u64,
        /// Why.
        #[serde(borrow)]
        error: WireError<'a>,
    },
}

impl Frame<'_> {
    /// About how many bytes the frame encodes to: the length of its strings, plus room for the
    /// numbers, tags and length prefixes around them (the encoder's first allocation).
    pub(crate) fn size_hint(&self) -> usize {
        const ROOM: usize = 64;
        ROOM + match self {
            Frame::Request { request, .. } => request.text_len(),
            Frame::Notify { envelope, .. } | Frame::Envelope { envelope, .. } => match envelope {
                WireEnvelope::Request(request) => request.text_len(),
                WireEnvelope::AckChunk { address, .. } | WireEnvelope::Interrupt { address, .. } => {
                    address.text_len()
                }
            },
            Frame::Reply { reply: WireReply::WithExit { exit, .. }, .. } => match exit {
                WireExit::Success(value) => text_len(value.as_ref()),
                WireExit::Failure(reasons) => reasons
                    .iter()
                    .map(|reason| match reason {
                        WireReason::Fail(json) | WireReason::Die(json) => text_len(json.as_ref()),
                        WireReason::Interrupt(_) => 0,
                    } + 10)
                    .sum(),
            },
            Frame::Reply { reply: WireReply::Chunk { values, .. }, .. } => {
                values.iter().map(|value| text_len(value.as_ref()) + 5).sum()
            }
            Frame::Failed { error: WireError::Defect(message), .. } => message.len(),
            Frame::Ping { .. }
            | Frame::Cancel { .. }
            | Frame::Done { .. }
            | Frame::Failed { .. } => 0,
        }
    }
}

fn text_len(text: Option<&Cow<'_, str>>) -> usize {
    text.map_or(0, |text| text.len())
}

impl WireAddress<'_> {
    fn text_len(&self) -> usize {
        self.group.len() + self.entity_type.len() + self.entity_id.len()
    }
}

impl WireRequest<'_> {
    fn text_len(&self) -> usize {
        self.address.text_len()
            + self.tag.len()
            + [&self.payload, &self.headers, &self.trace_id, &self.span_id]
                .into_iter()
                .map(|text| text_len(text.as_ref()))
                .sum::<usize>()
    }
}

/// An entity address.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireAddress<'a> {
    /// The shard group.
    #[serde(borrow)]
    pub(crate) group: Cow<'a, str>,
    /// The shard number (from 1).
    pub(crate) shard: u32,
    /// The entity type.
    #[serde(borrow)]
    pub(crate) entity_type: Cow<'a, str>,
    /// The entity id.
    #[serde(borrow)]
    pub(crate) entity_id: Cow<'a, str>,
}

/// A request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireRequest<'a> {
    /// The request id (a snowflake).
    pub(crate) request_id: u64,
    /// The addressed entity.
    #[serde(borrow)]
    pub(crate) address: WireAddress<'a>,
    /// The RPC tag.
    #[serde(borrow)]
    pub(crate) tag: Cow<'a, str>,
    /// The JSON payload, `None` when undefined.
    #[serde(borrow, deserialize_with = "borrowed::option")]
    pub(crate) payload: Option<Cow<'a, str>>,
    /// The JSON headers, `None` when undefined.
    #[serde(borrow, deserialize_with = "borrowed::option")]
    pub(crate) headers: Option<Cow<'a, str>>,
    /// Trace id.
    #[serde(borrow, deserialize_with = "borrowed::option")]
    pub(crate) trace_id: Option<Cow<'a, str>>,
    /// Span id.
    #[serde(borrow, deserialize_with = "borrowed::option")]
    pub(crate) span_id: Option<Cow<'a, str>>,
    /// Whether the trace is sampled.
    pub(crate) sampled: Option<bool>,
}

/// An envelope.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireEnvelope<'a> {
    /// A request.
    Request(#[serde(borrow)] WireRequest<'a>),
    /// An acknowledgement of a streamed chunk.
    AckChunk {
        /// The envelope id.
        id: u64,
        /// The addressed entity.
        #[serde(borrow)]
        address: WireAddress<'a>,
        /// The streaming request.
        request_id: u64,
        /// The acknowledged chunk.
        reply_id: u64,
    },
    /// An interruption.
    Interrupt {
        /// The envelope id.
        id: u64,
        /// The addressed entity.
        #[serde(borrow)]
        address: WireAddress<'a>,
        /// The interrupted request.
        request_id: u64,
    },
}

/// A reply.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireReply<'a> {
    /// The final reply.
    WithExit {
        /// The request it answers.
        request_id: u64,
        /// The reply id.
        id: u64,
        /// How the request ended.
        #[serde(borrow)]
        exit: WireExit<'a>,
    },
    /// A chunk of a streamed response.
    Chunk {
        /// The request it belongs to.
        request_id: u64,
        /// The reply id.
        id: u64,
        /// Its position in the stream.
        sequence: u32,
        /// The JSON values (`None` when undefined); never empty.
        #[serde(borrow, deserialize_with = "borrowed::values")]
        values: Vec<Option<Cow<'a, str>>>,
    },
}

/// How a request ended.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireExit<'a> {
    /// Success with a JSON value (`None` when undefined).
    Success(#[serde(borrow, deserialize_with = "borrowed::option")] Option<Cow<'a, str>>),
    /// Failure with its reasons.
    Failure(#[serde(borrow)] Vec<WireReason<'a>>),
}

/// One reason of a failure.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireReason<'a> {
    /// An expected failure, JSON.
    Fail(#[serde(borrow, deserialize_with = "borrowed::option")] Option<Cow<'a, str>>),
    /// A defect, JSON.
    Die(#[serde(borrow, deserialize_with = "borrowed::option")] Option<Cow<'a, str>>),
    /// An interruption.
    Interrupt(Option<i64>),
}

/// Why a call failed on the server.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireError<'a> {
    /// `ClusterError::EntityNotAssignedToRunner`.
    EntityNotAssignedToRunner(#[serde(borrow)] WireAddress<'a>),
    /// `ClusterError::MailboxFull`.
    MailboxFull(#[serde(borrow)] WireAddress<'a>),
    /// `ClusterError::AlreadyProcessingMessage`.
    AlreadyProcessingMessage {
        /// The request id.
        envelope_id: u64,
        /// The entity.
        #[serde(borrow)]
        address: WireAddress<'a>,
    },
    /// `ClusterError::Abandoned`.
    Abandoned {
        /// The entity.
        #[serde(borrow)]
        address: WireAddress<'a>,
        /// The request id.
        request_id: u64,
    },
    /// `ClusterError::RunnerUnavailable`, raised by the server itself (shutting down).
    RunnerUnavailable {
        /// The runner's host.
        #[serde(borrow)]
        host: Cow<'a, str>,
        /// The runner's port.
        port: u16,
    },
    /// `ClusterError::RunnerNotRegistered`.
    RunnerNotRegistered {
        /// The runner's host.
        #[serde(borrow)]
        host: Cow<'a, str>,
        /// The runner's port.
        port: u16,
    },
    /// Anything else: an unexpected failure, described.
    Defect(#[serde(borrow)] Cow<'a, str>),
    /// The connection has as many calls in flight as the server allows.
    Overloaded,
}

/// Deserializers that borrow optional strings from the frame's bytes (serde borrows a plain
/// `Cow<str>` field with `#[serde(borrow)]`, but not one inside an `Option` or a `Vec`).
mod borrowed {
    use super::{Cow, Deserialize, Deserializer};

    /// An optional string, borrowed.
    pub(super) fn option<'de: 'a, 'a, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Cow<'a, str>>, D::Error> {
        Ok(Option::<&'de str>::deserialize(deserializer)?.map(Cow::Borrowed))
    }

    /// A list of optional strings, each borrowed.
    pub(super) fn values<'de: 'a, 'a, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<Option<Cow<'a, str>>>, D::Error> {
        let values = Vec::<Option<&'de str>>::deserialize(deserializer)?;
        Ok(values.into_iter().map(|value| value.map(Cow::Borrowed)).collect())
    }
}
