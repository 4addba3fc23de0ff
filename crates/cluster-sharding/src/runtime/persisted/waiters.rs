//! The callers in this process that wait for the replies of persisted requests, and the
//! registrations that keep them.
//!
//! A caller registers before its request is saved, so that a reply stored right after is not
//! missed ([`ReplyWaiters::register`]).
//! Every source of replies hands them here: the outcome writers of this runner, the pushed
//! calls' answers, and the reply poller, which reads storage for whoever waits
//! ([`ReplyWaiters::waiting`]).
//! Dropping the registration unregisters the caller.

use std::sync::{Arc, Mutex};

use cluster_core::envelope::Reply;
use cluster_core::reply_handlers::{HandlerId, ReplyHandlers, ReplyWaiter, UnregisterMode};
use cluster_core::sync::lock;
use cluster_core::{ShardId, Snowflake};
use tokio::sync::{Notify, mpsc, oneshot};

/// The local callers waiting for replies (in `PersistedDelivery`).
#[derive(Default)]
pub(super) struct ReplyWaiters {
    handlers: Mutex<ReplyHandlers<Waiter>>,
    /// Wakes the reply poller when a caller starts waiting.
    registered: Notify,
}

/// A local caller waiting for replies.
pub(super) enum Waiter {
    /// Waits for the final reply of a unary request, or for the news that it will not come
    /// here (`Err`).
    Exit(Option<oneshot::Sender<Answer>>),
    /// Reads the chunks and the final reply of a streaming request.
    Stream(StreamWaiter),
}

/// The reader of a persisted stream's replies.
pub(super) struct StreamWaiter {
    sender: mpsc::Sender<Reply>,
    /// The chunks below this sequence were handed over already.
    /// The reply poller reads an unacknowledged chunk again at every poll, and a copy would
    /// only take a slot.
    next_sequence: u32,
}

impl Waiter {
    /// The waiter of a stream's reader.
    pub(super) fn stream(sender: mpsc::Sender<Reply>) -> Waiter {
        Waiter::Stream(StreamWaiter { sender, next_sequence: 0 })
    }
}

impl ReplyWaiter for Waiter {
    fn respond(&mut self, reply: &Reply) {
        match self {
            Waiter::Exit(sender) => {
                if reply.is_final()
                    && let Some(sender) = sender.take()
                {
                    // The caller may have gone away.
                    let _ = sender.send(Ok(reply.clone()));
                }
            }
            Waiter::Stream(stream) => match reply {
                // The last slot is kept for the final reply.
                // The waiter ends with it, so it must never find the channel full.
                // A chunk that does not fit is handed over again by the reply poller until it
                // is acknowledged (the caller is behind).
                Reply::Chunk(chunk) => {
                    if chunk.sequence() >= stream.next_sequence
                        && stream.sender.capacity() > 1
                        && stream.sender.try_send(reply.clone()).is_ok()
                    {
                        stream.next_sequence = chunk.sequence() + 1;
                    }
                }
                Reply::WithExit(_) => {
                    // The caller may have gone away.
                    let _ = stream.sender.try_send(reply.clone());
                }
            },
        }
    }

    fn complete(self) {}

    fn unregistered(self, mode: UnregisterMode) {
        if let Waiter::Exit(Some(sender)) = self {
            // The caller may have gone away.
            let _ = sender.send(Err(mode));
        }
    }
}

/// What a local caller of a persisted request hears: the final reply, or why it will not come
/// to this process.
pub(super) type Answer = Result<Reply, UnregisterMode>;

/// A waiter's registration; dropping it unregisters the waiter.
pub(super) struct OwnedRegistration {
    waiters: Arc<ReplyWaiters>,
    request_id: Snowflake,
    handler: HandlerId,
}

impl Drop for OwnedRegistration {
    fn drop(&mut self) {
        lock(&self.waiters.handlers).remove(self.request_id, self.handler);
    }
}

impl ReplyWaiters {
    /// Registers `waiter` for the replies of `request_id`, a request of `shard`, and wakes the
    /// reply poller.
    pub(super) fn register(
        self: &Arc<Self>,
        request_id: Snowflake,
        shard: &ShardId,
        waiter: Waiter,
    ) -> OwnedRegistration {
        let handler = lock(&self.handlers).register(request_id, shard.clone(), waiter);
        self.registered.notify_one();
        OwnedRegistration { waiters: Arc::clone(self), request_id, handler }
    }

    /// Registers a waiter for the final reply of `request_id`.
    pub(super) fn register_exit(
        self: &Arc<Self>,
        request_id: Snowflake,
        shard: &ShardId,
        reply: oneshot::Sender<Answer>,
    ) -> OwnedRegistration {
        self.register(request_id, shard, Waiter::Exit(Some(reply)))
    }

    /// Hands stored replies to their waiters.
    pub(super) fn on_replies_saved<'a>(&self, replies: impl IntoIterator<Item = &'a Reply>) {
        let mut handlers = lock(&self.handlers);
        for reply in replies {
            handlers.on_reply_saved(reply);
        }
    }

    /// Hands a stored reply to its waiters.
    pub(super) fn on_reply_saved(&self, reply: &Reply) {
        lock(&self.handlers).on_reply_saved(reply);
    }

    /// The requests someone waits for.
    pub(super) fn waiting(&self) -> Vec<Snowflake> {
        lock(&self.handlers).waiting().collect()
    }

    /// Returns once someone waits (at once if someone does).
    pub(super) async fn someone_waits(&self) {
        loop {
            let registered = self.registered.notified();
            if lock(&self.handlers).waiting().next().is_some() {
                return;
            }
            registered.await;
        }
    }

    /// Ends the waits for the requests that `abandoned` selects: their callers hear that their
    /// requests are left stored for the next owner (`ClusterError::Abandoned`).
    pub(super) fn abandon(&self, mut abandoned: impl FnMut(Snowflake) -> bool) {
        let mut handlers = lock(&self.handlers);
        let selected: Vec<Snowflake> = handlers.waiting().filter(|id| abandoned(*id)).collect();
        for request_id in selected {
            handlers.unregister(request_id, UnregisterMode::Abandon);
        }
    }

    /// Ends the waits for replies of `shard`'s requests.
    pub(super) fn unregister_shard(&self, shard: &ShardId, mode: UnregisterMode) {
        lock(&self.handlers).unregister_shard(shard, mode);
    }
}
