//! The probe for runners that are gone: failover in seconds after a runner is killed.
//!
//! - A killed or crashed process closes its sockets: its transport address refuses
//!   connections at once, and its advisory-lock session ends.
//!   The registry learns of it only when its heartbeat expires (`shard_lock_expiration`), or
//!   at the runner-health singleton's next round, which may have run on that very runner.
//! - So every runner probes its peers every `runner_probe_interval` ([`Transport::probe`]):
//!   up to [`PROBED_PEERS_MAX`] of the runners that hold shards, those that follow it in
//!   address order (every peer in a cluster of up to 9 runners).
//! - A peer whose address refuses connections twice, [`CONFIRM_SPACING`] apart, is gone.
//!   The prober lets go of its locks ([`RunnerStorage::release_gone`]: lease rows are deleted,
//!   advisory locks went with its session), marks it unhealthy, and syncs the registry at once.
//!   The others see it unhealthy at their next sync and take its shards.
//! - A frozen process keeps its listening socket, and a partitioned one does not answer: neither
//!   refuses a connection, so neither is taken over before its locks expire.
//! - Never the last healthy runner: a prober that is not healthy itself marks nobody.
//!
//! [`RunnerStorage::release_gone`]: cluster_core::storage::RunnerStorage::release_gone

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::RunnerAddress;
use cluster_core::config::RunnerHealthCheck;
use cluster_core::membership::Assignment;
use cluster_core::transport::{Probe, Transport};

use super::{Member, REGISTRY_TIMEOUT, bounded};
use crate::metrics;

/// The most peers one runner probes each round.
pub(crate) const PROBED_PEERS_MAX: usize = 8;
/// The pause between the two refused probes that find a runner gone.
pub(crate) const CONFIRM_SPACING: Duration = Duration::from_millis(200);

impl Member {
    /// Whether this runner probes its peers: a runner with a transport, unless the health check
    /// is heartbeats only.
    pub(super) fn probes_peers(&self) -> bool {
        self.runner.is_some()
            && self.transport.is_some()
            && self.config.runner_health_check != RunnerHealthCheck::Heartbeat
    }

    /// The probe loop (see the module documentation); ends when the member stops.
    pub(super) async fn probe_loop(self: Arc<Member>) {
        let (Some(transport), Some(me)) = (self.transport.clone(), self.address().cloned()) else {
            return;
        };
        let interval = self.config.runner_probe_interval;
        loop {
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.stopped.cancelled() => return,
            }
            let peers = {
                let mut state = self.state();
                // A runner that left the assignment is no longer watched: its address may
                // serve another runner later.
                let assignment = state.assignment.clone();
                state.gone.retain(|address| assignment.iter().any(|(_, owner)| owner == address));
                successors(&assignment, &me, PROBED_PEERS_MAX)
            };
            let probes = peers.iter().map(|peer| {
                let transport = Arc::clone(&transport);
                async move { (peer, is_gone(&*transport, peer).await) }
            });
            for (peer, gone) in futures_util::future::join_all(probes).await {
                let known = self.state().gone.contains(peer);
                match (gone, known) {
                    (true, false) => self.runner_gone(peer).await,
                    // Something listens there again: a new process at the same address.
                    (false, true) => {
                        self.state().gone.remove(peer);
                    }
                    _ => {}
                }
            }
            self.update_unserved();
        }
    }

    /// `peer` refused connections twice: lets go of its locks, marks it unhealthy, and syncs
    /// the registry at once. A step that fails is tried again at the next probe.
    async fn runner_gone(&self, peer: &RunnerAddress) {
        let healthy =
            self.runner.as_ref().is_some_and(|runner| self.state().membership.is_healthy(runner));
        if !healthy {
            tracing::debug!(runner = %peer, "a peer refuses connections, but this runner is not healthy: leaving it to the others");
            return;
        }
        // A runner that left gracefully unregistered before its listener closed: nothing to do.
        match bounded(REGISTRY_TIMEOUT, self.storage.get_runners()).await {
            Ok(runners)
                if runners.iter().any(|(runner, healthy)| runner.address == *peer && *healthy) => {}
            Ok(_) => {
                tracing::debug!(runner = %peer, "a peer refuses connections, and the registry lists it unhealthy or not at all");
                self.state().gone.insert(peer.clone());
                return;
            }
            Err(error) => {
                tracing::debug!(runner = %peer, %error, "could not read the registry; trying again at the next probe");
                return;
            }
        }
        tracing::warn!(runner = %peer, "runner refuses connections: its process is gone; marking it unhealthy so that its shards move now");
        if let Err(error) = bounded(REGISTRY_TIMEOUT, self.storage.release_gone(peer)).await {
            tracing::warn!(runner = %peer, %error, "could not let go of a gone runner's locks; trying again at the next probe");
            return;
        }
        if let Err(error) =
            bounded(REGISTRY_TIMEOUT, self.storage.set_runner_health(peer, false)).await
        {
            tracing::warn!(runner = %peer, %error, "could not mark a gone runner unhealthy; trying again at the next probe");
            return;
        }
        metrics::count(metrics::RUNNERS_GONE, 1);
        self.state().gone.insert(peer.clone());
        if let Some(transport) = &self.transport {
            transport.on_runner_unavailable(peer);
        }
        self.update_unserved();
        self.resync.notify_one();
    }

    /// Sets the unserved-shards gauge (see [`Member::readiness`]).
    pub(super) fn update_unserved(&self) {
        metrics::set(metrics::SHARDS_UNSERVED, self.readiness().unserved);
    }
}

/// Whether `peer` refuses connections twice, [`CONFIRM_SPACING`] apart.
async fn is_gone(transport: &dyn Transport, peer: &RunnerAddress) -> bool {
    if transport.probe(peer).await != Probe::Refused {
        return false;
    }
    tokio::time::sleep(CONFIRM_SPACING).await;
    transport.probe(peer).await == Probe::Refused
}

/// Up to `max` of the runners that hold shards in `assignment`, those that follow `me` in
/// address order (wrapping around), without `me`.
pub(super) fn successors(
    assignment: &Assignment,
    me: &RunnerAddress,
    max: usize,
) -> Vec<RunnerAddress> {
    let owners: BTreeSet<&RunnerAddress> =
        assignment.iter().map(|(_, owner)| owner).filter(|owner| *owner != me).collect();
    let after = owners.iter().filter(|owner| **owner > me);
    let before = owners.iter().filter(|owner| **owner < me);
    after.chain(before).take(max).map(|owner| (*owner).clone()).collect()
}

/// The shards of `assignment` whose owner is in `gone`.
pub(super) fn shards_of_gone(assignment: &Assignment, gone: &BTreeSet<RunnerAddress>) -> usize {
    if gone.is_empty() {
        return 0;
    }
    assignment.iter().filter(|(_, owner)| gone.contains(*owner)).count()
}

#[cfg(test)]
mod tests {
    use cluster_core::ShardId;

    use super::*;

    fn address(port: u16) -> RunnerAddress {
        RunnerAddress::new("host", port)
    }

    fn shard(id: u32) -> ShardId {
        ShardId::new(cluster_core::ShardGroup::default_group(), id)
    }

    #[test]
    fn successors_wrap_around_and_skip_me() {
        let assignment: Assignment =
            (1..=5_u16).map(|port| (shard(u32::from(port)), address(port))).collect();
        let got = successors(&assignment, &address(3), 3);
        assert_eq!(got, vec![address(4), address(5), address(1)]);
        let all = successors(&assignment, &address(3), 8);
        assert_eq!(all, vec![address(4), address(5), address(1), address(2)]);
        // A runner without shards still probes those that follow its address.
        let outsider = successors(&assignment, &address(9), 2);
        assert_eq!(outsider, vec![address(1), address(2)]);
    }

    #[test]
    fn shards_of_gone_counts_only_gone_owners() {
        let assignment: Assignment =
            [(shard(1), address(1)), (shard(2), address(1)), (shard(3), address(2))]
                .into_iter()
                .collect();
        assert_eq!(shards_of_gone(&assignment, &BTreeSet::new()), 0);
        assert_eq!(shards_of_gone(&assignment, &BTreeSet::from([address(1)])), 2);
    }
}
