//! The simulated cluster: several runners and a client-only process of the real runtime in
//! one single-threaded tokio runtime with paused time, on the in-memory storages, with faults
//! and the workload drawn from one `u64` seed, and invariants checked as the run goes.
//!
//! ```text
//! cargo xtask sim --seeds 200     # seeds 0..200, each run twice to compare histories
//! cargo xtask sim --seed 17       # one seed, with its history printed
//! ```
//!
//! Determinism needs tokio's own random choices (`select!` branch order) seeded too, which
//! tokio offers only when built with `--cfg tokio_unstable` (`Builder::rng_seed`); `cargo
//! xtask sim` builds so, in a target directory of its own. Without it a run still checks every
//! invariant, but two runs of one seed may take different paths.
//!
//! Faults (two schedules, each from a random stream of its own): runners freeze (lock
//! storage black-holed for a while), crash (their lock storage dies: no refresh, no release;
//! cut off the network) and are replaced, restart gracefully, are partitioned off the
//! network, join in bursts, are replaced one by one in rolling updates; reply writes get
//! slow, storage calls fail; the transport bounds each process's calls to a runner as a TCP
//! connection does (pushed persisted requests in a lane of their own), and delays, loses and
//! duplicates calls; storage and one runner's lock storage get latency spikes; storage
//! transactions are slow to begin; clocks are skewed. [`SimConfig::graceful`] draws only the graceful faults. The workload is
//! persisted requests with primary keys and volatile requests from a client-only member of
//! the cluster, transactional requests that the runners send (which go directly to the
//! entities they hold), and (feature `workflow`) workflow executions of a compensated saga
//! that ships through a compensated child workflow (`workflow`).
//!
//! Checked: no shard is acquired by two live runners at one sampled instant, no runner
//! writes a final reply while the database does not hold the shard's lease for it (fencing),
//! a runner holding shards with healthy lock storage keeps reading its mailboxes (liveness),
//! every request is answered to its caller within a bound once faults end, exactly one final
//! reply is stored per request, every volatile request ends with its reply or a typed error;
//! a handler runs again only after a run on a runner that crashed or froze, or after a write
//! of its reply failed (`runs`), and without such faults each entity runs its requests in
//! storage order; once the faults are over, a volatile call and a persisted call to a runner
//! are answered within a second while more long persisted calls than the transport's slots
//! are pushed to it (the latency probe); for workflows, a stored activity result is never run
//! again, and compensations run once per stored failed outcome (an earlier run compensates too
//! only if its runner crashed or froze, or its outcome's write failed), never for a success.
//! `docs/testing.md` has the details.

use cluster_sharding::Plumbing;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::envelope::{Exit, Reply, WithExit};
use cluster_core::ids::RunnerAddress;
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::sync::lock;
use cluster_core::{Clock, EntityAddress, MachineId, ShardingConfig, Snowflake, Timestamp};
use cluster_sharding::{Entity, EntityContext, Handler, Protocol, RequestContext, Rpc, Sharding};
use serde::{Deserialize, Serialize};

use crate::faulty::{Faults, FaultyMessageStorage, FaultyRunnerStorage, LockFaults, StorageEvent};
use crate::memory::{MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage};
use crate::transport::{MemoryNetwork, NetworkFaults, Slots};

mod runs;
#[cfg(feature = "workflow")]
mod workflow;

/// A small, fast, seedable random source (splitmix64): every choice of a simulation.
#[derive(Clone, Debug)]
pub struct SimRng(u64);

impl SimRng {
    /// The source of `seed`.
    pub fn new(seed: u64) -> SimRng {
        SimRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A duration in `min..=max`, in whole milliseconds.
    pub fn duration(&mut self, min: Duration, max: Duration) -> Duration {
        let (min, max) = (millis(min), millis(max).max(millis(min)));
        Duration::from_millis(min + self.below(max - min + 1))
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The simulation's wall clock: tokio's (paused) clock from a fixed origin, plus a skew of
/// its own per runner.
#[derive(Debug)]
pub struct SimClock {
    origin: Timestamp,
    start: tokio::time::Instant,
    skew: Duration,
    ahead: bool,
}

impl SimClock {
    /// A clock `skew` ahead of (or, with `ahead` false, behind) the simulation's time.
    pub fn new(start: tokio::time::Instant, skew: Duration, ahead: bool) -> SimClock {
        SimClock { origin: Timestamp::from_unix_millis(1_700_000_000_000), start, skew, ahead }
    }
}

impl Clock for SimClock {
    fn now(&self) -> Timestamp {
        let now = self.origin.saturating_add(self.start.elapsed());
        if self.ahead { now.saturating_add(self.skew) } else { now.saturating_sub(self.skew) }
    }
}

/// What one simulation runs.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Every choice comes from this seed.
    pub seed: u64,
    /// Runners at any time.
    pub runners: usize,
    /// Persisted requests the client sends.
    pub requests: usize,
    /// Whether faults are injected.
    pub faults: bool,
    /// The faults added after the first regression seeds (with `faults`): a second schedule
    /// (the transport delays, loses and duplicates calls; latency spikes of storage and of
    /// lock storage), and a crashed runner's message storage dying with it (its tasks no
    /// longer reach the database, as after a real crash).
    pub extended_faults: bool,
    /// Workflow executions the client runs (needs the `workflow` feature).
    pub workflows: usize,
    /// Workflow executions the client interrupts, among automatic wakes and resumes (needs
    /// the `workflow` feature).
    pub holds: usize,
    /// The scenario added with the checks of handler runs: handlers that take a moment,
    /// transactional requests that runners send (so that they go directly to local entities),
    /// periods of slow transaction begins, and orders that ship through a child workflow.
    pub exactly_once: bool,
    /// Graceful faults only (restarts, joins, rolling updates, partitions, slow and lossy
    /// networks and storage; no crash, freeze, slow lock storage or storage error): every
    /// handler must run exactly once, and each entity in storage order.
    pub graceful: bool,
    /// The network bounds each process's calls in flight to each runner as a connection of the
    /// TCP transport does (8 calls, and 4 pushed persisted requests in a lane of their own), and
    /// once the faults are over the latency probe runs: more long persisted calls than those
    /// slots are pushed to one runner, and a volatile call and a persisted call to other
    /// entities of that runner must still be answered within a second.
    pub transport_slots: bool,
}

impl SimConfig {
    /// The default scenario of `seed`: 3 runners, 60 persisted and 60 volatile requests from
    /// the client, 20 transactional requests from the runners, 20 workflow executions, every
    /// fault.
    pub fn seed(seed: u64) -> SimConfig {
        SimConfig {
            seed,
            runners: 3,
            requests: 60,
            faults: true,
            extended_faults: true,
            workflows: 20,
            holds: 8,
            exactly_once: true,
            graceful: false,
            transport_slots: true,
        }
    }

    /// The scenario of `seed` with graceful faults only, where every handler runs once.
    pub fn graceful(seed: u64) -> SimConfig {
        SimConfig { graceful: true, ..SimConfig::seed(seed) }
    }

    /// The scenario of `seed` as it was before the checks of handler runs came (the
    /// regression seeds found then replay it exactly; the runs are checked all the same).
    pub fn extended(seed: u64) -> SimConfig {
        SimConfig { exactly_once: false, holds: 0, transport_slots: false, ..SimConfig::seed(seed) }
    }

    /// The scenario of `seed` as it was before transport faults, latency spikes, dying
    /// message storage and workflows came (the regression seeds found then replay it
    /// exactly).
    pub fn classic(seed: u64) -> SimConfig {
        SimConfig { extended_faults: false, workflows: 0, ..SimConfig::extended(seed) }
    }
}

/// What a simulation saw.
#[derive(Clone, Debug)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// A hash of the event log: equal for two runs that took the same path.
    pub history: u64,
    /// The event log (virtual milliseconds and what happened).
    pub events: Vec<(u64, String)>,
    /// The invariants that did not hold.
    pub violations: Vec<String>,
}

impl SimReport {
    /// Whether every invariant held.
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }
}

/// The event log of a run.
#[derive(Clone)]
struct History {
    start: tokio::time::Instant,
    events: Arc<Mutex<Vec<(u64, String)>>>,
}

impl History {
    fn record(&self, event: String) {
        let at = millis(self.start.elapsed());
        lock(&self.events).push((at, event));
    }

    fn take(&self) -> Vec<(u64, String)> {
        std::mem::take(&mut *lock(&self.events))
    }
}

/// FNV-1a over the event log.
fn hash(events: &[(u64, String)]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for (at, event) in events {
        for byte in at.to_le_bytes().iter().chain(event.as_bytes()).chain(b"\n") {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// Runs one simulation on a fresh single-threaded runtime with paused time.
///
/// # Panics
///
/// If the runtime cannot be built.
pub fn run(config: &SimConfig) -> SimReport {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_time().start_paused(true);
    #[cfg(tokio_unstable)]
    builder.rng_seed(tokio::runtime::RngSeed::from_bytes(&config.seed.to_le_bytes()));
    let runtime = match builder.build() {
        Ok(runtime) => runtime,
        Err(error) => panic!("cannot build the simulation's runtime: {error}"),
    };
    let report = runtime.block_on(simulate(config.clone()));
    runtime.shutdown_background();
    report
}

/// How long a lock lives without a refresh in the simulation.
const EXPIRATION: Duration = Duration::from_secs(2);
/// When the last request is sent at the latest.
const WORKLOAD: Duration = Duration::from_secs(20);
/// When faults stop.
const FAULTS_END: Duration = Duration::from_secs(25);
/// How long after the faults stop every caller must have its reply.
const HEAL_BOUND: Duration = Duration::from_secs(60);
/// The longest pause of a healthy runner's storage read loop (20 poll intervals).
const READ_STALL: Duration = Duration::from_secs(2);
/// How long after a freeze a runner's lock storage counts as recovering.
const LOCK_RECOVERY: Duration = Duration::from_secs(3);
/// How long a volatile call may take, faults or not, before it counts as a hang.
const VOLATILE_BOUND: Duration = Duration::from_secs(30);
/// How long a runner's own call waits before it is made again from another runner.
const LOCAL_CALL_BOUND: Duration = Duration::from_secs(10);
/// The calls each process may have in flight to each runner (`transport_slots`): fewer pushed
/// ones than the latency probe's long calls, so that some pushes find their lane full.
const SIM_SLOTS: Slots = Slots { calls: 8, pushed: 4 };
/// How many long persisted calls the latency probe pushes to one runner: more than its
/// slots.
const PROBE_HOLDS: usize = 12;
/// How long each of those calls' handlers takes.
const PROBE_HOLD: Duration = Duration::from_secs(20);
/// How long a call of the latency probe may take while the long calls are held.
const PROBE_BOUND: Duration = Duration::from_secs(1);
/// How long the cluster may take to settle after the faults before the probe runs.
const SETTLE_BOUND: Duration = Duration::from_secs(30);

fn runner_config(runner_address: Option<RunnerAddress>) -> ShardingConfig {
    ShardingConfig {
        runner_address,
        shards_per_group: 12,
        refresh_assignments_interval: Duration::from_millis(100),
        shard_lock_refresh_interval: Duration::from_millis(500),
        shard_lock_expiration: EXPIRATION,
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(100),
        entity_termination_timeout: Duration::from_millis(500),
        runner_health_check_interval: Duration::from_secs(1),
        ..ShardingConfig::default()
    }
}

/// A persisted request with a primary key: add one to a counter.
#[derive(Serialize, Deserialize)]
struct Add {
    key: String,
}

impl Rpc for Add {
    const TAG: &'static str = "Add";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A persisted request with a primary key that runs in a storage transaction: add one to a
/// counter (the runners send these, so that they go directly to the entities they hold).
#[derive(Serialize, Deserialize)]
struct AddTx {
    key: String,
}

impl Rpc for AddTx {
    const TAG: &'static str = "AddTx";
    const PERSISTED: bool = true;
    const WITH_TRANSACTION: bool = true;
    type Success = u64;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A persisted request with a primary key whose handler takes `millis` (simulated time): the
/// long persisted calls of the latency probe.
#[derive(Serialize, Deserialize)]
struct Hold {
    key: String,
    millis: u64,
}

impl Rpc for Hold {
    const TAG: &'static str = "Hold";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A volatile request: sent runner to runner through the simulated network.
#[derive(Serialize, Deserialize)]
struct Echo {
    n: u64,
}

impl Rpc for Echo {
    const TAG: &'static str = "Echo";
    type Success = u64;
    type Error = String;
}

/// The simulated entity: a counter, which records its handler runs. Its value is durable
/// state, so each counter's successful replies are 1, 2, 3, … once each, across every fault
/// ([`check_durable_counts`]).
struct SimCounter {
    value: u64,
    recorder: Option<Arc<runs::Recorder>>,
}

impl Entity for SimCounter {
    const TYPE: &'static str = "SimCounter";

    async fn create(context: &EntityContext) -> SimCounter {
        SimCounter { value: 0, recorder: context.sharding().extension::<runs::Recorder>() }
    }

    fn protocol(protocol: &mut Protocol<SimCounter>) {
        protocol.durable(|counter| &mut counter.value);
        protocol.handle::<Add>().handle::<AddTx>().handle::<Echo>().handle::<Hold>();
    }
}

impl SimCounter {
    /// Records a run of a keyed request and takes the run's time; the run, to end when the
    /// handler returns.
    async fn add(&mut self, context: &RequestContext, key: &str) -> (u64, Option<runs::Run>) {
        let mut run = None;
        if let Some(recorder) = &self.recorder {
            let (takes, started) = recorder.ran(key, context.request_id(), context.address());
            run = Some(started);
            if !takes.is_zero() {
                tokio::time::sleep(takes).await;
            }
        }
        self.value += 1;
        (self.value, run)
    }
}

impl Handler<Echo> for SimCounter {
    async fn handle(&mut self, _: &RequestContext, request: Echo) -> Result<u64, String> {
        Ok(request.n)
    }
}

impl Handler<Add> for SimCounter {
    async fn handle(&mut self, context: &RequestContext, add: Add) -> Result<u64, String> {
        let (value, run) = self.add(context, &add.key).await;
        if let Some(run) = run {
            run.returned();
        }
        Ok(value)
    }
}

impl Handler<Hold> for SimCounter {
    async fn handle(&mut self, context: &RequestContext, hold: Hold) -> Result<u64, String> {
        let (value, run) = self.add(context, &hold.key).await;
        tokio::time::sleep(Duration::from_millis(hold.millis)).await;
        if let Some(run) = run {
            run.returned();
        }
        Ok(value)
    }
}

impl Handler<AddTx> for SimCounter {
    async fn handle(&mut self, context: &RequestContext, add: AddTx) -> Result<u64, String> {
        if context.transaction().is_none() {
            return Err("AddTx ran outside a transaction".to_owned());
        }
        let (value, run) = self.add(context, &add.key).await;
        if let Some(run) = run {
            run.returned();
        }
        Ok(value)
    }
}

/// One runner of the simulation.
struct SimRunner {
    name: String,
    address: RunnerAddress,
    sharding: Sharding,
    locks: Arc<LockFaults>,
    /// Its message storage handle's faults.
    storage: Arc<Faults>,
    /// When its storage read loop last read (simulated milliseconds).
    last_read: Arc<std::sync::atomic::AtomicU64>,
    /// Frozen (its lock storage hangs) until this simulated millisecond.
    frozen_until: Arc<std::sync::atomic::AtomicU64>,
    /// Crashed or stopped: no longer part of the ownership check.
    gone: bool,
}

impl SimRunner {
    /// Up, and not stopping.
    fn is_live(&self) -> bool {
        !self.gone && self.frozen_until.load(std::sync::atomic::Ordering::Relaxed) != u64::MAX
    }
}

/// The shared pieces every runner of a run opens.
struct World {
    start: tokio::time::Instant,
    /// A crash also kills the runner's message storage handle (`extended_faults`).
    crash_kills_storage: bool,
    /// The message database (each process has its own faulty handle on it).
    messages: Arc<dyn MessageStorage>,
    /// Every process's storage faults (slow replies apply to all).
    storage_faults: Arc<Mutex<Vec<Arc<Faults>>>>,
    /// The address of every stored request (for the fencing check).
    requests: Arc<Mutex<BTreeMap<Snowflake, EntityAddress>>>,
    registry: Arc<MemoryRunnerDatabase>,
    /// The runners' network (volatile requests, health checks).
    network: Arc<MemoryNetwork>,
    history: History,
    violations: Arc<Mutex<Vec<String>>>,
    runners: Arc<Mutex<Vec<SimRunner>>>,
    next_port: u16,
    /// The provisional machine id of the next runtime: its snowflake ids (which order stored
    /// messages) follow the seed.
    next_machine_id: std::sync::atomic::AtomicU64,
    /// The workflow scenario's ledger, when it runs.
    #[cfg(feature = "workflow")]
    workflows: Option<Arc<workflow::Ledger>>,
    /// Every handler run, and the faults that explain a run again.
    runs: Arc<runs::Runs>,
    /// Handlers take a moment (`exactly_once`).
    slow_handlers: bool,
    /// The faults of the first schedule still in force after it moved on (a freeze, a
    /// partition, slow replies): the latency probe waits for them to end.
    in_force: Arc<std::sync::atomic::AtomicUsize>,
}

/// A fault in force until dropped (see `World::in_force`).
struct InForce(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for InForce {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl World {
    /// A fault that stays in force after the schedule moves on, until the guard drops.
    fn in_force(&self) -> InForce {
        self.in_force.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        InForce(Arc::clone(&self.in_force))
    }

    fn violation(&self, what: String) {
        self.history.record(format!("VIOLATION {what}"));
        lock(&self.violations).push(what);
    }

    /// A process's own handle on the message database. For a runner it checks fencing: a
    /// final reply is written only while the database holds the shard's lease for it.
    fn storage_for(
        &self,
        runner: Option<RunnerAddress>,
        last_read: Arc<std::sync::atomic::AtomicU64>,
    ) -> (Arc<dyn MessageStorage>, Arc<Faults>) {
        let (storage, faults) = FaultyMessageStorage::new(Arc::clone(&self.messages));
        let start = self.start;
        let (requests, registry) = (Arc::clone(&self.requests), Arc::clone(&self.registry));
        let (history, violations) = (self.history.clone(), Arc::clone(&self.violations));
        let runs = Arc::clone(&self.runs);
        #[cfg(feature = "workflow")]
        let workflows = self.workflows.clone();
        faults.observe(Arc::new(move |event| {
            #[cfg(feature = "workflow")]
            if let Some(ledger) = &workflows {
                ledger.observe(&event);
            }
            match event {
            StorageEvent::RequestSaved(request) => {
                let address = request.address.clone();
                lock(&requests).insert(request.request_id, address);
            }
            StorageEvent::Read(_) => {
                last_read.store(millis(start.elapsed()), std::sync::atomic::Ordering::Relaxed);
            }
            StorageEvent::FinalReply(reply) => {
                let Some(runner) = &runner else { return };
                let address = lock(&requests).get(&reply.request_id()).cloned();
                let Some(shard) = address.map(|address| address.shard_id) else { return };
                let holder = registry.lock_holder(&shard, EXPIRATION);
                if holder.as_ref() != Some(runner) {
                    let what = format!(
                        "runner {runner} stored the final reply of {} while {holder:?} held {shard}",
                        reply.request_id()
                    );
                    history.record(format!("VIOLATION {what}"));
                    lock(&violations).push(what);
                }
            }
            StorageEvent::FinalReplyStored(_) => {}
            StorageEvent::ReplyWriteFailed(reply) => {
                let address = lock(&requests).get(&reply.request_id()).cloned();
                runs.reply_write_failed(reply.request_id(), address);
            }
            }
        }));
        lock(&self.storage_faults).push(Arc::clone(&faults));
        (Arc::new(storage), faults)
    }

    /// The provisional machine id of the next runtime.
    fn machine_id(&self) -> MachineId {
        let id = self.next_machine_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        MachineId::new(i32::try_from(id % 1024).unwrap_or(0))
    }

    /// Starts a runner whose clock is skewed by up to 200 ms.
    async fn start_runner(&mut self, rng: &mut SimRng) {
        let port = self.next_port;
        self.next_port += 1;
        let skew = rng.duration(Duration::ZERO, Duration::from_millis(200));
        let clock: Arc<dyn Clock> = Arc::new(SimClock::new(self.start, skew, rng.below(2) == 0));
        let locks: Arc<dyn RunnerStorage> =
            Arc::new(MemoryRunnerStorage::new(Arc::clone(&self.registry), EXPIRATION));
        let (locks, faults) = FaultyRunnerStorage::new(locks);
        let address = RunnerAddress::new("sim", port);
        let config = runner_config(Some(address.clone()));
        let last_read = Arc::new(std::sync::atomic::AtomicU64::new(millis(self.start.elapsed())));
        let (messages, storage) = self.storage_for(Some(address.clone()), Arc::clone(&last_read));
        let transport = self.network.transport();
        match Sharding::member(config, messages, Arc::new(locks))
            .clock(clock)
            .provisional_machine_id(self.machine_id())
            .transport(transport)
            .start()
            .await
        {
            Ok(sharding) => {
                self.network.attach(address.clone(), sharding.runner_handler());
                sharding.insert_extension(Arc::new(runs::Recorder {
                    runs: Arc::clone(&self.runs),
                    runner: format!("runner-{port}"),
                    slow_handlers: self.slow_handlers,
                }));
                if let Err(error) = sharding.entity::<SimCounter>().register() {
                    self.violation(format!("runner {port} could not register: {error}"));
                }
                #[cfg(feature = "workflow")]
                if let Some(ledger) = &self.workflows
                    && let Err(error) = ledger.register(&sharding, &format!("runner-{port}"))
                {
                    self.violation(format!("runner {port} has no workflow engine: {error}"));
                }
                let name = format!("runner-{port}");
                self.history.record(format!("start {name} skew {}ms", millis(skew)));
                let runner = SimRunner {
                    name,
                    address,
                    sharding,
                    locks: faults,
                    storage,
                    last_read,
                    frozen_until: Arc::default(),
                    gone: false,
                };
                lock(&self.runners).push(runner);
            }
            Err(error) => self.violation(format!("runner {port} did not start: {error}")),
        }
    }

    /// The oldest live runner, if at least `at_least` are live.
    fn pick_oldest_live(&self, at_least: usize) -> Option<usize> {
        let runners = lock(&self.runners);
        let live: Vec<usize> = (0..runners.len()).filter(|&i| runners[i].is_live()).collect();
        (live.len() >= at_least).then(|| live[0])
    }

    /// The index of a live runner, if there are at least `at_least` live ones.
    fn pick_live(&self, rng: &mut SimRng, at_least: usize) -> Option<usize> {
        pick_live(&lock(&self.runners), rng, at_least)
    }
}

/// The index of a live runner among `runners`, if at least `at_least` are live.
fn pick_live(runners: &[SimRunner], rng: &mut SimRng, at_least: usize) -> Option<usize> {
    let live: Vec<usize> = (0..runners.len()).filter(|&i| runners[i].is_live()).collect();
    if live.len() < at_least {
        return None;
    }
    let choice = usize::try_from(rng.below(live.len() as u64)).unwrap_or(0);
    live.get(choice).copied()
}

/// One fault of the schedule.
enum Fault {
    /// The runner's lock storage hangs for a while (a frozen process).
    Freeze(Duration),
    /// The runner dies: no more refreshes or releases, off the network, and (with
    /// `extended_faults`) its message storage calls no longer reach the database; a new
    /// runner replaces it.
    Crash,
    /// The runner shuts down gracefully; a new runner replaces it.
    Restart,
    /// Reply writes take this long for a while.
    SlowReplies(Duration, Duration),
    /// The runner is cut off the network (calls to it fail) for a while.
    Partition(Duration),
    /// Several runners join at once; as many of the oldest leave gracefully a while later.
    JoinBurst(usize, Duration),
    /// Every live runner is replaced, one after the other, this far apart.
    RollingUpdate(Duration),
    /// The next reads, request saves and reply writes of every process fail (a database that
    /// drops connections for a moment).
    StorageErrors(u32),
}

async fn simulate(config: SimConfig) -> SimReport {
    let start = tokio::time::Instant::now();
    let mut rng = SimRng::new(config.seed);
    let database_clock: Arc<dyn Clock> = Arc::new(SimClock::new(start, Duration::ZERO, true));
    let database = Arc::new(MemoryMessageStorage::new(Arc::clone(&database_clock)));
    let memory: Arc<dyn MessageStorage> = Arc::clone(&database) as Arc<dyn MessageStorage>;
    let history = History { start, events: Arc::default() };
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut world = World {
        start,
        crash_kills_storage: config.faults && config.extended_faults,
        messages: memory,
        storage_faults: Arc::default(),
        requests: Arc::default(),
        registry: MemoryRunnerDatabase::new(database_clock),
        network: MemoryNetwork::new(),
        history: history.clone(),
        violations: Arc::clone(&violations),
        runners: Arc::default(),
        next_port: 1,
        next_machine_id: std::sync::atomic::AtomicU64::new(config.seed),
        #[cfg(feature = "workflow")]
        workflows: (config.workflows + config.holds > 0).then(|| {
            let (children, holds) = (config.exactly_once, config.holds > 0);
            workflow::Ledger::new(history.clone(), Arc::clone(&violations), children, holds)
        }),
        runs: runs::Runs::new(history.clone()),
        slow_handlers: config.exactly_once,
        in_force: Arc::default(),
    };
    #[cfg(not(feature = "workflow"))]
    if config.workflows + config.holds > 0 {
        world.violation("workflows need the `workflow` feature of cluster-testkit".to_owned());
    }
    if config.transport_slots {
        world.network.bound_slots(SIM_SLOTS);
    }
    for _ in 0..config.runners {
        world.start_runner(&mut rng).await;
    }
    let sampler = tokio::spawn(check_ownership(
        Arc::clone(&world.runners),
        world.history.clone(),
        Arc::clone(&world.violations),
    ));
    let (client, mut calls) = start_workload(&world, &config, &mut rng).await;
    let local_requests = if config.exactly_once { config.requests / 3 } else { 0 };
    if local_requests > 0 {
        // A stream of choices of its own: the older scenarios' draws stay as they were.
        let mut rng = SimRng::new(config.seed ^ 0x6c6f_6361_6c73_656e);
        calls.extend(start_local_senders(&world, local_requests, &mut rng));
    }
    #[cfg(feature = "workflow")]
    let calls = {
        let mut calls = calls;
        if let Some(ledger) = &world.workflows {
            // A stream of choices of its own: the older scenarios' draws stay as they were.
            let mut rng = SimRng::new(config.seed ^ 0x776f_726b_666c_6f77);
            calls.extend(ledger.start(&client, config.workflows, &mut rng));
            // A stream of its own too: the orders' draws stay as they were.
            let mut rng = SimRng::new(config.seed ^ 0x686f_6c64_7369_6e74);
            calls.extend(ledger.start_holds(&client, config.holds, &mut rng));
        }
        calls
    };
    run_fault_schedules(&mut world, &config, &mut rng).await;
    // Every caller gets its reply within a bound once the faults are over.
    let deadline = start + FAULTS_END + HEAL_BOUND;
    for (key, call) in calls {
        match tokio::time::timeout_at(deadline, call).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => world.violation(format!("the caller of {key} panicked")),
            Err(_) => {
                world.violation(format!("{key} was not answered within the bound"));
                #[cfg(feature = "workflow")]
                if let Some(id) = key.strip_prefix("order ").and_then(|id| id.parse().ok()) {
                    for line in workflow::describe(&database, id) {
                        world.history.record(format!("  stored: {line}"));
                    }
                }
            }
        }
    }
    if config.transport_slots {
        probe_pushed_latency(&world, &client).await;
    }
    sampler.abort();
    check_final_replies(&world, &client, Add::TAG, "k", config.requests).await;
    check_final_replies(&world, &client, AddTx::TAG, "t", local_requests).await;
    check_runs(&world, &database);
    check_durable_counts(&world, &client, &database).await;
    #[cfg(feature = "workflow")]
    if let Some(ledger) = &world.workflows {
        ledger.check_end(&world.runs.ungraceful_runners(), &world.runs.failed_entities());
    }
    stop(&world, &client).await;
    let events = history.take();
    let violations = lock(&world.violations).clone();
    SimReport { seed: config.seed, history: hash(&events), events, violations }
}

/// Runs the fault schedules (each from a random stream of its own, so that the older
/// scenarios' draws stay as they were) until they end.
async fn run_fault_schedules(world: &mut World, config: &SimConfig, rng: &mut SimRng) {
    let more_faults = (config.faults && config.extended_faults).then(|| {
        let rng = SimRng::new(config.seed ^ 0x6e65_7477_6f72_6b73);
        tokio::spawn(inject_more_faults(MoreFaults::of(world, config.graceful), rng))
    });
    let slow_transactions = (config.faults && config.exactly_once).then(|| {
        let rng = SimRng::new(config.seed ^ 0x7472_616e_7361_6374);
        tokio::spawn(slow_transactions(MoreFaults::of(world, config.graceful), rng))
    });
    if config.faults {
        inject_faults(world, rng, config.graceful).await;
    }
    for schedule in [more_faults, slow_transactions].into_iter().flatten() {
        let _ = schedule.await;
    }
}

/// The entity of request `index` (requests spread over seven counters).
fn counter_of(client: &Sharding, index: usize) -> cluster_sharding::EntityClient<SimCounter> {
    client.client::<SimCounter>(format!("counter-{}", index % COUNTERS))
}

/// How many counters the requests go to.
const COUNTERS: usize = 7;

/// A client-only process sends every request at a time drawn from the seed and retries it
/// (with its key) until it is answered.
async fn start_workload(
    world: &World,
    config: &SimConfig,
    rng: &mut SimRng,
) -> (Sharding, Vec<(String, tokio::task::JoinHandle<()>)>) {
    let clock: Arc<dyn Clock> = Arc::new(SimClock::new(world.start, Duration::ZERO, true));
    // A client-only member of the cluster: it computes the assignment and reaches the runners
    // through the network for volatile requests.
    let registry: Arc<dyn RunnerStorage> =
        Arc::new(MemoryRunnerStorage::new(Arc::clone(&world.registry), EXPIRATION));
    let transport = world.network.transport();
    let (storage, _) = world.storage_for(None, Arc::default());
    let client = match Sharding::member(runner_config(None), storage, registry)
        .clock(clock)
        .provisional_machine_id(world.machine_id())
        .transport(transport)
        .start()
        .await
    {
        Ok(client) => client,
        Err(error) => panic!("the simulation's client does not start: {error}"),
    };
    let mut calls = Vec::with_capacity(config.requests);
    for index in 0..config.requests {
        let key = format!("k{index}");
        let at = rng.duration(Duration::ZERO, WORKLOAD);
        let (counter, history) = (counter_of(&client, index), world.history.clone());
        let call_key = key.clone();
        let call = tokio::spawn(async move {
            tokio::time::sleep(at).await;
            loop {
                match counter.send(Add { key: call_key.clone() }).await {
                    Ok(value) => {
                        history.record(format!("answered {call_key} = {value}"));
                        return;
                    }
                    Err(error) => {
                        history.record(format!("retry {call_key}: {error}"));
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                }
            }
        });
        calls.push((key, call));
    }
    // Volatile requests: each ends with its echo or a typed error within the bound, never a
    // hang.
    for index in 0..config.requests {
        let at = rng.duration(Duration::ZERO, WORKLOAD);
        let (counter, history, violations) =
            (counter_of(&client, index), world.history.clone(), Arc::clone(&world.violations));
        let n = u64::try_from(index).unwrap_or(u64::MAX);
        let call = tokio::spawn(async move {
            tokio::time::sleep(at).await;
            let what = match tokio::time::timeout(VOLATILE_BOUND, counter.send(Echo { n })).await {
                Ok(Ok(echo)) if echo == n => format!("echo {n}"),
                Ok(Ok(echo)) => format!("VIOLATION echo {n} answered {echo}"),
                Ok(Err(error)) => format!("echo {n} failed: {error}"),
                Err(_) => format!("VIOLATION echo {n} hung for {}ms", millis(VOLATILE_BOUND)),
            };
            if let Some(violation) = what.strip_prefix("VIOLATION ") {
                lock(&violations).push(violation.to_owned());
            }
            history.record(what);
        });
        calls.push((format!("e{index}"), call));
    }
    (client, calls)
}

/// The runners send transactional requests too (`exactly_once`): each from a live runner at
/// its time drawn from the seed, again from one until it is answered. A runner that holds the
/// entity's shard hands its own request to the entity directly.
fn start_local_senders(
    world: &World,
    count: usize,
    rng: &mut SimRng,
) -> Vec<(String, tokio::task::JoinHandle<()>)> {
    let mut calls = Vec::with_capacity(count);
    for index in 0..count {
        let key = format!("t{index}");
        let at = rng.duration(Duration::ZERO, WORKLOAD);
        let mut pick = SimRng::new(rng.next_u64());
        let (runners, history) = (Arc::clone(&world.runners), world.history.clone());
        let call_key = key.clone();
        let call = tokio::spawn(async move {
            tokio::time::sleep(at).await;
            loop {
                let sender = {
                    let runners = lock(&runners);
                    pick_live(&runners, &mut pick, 1)
                        .map(|index| (runners[index].name.clone(), runners[index].sharding.clone()))
                };
                let Some((name, sharding)) = sender else {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                };
                let add = AddTx { key: call_key.clone() };
                // A runner that crashes takes its callers with it: a call cut off that way is
                // made again from another runner, as the caller's own retry would be.
                let counter = counter_of(&sharding, index);
                match tokio::time::timeout(LOCAL_CALL_BOUND, counter.send(add)).await {
                    Ok(Ok(value)) => {
                        history.record(format!("answered {call_key} = {value} (from {name})"));
                        return;
                    }
                    Ok(Err(error)) => {
                        history.record(format!("retry {call_key} from {name}: {error}"));
                        tokio::time::sleep(Duration::from_millis(500)).await;
                    }
                    Err(_) => history.record(format!("retry {call_key}: {name} did not answer")),
                }
            }
        });
        calls.push((key, call));
    }
    calls
}

/// The faults of the graceful scenario (`SimConfig::graceful`), by their number below.
const GRACEFUL_FAULTS: [u64; 5] = [2, 3, 4, 5, 7];

/// Draws and applies the fault schedule until [`FAULTS_END`].
async fn inject_faults(world: &mut World, rng: &mut SimRng, graceful: bool) {
    loop {
        tokio::time::sleep(rng.duration(Duration::from_millis(500), Duration::from_secs(3))).await;
        if world.start.elapsed() >= FAULTS_END {
            return;
        }
        let drawn = if graceful {
            let index = usize::try_from(rng.below(GRACEFUL_FAULTS.len() as u64)).unwrap_or(0);
            GRACEFUL_FAULTS[index]
        } else {
            rng.below(8)
        };
        let fault = match drawn {
            0 => Fault::Freeze(rng.duration(Duration::from_millis(500), Duration::from_secs(4))),
            1 => Fault::Crash,
            2 => Fault::Restart,
            3 => Fault::Partition(rng.duration(Duration::from_millis(500), Duration::from_secs(5))),
            4 => Fault::JoinBurst(
                usize::try_from(2 + rng.below(2)).unwrap_or(2),
                rng.duration(Duration::from_secs(1), Duration::from_secs(4)),
            ),
            5 => Fault::RollingUpdate(
                rng.duration(Duration::from_millis(200), Duration::from_secs(1)),
            ),
            6 => Fault::StorageErrors(u32::try_from(1 + rng.below(5)).unwrap_or(1)),
            _ => Fault::SlowReplies(
                rng.duration(Duration::from_millis(50), Duration::from_millis(800)),
                rng.duration(Duration::from_millis(500), Duration::from_secs(3)),
            ),
        };
        apply(world, rng, fault).await;
    }
}

async fn apply(world: &mut World, rng: &mut SimRng, fault: Fault) {
    match fault {
        Fault::Freeze(duration) => {
            let Some(index) = world.pick_live(rng, 1) else { return };
            let (name, locks) = {
                let runners = lock(&world.runners);
                let until = millis(world.start.elapsed() + duration);
                runners[index].frozen_until.fetch_max(until, std::sync::atomic::Ordering::Relaxed);
                (runners[index].name.clone(), Arc::clone(&runners[index].locks))
            };
            world.history.record(format!("freeze {name} for {}ms", millis(duration)));
            world.runs.ungraceful(&name, "freeze");
            locks.blackhole(true);
            let (history, in_force) = (world.history.clone(), world.in_force());
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                locks.blackhole(false);
                history.record(format!("thaw {name}"));
                drop(in_force);
            });
        }
        Fault::Crash => {
            let Some(index) = world.pick_live(rng, 2) else { return };
            let name = {
                let mut runners = lock(&world.runners);
                runners[index].locks.kill();
                if world.crash_kills_storage {
                    runners[index].storage.kill();
                }
                runners[index].gone = true;
                world.network.detach(&runners[index].address);
                // Its connections close with it: the calls waiting on it fail, as they would
                // over TCP (a frozen runner's stay open).
                world.network.cut_calls_to(&runners[index].address);
                runners[index].name.clone()
            };
            world.history.record(format!("crash {name}"));
            world.runs.ungraceful(&name, "crash");
            world.start_runner(rng).await;
        }
        Fault::Restart => {
            let Some(index) = world.pick_live(rng, 1) else { return };
            let name = lock(&world.runners)[index].name.clone();
            world.history.record(format!("restart {name}"));
            stop_runner(world, index);
            world.start_runner(rng).await;
        }
        Fault::JoinBurst(count, stay) => join_burst(world, rng, count, stay).await,
        Fault::StorageErrors(times) => storage_errors(world, times),
        Fault::RollingUpdate(gap) => rolling_update(world, rng, gap).await,
        Fault::Partition(duration) => {
            let Some(index) = world.pick_live(rng, 1) else { return };
            let (name, address, sharding) = {
                let runners = lock(&world.runners);
                let runner = &runners[index];
                (runner.name.clone(), runner.address.clone(), runner.sharding.clone())
            };
            world.history.record(format!("partition {name} for {}ms", millis(duration)));
            world.network.detach(&address);
            let (network, history, runners) =
                (Arc::clone(&world.network), world.history.clone(), Arc::clone(&world.runners));
            let in_force = world.in_force();
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                let gone = lock(&runners).iter().any(|runner| runner.name == name && runner.gone);
                if !gone {
                    network.attach(address, sharding.runner_handler());
                    history.record(format!("heal {name}"));
                }
                drop(in_force);
            });
        }
        Fault::SlowReplies(delay, duration) => {
            world.history.record(format!(
                "slow replies {}ms for {}ms",
                millis(delay),
                millis(duration)
            ));
            let faults: Vec<Arc<Faults>> = lock(&world.storage_faults).clone();
            for process in &faults {
                process.delay_replies(delay);
            }
            let (history, in_force) = (world.history.clone(), world.in_force());
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                for process in &faults {
                    process.delay_replies(Duration::ZERO);
                }
                history.record("replies fast again".to_owned());
                drop(in_force);
            });
        }
    }
}

/// The next `times` reads, request saves and reply writes of every process fail.
fn storage_errors(world: &World, times: u32) {
    world.history.record(format!("storage errors x{times}"));
    let faults: Vec<Arc<Faults>> = lock(&world.storage_faults).clone();
    for process in &faults {
        process.fail_reads(times);
        process.fail_request_saves(times);
        process.fail_reply_saves(times);
    }
}

/// What the second fault schedule reaches: the transport, every process's storage and the
/// runners' lock storages.
struct MoreFaults {
    start: tokio::time::Instant,
    network: Arc<MemoryNetwork>,
    storage_faults: Arc<Mutex<Vec<Arc<Faults>>>>,
    runners: Arc<Mutex<Vec<SimRunner>>>,
    history: History,
    runs: Arc<runs::Runs>,
    /// Graceful faults only: no slow lock storage.
    graceful: bool,
}

impl MoreFaults {
    fn of(world: &World, graceful: bool) -> MoreFaults {
        MoreFaults {
            start: world.start,
            network: Arc::clone(&world.network),
            storage_faults: Arc::clone(&world.storage_faults),
            runners: Arc::clone(&world.runners),
            history: world.history.clone(),
            runs: Arc::clone(&world.runs),
            graceful,
        }
    }
}

/// Transport calls always take 0–2 ms outside the fault periods.
const BASE_NETWORK: NetworkFaults = NetworkFaults {
    delay_min: Duration::ZERO,
    delay_max: Duration::from_millis(2),
    loss_per_mille: 0,
    duplicate_per_mille: 0,
};

/// The second fault schedule, from a random stream of its own (so that the first one's draws
/// stay as they were): periods of a lossy network (delays, lost and duplicated calls),
/// latency spikes of the message storage, and slow lock storage on one runner.
async fn inject_more_faults(faults: MoreFaults, mut rng: SimRng) {
    faults.network.set_faults(BASE_NETWORK, rng.next_u64());
    loop {
        tokio::time::sleep(rng.duration(Duration::from_secs(1), Duration::from_secs(4))).await;
        if faults.start.elapsed() >= FAULTS_END {
            break;
        }
        let duration = rng.duration(Duration::from_millis(500), Duration::from_secs(4));
        match rng.below(if faults.graceful { 2 } else { 3 }) {
            0 => {
                let network = NetworkFaults {
                    delay_min: Duration::ZERO,
                    delay_max: rng.duration(Duration::from_millis(5), Duration::from_millis(200)),
                    loss_per_mille: 10 + rng.below(190),
                    duplicate_per_mille: 10 + rng.below(190),
                };
                faults.history.record(format!(
                    "lossy network for {}ms: delays up to {}ms, {}‰ lost, {}‰ duplicated",
                    millis(duration),
                    millis(network.delay_max),
                    network.loss_per_mille,
                    network.duplicate_per_mille
                ));
                faults.network.set_faults(network, rng.next_u64());
                tokio::time::sleep(duration).await;
                faults.network.set_faults(BASE_NETWORK, rng.next_u64());
                faults.history.record(format!(
                    "network calm again ({} lost, {} duplicated so far)",
                    faults.network.lost(),
                    faults.network.duplicated()
                ));
            }
            1 => {
                let delay = rng.duration(Duration::from_millis(20), Duration::from_millis(500));
                faults.history.record(format!(
                    "storage latency {}ms for {}ms",
                    millis(delay),
                    millis(duration)
                ));
                let processes: Vec<Arc<Faults>> = lock(&faults.storage_faults).clone();
                for process in &processes {
                    process.delay_storage(delay);
                }
                tokio::time::sleep(duration).await;
                for process in &processes {
                    process.delay_storage(Duration::ZERO);
                }
                faults.history.record("storage fast again".to_owned());
            }
            _ => slow_locks(&faults, &mut rng, duration).await,
        }
    }
    faults.network.clear_faults();
}

/// One runner's lock storage answers slowly for a while (it counts as recovering, like a
/// freeze, for the liveness check).
async fn slow_locks(faults: &MoreFaults, rng: &mut SimRng, duration: Duration) {
    let delay = rng.duration(Duration::from_millis(100), Duration::from_millis(1_500));
    let picked = {
        let runners = lock(&faults.runners);
        pick_live(&runners, rng, 1).map(|index| {
            let runner = &runners[index];
            let until = millis(faults.start.elapsed() + duration);
            runner.frozen_until.fetch_max(until, std::sync::atomic::Ordering::Relaxed);
            (runner.name.clone(), Arc::clone(&runner.locks))
        })
    };
    let Some((name, locks)) = picked else { return };
    faults.runs.ungraceful(&name, "slow lock storage");
    faults.history.record(format!(
        "slow lock storage on {name}: {}ms for {}ms",
        millis(delay),
        millis(duration)
    ));
    locks.delay_locks(delay);
    tokio::time::sleep(duration).await;
    locks.delay_locks(Duration::ZERO);
    faults.history.record(format!("lock storage fast again on {name}"));
}

/// The third fault schedule (`exactly_once`), from a random stream of its own: periods in which
/// every process's storage transactions are slow to begin (a pool waiting for a connection).
async fn slow_transactions(faults: MoreFaults, mut rng: SimRng) {
    loop {
        tokio::time::sleep(rng.duration(Duration::from_secs(1), Duration::from_secs(5))).await;
        if faults.start.elapsed() >= FAULTS_END {
            return;
        }
        let delay = rng.duration(Duration::from_millis(50), Duration::from_millis(400));
        let duration = rng.duration(Duration::from_millis(500), Duration::from_secs(3));
        faults.history.record(format!(
            "slow transactions {}ms for {}ms",
            millis(delay),
            millis(duration)
        ));
        let processes: Vec<Arc<Faults>> = lock(&faults.storage_faults).clone();
        for process in &processes {
            process.delay_begin_transaction(delay);
        }
        tokio::time::sleep(duration).await;
        for process in &processes {
            process.delay_begin_transaction(Duration::ZERO);
        }
        faults.history.record("transactions fast again".to_owned());
    }
}

/// Several runners join at once; as many of the oldest leave a while later.
async fn join_burst(world: &mut World, rng: &mut SimRng, count: usize, stay: Duration) {
    world.history.record(format!("join burst of {count}, staying {}ms", millis(stay)));
    for _ in 0..count {
        world.start_runner(rng).await;
    }
    tokio::time::sleep(stay).await;
    for _ in 0..count {
        let Some(index) = world.pick_oldest_live(2) else { break };
        stop_runner(world, index);
    }
}

/// Every live runner is replaced, one after the other.
async fn rolling_update(world: &mut World, rng: &mut SimRng, gap: Duration) {
    let live: Vec<String> = {
        let runners = lock(&world.runners);
        runners.iter().filter(|runner| !runner.gone).map(|runner| runner.name.clone()).collect()
    };
    world.history.record(format!(
        "rolling update of {} runners, {}ms apart",
        live.len(),
        millis(gap)
    ));
    for name in live {
        world.start_runner(rng).await;
        let index = {
            let runners = lock(&world.runners);
            runners.iter().position(|runner| runner.name == name && runner.is_live())
        };
        if let Some(index) = index {
            stop_runner(world, index);
        }
        tokio::time::sleep(gap).await;
    }
}

/// Shuts a runner down gracefully (in the background; it leaves the checks once stopped,
/// and stops counting as live for the liveness check at once).
fn stop_runner(world: &World, index: usize) {
    let (name, sharding) = {
        let runners = lock(&world.runners);
        runners[index].frozen_until.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
        (runners[index].name.clone(), runners[index].sharding.clone())
    };
    world.history.record(format!("leave {name}"));
    let (runners, history) = (Arc::clone(&world.runners), world.history.clone());
    tokio::spawn(async move {
        sharding.shutdown().await;
        history.record(format!("stopped {name}"));
        let mut runners = lock(&runners);
        if let Some(runner) = runners.iter_mut().find(|runner| runner.name == name) {
            runner.gone = true;
        }
    });
}

/// Every 25 ms: no shard is acquired by two live runners.
async fn check_ownership(
    runners: Arc<Mutex<Vec<SimRunner>>>,
    history: History,
    violations: Arc<Mutex<Vec<String>>>,
) {
    // Each overlap is reported once, however many samples see it.
    let mut reported = std::collections::BTreeSet::new();
    // When each runner was last seen holding no shard (nothing to read then).
    let mut idle_at: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        tokio::time::sleep(Duration::from_millis(25)).await;
        let mut owners: BTreeMap<String, String> = BTreeMap::new();
        let runners = lock(&runners);
        let now = millis(history.start.elapsed());
        for runner in runners.iter().filter(|runner| !runner.gone) {
            let acquired = runner.sharding.acquired_shards();
            // Liveness: a runner that holds shards with healthy lock storage keeps reading
            // its mailboxes (the reference's "healthy but not consuming" reports).
            let frozen_until = runner.frozen_until.load(std::sync::atomic::Ordering::Relaxed);
            let last_read = runner.last_read.load(std::sync::atomic::Ordering::Relaxed);
            let healthy = now > frozen_until.saturating_add(millis(LOCK_RECOVERY));
            if acquired.is_empty() {
                idle_at.insert(runner.name.clone(), now);
            }
            let since = last_read.max(idle_at.get(&runner.name).copied().unwrap_or(0));
            if !acquired.is_empty() && healthy && now.saturating_sub(since) > millis(READ_STALL) {
                let what = format!(
                    "{} holds {} shards but its storage read loop has not read since {since} ms",
                    runner.name,
                    acquired.len()
                );
                if reported.insert(format!("{}@{since}", runner.name)) {
                    history.record(format!("VIOLATION {what}"));
                    lock(&violations).push(what);
                }
            }
            for shard in acquired {
                if let Some(other) = owners.insert(shard.to_string(), runner.name.clone()) {
                    let what =
                        format!("shard {shard} acquired by {other} and {} at once", runner.name);
                    if !reported.insert(what.clone()) {
                        continue;
                    }
                    history.record(format!("VIOLATION {what}"));
                    lock(&violations).push(what);
                }
            }
        }
    }
}

/// The latency probe (`transport_slots`), once the faults are over and the cluster settled.
///
/// - The client pushes [`PROBE_HOLDS`] long persisted calls (more than its slots to one
///   runner) to entities of one runner, and waits until their handlers run.
/// - Then a volatile call and a persisted call to other entities of that runner must each be
///   answered within [`PROBE_BOUND`]: the held calls must not take the transport's slots that
///   other calls need.
/// - Every long call is answered, once.
async fn probe_pushed_latency(world: &World, client: &Sharding) {
    // The faults are over: storage errors injected and not used up yet are dropped.
    let processes: Vec<Arc<Faults>> = lock(&world.storage_faults).clone();
    for process in &processes {
        process.fail_reads(0);
        process.fail_request_saves(0);
        process.fail_reply_saves(0);
    }
    let Some((owner, shards)) = settled_owner(world).await else {
        world.violation(format!(
            "the cluster did not settle within {}ms of the last answer",
            millis(SETTLE_BOUND)
        ));
        return;
    };
    let on_owner: Vec<String> = (0..)
        .map(|n| format!("probe-{n}"))
        .filter(|id| shards.contains(&client.client::<SimCounter>(id.as_str()).address().shard_id))
        .take(PROBE_HOLDS + 2)
        .collect();
    world.history.record(format!("probe: {PROBE_HOLDS} long calls pushed to {owner}"));
    let hold_for = u64::try_from(PROBE_HOLD.as_millis()).unwrap_or(u64::MAX);
    let holds: Vec<_> = on_owner[..PROBE_HOLDS]
        .iter()
        .enumerate()
        .map(|(n, id)| {
            let counter = client.client::<SimCounter>(id.as_str());
            let hold = Hold { key: format!("hold{n}"), millis: hold_for };
            (counter.clone(), tokio::spawn(async move { counter.send(hold).await }))
        })
        .collect();
    let started = async {
        while !(0..PROBE_HOLDS).all(|n| world.runs.has_run(&format!("hold{n}"))) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(PROBE_BOUND, started).await.is_err() {
        world.violation(format!("probe: the long calls to {owner} did not all start"));
    }
    let echo = client.client::<SimCounter>(on_owner[PROBE_HOLDS].as_str());
    probe_call(world, &owner, "volatile call", echo.send(Echo { n: 7 })).await;
    let add = client.client::<SimCounter>(on_owner[PROBE_HOLDS + 1].as_str());
    probe_call(world, &owner, "persisted call", add.send(Add { key: "probe".to_owned() })).await;
    for (n, (counter, hold)) in holds.into_iter().enumerate() {
        match tokio::time::timeout(PROBE_HOLD + HEAL_BOUND, hold).await {
            Ok(Ok(Ok(_))) => {}
            outcome => world.violation(format!("probe: long call {n} ended with {outcome:?}")),
        }
        check_final_reply(world, counter.address(), Hold::TAG, &format!("hold{n}")).await;
    }
}

/// One call of the latency probe: answered within [`PROBE_BOUND`], or a violation.
async fn probe_call<T, E: std::fmt::Debug>(
    world: &World,
    owner: &str,
    what: &str,
    call: impl Future<Output = Result<T, cluster_sharding::CallError<E>>>,
) {
    let sent = tokio::time::Instant::now();
    match tokio::time::timeout(PROBE_BOUND, call).await {
        Ok(Ok(_)) => {
            let took = millis(sent.elapsed());
            world.history.record(format!("probe: {what} to {owner} took {took}ms"));
        }
        Ok(Err(error)) => world.violation(format!("probe: {what} to {owner} failed: {error:?}")),
        Err(_) => world.violation(format!(
            "probe: {what} to {owner} unanswered after {}ms while long persisted calls were \
             pushed to it",
            millis(PROBE_BOUND)
        )),
    }
}

/// Waits, at most [`SETTLE_BOUND`], until no fault is in force any more and the live runners
/// hold every shard between them, the same for a second: the name of the first live runner
/// that holds shards, and its shards.
async fn settled_owner(
    world: &World,
) -> Option<(String, std::collections::BTreeSet<cluster_core::ShardId>)> {
    let deadline = tokio::time::Instant::now() + SETTLE_BOUND;
    let mut last = None;
    while tokio::time::Instant::now() < deadline {
        if world.in_force.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            last = None;
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let held: Vec<(String, Vec<cluster_core::ShardId>)> = {
            let runners = lock(&world.runners);
            runners
                .iter()
                .filter(|runner| runner.is_live())
                .map(|runner| (runner.name.clone(), runner.sharding.acquired_shards()))
                .collect()
        };
        let total: usize = held.iter().map(|(_, shards)| shards.len()).sum();
        let distinct: std::collections::BTreeSet<_> =
            held.iter().flat_map(|(_, shards)| shards.iter().cloned()).collect();
        let whole = total == distinct.len() && distinct.len() == 12;
        if whole && last.as_ref() == Some(&held) {
            let (owner, shards) = held.into_iter().find(|(_, shards)| !shards.is_empty())?;
            return Some((owner, shards.into_iter().collect()));
        }
        last = whole.then_some(held);
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    None
}

/// Exactly one final reply is stored for the request `tag` with key `key` of `address`.
async fn check_final_reply(world: &World, address: &EntityAddress, tag: &str, key: &str) {
    let primary_key = cluster_core::envelope::primary_key(address, tag, key);
    let request = match world.messages.request_id_for_primary_key(&primary_key).await {
        Ok(Some(request)) => request,
        Ok(None) => return world.violation(format!("{key} is not stored")),
        Err(error) => return world.violation(format!("{key} cannot be read: {error}")),
    };
    match world.messages.replies_for_unfiltered(&[request]).await {
        Ok(replies) => {
            let finals = replies.iter().filter(|reply| reply.is_final()).count();
            if finals != 1 {
                world.violation(format!("{key} has {finals} final replies"));
            }
        }
        Err(error) => world.violation(format!("{key}'s replies cannot be read: {error}")),
    }
}

/// Exactly one final reply is stored per request (`<prefix><index>`, with tag `tag`).
async fn check_final_replies(
    world: &World,
    client: &Sharding,
    tag: &str,
    prefix: &str,
    requests: usize,
) {
    for index in 0..requests {
        let address = counter_of(client, index).address().clone();
        check_final_reply(world, &address, tag, &format!("{prefix}{index}")).await;
    }
}

/// Every handler run again was after a run that a crash, a freeze or a failed reply write
/// explains; without any of those, each entity ran its requests in storage order.
fn check_runs(world: &World, database: &MemoryMessageStorage) {
    for rerun in world.runs.unexplained_reruns() {
        world.violation(rerun);
    }
    let ungraceful = world.runs.ungraceful_runners();
    if ungraceful.is_empty() && world.runs.failed_entities().is_empty() {
        for entity in world.runs.out_of_order(|address| database.request_order(address)) {
            world.violation(format!("out of storage order: {entity}"));
        }
    }
    let (runs, repeated) = world.runs.counts();
    world.history.record(format!(
        "handlers: {runs} runs, {repeated} repeated, ungraceful runners {ungraceful:?}"
    ));
}

/// Each counter's stored value is the number of its requests answered with success, and those
/// answers are 1, 2, … that number, once each: every request changed the durable state once,
/// with its reply, whatever crashed, froze or moved.
async fn check_durable_counts(world: &World, client: &Sharding, database: &MemoryMessageStorage) {
    for index in 0..COUNTERS {
        let counter = counter_of(client, index);
        let address = counter.address().clone();
        let requests = database.request_order(&address);
        let mut values = Vec::new();
        let replies = match world.messages.replies_for_unfiltered(&requests).await {
            Ok(replies) => replies,
            Err(error) => {
                return world.violation(format!("{address}: replies unreadable: {error}"));
            }
        };
        for reply in replies {
            if let Reply::WithExit(WithExit { exit: Exit::Success(value), .. }) = reply {
                match value.decode::<u64>() {
                    Ok(value) => values.push(value),
                    Err(error) => world.violation(format!("{address}: a reply {error}")),
                }
            }
        }
        values.sort_unstable();
        let expected: Vec<u64> = (1..=values.len() as u64).collect();
        if values != expected {
            world.violation(format!("{address}: answered values {values:?}, not 1 to n once each"));
            for line in database.describe(address.entity_id.as_str()) {
                world.history.record(format!("  stored: {line}"));
            }
        }
        let stored = match counter.stored_state::<u64>().await {
            Ok(stored) => stored.map_or(0, |(value, _)| value),
            Err(error) => return world.violation(format!("{address}: state unreadable: {error}")),
        };
        if stored != values.len() as u64 {
            world.violation(format!(
                "{address}: stored value {stored}, {} successful answers",
                values.len()
            ));
        }
    }
}

/// Stops the client and every runner that is still up (crashed ones just stay).
async fn stop(world: &World, client: &Sharding) {
    client.shutdown().await;
    let live: Vec<Sharding> = {
        let runners = lock(&world.runners);
        runners.iter().filter(|runner| !runner.gone).map(|runner| runner.sharding.clone()).collect()
    };
    for sharding in live {
        let _ = tokio::time::timeout(Duration::from_secs(30), sharding.shutdown()).await;
    }
}
