//! [`ShardingBuilder`]: the one way to start a [`Sharding`] runtime, and [`StartError`], the one
//! way it fails to start.
//!
//! What the builder is given decides what the process is:
//!
//! | given | the process |
//! | --- | --- |
//! | nothing | volatile requests to entities of this process only |
//! | `messages` | one runner owning every shard, no locks (a storage of its own) |
//! | `messages`, `runners`, `single_runner()` | one runner holding every shard's lock |
//! | `messages`, `runners` | a member of a cluster: membership, locks, handoff |
//! | `messages`, `runners`, `transport` | the same, with volatile requests to other runners |
//! | `client_only()` and `messages` (and `runners`, `transport`) | a client: it hosts no entity |

use std::sync::Arc;

use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::transport::Transport;
use cluster_core::{Clock, MachineId, Runner, ShardingConfig, SystemClock};

use crate::error::StartError;
use crate::placement::health::RunnerHealth;
use crate::placement::member::{Member, RUNNER_HEALTH};
use crate::placement::single_runner::{HeldLocks, LockedRuntime, all_shards};
use crate::services::singleton::SingletonOptions;
use crate::sharding::{Basics, Sharding};

/// Puts a [`Sharding`] runtime together: [`Sharding::builder`], the parts, then
/// [`start`](ShardingBuilder::start).
///
/// ```
/// use cluster_core::ShardingConfig;
/// use cluster_sharding::Sharding;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), cluster_sharding::StartError> {
/// // No storage: volatile requests to the entities of this process.
/// let sharding = Sharding::builder(ShardingConfig::default()).start().await?;
/// sharding.shutdown().await;
/// # Ok(())
/// # }
/// ```
///
/// The module table of `cluster_sharding::builder` says which parts make which process.
#[must_use = "a builder does nothing until it is started"]
pub struct ShardingBuilder {
    config: ShardingConfig,
    clock: Arc<dyn Clock>,
    messages: Option<Arc<dyn MessageStorage>>,
    runners: Option<Arc<dyn RunnerStorage>>,
    transport: Option<Arc<dyn Transport>>,
    client_only: bool,
    single_runner: bool,
    runner_health: Option<Arc<dyn RunnerHealth>>,
    machine_id: Option<MachineId>,
}

impl std::fmt::Debug for ShardingBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardingBuilder")
            .field("runner", &self.config.runner_address)
            .field("messages", &self.messages.is_some())
            .field("runners", &self.runners.is_some())
            .field("transport", &self.transport.is_some())
            .field("client_only", &self.client_only)
            .field("single_runner", &self.single_runner)
            .field("runner_health", &self.runner_health.is_some())
            .field("machine_id", &self.machine_id)
            .finish_non_exhaustive()
    }
}

impl ShardingBuilder {
    /// A builder of a runtime configured with `config`, on the system clock, with no storage
    /// and no transport (what [`Sharding::builder`] returns).
    pub(crate) fn new(config: ShardingConfig) -> ShardingBuilder {
        ShardingBuilder {
            config,
            clock: Arc::new(SystemClock),
            messages: None,
            runners: None,
            transport: None,
            client_only: false,
            single_runner: false,
            runner_health: None,
            machine_id: None,
        }
    }

    /// Persisted requests, their replies and their chunks go through `storage`.
    ///
    /// - A runner saves what it is sent there and reads its shards' mailboxes from it.
    /// - A client saves its requests there and reads their replies back.
    pub fn messages(mut self, storage: Arc<dyn MessageStorage>) -> ShardingBuilder {
        self.messages = Some(storage);
        self
    }

    /// The runner registry and the shard locks live in `storage`.
    ///
    /// - Without [`single_runner`](ShardingBuilder::single_runner), the process joins the
    ///   cluster of every runner on `storage`: shards are assigned by the hash ring over the
    ///   healthy runners, locked, and handed over when runners join, leave or crash.
    /// - It needs [`messages`](ShardingBuilder::messages).
    pub fn runners(mut self, storage: Arc<dyn RunnerStorage>) -> ShardingBuilder {
        self.runners = Some(storage);
        self
    }

    /// Volatile requests reach entities of other runners through `transport`.
    ///
    /// - The transport delivers the other runners' requests to this one through
    ///   [`Plumbing::runner_handler`](crate::Plumbing::runner_handler).
    /// - With a transport, the runners check each other's health by pinging (see
    ///   `RUNNER_HEALTH_CHECK` in docs/configuration.md).
    /// - It needs [`runners`](ShardingBuilder::runners): routing follows the membership.
    pub fn transport(mut self, transport: Arc<dyn Transport>) -> ShardingBuilder {
        self.transport = Some(transport);
        self
    }

    /// The runner-health singleton judges the runners with `health` instead of pinging them
    /// (the reference's `RunnerHealth` service, `effect/src/cluster/RunnerHealth.ts`).
    ///
    /// - Once per `runner_health_check_interval` it asks about every runner the registry
    ///   lists, and marks unhealthy those `health` says are dead (never the last healthy one);
    ///   their shards go to the others. `runner_health_check` is not used.
    /// - It needs [`runners`](ShardingBuilder::runners), and works with or without a
    ///   transport; a client or a single runner judges nobody, and is refused.
    pub fn runner_health(mut self, health: Arc<dyn RunnerHealth>) -> ShardingBuilder {
        self.runner_health = Some(health);
        self
    }

    /// Time is read from `clock` instead of the system clock.
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> ShardingBuilder {
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
    pub fn provisional_machine_id(mut self, machine_id: MachineId) -> ShardingBuilder {
        self.machine_id = Some(machine_id);
        self
    }

    /// The process is a client: it hosts no entity and reads no mailbox (the reference's
    /// client-only mode).
    ///
    /// - The configuration's runner address and listen address are dropped.
    /// - Registering an entity type is a no-op.
    /// - Persisted requests are saved for the runners that own their shards; their replies are
    ///   read back every `entity_reply_poll_interval`.
    /// - Volatile requests need a transport (and `runners`, to know the owners); without one
    ///   they fail with `EntityNotAssignedToRunner`.
    pub fn client_only(mut self) -> ShardingBuilder {
        self.client_only = true;
        self
    }

    /// The process is the only runner on its storages (the reference's `SingleRunner`).
    ///
    /// - At start it registers, takes every shard's lock in [`runners`](ShardingBuilder::runners),
    ///   and fails with [`StartError::ShardsHeld`] if another live runner holds any.
    /// - It refreshes its locks, and serves a shard only while its lease is confirmed.
    /// - At shutdown, once its entities have stopped, it releases the locks and unregisters.
    pub fn single_runner(mut self) -> ShardingBuilder {
        self.single_runner = true;
        self
    }

    /// Starts the runtime and its loops.
    ///
    /// # Errors
    ///
    /// - [`StartError::Config`]: the configuration is invalid.
    /// - [`StartError::Missing`] or [`StartError::Conflict`]: the parts do not make a process
    ///   (see the module table).
    /// - [`StartError::Storage`], [`StartError::ShardsHeld`]: a single runner could not take its
    ///   shards.
    ///
    /// # Cancel safety
    ///
    /// Not cancel safe: a single runner dropped half-way may hold locks (they expire).
    pub async fn start(self) -> Result<Sharding, StartError> {
        let ShardingBuilder {
            mut config,
            clock,
            messages,
            runners,
            transport,
            client_only,
            single_runner,
            runner_health,
            machine_id,
        } = self;
        if runner_health.is_some() && (runners.is_none() || client_only || single_runner) {
            let why = "a runner-health check needs `runners`, not a client or a single runner";
            return Err(StartError::Conflict(why));
        }
        // Every storage operation of the runtime is timed and its errors counted.
        let messages = messages.map(crate::metered::MeteredMessages::wrap);
        let runners = runners.map(crate::metered::MeteredRunners::wrap);
        if client_only {
            config.runner_address = None;
            config.runner_listen_address = None;
            if single_runner {
                return Err(StartError::Conflict("a client-only process is not a single runner"));
            }
        }
        if transport.is_some() && runners.is_none() {
            return Err(StartError::Missing {
                part: "runners",
                reason: "a transport routes by the membership kept in the runner storage",
            });
        }
        if single_runner && transport.is_some() {
            return Err(StartError::Conflict("a single runner has no other runner to reach"));
        }
        let basics = Basics { config, clock, machine_id };
        match (messages, runners) {
            (None, None) if client_only => Err(StartError::Missing {
                part: "messages",
                reason: "a client-only process sends persisted requests only",
            }),
            (None, None) if single_runner => Err(StartError::Missing {
                part: "messages",
                reason: "a single runner delivers persisted requests",
            }),
            (None, None) => Ok(Sharding::start_volatile(basics)?),
            (None, Some(_)) => Err(StartError::Missing {
                part: "messages",
                reason: "a runner storage needs a message storage",
            }),
            (Some(_), None) if single_runner => {
                Err(StartError::Missing { part: "runners", reason: "a single runner's locks" })
            }
            (Some(messages), None) if client_only => {
                Ok(Sharding::start_client_only(basics, messages)?)
            }
            (Some(messages), None) => Ok(Sharding::start_own_storage(basics, messages).await?),
            (Some(messages), Some(runners)) if single_runner => {
                start_single_runner(basics, messages, runners).await
            }
            (Some(messages), Some(runners)) => {
                start_cluster(basics, messages, runners, transport, runner_health)
            }
        }
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
    let member = Arc::new(Member::new(
        config.clone(),
        Arc::clone(&basics.clock),
        runners,
        Arc::clone(&messages),
        transport.clone(),
        runner_health,
    ));
    let sharding = Sharding::with_cluster(basics, messages, Arc::clone(&member), transport)?;
    member.start(&sharding);
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
