//! The storage read loop (`effect/src/cluster/Sharding.ts`): claims the unprocessed messages
//! of the shards this runner holds, in storage order, and hands them to `runs`.
//!
//! It reads when woken (a new request, an interrupt, a registration, a released claim), at
//! each `entity_message_poll_interval`, sooner after a full mailbox, and when an entity is
//! reaped at the residency cap.
//! Each read tells direct delivery what it caught up with and what it holds back
//! ([`DirectOrder`]).

use std::collections::BTreeSet;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use cluster_core::envelope::Envelope;
use cluster_core::storage::{MessageStorage, UnprocessedOptions};
use cluster_core::{Clock, EntityAddress, ShardId};

use super::direct::DirectOrder;
use super::lifecycle::Claiming;
use super::runs::{Dispatched, Runs, Unregistered};
use super::tracked::TrackedRequests;
use crate::api::entity::malformed;
use crate::placement::shards::Shards;
use crate::runtime::delivery::ReadLatch;
use crate::runtime::manager::Residency;
use crate::runtime::registry::Managers;

/// How often the read-loop lag gauge is set.
const READ_LAG_REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The storage read loop and what it reads with.
pub(super) struct ReadLoop {
    pub(super) runs: Arc<Runs>,
    pub(super) storage: Arc<dyn MessageStorage>,
    /// The shards held: a member's readable shards, a single runner's locks.
    pub(super) serving: Arc<Shards>,
    /// The shards this runner reads when no lock says otherwise.
    pub(super) shards: Vec<ShardId>,
    /// Marks the reads, so that a request claimed during one is not run twice.
    pub(super) tracked: Arc<TrackedRequests>,
    /// What each read tells direct delivery.
    pub(super) order: Arc<DirectOrder>,
    pub(super) managers: Arc<Managers>,
    pub(super) residency: Arc<Residency>,
    /// What wakes the loop.
    pub(super) read_latch: Arc<ReadLatch>,
    pub(super) clock: Arc<dyn Clock>,
    /// The most messages one read takes (`unprocessed_message_batch_size`).
    pub(super) batch_size: NonZeroU32,
    /// The pause between reads when nothing wakes the loop (`entity_message_poll_interval`).
    pub(super) poll_interval: Duration,
    /// The pause after a full mailbox (`send_retry_interval`).
    pub(super) retry_interval: Duration,
    /// When the loop last finished a read (the clock's epoch milliseconds, 0 before the
    /// first): the read-loop lag metric's source.
    pub(super) last_read: AtomicI64,
}

impl ReadLoop {
    /// The storage read loop; runs until shutdown.
    pub(super) async fn run(self: Arc<Self>) {
        let mut state = ReadState::default();
        loop {
            // When the next read comes:
            // - after `send_retry_interval`, for a full mailbox;
            // - when an entity is reaped, for requests held back by the residency cap;
            // - at the next poll, for everything else.
            let wait = if state.retry_soon { self.retry_interval } else { self.poll_interval };
            let residency = &self.residency;
            tokio::select! {
                () = self.read_latch.woken() => {}
                () = tokio::time::sleep(wait) => {}
                () = residency.freed(), if state.capped => {}
                () = self.serving.shutdown().token().cancelled() => return,
            }
            state.retry_soon = false;
            state.capped = false;
            // Drain a backlog at once, but never spin on a full batch of skipped messages.
            loop {
                let read = self.read_once(&mut state).await;
                if read.is_some() {
                    let now = self.clock.now().unix_millis();
                    self.last_read.store(now, Ordering::Relaxed);
                }
                if !matches!(read, Some(Read { full: true, delivered: true })) {
                    break;
                }
            }
        }
    }

    /// Sets the read-loop lag gauge every second: the time since the read loop last finished
    /// a read.
    /// It grows while the loop is stuck (a storage call that hangs, a read that waits), the
    /// "healthy but not consuming" runner.
    pub(super) async fn report_read_lag(self: Arc<Self>) {
        let mut ticks = tokio::time::interval(READ_LAG_REPORT_INTERVAL);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = self.serving.shutdown().token().cancelled() => return,
            }
            let last = self.last_read.load(Ordering::Relaxed);
            let lag = match last {
                0 => Duration::ZERO,
                last => {
                    let millis = self.clock.now().unix_millis().saturating_sub(last);
                    Duration::from_millis(u64::try_from(millis).unwrap_or(0))
                }
            };
            ::metrics::gauge!(crate::metrics::READ_LOOP_LAG).set(lag.as_secs_f64());
        }
    }

    /// The entities whose messages alone the next read takes, at the residency cap once a
    /// newcomer was refused there; `None` for every message.
    fn residents_to_read(&self, state: &mut ReadState) -> Option<Vec<EntityAddress>> {
        let at_cap = self.residency.is_full();
        state.residents_only &= at_cap;
        state.capped |= at_cap;
        state.residents_only.then(|| self.managers.resident_addresses())
    }

    /// One read of the storage read loop (`effect/src/cluster/Sharding.ts`).
    ///
    /// - At the residency cap, once a newcomer was refused (no resident instance was idle to
    ///   passivate for it), only the resident entities' messages are read, so that they keep
    ///   progressing.
    /// - Otherwise, every message of this runner's shards is read; at the cap, newcomers make
    ///   room by passivating idle instances.
    /// - `None` means that the read failed.
    async fn read_once(self: &Arc<Self>, state: &mut ReadState) -> Option<Read> {
        let batch_size = self.batch_size;
        let residents = self.residents_to_read(state);
        let addresses = residents.as_deref();
        let whole_shards = addresses.is_none();
        let options = UnprocessedOptions { limit: Some(batch_size), addresses };
        let now = self.clock.now();
        // A single runner reads every shard of its groups, unless it lost some of their locks.
        // A cluster's read holds its guard until its claim is stored: a shard's release waits
        // for it before the lock goes.
        let (held, reading) = match self.serving.member() {
            Some(cluster) => {
                let (readable, reading) = cluster.begin_read().await;
                (Some(readable), Some(reading))
            }
            None => (self.serving.held_locks().and_then(|locks| locks.served()), None),
        };
        let shards = match &held {
            Some(held) if held.is_empty() => return Some(Read { full: false, delivered: false }),
            Some(held) => held.as_slice(),
            None => &self.shards,
        };
        self.tracked.begin_read();
        let claimed = self.storage.unprocessed_messages(shards, now, options).await;
        drop(reading);
        let batch = match claimed {
            Ok(batch) => batch,
            Err(error) => {
                self.tracked.end_read();
                tracing::warn!(%error, "could not read unprocessed messages");
                return None;
            }
        };
        let full = batch.len() >= usize::try_from(batch_size.get()).unwrap_or(usize::MAX);
        for malformed_row in &batch.malformed {
            let reply = self
                .runs
                .final_reply(malformed_row.request_id, malformed(&malformed_row.error.to_string()));
            self.runs.save_final_reply(reply, None).await;
        }
        let mut delivered = false;
        let mut release = Vec::new();
        let mut refused = BTreeSet::new();
        for message in batch.messages {
            let request = match &message.envelope {
                Envelope::Request(request) => Some((request.address.clone(), request.request_id)),
                _ => None,
            };
            if let Some((address, request_id)) = &request
                && refused.contains(address)
            {
                // An earlier request to this entity was not delivered: this one waits behind
                // it, so that the entity sees them in order.
                self.order.hold(address, *request_id);
                release.push(*request_id);
                continue;
            }
            let dispatched = self.runs.dispatch(message, &mut state.unregistered, Claiming::Read);
            if let Some((address, request_id)) = &request {
                match dispatched {
                    Dispatched::Delivered
                    | Dispatched::Skipped
                    | Dispatched::Settled(_)
                    | Dispatched::Answer(_) => {
                        self.order.unhold(address, *request_id);
                    }
                    _ => {
                        self.order.hold(address, *request_id);
                        refused.insert(address.clone());
                    }
                }
            }
            match dispatched {
                Dispatched::Delivered => delivered = true,
                Dispatched::Skipped => {}
                // Answered (or being answered) since the select: this read's claim goes, in
                // case its outcome was to run again.
                Dispatched::Settled(id) | Dispatched::Release(id) => release.push(id),
                Dispatched::Retry(id) => {
                    state.retry_soon = true;
                    release.push(id);
                }
                Dispatched::Capped(id) => {
                    state.capped = true;
                    state.residents_only = true;
                    release.push(id);
                }
                Dispatched::Answer(reply) => self.runs.save_final_reply(reply, None).await,
            }
        }
        self.tracked.end_read();
        // Held now: a cluster's shards may have moved during the read; a single runner's not.
        let held_now = self.serving.member().map(|cluster| cluster.readable());
        self.order.caught_up(shards, held_now.as_deref().unwrap_or(shards), whole_shards && !full);
        state.unregistered.warn();
        if !release.is_empty()
            && let Err(error) = self.storage.reset_requests(&release).await
        {
            tracing::debug!(%error, "could not release claims");
        }
        Some(Read { full, delivered })
    }
}

/// What the storage read loop remembers between reads.
#[derive(Default)]
struct ReadState {
    unregistered: Unregistered,
    /// A request found its entity's mailbox full.
    retry_soon: bool,
    /// The residency cap held requests back (or was reached).
    capped: bool,
    /// A newcomer was refused at the cap because no resident instance was idle: reads take
    /// only the residents' messages until the cap is no longer reached.
    residents_only: bool,
}

/// What one read did.
struct Read {
    /// It returned a whole batch: there may be more.
    full: bool,
    /// It delivered something.
    delivered: bool,
}
