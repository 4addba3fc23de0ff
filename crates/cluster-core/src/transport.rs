//! The runner-to-runner transport contract (`effect/src/cluster/Runners.ts`).
//!
//! [`Transport`] is the client side, used by the runtime to reach other runners: `Ping`,
//! `Notify`, `Effect` ([`Transport::send`]), `Stream` ([`Transport::stream`]) and `Envelope`
//! ([`Transport::send_envelope`]). [`RunnerHandler`] is the server side the transport calls into
//! when a peer's call arrives. `cluster-rpc` implements both ends over TCP; the testkit has a
//! simulated transport with faults.
//!
//! Error mapping (`effect/src/cluster/Runners.ts`, effect's `Runners.test.ts`), which every
//! implementation keeps: a transport failure is [`ClusterError::RunnerUnavailable`] (routing
//! retries it); a peer that this process cannot authenticate, or that refuses this process, is
//! [`ClusterError::HandshakeFailed`] (a configuration error, not retried; not in the
//! reference); the server's typed errors (`EntityNotAssignedToRunner`, `MailboxFull`,
//! `AlreadyProcessingMessage`) come back as they are; a defect the server delivers for a
//! *persisted* request is `RunnerUnavailable` too, so the caller recovers the reply from storage,
//! while for a volatile request it becomes the request's `Die` reply; a reply that cannot be
//! encoded fails only its own request, with a `Die(MalformedMessage)` final reply.
//!
//! Persisted traffic never depends on the transport: storage is the source of truth and
//! polling the fallback.

use std::fmt;

use crate::envelope::{Envelope, Reply, Request};
use crate::error::ClusterError;
use crate::future::BoxFuture;
use crate::ids::RunnerAddress;

/// The replies of one request, in order, ending with its final reply.
///
/// Dropping the stream tells the other side that the caller went away: the server interrupts a
/// volatile request whose caller is gone.
pub trait ReplyStream: Send {
    /// The next reply, or `None` after the final reply (or when the stream was cut, which the
    /// previous item reported as an error).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a reply is only removed from the stream when this future returns it.
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>>;
}

/// Reaching other runners.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Whether the runner answers (the runner-health check).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    fn ping<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Result<(), ClusterError>>;

    /// Delivers `envelope` without waiting for a reply (the `Notify` RPC). For a persisted
    /// envelope it only tells the owner to read storage, so failures of persisted
    /// notifications are ignored by the caller; a volatile one is delivered to the entity.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the notification may or may not have been delivered.
    fn notify<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>>;

    /// Sends `request` and waits for its final reply (the `Effect` RPC). For a persisted
    /// request the request is already stored and the owner pushes the reply back when it saves
    /// it.
    ///
    /// A persisted call (a push) lasts until the request's final reply is stored, as long as
    /// its handler runs.
    /// An implementation with a bound on the calls in flight to a runner keeps pushes apart
    /// from the other calls (a lane of their own, with its own bound), so that held pushes
    /// never delay a volatile call, a notice or a ping.
    /// A push that finds its lane full fails at once with `RunnerUnavailable` rather than
    /// wait: its caller then waits on storage, where the request already is.
    /// The same holds for a persisted [`stream`](Transport::stream).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future abandons the call; the server interrupts a volatile request whose
    /// caller went away.
    fn send<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Reply, ClusterError>>;

    /// Sends a streaming `request` and returns its replies (the `Stream` RPC): chunks, each to
    /// be acknowledged with an `AckChunk` envelope, then the final reply.
    ///
    /// # Cancel safety
    ///
    /// As [`Transport::send`]; dropping the returned stream also abandons the call.
    fn stream<'a>(
        &'a self,
        address: &'a RunnerAddress,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'a, Result<Box<dyn ReplyStream>, ClusterError>>;

    /// Delivers an `AckChunk` or `Interrupt` envelope of a request (the `Envelope` RPC).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the envelope may or may not have been delivered. Both kinds are
    /// idempotent at the entity (an ack of another chunk is ignored, an interrupt of a finished
    /// request too).
    fn send_envelope<'a>(
        &'a self,
        address: &'a RunnerAddress,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'a, Result<(), ClusterError>>;

    /// Forgets cached connections to a runner that left the healthy set.
    fn on_runner_unavailable(&self, address: &RunnerAddress);

    /// Whether a process listens at `address` (the probe for runners that are gone).
    ///
    /// - [`Probe::Refused`] only when the address refused the connection: nothing listens
    ///   there, so the runner's process is gone.
    /// - A timeout, an unreachable host or any other failure is [`Probe::Unknown`]: a frozen
    ///   or partitioned runner must not look gone.
    /// - The default cannot tell, and says [`Probe::Unknown`].
    ///
    /// # Cancel safety
    ///
    /// Cancel safe.
    fn probe<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, Probe> {
        let _ = address;
        Box::pin(std::future::ready(Probe::Unknown))
    }
}

/// What [`Transport::probe`] found at a runner's address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// Something accepted the connection (or a connection to it is open).
    Listening,
    /// The address refused the connection: no process listens there.
    Refused,
    /// The probe could not tell: a timeout, an unreachable host, or a transport without probes.
    Unknown,
}

/// The server side: what the transport calls when a peer's RPC arrives.
pub trait RunnerHandler: Send + Sync + fmt::Debug {
    /// A `Notify`: a persisted envelope wakes the storage read loop; a volatile one is
    /// delivered (and its reply discarded).
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: the envelope may or may not have been delivered.
    fn notify(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>>;

    /// An `Effect` or `Stream`: the replies of `request` (one final reply for `Effect`).
    /// Dropping the returned stream means the caller went away: a volatile request still
    /// running is interrupted.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it returns abandons the call like dropping the stream.
    fn request(
        &self,
        request: Request,
        persisted: bool,
    ) -> BoxFuture<'_, Result<Box<dyn ReplyStream>, ClusterError>>;

    /// An `Envelope`: an acknowledgement or interrupt of a request.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe, but idempotent at the entity.
    fn envelope(
        &self,
        envelope: Envelope,
        persisted: bool,
    ) -> BoxFuture<'_, Result<(), ClusterError>>;
}
