//! The wire form of the protocol: one [`Frame`] per length-delimited message.
//!
//! These are the only serde types of the crate: explicit wire forms, converted
//! to and from the domain types of `cluster-core` in [`crate::codec`]. Strings are `Cow` so that
//! encoding borrows from the domain value; decoding always owns. Payloads, headers and reply
//! values are the caller's JSON text, shipped as is (`None` is the undefined value).
//!
//! Versioning: the handshake carries [`crate::handshake::PROTOCOL_VERSION`]; any change to these
//! types (even reordering variants, which changes their postcard tags) bumps it.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

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
        request: WireRequest<'a>,
        /// Whether the request is stored.
        persisted: bool,
    },
    /// Client: the `Envelope` RPC (an `AckChunk` or `Interrupt`).
    Envelope {
        /// The call id.
        call: u64,
        /// The envelope to deliver.
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
        reply: WireReply<'a>,
    },
    /// Server: the call failed; this ends it.
    Failed {
        /// The call id.
        call: u64,
        /// Why.
        error: WireError<'a>,
    },
}

/// An entity address.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireAddress<'a> {
    /// The shard group.
    pub(crate) group: Cow<'a, str>,
    /// The shard number (from 1).
    pub(crate) shard: u32,
    /// The entity type.
    pub(crate) entity_type: Cow<'a, str>,
    /// The entity id.
    pub(crate) entity_id: Cow<'a, str>,
}

/// A request.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct WireRequest<'a> {
    /// The request id (a snowflake).
    pub(crate) request_id: u64,
    /// The addressed entity.
    pub(crate) address: WireAddress<'a>,
    /// The RPC tag.
    pub(crate) tag: Cow<'a, str>,
    /// The JSON payload, `None` when undefined.
    pub(crate) payload: Option<Cow<'a, str>>,
    /// The JSON headers, `None` when undefined.
    pub(crate) headers: Option<Cow<'a, str>>,
    /// Trace id.
    pub(crate) trace_id: Option<Cow<'a, str>>,
    /// Span id.
    pub(crate) span_id: Option<Cow<'a, str>>,
    /// Whether the trace is sampled.
    pub(crate) sampled: Option<bool>,
}

/// An envelope.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireEnvelope<'a> {
    /// A request.
    Request(WireRequest<'a>),
    /// An acknowledgement of a streamed chunk.
    AckChunk {
        /// The envelope id.
        id: u64,
        /// The addressed entity.
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
        values: Vec<Option<Cow<'a, str>>>,
    },
}

/// How a request ended.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireExit<'a> {
    /// Success with a JSON value (`None` when undefined).
    Success(Option<Cow<'a, str>>),
    /// Failure with its reasons.
    Failure(Vec<WireReason<'a>>),
}

/// One reason of a failure.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireReason<'a> {
    /// An expected failure, JSON.
    Fail(Option<Cow<'a, str>>),
    /// A defect, JSON.
    Die(Option<Cow<'a, str>>),
    /// An interruption.
    Interrupt(Option<i64>),
}

/// Why a call failed on the server.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) enum WireError<'a> {
    /// `ClusterError::EntityNotAssignedToRunner`.
    EntityNotAssignedToRunner(WireAddress<'a>),
    /// `ClusterError::MailboxFull`.
    MailboxFull(WireAddress<'a>),
    /// `ClusterError::AlreadyProcessingMessage`.
    AlreadyProcessingMessage {
        /// The request id.
        envelope_id: u64,
        /// The entity.
        address: WireAddress<'a>,
    },
    /// `ClusterError::Abandoned`.
    Abandoned {
        /// The entity.
        address: WireAddress<'a>,
        /// The request id.
        request_id: u64,
    },
    /// `ClusterError::RunnerUnavailable`, raised by the server itself (shutting down).
    RunnerUnavailable {
        /// The runner's host.
        host: Cow<'a, str>,
        /// The runner's port.
        port: u16,
    },
    /// `ClusterError::RunnerNotRegistered`.
    RunnerNotRegistered {
        /// The runner's host.
        host: Cow<'a, str>,
        /// The runner's port.
        port: u16,
    },
    /// Anything else: an unexpected failure, described.
    Defect(Cow<'a, str>),
    /// The connection has as many calls in flight as the server allows.
    Overloaded,
}
