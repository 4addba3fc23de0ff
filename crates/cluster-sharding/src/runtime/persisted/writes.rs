//! The requests taken up and not settled, counted per shard: a shard's lock is let go only
//! after them.
//!
//! A request counts from its claim until its outcome is stored ([`WriteGuard`]).
//! A shard's release waits for its count to reach zero, at most for a bound
//! ([`ShardWrites::finished`]).
//! So:
//!
//! - a request that finishes while its shard drains is answered here;
//! - no final reply is written once this runner let the lock go.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cluster_core::ShardId;
use cluster_core::sync::lock;
use tokio::sync::Notify;

/// The unsettled requests per shard (in `PersistedDelivery`).
#[derive(Default)]
pub(super) struct ShardWrites {
    /// A shard is here while its count is above zero.
    counts: Mutex<BTreeMap<ShardId, usize>>,
    /// Woken when a write ends.
    ended: Notify,
}

/// A request of a shard taken up and not settled yet (see [`ShardWrites::begin`]).
pub(super) struct WriteGuard {
    writes: Arc<ShardWrites>,
    shard: ShardId,
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        {
            let mut counts = lock(&self.writes.counts);
            if let Some(count) = counts.get_mut(&self.shard) {
                *count -= 1;
                if *count == 0 {
                    counts.remove(&self.shard);
                }
            }
        }
        self.writes.ended.notify_waiters();
    }
}

impl ShardWrites {
    /// Counts a request of `shard` as taken up and not settled until the guard drops.
    ///
    /// It is taken when the request is claimed, before the check that the shard is served.
    /// So a release that stops serving the shard after that check waits for the request's
    /// outcome.
    pub(super) fn begin(self: &Arc<Self>, shard: &ShardId) -> WriteGuard {
        *lock(&self.counts).entry(shard.clone()).or_default() += 1;
        WriteGuard { writes: Arc::clone(self), shard: shard.clone() }
    }

    /// Waits, at most `bound`, until no request of `shard` is taken up and unsettled.
    ///
    /// With `None`, it waits for the requests of every shard.
    /// It is called once the shard's entities ended, before its lock is let go.
    pub(super) async fn finished(&self, shard: Option<&ShardId>, bound: Duration) {
        let waiting = async {
            loop {
                let ended = self.ended.notified();
                let busy = {
                    let counts = lock(&self.counts);
                    match shard {
                        Some(shard) => counts.contains_key(shard),
                        None => !counts.is_empty(),
                    }
                };
                if !busy {
                    return;
                }
                ended.await;
            }
        };
        if tokio::time::timeout(bound, waiting).await.is_err() {
            tracing::warn!(?shard, "final replies still being written when the lock is let go");
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use cluster_core::{ShardGroup, ShardId};

    use super::ShardWrites;

    fn shard(id: u32) -> ShardId {
        ShardId::new(ShardGroup::default_group(), id)
    }

    #[tokio::test(start_paused = true)]
    async fn a_release_waits_for_its_own_shard_only_and_no_longer_than_its_bound() {
        let writes = Arc::new(ShardWrites::default());
        let first = writes.begin(&shard(1));
        let second = writes.begin(&shard(1));
        let other = writes.begin(&shard(2));
        let started = tokio::time::Instant::now();
        let waiting = tokio::spawn({
            let writes = Arc::clone(&writes);
            async move { writes.finished(Some(&shard(1)), Duration::from_secs(60)).await }
        });
        drop(first);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "one write of the shard is still under way");
        drop(second);
        waiting.await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO, "it ended with the last write");
        // Every shard: the other shard's write holds it until the bound.
        writes.finished(None, Duration::from_secs(5)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        drop(other);
        writes.finished(None, Duration::from_secs(5)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
    }
}
