//! [`ShardingBuilder`]: the one way to start a [`Sharding`] runtime, and [`StartError`], the one
//! way it fails to start.
//!
//! A process says what it is by the constructor it starts from; each takes the parts its role
//! needs, and its builder offers only the settings that role has:
//!
//! | constructor | the process | settings of its own |
//! | --- | --- | --- |
//! | [`Sharding::volatile`] | volatile requests to entities of this process only | |
//! | [`Sharding::standalone`] | one runner owning every shard, no locks (a storage of its own) | |
//! | [`Sharding::single_runner`] | one runner holding every shard's lock | |
//! | [`Sharding::member`] | a member of a cluster: membership, locks, handoff | `transport`, `runner_health` |
//! | [`Sharding::client_only`] | a client: it hosts no entity, and reads replies from storage | |
//! | [`Sharding::cluster_client`] | a client that reads the registry and computes the assignment | `transport` |
//!
//! Every builder takes [`clock`](ShardingBuilder::clock) and
//! [`provisional_machine_id`](ShardingBuilder::provisional_machine_id).
//! The two clients drop the configuration's runner address; a member whose `runner_address` is
//! `None` is a cluster client too.
//!
//! A part that a role does not take is not offered, so a wrong combination does not compile:
//!
//! ```compile_fail,E0599
//! # use std::sync::Arc;
//! # use cluster_core::storage::{MessageStorage, RunnerStorage};
//! # use cluster_core::transport::Transport;
//! # use cluster_sharding::Sharding;
//! fn build(
//!     messages: Arc<dyn MessageStorage>,
//!     runners: Arc<dyn RunnerStorage>,
//!     transport: Arc<dyn Transport>,
//! ) {
//!     // A single runner has no other runner to reach.
//!     let _ = Sharding::single_runner(Default::default(), messages, runners).transport(transport);
//! }
//! ```
//!
//! ```compile_fail,E0599
//! # use std::sync::Arc;
//! # use cluster_core::storage::MessageStorage;
//! # use cluster_sharding::{RunnerHealth, Sharding};
//! fn build(messages: Arc<dyn MessageStorage>, health: Arc<dyn RunnerHealth>) {
//!     // A client judges no runner's health.
//!     let _ = Sharding::client_only(Default::default(), messages).runner_health(health);
//! }
//! ```

use std::sync::Arc;

use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::transport::Transport;
use cluster_core::{Clock, MachineId, Runner, ShardingConfig, SystemClock};

use crate::error::StartError;
use crate::metered::Deadlines;
use crate::placement::health::RunnerHealth;
use crate::placement::member::{Member as MemberRuntime, RUNNER_HEALTH};
use crate::placement::single_runner::{HeldLocks, LockedRuntime, all_shards};
use crate::services::retention::{self, MESSAGE_RETENTION};
use crate::services::singleton::SingletonOptions;
use crate::sharding::{Basics, Sharding};

use roles::{ClientOnly, ClusterClient, Member, SingleRunner, Standalone, Volatile};

/// Puts a [`Sharding`] runtime together: a constructor per role ([`Sharding::volatile`],
/// [`Sharding::standalone`], [`Sharding::single_runner`], [`Sharding::member`],
/// [`Sharding::client_only`]), its settings, then `start`.
///
/// ```
/// use cluster_core::ShardingConfig;
/// use cluster_sharding::Sharding;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), cluster_sharding::StartError> {
/// // No storage: volatile requests to the entities of this process.
/// let sharding = Sharding::volatile(ShardingConfig::default()).start().await?;
/// sharding.shutdown().await;
/// # Ok(())
/// # }
/// ```
///
/// `Role` is one of the [`roles`] types; the module table of `cluster_sharding::builder` says
/// what each makes.
#[must_use = "a builder does nothing until it is started"]
pub struct ShardingBuilder<Role> {
    config: ShardingConfig,
    clock: Arc<dyn Clock>,
    machine_id: Option<MachineId>,
    role: Role,
}

/// The roles a process takes, one per constructor: each holds the parts that role needs.
pub mod roles {
    use std::sync::Arc;

    use cluster_core::storage::{MessageStorage, RunnerStorage};
    use cluster_core::transport::Transport;

    use crate::placement::health::RunnerHealth;

    /// Volatile requests only ([`Sharding::volatile`](crate::Sharding::volatile)).
    pub struct Volatile(pub(super) ());

    /// One runner on a storage of its own
    /// ([`Sharding::standalone`](crate::Sharding::standalone)).
    pub struct Standalone {
        pub(super) messages: Arc<dyn MessageStorage>,
    }

    /// The only runner on its storages
    /// ([`Sharding::single_runner`](crate::Sharding::single_runner)).
    pub struct SingleRunner {
        pub(super) messages: Arc<dyn MessageStorage>,
        pub(super) runners: Arc<dyn RunnerStorage>,
    }

    /// A member of a cluster ([`Sharding::member`](crate::Sharding::member)).
    pub struct Member {
        pub(super) messages: Arc<dyn MessageStorage>,
        pub(super) runners: Arc<dyn RunnerStorage>,
        pub(super) transport: Option<Arc<dyn Transport>>,
        pub(super) runner_health: Option<Arc<dyn RunnerHealth>>,
    }

    /// A client that hosts no entity ([`Sharding::client_only`](crate::Sharding::client_only)).
    pub struct ClientOnly {
        pub(super) messages: Arc<dyn MessageStorage>,
    }

    /// A client of a cluster
    /// ([`Sharding::cluster_client`](crate::Sharding::cluster_client)).
    pub struct ClusterClient {
        pub(super) messages: Arc<dyn MessageStorage>,
        pub(super) runners: Arc<dyn RunnerStorage>,
        pub(super) transport: Option<Arc<dyn Transport>>,
    }

    impl std::fmt::Debug for Volatile {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Volatile")
        }
    }

    impl std::fmt::Debug for Standalone {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("Standalone")
        }
    }

    impl std::fmt::Debug for SingleRunner {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("SingleRunner")
        }
    }

    impl std::fmt::Debug for Member {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Member")
                .field("transport", &self.transport.is_some())
                .field("runner_health", &self.runner_health.is_some())
                .finish_non_exhaustive()
        }
    }

    impl std::fmt::Debug for ClientOnly {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("ClientOnly")
        }
    }

    impl std::fmt::Debug for ClusterClient {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ClusterClient")
                .field("transport", &self.transport.is_some())
                .finish_non_exhaustive()
        }
    }
}

impl<Role: std::fmt::Debug> std::fmt::Debug for ShardingBuilder<Role> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardingBuilder")
            .field("role", &self.role)
            .field("runner", &self.config.runner_address)
            .field("machine_id", &self.machine_id)
            .finish_non_exhaustive()
    }
}

impl Sharding {
    /// A process with no storage: volatile requests to the entities of this process only.
    pub fn volatile(config: ShardingConfig) -> ShardingBuilder<Volatile> {
        ShardingBuilder::new(config, Volatile(()))
    }

    /// One runner that owns every shard of its groups, on a message storage of its own.
    ///
    /// - It takes no lock and joins no registry: no other runner may use `messages`.
    /// - At start it releases the claims a previous run left behind.
    pub fn standalone(
        config: ShardingConfig,
        messages: Arc<dyn MessageStorage>,
    ) -> ShardingBuilder<Standalone> {
        ShardingBuilder::new(config, Standalone { messages })
    }

    /// The only runner on its storages (the reference's `SingleRunner`).
    ///
    /// - At start it registers in `runners`, takes every shard's lock there, and fails with
    ///   [`StartError::ShardsHeld`] if another live runner holds any.
    /// - It refreshes its locks, and serves a shard only while its lease is confirmed.
    /// - At shutdown, once its entities have stopped, it releases the locks and unregisters.
    /// - Persisted requests, their replies and their chunks go through `messages`.
    pub fn single_runner(
        config: ShardingConfig,
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
    ) -> ShardingBuilder<SingleRunner> {
        ShardingBuilder::new(config, SingleRunner { messages, runners })
    }

    /// A member of the cluster of every runner on `runners`.
    ///
    /// - Shards are assigned by the hash ring over the healthy runners, locked in `runners`,
    ///   and handed over when runners join, leave or crash.
    /// - Persisted requests, their replies and their chunks go through `messages`.
    /// - Volatile requests reach other runners through a
    ///   [`transport`](ShardingBuilder::transport), if it has one.
    /// - With `runner_address` `None` it is a client of the cluster: it hosts no entity.
    pub fn member(
        config: ShardingConfig,
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
    ) -> ShardingBuilder<Member> {
        let role = Member { messages, runners, transport: None, runner_health: None };
        ShardingBuilder::new(config, role)
    }

    /// A client: it hosts no entity and reads no mailbox (the reference's client-only mode).
    ///
    /// - The configuration's runner address and listen address are dropped.
    /// - Registering an entity type is a no-op.
    /// - Persisted requests are saved in `messages` for the runners that own their shards;
    ///   their replies are read back every `entity_reply_poll_interval`.
    /// - Volatile requests fail with `EntityNotAssignedToRunner`: to reach the runners, use a
    ///   [`cluster_client`](Sharding::cluster_client) with a transport.
    pub fn client_only(
        config: ShardingConfig,
        messages: Arc<dyn MessageStorage>,
    ) -> ShardingBuilder<ClientOnly> {
        ShardingBuilder::new(config, ClientOnly { messages })
    }

    /// A client of the cluster of every runner on `runners`: it hosts no entity and holds no
    /// lock, but reads the registry and computes the shard assignment as the runners do.
    ///
    /// - The configuration's runner address and listen address are dropped.
    /// - Persisted requests are saved in `messages`; with a
    ///   [`transport`](ShardingBuilder::transport), the owner is told at once.
    /// - With a transport, volatile requests go straight to their owners; without one they
    ///   fail with `EntityNotAssignedToRunner`.
    pub fn cluster_client(
        config: ShardingConfig,
        messages: Arc<dyn MessageStorage>,
        runners: Arc<dyn RunnerStorage>,
    ) -> ShardingBuilder<ClusterClient> {
        ShardingBuilder::new(config, ClusterClient { messages, runners, transport: None })
    }
}

impl<Role> ShardingBuilder<Role> {
    fn new(config: ShardingConfig, role: Role) -> ShardingBuilder<Role> {
        ShardingBuilder { config, clock: Arc::new(SystemClock), machine_id: None, role }
    }

    /// Time is read from `clock` instead of the system clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> ShardingBuilder<Role> {
        self.clock = clock;
        self
    }

    /// The machine id that this runtime's snowflake ids carry until the runner registry gives
    /// it one (a client-only process keeps it).
    ///
    /// By default it is drawn at random once per process, plus one per runtime.
    /// A deterministic simulation sets it from its seed, so that a seed replays with the same
    /// ids.
    /// Two runtimes with one machine id make colliding ids within a millisecond.
    pub fn provisional_machine_id(mut self, machine_id: MachineId) -> ShardingBuilder<Role> {
        self.machine_id = Some(machine_id);
        self
    }

    /// The settings every role shares.
    fn basics(self) -> (Basics, Role) {
        let ShardingBuilder { config, clock, machine_id, role } = self;
        (Basics { config, clock, machine_id }, role)
    }

    /// The settings of a client: without the runner address and the listen address.
    fn client_basics(self) -> (Basics, Role) {
        let (mut basics, role) = self.basics();
        basics.config.runner_address = None;
        basics.config.runner_listen_address = None;
        (basics, role)
    }
}

impl ShardingBuilder<Volatile> {
    /// Starts the runtime.
    ///
    /// # Errors
    ///
    /// [`StartError::Config`]: the configuration is invalid.
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, Volatile(())) = self.basics();
        Ok(Sharding::start_volatile(basics)?)
    }
}

impl ShardingBuilder<Standalone> {
    /// Starts the runtime and its storage read loop.
    ///
    /// # Errors
    ///
    /// - [`StartError::Config`]: the configuration is invalid.
    /// - [`StartError::Register`]: the message retention singleton could not be registered.
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, Standalone { messages }) = self.basics();
        let messages =
            crate::metered::MeteredMessages::wrap(messages, Deadlines::of(&basics.config));
        let sharding = Sharding::start_own_storage(basics, Arc::clone(&messages)).await?;
        start_retention(&sharding, messages)?;
        Ok(sharding)
    }
}

impl ShardingBuilder<SingleRunner> {
    /// Registers, takes every shard's lock, and starts the runtime and its loops.
    ///
    /// # Errors
    ///
    /// - [`StartError::Config`]: the configuration is invalid.
    /// - [`StartError::NoRunnerAddress`]: `runner_address` is `None`.
    /// - [`StartError::Storage`], [`StartError::ShardsHeld`]: the shards could not be taken.
    /// - [`StartError::Register`]: the message retention singleton could not be registered.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a single runner dropped half-way may hold locks (they expire).
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, SingleRunner { messages, runners }) = self.basics();
        let messages =
            crate::metered::MeteredMessages::wrap(messages, Deadlines::of(&basics.config));
        let runners = crate::metered::MeteredRunners::wrap(runners, Deadlines::of(&basics.config));
        start_single_runner(basics, messages, runners).await
    }
}

impl ShardingBuilder<Member> {
    /// Volatile requests reach entities of other runners through `transport`.
    ///
    /// - The transport delivers the other runners' requests to this one through
    ///   [`Plumbing::runner_handler`](crate::Plumbing::runner_handler).
    /// - With a transport, the runners check each other's health by pinging (see
    ///   `RUNNER_HEALTH_CHECK` in docs/configuration.md).
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> ShardingBuilder<Member> {
        self.role.transport = Some(transport);
        self
    }

    /// The runner-health singleton judges the runners with `health` instead of pinging them
    /// (the reference's `RunnerHealth` service, `effect/src/cluster/RunnerHealth.ts`).
    ///
    /// Once per `runner_health_check_interval` it asks about every runner the registry lists,
    /// and marks unhealthy those `health` says are dead (never the last healthy one); their
    /// shards go to the others.
    /// `runner_health_check` is not used.
    pub fn runner_health(mut self, health: Arc<dyn RunnerHealth>) -> ShardingBuilder<Member> {
        self.role.runner_health = Some(health);
        self
    }

    /// Joins the cluster and starts the runtime and its loops.
    ///
    /// # Errors
    ///
    /// - [`StartError::Config`]: the configuration is invalid.
    /// - [`StartError::Register`]: the runner-health or the message retention singleton could
    ///   not be registered.
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, role) = self.basics();
        let Member { messages, runners, transport, runner_health } = role;
        let messages =
            crate::metered::MeteredMessages::wrap(messages, Deadlines::of(&basics.config));
        let runners = crate::metered::MeteredRunners::wrap(runners, Deadlines::of(&basics.config));
        start_cluster(basics, messages, runners, transport, runner_health)
    }
}

impl ShardingBuilder<ClientOnly> {
    /// Starts the client and its reply poller.
    ///
    /// # Errors
    ///
    /// [`StartError::Config`]: the configuration is invalid.
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, ClientOnly { messages }) = self.client_basics();
        let messages =
            crate::metered::MeteredMessages::wrap(messages, Deadlines::of(&basics.config));
        Ok(Sharding::start_client_only(basics, messages)?)
    }
}

impl ShardingBuilder<ClusterClient> {
    /// Volatile requests reach their owners through `transport`, and an owner is told at once
    /// of a persisted request stored for it.
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> ShardingBuilder<ClusterClient> {
        self.role.transport = Some(transport);
        self
    }

    /// Starts the client: it follows the registry and the assignment.
    ///
    /// # Errors
    ///
    /// [`StartError::Config`]: the configuration is invalid.
    pub async fn start(self) -> Result<Sharding, StartError> {
        let (basics, ClusterClient { messages, runners, transport }) = self.client_basics();
        let messages =
            crate::metered::MeteredMessages::wrap(messages, Deadlines::of(&basics.config));
        let runners = crate::metered::MeteredRunners::wrap(runners, Deadlines::of(&basics.config));
        start_cluster(basics, messages, runners, transport, None)
    }
}

/// A single runner on `messages`, holding every shard's lock in `runners` (see
/// `single_runner`), with its storage read loop started.
async fn start_single_runner(
    basics: Basics,
    messages: Arc<dyn MessageStorage>,
    runners: Arc<dyn RunnerStorage>,
) -> Result<Sharding, StartError> {
    let config = &basics.config;
    config.validate()?;
    let address = config.runner_address.clone().ok_or(StartError::NoRunnerAddress)?;
    let groups = config.shard_groups().assigned;
    let runner =
        Runner::new(address.clone(), groups.iter().cloned().collect(), config.runner_shard_weight);
    let machine_id = runners.register(&runner, true).await?;
    let shards = all_shards(&groups, config.shards_per_group);
    let acquired_at = tokio::time::Instant::now();
    let acquired = runners.acquire(&address, &shards).await?;
    if acquired.len() < shards.len() {
        // Give back what was taken: the other runner keeps the rest.
        let _ = runners.release_all(&address).await;
        return Err(StartError::ShardsHeld {
            held: shards.len() - acquired.len(),
            total: shards.len(),
        });
    }
    let interval = config.shard_lock_interval();
    let locks = Arc::new(HeldLocks::new(runners, address, shards, config, acquired_at));
    let sharding = Sharding::start_own_storage(basics, Arc::clone(&messages)).await?;
    sharding.set_machine_id(machine_id);
    sharding.hold_locks(Arc::clone(&locks));
    start_retention(&sharding, Arc::clone(&messages))?;
    let runtime = LockedRuntime {
        managers: Arc::clone(sharding.managers()),
        messages,
        read_latch: sharding.read_latch(),
    };
    let shutdown = sharding.shutdown_token().clone();
    sharding.spawn_owned(locks.refresh(runtime, interval, shutdown));
    Ok(sharding)
}

/// A member of the cluster whose runners share `messages` and `runners`: a runner, or a client
/// with `runner_address` `None`.
///
/// - Shards are assigned by the hash ring over the registry's healthy runners, locked in
///   `runners`, and handed over when runners join, leave or crash (docs/sharding.md,
///   "Several runners").
/// - Persisted requests and their replies go through `messages`.
/// - Volatile requests reach other runners through `transport`, if there is one.
fn start_cluster(
    basics: Basics,
    messages: Arc<dyn MessageStorage>,
    runners: Arc<dyn RunnerStorage>,
    transport: Option<Arc<dyn Transport>>,
    runner_health: Option<Arc<dyn RunnerHealth>>,
) -> Result<Sharding, StartError> {
    let config = &basics.config;
    config.validate()?;
    let member = Arc::new(MemberRuntime::new(
        config.clone(),
        Arc::clone(&basics.clock),
        runners,
        Arc::clone(&messages),
        transport.clone(),
        runner_health,
    ));
    let sharding =
        Sharding::with_cluster(basics, Arc::clone(&messages), Arc::clone(&member), transport)?;
    member.start(&sharding);
    start_retention(&sharding, messages)?;
    if member.checks_health() {
        let checker = Arc::clone(&member);
        sharding
            .register_singleton(RUNNER_HEALTH, SingletonOptions::default(), move |context| {
                Arc::clone(&checker).check_health(context.cancellation().clone())
            })
            .map_err(StartError::Register)?;
    }
    Ok(sharding)
}

/// Registers the message retention singleton on a runner whose configuration sets
/// `message_retention` ([`retention`](crate::services::retention)); warns on a runner whose
/// tables on PostgreSQL or MySQL would grow without bound. A client does neither.
fn start_retention(
    sharding: &Sharding,
    messages: Arc<dyn MessageStorage>,
) -> Result<(), StartError> {
    if !sharding.is_runner() {
        return Ok(());
    }
    let Some(retention) = sharding.config().message_retention else {
        let backend = messages.backend_name();
        if matches!(backend, "postgres" | "mysql") {
            tracing::warn!(
                backend,
                "message_retention is not set: processed requests and their replies are kept \
                 forever and the tables grow without bound; set MESSAGE_RETENTION (7 days, say)"
            );
        }
        return Ok(());
    };
    let clock = Arc::clone(sharding.clock());
    sharding
        .register_singleton(MESSAGE_RETENTION, SingletonOptions::default(), move |context| {
            let (messages, clock) = (Arc::clone(&messages), Arc::clone(&clock));
            retention::run(messages, clock, retention, context.cancellation().clone())
        })
        .map_err(StartError::Register)
}
