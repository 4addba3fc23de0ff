//! Persisted requests pushed by their callers (the owner's side of a persisted `Effect` RPC,
//! `effect/src/cluster/Sharding.ts`).
//!
//! A caller that does not serve a request's shard stores the request, then sends it to the
//! shard's owner over the transport.
//! The owner hands it to its entity as direct delivery does (`direct`), without waiting for its
//! read loop, and answers the call with the final reply once that reply is stored.
//! A stream is delivered by the owner's read loop, woken at once (it resumes after the last
//! stored chunk); its chunks go back on the call as they are stored, and the caller's
//! acknowledgements, stored, are given to the owner at once (`take_up`).
//!
//! # The stored reply is the answer
//!
//! The call is answered only by the waiter registered here for the request.
//! That waiter hears a final reply in two ways, both stored:
//!
//! - this process saved it (`save_final_reply` and the transactional commit wake the waiters
//!   only after the write succeeded);
//! - the reply poller read it from storage (another process stored it, or this one did before
//!   the waiter was registered).
//!
//! Storage accepts one final reply per request.
//! So the reply on the call is the stored one, and the caller may return it without a read.
//!
//! # Order and runs
//!
//! Nothing changes:
//!
//! - the request goes directly only under direct delivery's order rules, checked against the
//!   entity's earlier unprocessed requests read from storage at arrival;
//! - otherwise the read loop delivers it in storage order;
//! - the claim (`tracked`) keeps a push, a notify and a read of the same request from running
//!   it twice;
//! - the request is read from storage after it is reserved here, and runs only if it is still
//!   unanswered; what runs is the stored request, not the pushed copy.
//!
//! # Bounds
//!
//! - A push stays an open call until the final reply is stored, however long the handler runs.
//!   The transport keeps pushes in a lane of their own, so that they never take the slots of
//!   volatile calls, notices and pings (see `cluster_core::transport::Transport::send`).
//! - The owner takes up pushed requests (pushed, or told of in a notice) in at most
//!   `TAKE_UPS_MAX` tasks at once; past that, the read loop, woken at once, delivers them.
//!
//! # When the push fails
//!
//! The request stays stored, so nothing is lost:
//!
//! - the caller's lane of pushes to the owner is full: the call fails at once, the owner is
//!   told to read storage, and the caller waits on storage;
//! - the owner does not serve the shard (it moved), or stops: the call fails, and the caller
//!   waits on storage;
//! - the call breaks (a lost connection, the owner dies after storing the reply): the caller
//!   reads the reply from storage;
//! - the caller goes away: the request still runs, and only a stored interrupt stops it.

use std::sync::Arc;

use cluster_core::ClusterError;
use cluster_core::envelope::{Envelope, Reply, Request};
use cluster_core::future::BoxFuture;
use cluster_core::transport::ReplyStream;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::{CancellationToken, DropGuard};
use tracing::Instrument;

use cluster_core::Clock;
use cluster_core::storage::MessageStorage;
use tokio::sync::Semaphore;
use tokio_util::task::TaskTracker;

use super::direct::{DirectDelivery, EARLIER_LIMIT};
use super::tracked::TrackedRequests;
use super::waiters::{OwnedRegistration, ReplyWaiters, Waiter};
use crate::placement::remote::{PushedRequests, Remote};
use crate::placement::shards::Shards;
use crate::runtime::delivery::ReadLatch;
use crate::runtime::local::STREAM_BUFFER;

/// The owner's side of pushed requests, and what it works with.
pub(super) struct PushedDelivery {
    /// Where a pushed request goes when its order allows.
    pub(super) direct: Arc<DirectDelivery>,
    pub(super) storage: Arc<dyn MessageStorage>,
    /// The shards served: a push for another shard is refused.
    pub(super) serving: Arc<Shards>,
    /// Interrupts and acknowledgements told of go to their requests.
    pub(super) tracked: Arc<TrackedRequests>,
    /// The waiters that answer the calls.
    pub(super) waiters: Arc<ReplyWaiters>,
    /// Wakes the read loop for what is left to it.
    pub(super) read_latch: Arc<ReadLatch>,
    pub(super) clock: Arc<dyn Clock>,
    /// The take-ups under way (`TAKE_UPS_MAX`).
    pub(super) take_ups: Arc<Semaphore>,
    /// The runtime's tasks: the take-ups.
    pub(super) tasks: TaskTracker,
}

impl PushedRequests for PushedDelivery {
    fn serve(self: Arc<Self>, request: Request) -> BoxFuture<'static, Result<Reply, ClusterError>> {
        let span = tracing::debug_span!("serve_pushed", request_id = %request.request_id);
        Box::pin(self.serve_pushed(request).instrument(span))
    }

    fn serve_stream(
        self: Arc<Self>,
        request: Request,
    ) -> Result<Box<dyn ReplyStream>, ClusterError> {
        let address = request.address.clone();
        if !self.serving.serves(&address.shard_id) {
            self.read_latch.wake();
            return Err(ClusterError::EntityNotAssignedToRunner { address });
        }
        let (sender, replies) = mpsc::channel(STREAM_BUFFER);
        // Fed as this process stores the stream's replies, and by the reply poller.
        let registration =
            self.waiters.register(request.request_id, &address.shard_id, Waiter::stream(sender));
        // A stream goes through the read loop, which resumes it after its last stored chunk.
        self.read_latch.wake();
        Ok(Box::new(PushedStream { replies, _registration: registration, finished: false }))
    }

    fn take_up(self: Arc<Self>, envelope: Envelope) {
        match envelope {
            Envelope::Request(request) => self.take_up_request(request),
            envelope => {
                self.tracked.forward(&envelope);
                // Its row is read too, and marked processed, by the read loop.
                self.read_latch.wake();
            }
        }
    }
}

/// A pushed stream's replies as the owner stores them, until the final reply.
struct PushedStream {
    replies: mpsc::Receiver<Reply>,
    _registration: OwnedRegistration,
    finished: bool,
}

impl ReplyStream for PushedStream {
    fn next_reply(&mut self) -> BoxFuture<'_, Option<Result<Reply, ClusterError>>> {
        Box::pin(async move {
            if self.finished {
                return None;
            }
            // `None` once the waiter is gone (this runner stops): the caller reads storage.
            let reply = self.replies.recv().await?;
            self.finished = reply.is_final();
            Some(Ok(reply))
        })
    }
}

/// Reads the replies that `request`'s owner pushes on `call`, and hands each to this process's
/// `waiters` as the reply poller does: they are stored replies.
///
/// The task, one of `tasks`, ends at the final reply, when the call fails (storage answers
/// instead, and the owner is told to read through `remote`), or when the returned guard drops.
pub(super) fn pump_pushed(
    waiters: &Arc<ReplyWaiters>,
    remote: &Arc<Remote>,
    tasks: &TaskTracker,
    request: Request,
    call: BoxFuture<'static, Result<Box<dyn ReplyStream>, ClusterError>>,
) -> DropGuard {
    let stop = CancellationToken::new();
    let guard = stop.clone().drop_guard();
    let (waiters, remote) = (Arc::clone(waiters), Arc::clone(remote));
    tasks.spawn(async move {
        let request_id = request.request_id;
        let pumped = async {
            let mut replies = call.await?;
            while let Some(reply) = replies.next_reply().await {
                let reply = reply?;
                waiters.on_reply_saved(&reply);
                if reply.is_final() {
                    return Ok(());
                }
            }
            Err(ClusterError::EntityNotAssignedToRunner { address: request.address.clone() })
        };
        let pumped = tokio::select! {
            pumped = pumped => pumped,
            () = stop.cancelled() => return,
        };
        if let Err(error) = pumped {
            tracing::debug!(%error, %request_id, "a pushed stream broke off; reading storage");
            let shard = request.address.shard_id.clone();
            remote.wake_reader(&shard, || Envelope::Request(request));
        }
    });
    guard
}

impl PushedDelivery {
    /// Runs a pushed request here and answers with its stored final reply.
    async fn serve_pushed(self: Arc<Self>, request: Request) -> Result<Reply, ClusterError> {
        let address = request.address.clone();
        let request_id = request.request_id;
        if !self.serving.serves(&address.shard_id) {
            self.read_latch.wake();
            return Err(ClusterError::EntityNotAssignedToRunner { address });
        }
        let (reply, replied) = oneshot::channel();
        // Registered before the delivery, so that a reply stored right after is not missed.
        // A reply stored before is read by the reply poller, which polls for every waiter.
        let registration = self.waiters.register_exit(request_id, &address.shard_id, reply);
        let _serving = crate::metrics::Occupied::of(crate::metrics::PERSISTED_PUSHED_SERVING);
        // A task of its own: the delivery completes even if the caller goes away meanwhile.
        self.take_up_request(request);
        let answer = replied.await;
        drop(registration);
        match answer {
            Ok(Ok(reply)) => Ok(reply),
            // Shutdown, or the shard let go during shutdown: the caller reads storage.
            Ok(Err(_)) | Err(_) => Err(ClusterError::EntityNotAssignedToRunner { address }),
        }
    }

    /// Takes up a pushed request in a task of its own ([`deliver_pushed`]), unless
    /// [`TAKE_UPS_MAX`] are under way: then the read loop, woken at once, delivers it with the
    /// others it reads.
    ///
    /// So a flood of notices or pushes costs a bounded number of tasks and storage reads.
    ///
    /// [`deliver_pushed`]: PushedDelivery::deliver_pushed
    /// [`TAKE_UPS_MAX`]: super::TAKE_UPS_MAX
    fn take_up_request(self: &Arc<Self>, request: Request) {
        match Arc::clone(&self.take_ups).try_acquire_owned() {
            Ok(permit) => {
                let pushed = Arc::clone(self);
                self.tasks.spawn(async move {
                    pushed.deliver_pushed(request).await;
                    drop(permit);
                });
            }
            Err(_) => {
                let request_id = request.request_id;
                tracing::debug!(%request_id, "as many pushed requests taken up as allowed; left to the read loop");
                self.read_latch.wake();
            }
        }
    }

    /// Hands the stored final reply of `request_id`, if there is one, to this process's waiters,
    /// as the reply poller would.
    ///
    /// A caller's waiter registered after the reply was stored heard nothing of it, and the
    /// next poll may be far.
    async fn answer_if_stored(&self, request_id: cluster_core::Snowflake) {
        match self.storage.replies_for(&[request_id]).await {
            Ok(replies) => {
                self.waiters.on_replies_saved(replies.iter().filter(|reply| reply.is_final()));
            }
            Err(error) => tracing::debug!(%error, %request_id, "could not read a reply"),
        }
    }

    /// Hands a pushed request to its entity if direct delivery's order rules allow it now;
    /// otherwise leaves it to the read loop, which is woken.
    async fn deliver_pushed(self: Arc<Self>, request: Request) {
        let Some(reservation) = self.direct.reserve(&request) else {
            // Taken up here already, or its entity's requests go through the read loop now.
            // It may also have been answered just before a caller started waiting here.
            self.read_latch.wake();
            self.answer_if_stored(request.request_id).await;
            return;
        };
        // Read after the reservation: a run that ended before it stored its reply first, so a
        // request answered already (a second push, a late one) is not found and runs no more.
        // The stored request is what runs, not the pushed copy.
        // Its entity's earlier requests come with it, in one read (a backend may answer the
        // reads of concurrent pushes together).
        let now = self.clock.now();
        let ids = [request.request_id];
        let (stored, earlier) = match self
            .storage
            .unprocessed_messages_ordered(&ids, now, EARLIER_LIMIT)
            .await
        {
            Ok(mut ordered) => {
                let stored =
                    ordered.batch.messages.into_iter().find_map(|message| match message.envelope {
                        Envelope::Request(stored) if stored.request_id == request.request_id => {
                            Some(stored)
                        }
                        _ => None,
                    });
                (stored, ordered.earlier.remove(&request.request_id))
            }
            Err(error) => {
                tracing::debug!(%error, "could not read a pushed request; left to the read loop");
                self.read_latch.wake();
                return;
            }
        };
        let Some(stored) = stored else {
            tracing::debug!("a pushed request is answered already, or not due");
            drop(reservation);
            self.answer_if_stored(request.request_id).await;
            return;
        };
        Box::pin(self.direct.deliver(stored, reservation, earlier)).await;
    }
}
