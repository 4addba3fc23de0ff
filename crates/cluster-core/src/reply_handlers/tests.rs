//! Tests of the reply-handler registry and the transaction notification rule.

use std::cell::RefCell;
use std::rc::Rc;

use proptest::prelude::*;

use super::*;
use crate::envelope::{Chunk, Exit, RawJson, WithExit};
use crate::ids::ShardGroup;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Respond(u32, Snowflake, bool),
    Complete(u32),
    Unregistered(u32, UnregisterMode),
}

/// A waiter that records what it was told.
struct Recorder {
    name: u32,
    log: Rc<RefCell<Vec<Event>>>,
}

impl ReplyWaiter for Recorder {
    fn respond(&mut self, reply: &Reply) {
        self.log.borrow_mut().push(Event::Respond(self.name, reply.id(), reply.is_final()));
    }

    fn complete(self) {
        self.log.borrow_mut().push(Event::Complete(self.name));
    }

    fn unregistered(self, mode: UnregisterMode) {
        self.log.borrow_mut().push(Event::Unregistered(self.name, mode));
    }
}

fn shard(id: u32) -> ShardId {
    ShardId::new(ShardGroup::from("default"), id)
}

fn final_reply(request_id: u64, id: u64) -> Reply {
    Reply::WithExit(WithExit {
        request_id: Snowflake::new(request_id),
        id: Snowflake::new(id),
        exit: Exit::void(),
    })
}

fn chunk(request_id: u64, id: u64) -> Reply {
    Reply::Chunk(
        Chunk::new(Snowflake::new(request_id), Snowflake::new(id), 0, vec![RawJson::null()])
            .unwrap(),
    )
}

fn registry() -> (ReplyHandlers<Recorder>, Rc<RefCell<Vec<Event>>>) {
    (ReplyHandlers::new(), Rc::new(RefCell::new(Vec::new())))
}

#[test]
fn chunks_reach_every_waiter_and_the_final_reply_completes_them() {
    let (mut handlers, log) = registry();
    handlers.register(Snowflake::new(1), shard(1), Recorder { name: 1, log: log.clone() });
    handlers.register(Snowflake::new(1), shard(1), Recorder { name: 2, log: log.clone() });
    handlers.register(Snowflake::new(2), shard(1), Recorder { name: 3, log: log.clone() });
    assert_eq!(handlers.on_reply_saved(&chunk(1, 10)), 2);
    assert_eq!(handlers.len(), 3);
    assert_eq!(handlers.waiting().collect::<Vec<_>>(), [Snowflake::new(1), Snowflake::new(2)]);
    assert_eq!(handlers.on_reply_saved(&final_reply(1, 11)), 2);
    assert!(!handlers.is_waiting(Snowflake::new(1)));
    assert_eq!(handlers.len(), 1);
    assert_eq!(
        *log.borrow(),
        [
            Event::Respond(1, Snowflake::new(10), false),
            Event::Respond(2, Snowflake::new(10), false),
            Event::Respond(1, Snowflake::new(11), true),
            Event::Complete(1),
            Event::Respond(2, Snowflake::new(11), true),
            Event::Complete(2),
        ]
    );
    // A reply nobody waits for tells nobody.
    assert_eq!(handlers.on_reply_saved(&final_reply(9, 12)), 0);
}

#[test]
fn unregister_reroutes_by_default_and_abandons_with_interrupt() {
    let (mut handlers, log) = registry();
    handlers.register(Snowflake::new(1), shard(1), Recorder { name: 1, log: log.clone() });
    handlers.register(Snowflake::new(2), shard(1), Recorder { name: 2, log: log.clone() });
    assert_eq!(handlers.unregister(Snowflake::new(1), UnregisterMode::from_interrupt(false)), 1);
    assert_eq!(handlers.unregister(Snowflake::new(2), UnregisterMode::from_interrupt(true)), 1);
    assert_eq!(handlers.unregister(Snowflake::new(2), UnregisterMode::Abandon), 0);
    assert!(handlers.is_empty());
    assert_eq!(
        *log.borrow(),
        [
            Event::Unregistered(1, UnregisterMode::Reroute),
            Event::Unregistered(2, UnregisterMode::Abandon),
        ]
    );
}

#[test]
fn unregister_shard_only_touches_that_shard() {
    let (mut handlers, log) = registry();
    handlers.register(Snowflake::new(1), shard(1), Recorder { name: 1, log: log.clone() });
    handlers.register(Snowflake::new(2), shard(2), Recorder { name: 2, log: log.clone() });
    handlers.register(Snowflake::new(3), shard(1), Recorder { name: 3, log: log.clone() });
    assert_eq!(handlers.unregister_shard(&shard(1), UnregisterMode::Abandon), 2);
    assert_eq!(handlers.unregister_shard(&shard(1), UnregisterMode::Abandon), 0);
    assert!(handlers.is_waiting(Snowflake::new(2)));
    assert_eq!(handlers.len(), 1);
    assert_eq!(
        *log.borrow(),
        [
            Event::Unregistered(1, UnregisterMode::Abandon),
            Event::Unregistered(3, UnregisterMode::Abandon)
        ]
    );
}

#[test]
fn a_removed_waiter_is_not_told_anything() {
    let (mut handlers, log) = registry();
    let first =
        handlers.register(Snowflake::new(1), shard(1), Recorder { name: 1, log: log.clone() });
    handlers.register(Snowflake::new(1), shard(1), Recorder { name: 2, log: log.clone() });
    assert_eq!(handlers.remove(Snowflake::new(1), first).map(|waiter| waiter.name), Some(1));
    assert!(handlers.remove(Snowflake::new(1), first).is_none());
    handlers.on_reply_saved(&final_reply(1, 5));
    assert_eq!(*log.borrow(), [Event::Respond(2, Snowflake::new(5), true), Event::Complete(2)]);
    assert!(handlers.is_empty());
}

#[test]
fn final_replies_in_a_transaction_wait_for_the_outermost_commit() {
    let mut notifications = TransactionNotifications::new();
    assert_eq!(notifications.on_saved(&final_reply(1, 1)), Notify::Now);
    notifications.begin();
    assert!(notifications.in_transaction());
    assert_eq!(notifications.on_saved(&chunk(2, 2)), Notify::Now);
    assert_eq!(notifications.on_saved(&final_reply(2, 3)), Notify::Deferred);
    notifications.begin();
    assert_eq!(notifications.on_saved(&final_reply(3, 4)), Notify::Deferred);
    assert!(notifications.commit().is_empty(), "a nested commit hands its replies outwards");
    notifications.begin();
    assert_eq!(notifications.on_saved(&final_reply(4, 5)), Notify::Deferred);
    notifications.rollback();
    let released: Vec<Snowflake> = notifications.commit().iter().map(Reply::id).collect();
    assert_eq!(released, [Snowflake::new(3), Snowflake::new(4)]);
    assert!(!notifications.in_transaction());
}

#[derive(Clone, Debug)]
enum Op {
    Register(u8, u8),
    Remove(u8),
    Final(u8),
    Chunk(u8),
    Unregister(u8),
    UnregisterShard(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..6, 1u8..4).prop_map(|(request, shard)| Op::Register(request, shard)),
        (0u8..20).prop_map(Op::Remove),
        (0u8..6).prop_map(Op::Final),
        (0u8..6).prop_map(Op::Chunk),
        (0u8..6).prop_map(Op::Unregister),
        (1u8..4).prop_map(Op::UnregisterShard),
    ]
}

proptest! {
    /// Every registered waiter ends exactly once (completed, unregistered or removed), and the
    /// registry's count matches a plain model.
    #[test]
    fn every_waiter_ends_exactly_once(ops in proptest::collection::vec(op(), 0..60)) {
        let (mut handlers, log) = registry();
        let mut live: Vec<(u32, u64, u32, HandlerId)> = Vec::new();
        let mut removed = 0usize;
        let mut name = 0u32;
        for op in ops {
            match op {
                Op::Register(request, shard_id) => {
                    name += 1;
                    let id = handlers.register(
                        Snowflake::new(u64::from(request)),
                        shard(u32::from(shard_id)),
                        Recorder { name, log: log.clone() },
                    );
                    live.push((name, u64::from(request), u32::from(shard_id), id));
                }
                Op::Remove(idx) => {
                    if let Some(position) = live.len().checked_sub(1).map(|last| usize::from(idx).min(last)) {
                        let (_, request, _, id) = live.remove(position);
                        prop_assert!(handlers.remove(Snowflake::new(request), id).is_some());
                        removed += 1;
                    }
                }
                Op::Final(request) => {
                    handlers.on_reply_saved(&final_reply(u64::from(request), 1000));
                    live.retain(|(_, live_request, _, _)| *live_request != u64::from(request));
                }
                Op::Chunk(request) => {
                    handlers.on_reply_saved(&chunk(u64::from(request), 999));
                }
                Op::Unregister(request) => {
                    handlers.unregister(Snowflake::new(u64::from(request)), UnregisterMode::Reroute);
                    live.retain(|(_, live_request, _, _)| *live_request != u64::from(request));
                }
                Op::UnregisterShard(shard_id) => {
                    handlers.unregister_shard(&shard(u32::from(shard_id)), UnregisterMode::Abandon);
                    live.retain(|(_, _, live_shard, _)| *live_shard != u32::from(shard_id));
                }
            }
            prop_assert_eq!(handlers.len(), live.len());
        }
        let ended: Vec<u32> = log
            .borrow()
            .iter()
            .filter_map(|event| match event {
                Event::Complete(name) | Event::Unregistered(name, _) => Some(*name),
                Event::Respond(..) => None,
            })
            .collect();
        let mut unique = ended.clone();
        unique.sort_unstable();
        unique.dedup();
        prop_assert_eq!(unique.len(), ended.len(), "a waiter ended twice");
        prop_assert_eq!(ended.len() + removed + live.len(), usize::try_from(name).unwrap());
    }
}
