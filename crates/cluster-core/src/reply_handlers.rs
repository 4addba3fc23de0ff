//! Who waits for which reply, and when they are told (`effect/src/cluster/SqlMessageStorage.ts`,
//! `effect/src/cluster/MessageStorage.ts`, effect 4.0.3 and 4.1.0).
//!
//! [`ReplyHandlers`] is the in-process registry of waiters for the replies of requests: a local
//! caller of a persisted request, or the server side of a remote caller's `Effect` call. Only
//! replies saved *in this process* reach it; callers elsewhere poll storage. The waiter type is
//! a parameter ([`ReplyWaiter`]), so this module stays free of any runtime: the sharding crate
//! plugs in a channel.
//!
//! [`TransactionNotifications`] is the rule (since effect 4.0.3) for replies saved inside a storage
//! transaction: final replies notify their waiters only after the outermost commit, chunks at
//! once, and a rolled-back transaction's notifications are dropped.

use std::collections::{BTreeMap, BTreeSet};

use crate::envelope::Reply;
use crate::ids::ShardId;
use crate::snowflake::Snowflake;

/// How waiters are told that their registration ended without a final reply (effect 4.1.0).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnregisterMode {
    /// The shard moved: resume the waiter with `EntityNotAssignedToRunner`, after which it
    /// reads the reply from storage (the default).
    Reroute,
    /// This runner will never see the reply (shutdown, `abandonUndelivered`): interrupt the
    /// waiter with the abandon marker. The request stays stored for the next owner.
    Abandon,
}

impl UnregisterMode {
    /// The mode of the reference's `{ interrupt }` option.
    pub fn from_interrupt(interrupt: bool) -> UnregisterMode {
        if interrupt { UnregisterMode::Abandon } else { UnregisterMode::Reroute }
    }
}

/// One waiter for the replies of one request.
pub trait ReplyWaiter {
    /// A reply was saved: a chunk (more may follow) or the final reply.
    fn respond(&mut self, reply: &Reply);

    /// The final reply was delivered; the waiter is removed.
    fn complete(self);

    /// The registration ended without a final reply.
    fn unregistered(self, mode: UnregisterMode);
}

/// The handle of one registration, to remove it when its waiter goes away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HandlerId(u64);

#[derive(Debug)]
struct Handler<W> {
    id: HandlerId,
    shard_id: ShardId,
    waiter: W,
}

/// Waiters by request id, indexed by shard so a released shard's waiters are found at once.
#[derive(Debug)]
pub struct ReplyHandlers<W> {
    next_id: u64,
    by_request: BTreeMap<Snowflake, Vec<Handler<W>>>,
    by_shard: BTreeMap<ShardId, BTreeSet<(Snowflake, HandlerId)>>,
}

impl<W> Default for ReplyHandlers<W> {
    fn default() -> ReplyHandlers<W> {
        ReplyHandlers { next_id: 0, by_request: BTreeMap::new(), by_shard: BTreeMap::new() }
    }
}

impl<W: ReplyWaiter> ReplyHandlers<W> {
    /// An empty registry.
    pub fn new() -> ReplyHandlers<W> {
        ReplyHandlers::default()
    }

    /// Registers `waiter` for the replies of `request_id`, a request to an entity on
    /// `shard_id`.
    pub fn register(&mut self, request_id: Snowflake, shard_id: ShardId, waiter: W) -> HandlerId {
        let id = HandlerId(self.next_id);
        self.next_id += 1;
        self.by_shard.entry(shard_id.clone()).or_default().insert((request_id, id));
        self.by_request.entry(request_id).or_default().push(Handler { id, shard_id, waiter });
        self.debug_check();
        id
    }

    /// Removes one registration (its waiter went away) and returns its waiter.
    pub fn remove(&mut self, request_id: Snowflake, id: HandlerId) -> Option<W> {
        let handlers = self.by_request.get_mut(&request_id)?;
        let position = handlers.iter().position(|handler| handler.id == id)?;
        let handler = handlers.remove(position);
        if handlers.is_empty() {
            self.by_request.remove(&request_id);
        }
        self.forget_shard_entry(&handler.shard_id, request_id, id);
        self.debug_check();
        Some(handler.waiter)
    }

    /// A reply was saved in this process: every waiter of its request responds; on a final
    /// reply they are completed and removed. Returns how many waiters were told.
    pub fn on_reply_saved(&mut self, reply: &Reply) -> usize {
        let request_id = reply.request_id();
        if !reply.is_final() {
            let handlers = self.by_request.get_mut(&request_id);
            return handlers.map_or(0, |handlers| {
                handlers.iter_mut().for_each(|handler| handler.waiter.respond(reply));
                handlers.len()
            });
        }
        let handlers = self.take_request(request_id);
        let n_handlers = handlers.len();
        for mut handler in handlers {
            handler.waiter.respond(reply);
            handler.waiter.complete();
        }
        n_handlers
    }

    /// Ends every registration of `request_id` without a final reply (the reference's
    /// `unregisterReplyHandler(requestId, { interrupt })`).
    pub fn unregister(&mut self, request_id: Snowflake, mode: UnregisterMode) -> usize {
        let handlers = self.take_request(request_id);
        let n_handlers = handlers.len();
        handlers.into_iter().for_each(|handler| handler.waiter.unregistered(mode));
        n_handlers
    }

    /// Ends every registration for requests to entities on `shard_id` (the reference's
    /// `unregisterShardReplyHandlers`): on a rebalance with [`UnregisterMode::Reroute`], during
    /// shutdown with [`UnregisterMode::Abandon`].
    pub fn unregister_shard(&mut self, shard_id: &ShardId, mode: UnregisterMode) -> usize {
        let Some(entries) = self.by_shard.remove(shard_id) else {
            return 0;
        };
        let mut n_handlers = 0;
        let request_ids: BTreeSet<Snowflake> =
            entries.iter().map(|(request_id, _)| *request_id).collect();
        for request_id in request_ids {
            let Some(handlers) = self.by_request.get_mut(&request_id) else { continue };
            let (on_shard, elsewhere): (Vec<Handler<W>>, Vec<Handler<W>>) =
                handlers.drain(..).partition(|handler| handler.shard_id == *shard_id);
            *handlers = elsewhere;
            if handlers.is_empty() {
                self.by_request.remove(&request_id);
            }
            n_handlers += on_shard.len();
            on_shard.into_iter().for_each(|handler| handler.waiter.unregistered(mode));
        }
        self.debug_check();
        n_handlers
    }

    /// The requests someone waits for, in id order.
    pub fn waiting(&self) -> impl Iterator<Item = Snowflake> + '_ {
        self.by_request.keys().copied()
    }

    /// Whether anyone waits for `request_id`.
    pub fn is_waiting(&self, request_id: Snowflake) -> bool {
        self.by_request.contains_key(&request_id)
    }

    /// The number of registrations.
    pub fn len(&self) -> usize {
        self.by_request.values().map(Vec::len).sum()
    }

    /// Whether there are no registrations.
    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    fn take_request(&mut self, request_id: Snowflake) -> Vec<Handler<W>> {
        let handlers = self.by_request.remove(&request_id).unwrap_or_default();
        for handler in &handlers {
            self.forget_shard_entry(&handler.shard_id, request_id, handler.id);
        }
        self.debug_check();
        handlers
    }

    fn forget_shard_entry(&mut self, shard_id: &ShardId, request_id: Snowflake, id: HandlerId) {
        if let Some(entries) = self.by_shard.get_mut(shard_id) {
            entries.remove(&(request_id, id));
            if entries.is_empty() {
                self.by_shard.remove(shard_id);
            }
        }
    }

    /// The two indexes hold the same registrations.
    fn debug_check(&self) {
        if cfg!(debug_assertions) {
            let n_indexed: usize = self.by_shard.values().map(BTreeSet::len).sum();
            debug_assert_eq!(n_indexed, self.len(), "shard index out of step");
            debug_assert!(self.by_request.values().all(|handlers| !handlers.is_empty()));
        }
    }
}

/// Whether a saved reply's waiters are told now or at the outermost commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Notify {
    /// Tell the waiters now.
    Now,
    /// Held until the outermost transaction commits (dropped if it rolls back).
    Deferred,
}

/// The replies saved inside (possibly nested) storage transactions whose waiters must wait for
/// the outermost commit (effect 4.0.3).
#[derive(Debug, Default)]
pub struct TransactionNotifications {
    /// One list per open transaction, innermost last.
    frames: Vec<Vec<Reply>>,
}

impl TransactionNotifications {
    /// No transaction open.
    pub fn new() -> TransactionNotifications {
        TransactionNotifications::default()
    }

    /// A transaction (or a nested one) starts.
    pub fn begin(&mut self) {
        self.frames.push(Vec::new());
    }

    /// Whether a transaction is open.
    pub fn in_transaction(&self) -> bool {
        !self.frames.is_empty()
    }

    /// `reply` was saved: a final reply inside a transaction is held; anything else is
    /// notified now.
    pub fn on_saved(&mut self, reply: &Reply) -> Notify {
        match self.frames.last_mut() {
            Some(frame) if reply.is_final() => {
                frame.push(reply.clone());
                Notify::Deferred
            }
            _ => Notify::Now,
        }
    }

    /// The innermost transaction committed. Returns the replies to notify now: those of the
    /// outermost commit; a nested commit hands its replies to the enclosing transaction.
    pub fn commit(&mut self) -> Vec<Reply> {
        let frame = self.frames.pop().unwrap_or_default();
        match self.frames.last_mut() {
            Some(outer) => {
                outer.extend(frame);
                Vec::new()
            }
            None => frame,
        }
    }

    /// The innermost transaction rolled back: its held notifications are dropped.
    pub fn rollback(&mut self) {
        self.frames.pop();
    }
}

#[cfg(test)]
mod tests;
