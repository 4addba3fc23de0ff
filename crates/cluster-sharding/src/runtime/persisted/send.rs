//! Sending: what a caller in this process does with a persisted request.
//!
//! It saves the request (deduplicated by its primary key), hands it to its entity directly
//! when this runner serves it (`direct`), pushes it to its owner otherwise (`pushed`), and
//! waits for the final reply on the first of three ways (see the parent module).
//! The reply poller ([`Sending::poll_replies`]) reads the replies that other processes store.
//! A caller that goes away stores an interrupt for the request it made.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{Envelope, Exit, Interrupt, Reply, Request};
use cluster_core::future::BoxFuture;
use cluster_core::reply_handlers::UnregisterMode;
use cluster_core::storage::{MessageStorage, SaveRequestOptions, SaveResult};
use cluster_core::{ClusterError, EntityAddress, Snowflake};
use tokio::sync::{mpsc, oneshot};
use tokio_util::task::TaskTracker;

use super::direct::DirectDelivery;
use super::pushed::pump_pushed;
use super::waiters::{Answer, OwnedRegistration, ReplyWaiters, Waiter};
use crate::api::entity::Ids;
use crate::placement::remote::Remote;
use crate::placement::shards::Shards;
use crate::runtime::local::STREAM_BUFFER;

/// How often a request is saved again with a fresh id while its id is taken by another
/// message (see [`Sending::id_taken`]).
const ID_ATTEMPTS_MAX: u32 = 8;

/// The callers' side of persisted delivery, and what it works with.
pub(super) struct Sending {
    pub(super) storage: Arc<dyn MessageStorage>,
    /// Takes up a request this runner serves, once saved.
    pub(super) direct: Arc<DirectDelivery>,
    /// The local callers waiting for replies.
    pub(super) waiters: Arc<ReplyWaiters>,
    /// Pushes a request to its owner, or tells the owner to read it.
    pub(super) remote: Arc<Remote>,
    /// Says when this runtime shuts down.
    pub(super) serving: Arc<Shards>,
    pub(super) ids: Arc<Ids>,
    /// The runtime's tasks: the interrupt writers and stream pumps.
    pub(super) tasks: TaskTracker,
    /// The pause between two polls of the replies (`entity_reply_poll_interval`).
    pub(super) reply_poll_interval: Duration,
}

impl Sending {
    fn is_shutdown(&self) -> bool {
        self.serving.shutdown().is_cancelled()
    }

    fn wake_reader(&self, shard: &cluster_core::ShardId, envelope: impl FnOnce() -> Envelope) {
        self.remote.wake_reader(shard, envelope);
    }
}

/// A persisted stream as its caller sees it: the replies channel, the registration that feeds
/// it, and the acknowledgements that go to storage.
pub(crate) struct PersistedStream {
    sending: Arc<Sending>,
    address: EntityAddress,
    request_id: Snowflake,
    pub(crate) replies: mpsc::Receiver<Reply>,
    /// Feeds `replies` while the stream lives.
    _registration: OwnedRegistration,
    /// Stops the task that reads the replies the owner pushes, when the stream goes.
    _pump: Option<tokio_util::sync::DropGuard>,
    interrupt: InterruptOnDrop,
}

impl PersistedStream {
    /// Stores the acknowledgement of chunk `reply_id`, which lets the handler send the next.
    pub(crate) async fn ack(&self, reply_id: Snowflake) -> Result<(), ClusterError> {
        let ack = cluster_core::envelope::AckChunk {
            id: self.sending.ids.next(),
            address: self.address.clone(),
            request_id: self.request_id,
            reply_id,
        };
        self.sending.storage.save_ack_chunk(&ack).await?;
        if self.sending.is_shutdown() {
            // Stored for the next owner, which resumes the stream after this chunk.
            // This consumer gets no further chunk here.
            // This is the reference's abandoned AckChunk (`effect/src/cluster/Sharding.ts`).
            return Err(ClusterError::EntityNotAssignedToRunner { address: self.address.clone() });
        }
        self.sending.wake_reader(&self.address.shard_id, || Envelope::AckChunk(ack));
        Ok(())
    }

    /// Why the replies stopped before the final reply.
    ///
    /// - [`ClusterError::Abandoned`]: this runner stopped and left the request stored for the
    ///   next owner.
    /// - `None`: an interruption.
    pub(crate) fn ended_early(&self) -> Option<ClusterError> {
        self.sending.is_shutdown().then(|| ClusterError::Abandoned {
            address: self.address.clone(),
            request_id: self.request_id,
        })
    }

    /// The stream ended: nothing to interrupt any more.
    pub(crate) fn finish(&mut self) {
        self.interrupt.sending = None;
    }
}

/// Sends an interrupt for a persisted request whose caller went away, unless disarmed.
struct InterruptOnDrop {
    sending: Option<Arc<Sending>>,
    address: EntityAddress,
    request_id: Snowflake,
}

impl Drop for InterruptOnDrop {
    fn drop(&mut self) {
        let Some(sending) = self.sending.take() else { return };
        if sending.is_shutdown() {
            // The request stays stored for the next run.
            // An interrupt saved now would cut it off there.
            // (effect's `Sharding.test.ts`: no interrupts for durable messages at shutdown.)
            return;
        }
        let interrupt = Interrupt {
            id: sending.ids.next(),
            address: self.address.clone(),
            request_id: self.request_id,
        };
        let tasks = sending.tasks.clone();
        tasks.spawn(async move {
            let request_id = interrupt.request_id;
            if let Err(error) = sending.store_interrupt(interrupt).await {
                tracing::warn!(%error, %request_id, "could not store an interrupt");
            }
        });
    }
}

impl Sending {
    /// Stores an interrupt for the persisted request `request_id` of the entity at `address`,
    /// and wakes the owner's storage reader (see `Sharding::interrupt_request`).
    pub(crate) async fn interrupt_request(
        self: &Arc<Self>,
        address: &EntityAddress,
        request_id: Snowflake,
    ) -> Result<(), ClusterError> {
        let interrupt = Interrupt { id: self.ids.next(), address: address.clone(), request_id };
        self.store_interrupt(interrupt).await
    }

    async fn store_interrupt(self: &Arc<Self>, interrupt: Interrupt) -> Result<(), ClusterError> {
        self.storage.save_interrupt(&interrupt).await?;
        let shard = interrupt.address.shard_id.clone();
        self.wake_reader(&shard, || Envelope::Interrupt(interrupt));
        Ok(())
    }

    /// Saves a persisted request and waits for its final reply's exit.
    ///
    /// Dropping the returned future stores an interrupt for the request, unless
    /// `uninterruptible` or the request was stored before (a duplicate of its primary key: its
    /// first caller may still wait for it).
    /// The request itself stays stored.
    pub(crate) async fn send_persisted(
        self: &Arc<Self>,
        mut request: Request,
        options: SaveRequestOptions,
        uninterruptible: bool,
    ) -> Result<Exit, ClusterError> {
        let mut attempt = 1;
        let (mut registration, mut replied, direct, saved, earlier) = loop {
            let (reply, replied) = oneshot::channel();
            // Registered before the save, so a reply saved right after it is not missed.
            let registration =
                self.waiters.register_exit(request.request_id, &request.address.shard_id, reply);
            let direct = self.direct.plan(&request, &options);
            let (saved, earlier) = self.direct.save(&request, &options, direct.is_some()).await;
            if !matches!(saved, Ok(SaveResult::Success)) {
                self.direct.order.unhold(&request.address, request.request_id);
            }
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (registration, replied, direct, saved, earlier);
            }
        };
        let waited_id = match saved? {
            SaveResult::Success => request.request_id,
            SaveResult::Duplicate {
                last_received_reply: Some(Reply::WithExit(with_exit)), ..
            } => {
                return Ok(with_exit.exit);
            }
            SaveResult::Duplicate { original_id, .. } => {
                let (reply, duplicate_replied) = oneshot::channel();
                registration =
                    self.waiters.register_exit(original_id, &request.address.shard_id, reply);
                replied = duplicate_replied;
                original_id
            }
        };
        let fresh = waited_id == request.request_id;
        // A duplicate is pushed under the stored request's id: the owner runs (or waits for)
        // the stored request, not this copy.
        let waited = match fresh {
            true => request.clone(),
            false => Request { request_id: waited_id, ..request.clone() },
        };
        let mut push = None;
        if let Some(reservation) = direct.filter(|_| fresh) {
            // Boxed: its future would otherwise be inside this one, which the caller moves at
            // each await.
            Box::pin(self.direct.deliver(request.clone(), reservation, earlier)).await;
        } else if let Some(pushed) = self.remote.push(&waited) {
            // The owner runs it at once and answers on the call (`pushed`).
            push = Some(pushed);
        } else {
            self.wake_reader(&request.address.shard_id, || Envelope::Request(request.clone()));
        }
        if self.is_shutdown() {
            // Sent while this runner stops (an entity's `on_stop`): no reply will be read here.
            // The request is stored for the next owner.
            // This is the reference's abandon path (`effect/src/cluster/Sharding.ts`).
            tracing::debug!(request_id = %waited_id, "persisted request sent during shutdown: left stored");
            return Err(ClusterError::Abandoned {
                address: request.address,
                request_id: waited_id,
            });
        }
        // Only the caller that stored the request interrupts it when it goes away.
        // A duplicate's caller waits for a request that another caller made, and may still be
        // waiting for (the reference's client interrupts the request id it made, which a
        // duplicate never stored: `effect/src/cluster/Sharding.ts`, the client's `Interrupt`).
        let mut interrupt = InterruptOnDrop {
            sending: (!uninterruptible && fresh).then(|| Arc::clone(self)),
            address: request.address.clone(),
            request_id: waited_id,
        };
        // A shard that moves or a fenced reply keeps the wait going.
        // The reply poller reads the next owner's reply.
        // Only shutdown ends the wait without a reply.
        let exit = match push {
            Some(push) => self.await_pushed(&waited, push, &mut replied).await,
            None => self.await_reply(&request.address, waited_id, &mut replied).await,
        };
        interrupt.sending = None;
        drop(registration);
        exit
    }

    /// Saves a persisted streaming request; its chunks and final reply arrive on the returned
    /// stream's channel.
    pub(crate) async fn stream_persisted(
        self: &Arc<Self>,
        request: Request,
        options: SaveRequestOptions,
    ) -> Result<PersistedStream, ClusterError> {
        let (sender, replies) = mpsc::channel(STREAM_BUFFER);
        let shard_id = &request.address.shard_id.clone();
        let (mut request, mut attempt) = (request, 1);
        let (mut registration, saved) = loop {
            let registration =
                self.waiters.register(request.request_id, shard_id, Waiter::stream(sender.clone()));
            let saved = self.storage.save_request(&request, &options).await.map_err(Into::into);
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (registration, saved);
            }
        };
        let request_id = match saved? {
            SaveResult::Success => request.request_id,
            SaveResult::Duplicate { original_id, last_received_reply } => {
                registration =
                    self.waiters.register(original_id, shard_id, Waiter::stream(sender.clone()));
                if let Some(reply) = last_received_reply {
                    let _ = sender.try_send(reply);
                }
                original_id
            }
        };
        let fresh = request_id == request.request_id;
        // The stored request is what the owner runs, under its own id.
        let waited = Request { request_id, ..request.clone() };
        let pump = match self.remote.push_stream(&waited) {
            Some(call) => Some(pump_pushed(&self.waiters, &self.remote, &self.tasks, waited, call)),
            None => {
                self.wake_reader(&request.address.shard_id, || Envelope::Request(waited));
                None
            }
        };
        // As for a unary request: a duplicate's reader does not interrupt another's stream.
        let interrupt = InterruptOnDrop {
            sending: fresh.then(|| Arc::clone(self)),
            address: request.address.clone(),
            request_id,
        };
        Ok(PersistedStream {
            sending: Arc::clone(self),
            address: request.address,
            request_id,
            replies,
            _registration: registration,
            _pump: pump,
            interrupt,
        })
    }

    /// Saves a persisted request without waiting for its reply (a discarded call).
    pub(crate) async fn notify_persisted(
        self: &Arc<Self>,
        mut request: Request,
        options: SaveRequestOptions,
    ) -> Result<(), ClusterError> {
        let mut attempt = 1;
        let (direct, saved, earlier) = loop {
            let direct = self.direct.plan(&request, &options);
            let (saved, earlier) = self.direct.save(&request, &options, direct.is_some()).await;
            if !matches!(saved, Ok(SaveResult::Success)) {
                self.direct.order.unhold(&request.address, request.request_id);
            }
            if !self.id_taken(&saved, &mut request, &mut attempt) {
                break (direct, saved, earlier);
            }
        };
        // The save's error first: a request that was not stored must not look sent.
        let saved = saved?;
        if let Some(reservation) = direct.filter(|_| matches!(saved, SaveResult::Success)) {
            Box::pin(self.direct.deliver(request, reservation, earlier)).await;
        } else {
            self.wake_reader(&request.address.shard_id, || Envelope::Request(request.clone()));
        }
        Ok(())
    }

    /// Whether `request`'s save found its id taken by another message (`Conflict`: a primary
    /// key's duplicate is not an error but `SaveResult::Duplicate`), with attempts left; if so,
    /// `request` gets a fresh id to be saved again.
    ///
    /// Two processes make the same snowflake when they share a machine id and its millisecond
    /// and sequence: a client-only process draws its machine id at random, and a runner may
    /// get the same one from the registry (the reference's generator has the same gap).
    fn id_taken(
        &self,
        saved: &Result<SaveResult, ClusterError>,
        request: &mut Request,
        attempt: &mut u32,
    ) -> bool {
        let taken = matches!(
            saved,
            Err(ClusterError::Persistence(error))
                if error.kind() == cluster_core::error::StorageErrorKind::Conflict
        );
        if !taken || *attempt >= ID_ATTEMPTS_MAX {
            return false;
        }
        *attempt += 1;
        let fresh = self.ids.next();
        tracing::warn!(taken = %request.request_id, %fresh, "a persisted request's id is taken by another message (a process shares this machine id): saving it with a fresh id");
        request.request_id = fresh;
        true
    }

    /// Waits for the final reply of `request`, pushed to its owner as `push`.
    ///
    /// The first of the owner's answer on the call and the stored reply (read by the reply
    /// poller) wins.
    /// Both are the stored final reply (see `pushed`).
    /// A failed call leaves the wait to storage, and the owner is told to read.
    async fn await_pushed(
        self: &Arc<Self>,
        request: &Request,
        push: BoxFuture<'static, Result<Reply, ClusterError>>,
        replied: &mut oneshot::Receiver<Answer>,
    ) -> Result<Exit, ClusterError> {
        let (address, request_id) = (&request.address, request.request_id);
        let waiting = crate::metrics::Occupied::of(crate::metrics::PERSISTED_PUSHED_WAITING);
        tokio::select! {
            pushed = push => match pushed {
                Ok(Reply::WithExit(with_exit)) => {
                    metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "pushed")
                        .increment(1);
                    return Ok(with_exit.exit);
                }
                Ok(Reply::Chunk(_)) => {
                    tracing::debug!(%request_id, "a pushed request was answered with a chunk; waiting on storage");
                }
                // Also when the transport's lane of pushes to the owner is full: the request
                // is stored, and the owner is told to read it.
                Err(error) => {
                    tracing::debug!(%error, %request_id, "pushing the request failed; waiting on storage");
                    self.wake_reader(&address.shard_id, || Envelope::Request(request.clone()));
                }
            },
            answer = &mut *replied => {
                metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "stored")
                    .increment(1);
                return Self::answered(address, request_id, answer);
            }
        }
        drop(waiting);
        metrics::counter!(crate::metrics::PERSISTED_PUSHED, "answer" => "fallback").increment(1);
        self.await_reply(address, request_id, replied).await
    }

    async fn await_reply(
        self: &Arc<Self>,
        address: &EntityAddress,
        request_id: Snowflake,
        replied: &mut oneshot::Receiver<Answer>,
    ) -> Result<Exit, ClusterError> {
        // Woken by a reply saved in this process, or by the reply poller.
        Self::answered(address, request_id, replied.await)
    }

    /// What a local caller of `request_id` returns, from what its waiter heard.
    fn answered(
        address: &EntityAddress,
        request_id: Snowflake,
        answer: Result<Answer, oneshot::error::RecvError>,
    ) -> Result<Exit, ClusterError> {
        match answer {
            Ok(Ok(Reply::WithExit(with_exit))) => Ok(with_exit.exit),
            // This process stops: the request stays stored for the next owner.
            Ok(Err(UnregisterMode::Abandon)) => {
                Err(ClusterError::Abandoned { address: address.clone(), request_id })
            }
            // Unregistered without a reply otherwise: the reply will not be read here.
            _ => Err(ClusterError::EntityNotAssignedToRunner { address: address.clone() }),
        }
    }

    /// Reads the final replies of the requests that local callers wait for
    /// (`effect/src/cluster/Runners.ts`).
    ///
    /// It reads them all in one query, every `entity_reply_poll_interval` while anyone waits.
    /// It finds the replies that another process saved, or that this process saved before a
    /// restart.
    pub(crate) async fn poll_replies(self: Arc<Self>) {
        let interval = self.reply_poll_interval;
        loop {
            tokio::select! {
                () = self.waiters.someone_waits() => {}
                () = self.serving.shutdown().token().cancelled() => return,
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.serving.shutdown().token().cancelled() => return,
            }
            // Who waits is read now, not before the sleep: a caller that started waiting
            // meanwhile is read at this poll rather than the next.
            let waiting = self.waiters.waiting();
            if waiting.is_empty() {
                continue;
            }
            match self.storage.replies_for(&waiting).await {
                Ok(replies) => {
                    // Final replies and unacknowledged chunks: stream readers skip the chunks
                    // they already have.
                    self.waiters.on_replies_saved(&replies);
                }
                Err(error) => tracing::debug!(%error, "could not poll replies"),
            }
        }
    }
}
