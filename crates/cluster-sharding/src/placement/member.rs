//! This process as a member of a cluster of runners on one database
//! (`effect/src/cluster/Sharding.ts`): membership, shard locks, ownership fencing and the
//! shutdown handoff.
//!
//! Every runner (and client-only process) reads the runner registry every
//! `refresh_assignments_interval`.
//! From it, each computes the same shard assignment ([`cluster_core::membership`]).
//! A runner then:
//!
//! - takes the locks of the shards assigned to it;
//! - runs their entities and reads their messages only while it holds the lock
//!   ([`cluster_core::ownership`]);
//! - refreshes its locks every `shard_lock_interval`;
//! - lets a shard go (entities drained, lock released) when the assignment moves it elsewhere.
//!
//! The state machines decide; this module does the I/O:
//!
//! - The **sync loop** registers the runner, fetches the registry and publishes assignments.
//! - The **acquisition loop** releases the shards that moved away and locks the assigned ones.
//! - The **refresh loop** confirms the locks; losing one starts its release.
//!   When lock storage fails, it interrupts every entity and drops every lock before taking any
//!   again.
//! - **Leases**: a shard's messages are read only while its lock was confirmed recently enough
//!   that no other runner can have taken it ([`lock_lease`]).
//!   A runner that was frozen (a stopped process, a paused machine) reads nothing of it until a
//!   refresh answers.
//!   Otherwise its first read could claim a message that the new owner must deliver before the
//!   ones stored after it.
//! - **Fencing**: the final reply of a persisted request is stored only after a lock
//!   confirmation finds the shard held.
//!   Concurrent writers share confirmation rounds: one storage call confirms every shard queued
//!   for it, without the heartbeat.
//! - **Handoff**: at shutdown, once the entities drained, every shard is released through the
//!   per-shard path, bounded by `shard_lock_interval`.
//!   So other runners take the shards at once.
//!   Then `release_all` drops what is left.
//!
//! Persisted traffic needs nothing else: the request is stored, and its shard's owner reads it.
//! A transport, when there is one, only tells the owner to read at once.
//!
//! Volatile requests for another runner's shard go through the transport given to
//! [`ShardingBuilder::transport`](crate::ShardingBuilder::transport) (see `remote`).
//! Without one, they fail with `EntityNotAssignedToRunner`.
//!
//! With a transport, the runner-health singleton judges the runners as `runner_health_check`
//! says.
//! By default it pings the runners that answered a ping once, and marks them unhealthy when
//! they stop answering.
//! It leaves the others to their registry heartbeat: those are runners of the reference, which
//! do not speak this transport.
//! Given a check of the application's ([`RunnerHealth`], with or without a transport), the
//! singleton asks it instead and pings nobody.

mod probe;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cluster_core::config::RunnerHealthCheck;
use cluster_core::future::BoxFuture;
use cluster_core::membership::{Assignment, Membership, MembershipConfig};
use cluster_core::ownership::{AcquisitionGates, ShardOwnership};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::sync::lock;
use cluster_core::transport::Transport;
use cluster_core::{Clock, MachineId, Runner, RunnerAddress, ShardId, ShardingConfig};
use futures_util::FutureExt;
use futures_util::future::Shared;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::metrics;
use crate::placement::health::RunnerHealth;
use crate::placement::lock_lease;
use crate::runtime::delivery::Serving;
use crate::runtime::registry::Managers;

/// How long a registry call may take (the reference's 5 s).
const REGISTRY_TIMEOUT: Duration = Duration::from_secs(5);
/// The pause after a failed sync iteration (the reference's 1 s).
const SYNC_RETRY: Duration = Duration::from_secs(1);
/// The acquisition loop retries partially acquired sets this often (the reference's 1 s).
const ACQUISITION_PERIOD: Duration = Duration::from_secs(1);
/// Lock refresh attempts within one refresh (the reference's 5 retries, 50 ms apart).
const REFRESH_ATTEMPTS: u32 = 6;
const REFRESH_SPACING: Duration = Duration::from_millis(50);
/// The spacing of per-shard release retries (the reference's 50 ms).
const RELEASE_RETRY: Duration = Duration::from_millis(50);
/// A stuck release is reported at most this often.
const RELEASE_WARNING_PERIOD: Duration = Duration::from_secs(30);

/// What a cluster member asks of the runtime it belongs to: the entities and singletons of
/// the shards it takes and lets go, and the persisted requests in flight on them.
pub(crate) trait MemberHost: Serving + Clone + Send + Sync + 'static {
    /// Whether the runtime is shutting down.
    fn is_shutdown(&self) -> bool;

    /// Runs `task` as a task of the runtime, awaited at shutdown.
    fn spawn_owned(&self, task: impl Future<Output = ()> + Send + 'static);

    /// The entity managers, whose instances stop with their shard.
    fn managers(&self) -> &Arc<Managers>;

    /// Starts the singletons of the shards served now, and stops the others.
    fn sync_singletons(&self);

    /// Stops the singletons of `shard` (all with `None`) and waits until they ended.
    fn stop_singletons_in(&self, shard: Option<&ShardId>) -> impl Future<Output = ()> + Send;

    /// Stamps new ids with the machine id the registry gave this runner.
    fn set_machine_id(&self, machine_id: MachineId);

    /// Wakes the storage read loop: a shard was taken.
    fn poll_storage(&self);

    /// Waits, at most `bound`, until no persisted request of `shard` (of any shard with
    /// `None`) is taken up and unsettled.
    fn writes_finished(
        &self,
        shard: Option<&ShardId>,
        bound: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// Tells the local callers waiting for replies of `shard`'s requests that they were
    /// abandoned to the next owner.
    fn abandon_waiters_of(&self, shard: &ShardId);
}

/// The multi-runner side of a runtime: membership, shard locks and the handoff.
pub(crate) struct Member {
    config: ShardingConfig,
    /// How long a lock operation's answer confirms its shards ([`lock_lease`]).
    lease: Duration,
    clock: Arc<dyn Clock>,
    storage: Arc<dyn RunnerStorage>,
    /// Where the claims of a previous owner on a taken shard's messages are released.
    messages: Arc<dyn MessageStorage>,
    /// Told when a runner leaves; pings runners for the runner-health singleton.
    transport: Option<Arc<dyn Transport>>,
    /// The application's runner-health check, asked instead of pinging.
    health: Option<Arc<dyn RunnerHealth>>,
    /// This runner; `None` in a client-only process.
    runner: Option<Runner>,
    state: Mutex<State>,
    /// Wakes the acquisition loop.
    acquisition: Notify,
    /// Bumped on every lock change: a shard acquired, an assignment published, lock storage
    /// unhealthy, shutdown.
    /// Requests waiting for a shard's lock then check again.
    lock_events: watch::Sender<u64>,
    /// The lock confirmations of fencing: each shard's outcome, its round in flight or next.
    confirmations: Mutex<Confirmations>,
    /// Set when the shutdown handoff starts: every shard is released.
    handoff: CancellationToken,
    /// Woken when nothing is held any more during the handoff.
    handed_off: Notify,
    /// Stops the loops, after the handoff.
    stopped: CancellationToken,
    /// The in-flight lock confirmations, which outlive an interrupted writer; awaited by the
    /// shutdown handoff.
    confirming: TaskTracker,
    /// Held shared by a read of stored messages, from the choice of its shards until its claim
    /// is stored; held at once by a shard's release before its lock goes
    /// ([`Member::begin_read`]).
    reads: tokio::sync::RwLock<()>,
    /// Held while registering, and while unregistering at shutdown.
    /// So a registration in flight cannot advertise a runner that is going away.
    registration: tokio::sync::Mutex<()>,
    /// Wakes the registry sync loop before its interval: a peer was found gone.
    resync: Notify,
}

/// What [`Sharding::readiness`](crate::Sharding::readiness) reports: whether this process
/// serves what the cluster assigns it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Readiness {
    /// Whether this process is a runner (a client serves no shard).
    pub runner: bool,
    /// Whether the runner is in the runner registry.
    pub registered: bool,
    /// Whether the shard lock storage answers.
    pub lock_storage_healthy: bool,
    /// The shards the current assignment gives this runner.
    pub assigned: usize,
    /// Of those, the shards whose lock this runner does not hold yet.
    /// A previous owner may still be handing them over.
    pub not_acquired: usize,
    /// The shards no runner serves, as this runner sees them: those the assignment gives a peer
    /// that this runner found gone (its address refuses connections), and `not_acquired`.
    /// It does not make the runner unready.
    pub unserved: usize,
}

/// Fencing's lock confirmations (see [`Member::confirm_lock`]).
#[derive(Default)]
struct Confirmations {
    /// The outcome of each shard's confirmation, in the round in flight or the next one.
    outcomes: BTreeMap<ShardId, Shared<BoxFuture<'static, bool>>>,
    /// The shards of the next round, and where each one's outcome goes.
    next: Vec<(ShardId, oneshot::Sender<bool>)>,
    /// Whether a task runs the rounds.
    running: bool,
}

/// What the loops share.
struct State {
    membership: Membership,
    ownership: ShardOwnership,
    assignment: Assignment,
    /// The shards whose per-shard release task is running.
    ///
    /// A shard is claimed here in the same critical section that reads the releasing shards.
    /// So a task that ends meanwhile cannot have its shard released a second time, by a round
    /// that read the shard as releasing.
    release_tasks: BTreeSet<ShardId>,
    /// The shards whose lock is being released: no read starts on them any more.
    unreadable: BTreeSet<ShardId>,
    /// When the last lock operation that confirmed each held shard was sent: its acquisition,
    /// a refresh, or a fencing confirmation.
    /// A shard's messages are read only within the lease that follows.
    confirmed: BTreeMap<ShardId, Instant>,
    /// The peers this runner found gone and marked unhealthy, while the assignment still gives
    /// them shards (see `probe`).
    gone: BTreeSet<RunnerAddress>,
}

impl State {
    /// A lock operation sent at `sent_at` confirmed `shards`.
    ///
    /// Returns whether one of them was held with its lease lapsed: its messages were not read
    /// meanwhile.
    fn confirm(&mut self, shards: &[ShardId], sent_at: Instant, lease: Duration) -> bool {
        let mut resumed = false;
        for shard in shards {
            match self.confirmed.get_mut(shard) {
                Some(at) => {
                    resumed |= at.elapsed() >= lease && self.ownership.is_owned_or_releasing(shard);
                    *at = (*at).max(sent_at);
                }
                None => {
                    self.confirmed.insert(shard.clone(), sent_at);
                }
            }
        }
        resumed
    }

    /// Whether `shard`'s lock was confirmed less than `lease` ago.
    fn is_confirmed(&self, shard: &ShardId, now: Instant, lease: Duration) -> bool {
        self.confirmed.get(shard).is_some_and(|at| now.saturating_duration_since(*at) < lease)
    }
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member").field("runner", &self.runner).finish_non_exhaustive()
    }
}

impl Member {
    /// The member that `config` describes (a runner, or a client with `runner_address`
    /// `None`), on the registry and locks in `runners`; its loops start with
    /// [`Member::start`]. Its runner-health singleton asks `health` when given, and otherwise
    /// pings through `transport`.
    pub(crate) fn new(
        config: ShardingConfig,
        clock: Arc<dyn Clock>,
        runners: Arc<dyn RunnerStorage>,
        messages: Arc<dyn MessageStorage>,
        transport: Option<Arc<dyn Transport>>,
        health: Option<Arc<dyn RunnerHealth>>,
    ) -> Member {
        let runner = config.runner_address.clone().map(|address| {
            let groups = config.shard_groups().assigned.into_iter().collect();
            Runner::new(address, groups, config.runner_shard_weight)
        });
        let membership = Membership::new(MembershipConfig {
            shards_per_group: config.shards_per_group,
            join_debounce: config.runner_join_debounce,
        });
        Member {
            lease: lock_lease(&config),
            config,
            clock,
            storage: runners,
            messages,
            transport,
            health,
            runner,
            state: Mutex::new(State {
                membership,
                ownership: ShardOwnership::new(),
                assignment: Assignment::default(),
                release_tasks: BTreeSet::new(),
                confirmed: BTreeMap::new(),
                unreadable: BTreeSet::new(),
                gone: BTreeSet::new(),
            }),
            resync: Notify::new(),
            acquisition: Notify::new(),
            lock_events: watch::Sender::new(0),
            confirmations: Mutex::new(Confirmations::default()),
            handoff: CancellationToken::new(),
            handed_off: Notify::new(),
            stopped: CancellationToken::new(),
            confirming: TaskTracker::new(),
            registration: tokio::sync::Mutex::new(()),
            reads: tokio::sync::RwLock::new(()),
        }
    }

    /// Starts the loops on `host`'s tasks: the registry sync, and for a runner the lock
    /// acquisition and refresh.
    pub(crate) fn start<H: MemberHost>(self: &Arc<Member>, host: &H) {
        metrics::set(metrics::RUNNERS, usize::from(self.runner.is_some()));
        metrics::set(metrics::SHARDS, 0);
        host.spawn_owned(Arc::clone(self).sync_loop(host.clone()));
        if self.runner.is_some() {
            host.spawn_owned(Arc::clone(self).acquisition_loop(host.clone()));
            host.spawn_owned(Arc::clone(self).refresh_loop(host.clone()));
        }
        if self.probes_peers() {
            host.spawn_owned(Arc::clone(self).probe_loop());
        }
    }

    /// Whether this process is a runner (not a client) with a transport or a runner-health
    /// check of the application's: what the runner-health singleton needs.
    pub(crate) fn checks_health(&self) -> bool {
        self.runner.is_some() && (self.transport.is_some() || self.health.is_some())
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    fn address(&self) -> Option<&RunnerAddress> {
        self.runner.as_ref().map(|runner| &runner.address)
    }

    fn lock_changed(&self) {
        self.lock_events.send_modify(|events| *events = events.wrapping_add(1));
    }

    /// The owner of `shard` in the current assignment.
    pub(crate) fn owner(&self, shard: &ShardId) -> Option<RunnerAddress> {
        self.state().assignment.owner(shard).cloned()
    }

    /// What a readiness check reads: registration, lock storage, and the shards assigned here
    /// against those acquired.
    pub(crate) fn readiness(&self) -> Readiness {
        let state = self.state();
        let registered =
            self.runner.as_ref().is_some_and(|runner| !state.membership.needs_registration(runner));
        let assigned =
            self.address().map(|address| state.assignment.shards_of(address)).unwrap_or_default();
        let not_acquired =
            assigned.iter().filter(|shard| !state.ownership.is_acquired(shard)).count();
        let unserved = probe::shards_of_gone(&state.assignment, &state.gone) + not_acquired;
        Readiness {
            runner: self.runner.is_some(),
            registered,
            lock_storage_healthy: state.ownership.locks_healthy(),
            assigned: assigned.len(),
            not_acquired,
            unserved,
        }
    }

    /// Whether `shard` is active here: locked and running.
    pub(crate) fn is_acquired(&self, shard: &ShardId) -> bool {
        self.state().ownership.is_acquired(shard)
    }

    /// Whether a request of `shard` may be handed to an entity here now: the shard is acquired
    /// and its lock was confirmed within the lease ([`lock_lease`]).
    ///
    /// A runner frozen past the lease may have lost the lock without knowing yet.
    /// The read loop waits for a refresh before it reads the shard ([`Member::readable`]); so do
    /// the other ways to an entity: direct delivery, pushed requests and volatile ones.
    pub(crate) fn delivers(&self, shard: &ShardId) -> bool {
        let state = self.state();
        state.ownership.is_acquired(shard) && state.is_confirmed(shard, Instant::now(), self.lease)
    }

    /// The shards whose messages this runner reads.
    pub(crate) fn acquired(&self) -> Vec<ShardId> {
        self.state().ownership.acquired().cloned().collect()
    }

    /// The shards whose stored messages this runner reads.
    ///
    /// - The acquired shards.
    /// - The releasing shards: their draining entities still take interrupts and
    ///   acknowledgements (effect 4.0.3).
    ///   Their requests are left to the next owner.
    ///
    /// Only those whose lock was confirmed within the lease ([`lock_lease`]).
    /// A runner that was frozen past it may have lost the lock without knowing yet.
    /// Its read would claim messages that the next owner must read in order, so it waits for a
    /// refresh.
    pub(crate) fn readable(&self) -> Vec<ShardId> {
        let state = self.state();
        let now = Instant::now();
        let mut held = state.ownership.held();
        held.retain(|shard| {
            state.is_confirmed(shard, now, self.lease) && !state.unreadable.contains(shard)
        });
        held
    }

    /// Waits until the reads under way end (see [`Member::begin_read`]).
    ///
    /// At most `shard_lock_expiration`: past it, the lock is gone anyway.
    async fn reads_finished(&self) {
        let wait = self.config.shard_lock_expiration;
        if tokio::time::timeout(wait, self.reads.write()).await.is_err() {
            tracing::warn!(
                ?wait,
                "a read of stored messages is still under way; letting the locks go"
            );
        }
    }

    /// Starts a read of stored messages: the shards it reads ([`Member::readable`]), and a
    /// guard to hold until its claim is stored.
    ///
    /// A shard's release waits for the reads under way before its lock goes.
    /// Otherwise a read that chose the shard before the release could claim its messages after
    /// the next owner took the lock and released the previous claims, and hide them from it.
    pub(crate) async fn begin_read(&self) -> (Vec<ShardId>, tokio::sync::RwLockReadGuard<'_, ()>) {
        let guard = self.reads.read().await;
        (self.readable(), guard)
    }

    /// The runner started shutting down: requests waiting for a lock stop waiting.
    pub(crate) fn shutting_down(&self) {
        self.lock_changed();
    }
}

impl Member {
    /// The registry sync loop (`effect/src/cluster/Sharding.ts`).
    async fn sync_loop<H: MemberHost>(self: Arc<Member>, host: H) {
        let interval = self.config.refresh_assignments_interval;
        loop {
            let pause = match self.sync_once(&host).await {
                Ok(true) => Duration::ZERO,
                Ok(false) => interval,
                Err(error) => {
                    tracing::debug!(%error, "registry sync failed; retrying");
                    SYNC_RETRY
                }
            };
            tokio::select! {
                () = tokio::time::sleep(pause) => {}
                () = self.resync.notified() => {}
                () = self.stopped.cancelled() => return,
            }
        }
    }

    /// One sync iteration; `Ok(true)` when the runner must register again at once.
    async fn sync_once<H: MemberHost>(&self, host: &H) -> Result<bool, String> {
        let live = self.runner.as_ref().filter(|_| !host.is_shutdown());
        if let Some(runner) = live
            && self.state().membership.needs_registration(runner)
        {
            let _registering = self.registration.lock().await;
            if !host.is_shutdown() {
                let machine_id =
                    tokio::time::timeout(REGISTRY_TIMEOUT, self.storage.register(runner, true))
                        .await
                        .map_err(|_| "register timed out".to_owned())?
                        .map_err(|error| error.to_string())?;
                host.set_machine_id(machine_id);
                tracing::debug!(runner = %runner.address, ?machine_id, "registered");
            }
        }
        let runners = tokio::time::timeout(REGISTRY_TIMEOUT, self.storage.get_runners())
            .await
            .map_err(|_| "get_runners timed out".to_owned())?
            .map_err(|error| error.to_string())?;
        let live = self.runner.as_ref().filter(|_| !host.is_shutdown());
        let now = self.clock.now();
        let step = {
            let mut state = self.state();
            let step = state.membership.observe(now, &runners, live);
            if let Some(assignment) = &step.assignment {
                state.assignment = assignment.clone();
                if let Some(address) = self.address() {
                    let mine = assignment.shards_of(address);
                    state.ownership.set_assignment(mine);
                }
            }
            step
        };
        for address in &step.unavailable {
            tracing::info!(runner = %address, "runner left or turned unhealthy");
            if let Some(transport) = &self.transport {
                transport.on_runner_unavailable(address);
            }
        }
        if step.register_again {
            return Ok(true);
        }
        if let Some(assignment) = &step.assignment {
            tracing::info!(
                runners = step.healthy_count,
                shards = assignment.len(),
                mine = self.address().map_or(0, |address| assignment.shards_of(address).len()),
                "shard assignment published"
            );
            self.acquisition.notify_one();
            self.lock_changed();
        }
        if step.reopen_acquisition {
            self.acquisition.notify_one();
        }
        metrics::set(metrics::JOINS_PENDING, usize::from(step.joins_pending));
        if let Some(runner) = live {
            let healthy = self.state().membership.is_healthy(runner);
            metrics::set(metrics::RUNNERS_HEALTHY, usize::from(healthy));
            if step.healthy_count == 0 {
                tracing::warn!(runner = %runner.address, "no healthy runner: marking this one healthy");
                tokio::time::timeout(
                    REGISTRY_TIMEOUT,
                    self.storage.set_runner_health(&runner.address, true),
                )
                .await
                .map_err(|_| "set_runner_health timed out".to_owned())?
                .map_err(|error| error.to_string())?;
            }
        }
        Ok(false)
    }

    /// The shard acquisition loop (`effect/src/cluster/Sharding.ts`).
    async fn acquisition_loop<H: MemberHost>(self: Arc<Member>, host: H) {
        let Some(address) = self.address().cloned() else { return };
        loop {
            let period = ACQUISITION_PERIOD.min(self.config.entity_message_poll_interval);
            tokio::select! {
                () = self.acquisition.notified() => {}
                () = tokio::time::sleep(period) => {}
                () = self.handoff.cancelled(), if !self.handoff.is_cancelled() => {}
                () = self.stopped.cancelled() => return,
            }
            self.acquisition_round(&host, &address).await;
        }
    }

    async fn acquisition_round<H: MemberHost>(
        self: &Arc<Member>,
        host: &H,
        address: &RunnerAddress,
    ) {
        let handing_off = self.handoff.is_cancelled();
        let (releasing, forced, to_acquire, joins_pending) = {
            let mut state = self.state();
            let moved = state.ownership.begin_round(handing_off);
            if !moved.is_empty() {
                tracing::info!(shards = moved.len(), "releasing shards that moved away");
            }
            let forced = state.ownership.start_forced_release();
            let State { ownership, release_tasks, .. } = &mut *state;
            let releasing: Vec<ShardId> = ownership
                .releasing()
                .filter(|shard| !ownership.is_force_releasing(shard))
                .filter(|shard| release_tasks.insert((*shard).clone()))
                .cloned()
                .collect();
            let joins_pending = state.membership.has_pending_joins();
            let gates = AcquisitionGates { shutting_down: host.is_shutdown(), joins_pending };
            (releasing, forced, state.ownership.shards_to_acquire(gates), joins_pending)
        };
        self.update_shard_gauges();
        if let Some(shards) = forced {
            host.spawn_owned(Arc::clone(self).forced_release(host.clone(), shards));
        }
        for shard in releasing {
            host.spawn_owned(Arc::clone(self).release_shard(host.clone(), shard));
        }
        if handing_off && self.state().ownership.is_handed_off() {
            self.handed_off.notify_waiters();
        }
        if to_acquire.is_empty() {
            return;
        }
        let interval = self.config.shard_lock_interval();
        let sent_at = Instant::now();
        let acquired = match tokio::time::timeout(
            interval,
            self.storage.acquire(address, &to_acquire),
        )
        .await
        {
            Ok(Ok(acquired)) => acquired,
            Ok(Err(error)) => {
                tracing::warn!(%error, "could not acquire shard locks");
                return;
            }
            Err(_) => {
                tracing::warn!("acquiring shard locks timed out");
                self.acquisition.notify_one();
                return;
            }
        };
        if acquired.is_empty() {
            return;
        }
        // The previous owner's claims on these shards' messages are released.
        if let Ok(Err(error)) =
            tokio::time::timeout(interval, self.messages.reset_shards(&acquired)).await
        {
            tracing::debug!(%error, "could not release the previous owner's claims");
        }
        let outcome = {
            let mut state = self.state();
            state.confirm(&acquired, sent_at, self.lease);
            state.ownership.on_acquired(&acquired, joins_pending)
        };
        if !outcome.activated.is_empty() {
            tracing::info!(shards = outcome.activated.len(), "shards acquired");
            metrics::count(metrics::SHARD_ACQUISITIONS, outcome.activated.len());
            self.lock_changed();
            host.poll_storage();
            host.sync_singletons();
        }
        if !outcome.to_release.is_empty() {
            self.acquisition.notify_one();
        }
        self.update_shard_gauges();
    }

    fn update_shard_gauges(&self) {
        let state = self.state();
        metrics::set(metrics::SHARDS, state.ownership.n_acquired());
        metrics::set(metrics::SHARDS_RELEASING, state.ownership.n_releasing());
        metrics::set(metrics::SHARD_LOCKS_HEALTHY, usize::from(state.ownership.locks_healthy()));
    }

    /// Releases one shard (`effect/src/cluster/Sharding.ts` `releaseShard`).
    ///
    /// 1. Its entities and singletons stop.
    /// 2. The requests that finished meanwhile are answered, for a bounded time.
    /// 3. Its lock is released.
    /// 4. Local callers waiting for its replies read them from storage.
    ///    During shutdown, they are told instead that their requests were abandoned here.
    async fn release_shard<H: MemberHost>(self: Arc<Member>, host: H, shard: ShardId) {
        let Some(address) = self.address().cloned() else { return };
        let release_started = Instant::now();
        let termination_timeout = self.config.entity_termination_timeout;
        let force = self.handoff.is_cancelled();
        // The shard's singletons stop too; the lock waits for both.
        host.sync_singletons();
        futures_util::future::join(
            host.managers().stop_shard(&shard, force, termination_timeout),
            host.stop_singletons_in(Some(&shard)),
        )
        .await;
        // The requests that finished while the shard drained are answered before the lock
        // goes, however slow storage is, up to the lock's expiration.
        // Past it, another runner may hold the shard anyway, and that owner runs what is left.
        host.writes_finished(Some(&shard), self.config.shard_lock_expiration).await;
        // No read chooses the shard from now on, and the reads that did are over before the
        // lock goes (see `begin_read`).
        self.state().unreadable.insert(shard.clone());
        self.reads_finished().await;
        let started = Instant::now();
        let mut warned_at: Option<Instant> = None;
        loop {
            if self.state().ownership.is_force_releasing(&shard) {
                // A forced release took over: it drops every lock at once.
                break;
            }
            if self.stopped.is_cancelled() {
                // Shutdown is over: its `release_all` drops the lock, or it expires.
                break;
            }
            let interval = self.config.shard_lock_interval();
            match bounded(interval, self.storage.release(&address, &shard)).await {
                Ok(()) => {
                    // Together: a round never sees the shard releasing with no task for it.
                    let mut state = self.state();
                    state.ownership.release_finished(&shard);
                    state.release_tasks.remove(&shard);
                    drop(state);
                    // Completed releases only, as the reference's timer.
                    metrics::record_shard_release(release_started.elapsed());
                    break;
                }
                Err(error) => {
                    if warned_at.is_none_or(|at| at.elapsed() >= RELEASE_WARNING_PERIOD) {
                        tracing::warn!(%error, %shard, waited = ?started.elapsed(), "could not release a shard lock; retrying");
                        warned_at = Some(Instant::now());
                    }
                    tokio::select! {
                        () = tokio::time::sleep(RELEASE_RETRY) => {}
                        () = self.stopped.cancelled() => {}
                    }
                }
            }
        }
        // Also after a forced release took over or shutdown ended the loop (no-op otherwise).
        {
            let mut state = self.state();
            state.release_tasks.remove(&shard);
            state.unreadable.remove(&shard);
        }
        if self.stopped.is_cancelled() {
            return;
        }
        Member::unregister_shard_waiters(&host, &shard);
        tracing::debug!(%shard, took = ?started.elapsed(), "shard released");
        self.update_shard_gauges();
        self.acquisition.notify_one();
        if self.handoff.is_cancelled() && self.state().ownership.is_handed_off() {
            self.handed_off.notify_waiters();
        }
    }

    /// Lock storage failed (`effect/src/cluster/Sharding.ts` "forced release").
    ///
    /// Every shard is let go without waiting for entities.
    /// Then every lock is dropped with `release_all`.
    async fn forced_release<H: MemberHost>(self: Arc<Member>, host: H, shards: Vec<ShardId>) {
        let Some(address) = self.address().cloned() else { return };
        let termination_timeout = self.config.entity_termination_timeout;
        host.sync_singletons();
        let sharding = &host;
        futures_util::future::join_all(shards.iter().map(|shard| async move {
            futures_util::future::join(
                sharding.managers().stop_shard(shard, true, termination_timeout),
                sharding.stop_singletons_in(Some(shard)),
            )
            .await;
        }))
        .await;
        let expiration = self.config.shard_lock_expiration;
        let started = Instant::now();
        let mut warned_at: Option<Instant> = None;
        loop {
            if self.stopped.is_cancelled() {
                // Shutdown is over: its own `release_all` was the last word.
                return;
            }
            let healthy = self.state().ownership.locks_healthy();
            if healthy {
                let interval = self.config.shard_lock_interval();
                host.writes_finished(None, interval).await;
                // As a release's: no read claims these shards' messages once their locks go.
                self.state().unreadable.extend(shards.iter().cloned());
                self.reads_finished().await;
                match bounded(interval, self.storage.release_all(&address)).await {
                    Ok(()) => break,
                    Err(error) => tracing::debug!(%error, "release_all failed; retrying"),
                }
            }
            let overdue = started.elapsed() >= expiration;
            if overdue
                && warned_at.is_none_or(|at| at.elapsed() >= expiration.max(RELEASE_WARNING_PERIOD))
            {
                let blocking = host.managers().types_in(&shards);
                tracing::warn!(waited = ?started.elapsed(), ?blocking, "forced release of the shard locks still pending");
                warned_at = Some(Instant::now());
            }
            let mut events = self.lock_events.subscribe();
            tokio::select! {
                _ = events.changed() => {}
                () = tokio::time::sleep(RELEASE_RETRY) => {}
                () = self.stopped.cancelled() => {}
            }
        }
        {
            let mut state = self.state();
            state.ownership.finish_forced_release(&shards);
            for shard in &shards {
                state.unreadable.remove(shard);
            }
        }
        for shard in &shards {
            Member::unregister_shard_waiters(&host, shard);
        }
        tracing::info!(shards = shards.len(), "forced release done");
        self.update_shard_gauges();
        self.acquisition.notify_one();
    }

    /// The lock refresh loop (`effect/src/cluster/Sharding.ts`).
    ///
    /// It confirms the held locks every `shard_lock_interval`.
    /// While lock storage is unhealthy, it probes it instead.
    async fn refresh_loop<H: MemberHost>(self: Arc<Member>, host: H) {
        let Some(address) = self.address().cloned() else { return };
        let interval = self.config.shard_lock_interval();
        let mut ticks = tokio::time::interval(interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = self.stopped.cancelled() => return,
            }
            let healthy = self.state().ownership.locks_healthy();
            if healthy {
                let held = self.state().ownership.held();
                let sent_at = Instant::now();
                let refreshed =
                    tokio::time::timeout(interval, refresh(&*self.storage, &address, &held)).await;
                metrics::record_seconds(metrics::SHARD_LOCK_REFRESH, sent_at.elapsed());
                match refreshed {
                    Ok(Ok(returned)) => {
                        let (releasing, resumed) = {
                            let mut state = self.state();
                            let releasing = state.ownership.release_lost_shards(&held, &returned);
                            let resumed = state.confirm(&returned, sent_at, self.lease);
                            let held_now: BTreeSet<ShardId> =
                                state.ownership.held().into_iter().collect();
                            state.confirmed.retain(|shard, _| held_now.contains(shard));
                            (releasing, resumed)
                        };
                        if resumed {
                            tracing::warn!(
                                "shard locks confirmed again after their lease lapsed; their \
                                 messages are read again"
                            );
                            host.poll_storage();
                        }
                        if returned.len() < held.len() {
                            tracing::warn!(
                                lost = held.len() - returned.len(),
                                "shard locks lost; releasing them"
                            );
                            metrics::count(metrics::SHARD_LOSSES, held.len() - returned.len());
                        }
                        if releasing {
                            self.acquisition.notify_one();
                        }
                    }
                    Ok(Err(error)) => self.locks_unhealthy(&host, &error.to_string()).await,
                    Err(_) => self.locks_unhealthy(&host, "refresh timed out").await,
                }
            } else {
                let probe = self.storage.refresh(&address, &[]);
                if let Ok(Ok(_)) = tokio::time::timeout(interval, probe).await {
                    let recovered = {
                        let mut state = self.state();
                        let mine = state.assignment.shards_of(&address);
                        state.ownership.mark_healthy(mine)
                    };
                    if recovered {
                        tracing::info!("shard lock storage is healthy again");
                        self.lock_changed();
                        self.acquisition.notify_one();
                    }
                }
            }
            self.update_shard_gauges();
        }
    }

    /// Lock storage failed, so ownership is uncertain.
    ///
    /// - Every entity of the held shards is interrupted at once.
    /// - The acquisition loop drops every lock before taking any again.
    async fn locks_unhealthy<H: MemberHost>(&self, host: &H, why: &str) {
        let affected = self.state().ownership.mark_unhealthy();
        let Some(affected) = affected else { return };
        tracing::warn!(
            why,
            shards = affected.len(),
            "shard lock storage is unhealthy: interrupting the shards' entities"
        );
        self.lock_changed();
        host.sync_singletons();
        self.acquisition.notify_one();
        let termination_timeout = self.config.entity_termination_timeout;
        for shard in affected {
            let sharding = host.clone();
            host.spawn_owned(async move {
                sharding.managers().stop_shard(&shard, true, termination_timeout).await;
            });
        }
    }

    /// `shard` was let go.
    ///
    /// - During shutdown, the local callers waiting for replies of its requests are told that
    ///   their requests were abandoned to the next owner.
    /// - Otherwise (a rebalance) they keep waiting.
    ///   The reply poller reads the next owner's final replies and stream chunks from storage.
    ///   The reference's rerouted callers read them from storage too.
    fn unregister_shard_waiters<H: MemberHost>(host: &H, shard: &ShardId) {
        if host.is_shutdown() {
            host.abandon_waiters_of(shard);
        }
    }

    /// The shutdown handoff (`effect/src/cluster/Sharding.ts`, effect 4.0.3).
    ///
    /// It runs once the entities drained:
    ///
    /// 1. Every shard goes through the per-shard release, bounded by `shard_lock_interval`.
    /// 2. The runner leaves the registry, and the loops stop.
    /// 3. The final replies still being written are awaited, at most `shard_lock_expiration`.
    /// 4. `release_all` drops what is left.
    pub(crate) async fn hand_off<H: MemberHost>(self: &Arc<Member>, host: &H) {
        self.lock_changed();
        if let Some(address) = self.address().cloned() {
            let handed_off = self.handed_off.notified();
            self.handoff.cancel();
            self.acquisition.notify_one();
            let bound = self.config.shard_lock_interval();
            if !self.state().ownership.is_handed_off()
                && tokio::time::timeout(bound, handed_off).await.is_err()
            {
                tracing::warn!(
                    held = self.state().ownership.held().len(),
                    "handoff incomplete; dropping the remaining locks"
                );
            }
            {
                let _registering = self.registration.lock().await;
                let unregistered = bounded(REGISTRY_TIMEOUT, self.storage.unregister(&address));
                if let Err(error) = unregistered.await {
                    tracing::warn!(%error, "could not unregister the runner");
                }
            }
            self.stopped.cancel();
            host.writes_finished(None, self.config.shard_lock_expiration).await;
            // The writers are done; a confirmation they started ends within its timeout.
            self.confirming.close();
            self.confirming.wait().await;
            {
                let mut state = self.state();
                let held = state.ownership.held();
                state.unreadable.extend(held);
            }
            self.reads_finished().await;
            let released = bounded(bound, self.storage.release_all(&address));
            if let Err(error) = released.await {
                tracing::warn!(%error, "could not release the shard locks; they expire");
            }
            tracing::info!(runner = %address, "shutdown complete");
        }
        self.stopped.cancel();
        metrics::set(metrics::SHARDS, 0);
    }

    /// The body of the runner-health singleton (`effect/src/cluster/Sharding.ts`, with the
    /// checks of `effect/src/cluster/RunnerHealth.ts`), until `cancellation`.
    ///
    /// - It runs every `runner_health_check_interval`, when more than one runner is registered.
    /// - It judges each runner with the application's [`RunnerHealth`] when there is one, and
    ///   otherwise as `runner_health_check` says (see [`judge`]).
    /// - It records the verdicts that changed.
    /// - It never marks the last healthy runner unhealthy.
    ///
    /// The sync loops then treat an unhealthy runner as gone.
    /// Without a check and without a transport there is nothing to ask: it returns at once.
    pub(crate) async fn check_health(self: Arc<Member>, cancellation: CancellationToken) {
        let judge = match (&self.health, &self.transport) {
            (Some(health), _) => Judge::Check(Arc::clone(health)),
            (None, Some(transport)) => {
                Judge::Ping(Arc::clone(transport), self.config.runner_health_check)
            }
            (None, None) => return,
        };
        let interval = self.config.runner_health_check_interval;
        // The runners that answered a ping of this singleton's, while it runs here.
        let mut known = BTreeSet::new();
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = cancellation.cancelled() => return,
            }
            let checked = check_runners(&self, &judge, &mut known).await;
            if let Err(error) = checked {
                tracing::debug!(%error, "runner health check failed");
            }
        }
    }

    /// Whether `shard` is active here (see [`Member::is_acquired`]) once the wait for its
    /// lock is over: while the shard is assigned here and its lock is not taken yet, this
    /// waits, at most `shard_lock_expiration`. The previous owner is still draining it
    /// (`effect/src/cluster/Sharding.ts`).
    pub(crate) async fn await_lock(&self, shard: &ShardId, shutting_down: impl Fn() -> bool) {
        let deadline = crate::time::deadline(self.config.shard_lock_expiration);
        let mut events = self.lock_events.subscribe();
        loop {
            if !self.state().ownership.is_awaiting_lock(shard, shutting_down()) {
                return;
            }
            tokio::select! {
                changed = events.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep_until(deadline) => return,
            }
        }
    }

    /// Whether this runner may store the final reply of a request of `shard`
    /// (`effect/src/cluster/Sharding.ts`, effect 4.1.0).
    ///
    /// - The shard must be acquired or releasing here.
    /// - A lock confirmation must find it held.
    /// - Concurrent writers share confirmations: a writer joins the round that covers its
    ///   shard, in flight or next, and one round confirms every shard queued for it in one
    ///   storage call, one round at a time (they run on the runner's one lock session anyway).
    /// - The rounds outlive a writer that is interrupted.
    pub(crate) async fn confirm_lock(self: &Arc<Member>, shard: &ShardId) -> bool {
        let Some(address) = self.address().cloned() else { return false };
        if !self.state().ownership.is_owned_or_releasing(shard) {
            return false;
        }
        let confirmation = {
            let mut confirmations = lock(&self.confirmations);
            match confirmations.outcomes.get(shard) {
                Some(outcome) => outcome.clone(),
                None => {
                    let (sender, outcome) = oneshot::channel();
                    let outcome: BoxFuture<'static, bool> =
                        Box::pin(outcome.map(|outcome| outcome.unwrap_or(false)));
                    let outcome = outcome.shared();
                    confirmations.outcomes.insert(shard.clone(), outcome.clone());
                    confirmations.next.push((shard.clone(), sender));
                    if !confirmations.running {
                        confirmations.running = true;
                        self.confirming.spawn(Arc::clone(self).confirmation_rounds(address));
                    }
                    outcome
                }
            }
        };
        let confirmed = confirmation.await;
        if !confirmed {
            tracing::warn!(%shard, "shard lock not confirmed: the final reply is left for the next owner");
        }
        confirmed
    }

    /// Runs confirmation rounds while shards are queued for one (see [`Member::confirm_lock`]).
    async fn confirmation_rounds(self: Arc<Member>, address: RunnerAddress) {
        let interval = self.config.shard_lock_interval();
        loop {
            // The writers that are ready to run go first, once, so that the shards they queue
            // join this round rather than the next.
            tokio::task::yield_now().await;
            let round = {
                let mut confirmations = lock(&self.confirmations);
                if confirmations.next.is_empty() {
                    confirmations.running = false;
                    return;
                }
                std::mem::take(&mut confirmations.next)
            };
            let shards: Vec<ShardId> = round.iter().map(|(shard, _)| shard.clone()).collect();
            let sent_at = Instant::now();
            // Without the heartbeat: the refresh loop keeps it.
            let confirmed = match tokio::time::timeout(
                interval,
                self.storage.confirm(&address, &shards),
            )
            .await
            {
                Ok(Ok(returned)) => {
                    let releasing = {
                        let mut state = self.state();
                        state.confirm(&returned, sent_at, self.lease);
                        state.ownership.release_lost_shards(&shards, &returned)
                    };
                    if releasing {
                        self.acquisition.notify_one();
                    }
                    returned
                }
                Ok(Err(error)) => {
                    tracing::debug!(%error, shards = shards.len(), "could not confirm shard locks");
                    Vec::new()
                }
                Err(_) => Vec::new(),
            };
            {
                let mut confirmations = lock(&self.confirmations);
                for shard in &shards {
                    confirmations.outcomes.remove(shard);
                }
            }
            for (shard, sender) in round {
                // The writer may have gone away; the outcome is shared with those that wait.
                let _ = sender.send(confirmed.contains(&shard));
            }
        }
    }
}

/// The name of the runner-health singleton (the reference's).
pub(crate) const RUNNER_HEALTH: &str = "effect/cluster/Sharding/RunnerHealth";
/// A runner counts as alive if one of this many pings answers.
const PING_ATTEMPTS: u32 = 5;
const PING_SPACING: Duration = Duration::from_millis(500);
const PING_TIMEOUT: Duration = Duration::from_secs(10);
/// How many runners are pinged (or asked about) at once.
const PING_CONCURRENCY: usize = 10;
/// How long the application's [`RunnerHealth`] may take to judge one runner; past it, the runner
/// counts as alive.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// How the runner-health singleton judges the runners.
enum Judge {
    /// Through the transport's pings, as the mode says.
    Ping(Arc<dyn Transport>, RunnerHealthCheck),
    /// With the application's check
    /// ([`ShardingBuilder::runner_health`](crate::ShardingBuilder::runner_health)).
    Check(Arc<dyn RunnerHealth>),
}

impl Judge {
    /// The name of the way runners are judged, for the logs.
    fn name(&self) -> &'static str {
        match self {
            Judge::Ping(_, mode) => mode.as_str(),
            Judge::Check(_) => "custom",
        }
    }
}

/// What one round found out about one runner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Verdict {
    /// Whether the runner counts as healthy.
    alive: bool,
    /// Whether it answered a ping in this round.
    answered: bool,
}

/// Judges the runner at `address`, which the registry lists (so its heartbeat is live), with
/// the application's check or as the ping mode says; `known` tells whether it answered a ping
/// of this singleton's before.
///
/// - The application's check: alive as it says; alive when it takes longer than
///   [`CHECK_TIMEOUT`] (a check that cannot tell takes no shard away).
/// - `Ping`: alive when one of [`PING_ATTEMPTS`] pings answers (the reference's
///   `RunnerHealth.layerPing`).
/// - `Heartbeat`: alive; no ping.
/// - `PingKnown`: a known runner is judged as with `Ping`.
///   An unknown one gets one ping, to learn whether it speaks the transport.
///   It is alive whatever the answer: a runner of the reference never answers, and only its
///   heartbeat says whether it lives.
async fn judge(judging: &Judge, known: bool, address: &RunnerAddress) -> Verdict {
    let (transport, mode) = match judging {
        Judge::Ping(transport, mode) => (&**transport, *mode),
        Judge::Check(health) => {
            let checked = tokio::time::timeout(CHECK_TIMEOUT, health.is_alive(address)).await;
            let alive = checked.unwrap_or_else(|_| {
                tracing::warn!(
                    runner = %address,
                    timeout = ?CHECK_TIMEOUT,
                    "the runner-health check did not answer in time; the runner counts as alive"
                );
                true
            });
            return Verdict { alive, answered: false };
        }
    };
    match mode {
        RunnerHealthCheck::Heartbeat => Verdict { alive: true, answered: false },
        RunnerHealthCheck::Ping => {
            let answered = answers(transport, address, PING_ATTEMPTS).await;
            Verdict { alive: answered, answered }
        }
        RunnerHealthCheck::PingKnown if known => {
            let answered = answers(transport, address, PING_ATTEMPTS).await;
            Verdict { alive: answered, answered }
        }
        RunnerHealthCheck::PingKnown => {
            let answered = answers(transport, address, 1).await;
            Verdict { alive: true, answered }
        }
    }
}

/// One round of the runner-health check; `known` holds the runners that answered a ping in an
/// earlier round, and is updated.
async fn check_runners(
    cluster: &Member,
    judging: &Judge,
    known: &mut BTreeSet<RunnerAddress>,
) -> Result<(), String> {
    use futures_util::StreamExt;

    let runners = tokio::time::timeout(REGISTRY_TIMEOUT, cluster.storage.get_runners())
        .await
        .map_err(|_| "get_runners timed out".to_owned())?
        .map_err(|error| error.to_string())?;
    // A runner that left the registry is forgotten: another process may take its address.
    known.retain(|address| runners.iter().any(|(runner, _)| runner.address == *address));
    if runners.len() <= 1 {
        return Ok(());
    }
    let mut healthy = runners.iter().filter(|(_, healthy)| *healthy).count();
    let checked = runners.len();
    let before = &*known;
    let checks =
        futures_util::stream::iter(runners.into_iter().map(|(runner, was_healthy)| async move {
            let known = before.contains(&runner.address);
            let verdict = judge(judging, known, &runner.address).await;
            (runner, was_healthy, verdict)
        }))
        .buffer_unordered(PING_CONCURRENCY)
        .collect::<Vec<_>>()
        .await;
    let mut unhealthy = 0_usize;
    for (runner, was_healthy, verdict) in checks {
        if verdict.answered && known.insert(runner.address.clone()) {
            tracing::debug!(runner = %runner.address, "runner answered a ping: judged by pings from now on");
        }
        let alive = verdict.alive;
        if !alive {
            unhealthy += 1;
        }
        if alive == was_healthy {
            continue;
        }
        if !alive && healthy <= 1 {
            tracing::warn!(runner = %runner.address, "the last healthy runner does not answer; left healthy");
            continue;
        }
        tracing::warn!(runner = %runner.address, healthy = alive, "runner health changed");
        tokio::time::timeout(
            REGISTRY_TIMEOUT,
            cluster.storage.set_runner_health(&runner.address, alive),
        )
        .await
        .map_err(|_| "set_runner_health timed out".to_owned())?
        .map_err(|error| error.to_string())?;
        if alive {
            healthy += 1;
        } else {
            healthy -= 1;
        }
    }
    let mode = judging.name();
    tracing::debug!(mode, checked, unhealthy, known = known.len(), "runner health check finished");
    Ok(())
}

/// Whether `address` answers one of `attempts` pings.
async fn answers(transport: &dyn Transport, address: &RunnerAddress, attempts: u32) -> bool {
    for attempt in 1..=attempts {
        if let Ok(Ok(())) = tokio::time::timeout(PING_TIMEOUT, transport.ping(address)).await {
            return true;
        }
        if attempt < attempts {
            tokio::time::sleep(PING_SPACING).await;
        }
    }
    false
}

/// `call`, failing with a timeout error after `limit` (a lock storage that hangs is a lock
/// storage that fails).
async fn bounded<T>(
    limit: Duration,
    call: impl std::future::Future<Output = Result<T, cluster_core::error::StorageError>>,
) -> Result<T, cluster_core::error::StorageError> {
    tokio::time::timeout(limit, call).await.unwrap_or_else(|_| {
        Err(cluster_core::error::StorageError::new(
            cluster_core::error::StorageErrorKind::Timeout,
            format!("no answer within {limit:?}"),
        ))
    })
}

/// Refreshes `held`, retrying a few times (the reference's 5 retries 50 ms apart).
async fn refresh(
    storage: &dyn RunnerStorage,
    address: &RunnerAddress,
    held: &[ShardId],
) -> Result<Vec<ShardId>, cluster_core::error::StorageError> {
    let mut attempt = 1;
    loop {
        match storage.refresh(address, held).await {
            Ok(returned) => return Ok(returned),
            Err(error) if attempt >= REFRESH_ATTEMPTS => return Err(error),
            Err(_) => {
                attempt += 1;
                tokio::time::sleep(REFRESH_SPACING).await;
            }
        }
    }
}
