//! [`RunnerHealth`]: a check of the application's that tells the runner-health singleton
//! whether a runner is alive, instead of the transport's pings (the reference's `RunnerHealth`
//! service, `effect/src/cluster/RunnerHealth.ts`).
//!
//! The singleton asks it about every runner the registry lists, once per
//! `runner_health_check_interval`, and marks unhealthy those it says are dead (never the last
//! healthy one); their shards then go to the others. `durable-cluster`'s feature `kubernetes`
//! has one that reads pod readiness from the Kubernetes API.

use cluster_core::RunnerAddress;
use cluster_core::future::BoxFuture;

/// Tells whether a runner is alive: the runner-health singleton's judge when one is given to
/// [`ShardingBuilder::runner_health`](crate::ShardingBuilder::runner_health).
///
/// A runner judged dead is marked unhealthy in the registry and loses its shards, so the check
/// should say "dead" only when it knows: when it cannot tell (its own source fails), answering
/// `true` leaves the runner to its registry heartbeat, as the reference's Kubernetes check does.
///
/// One health round asks about every listed runner, up to ten at a time; an implementation that
/// reads a shared source (a list of pods) should read it once per round, not once per runner.
/// A call that takes longer than 30 seconds counts as `true`.
///
/// ```
/// use cluster_core::RunnerAddress;
/// use cluster_core::future::BoxFuture;
/// use cluster_sharding::RunnerHealth;
///
/// /// Every runner on a host of the allow list is alive.
/// struct AllowList(Vec<String>);
///
/// impl RunnerHealth for AllowList {
///     fn is_alive<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, bool> {
///         Box::pin(async move { self.0.iter().any(|host| host == address.host()) })
///     }
/// }
/// ```
pub trait RunnerHealth: Send + Sync + 'static {
    /// Whether the runner at `address`, which the registry lists, is alive.
    fn is_alive<'a>(&'a self, address: &'a RunnerAddress) -> BoxFuture<'a, bool>;
}
