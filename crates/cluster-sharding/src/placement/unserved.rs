//! The warning of a persisted call that waits for a shard no runner holds.
//!
//! - A persisted request whose shard has no owner (no runner serves its shard group, or none is
//!   up) stays stored until a runner takes the shard, and its caller waits until then.
//!   Without a word, a client-only process with no runner looks hung.
//! - [`watched`] runs the call and checks the shard's owner every `refresh_assignments_interval`
//!   (the assignment changes no more often than that).
//!   While there is none, it warns, at doubling intervals up to [`WARNING_INTERVAL_MAX`].
//! - A call whose shard has an owner when it is sent is not watched: the common case costs one
//!   lookup of the assignment, and no timer.
//! - The wait itself is the reference's (a persisted caller waits for its reply).
//!   A caller bounds it with a timeout around the call: dropping the call interrupts the
//!   request, and the interrupt is stored with it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::{EntityAddress, ShardingConfig, Snowflake};

use crate::placement::member::Member;

/// The longest pause between two warnings about one call.
pub(crate) const WARNING_INTERVAL_MAX: Duration = Duration::from_secs(300);

/// Runs `call`, the persisted request `request_id` to `address`, and warns while no runner
/// holds its shard in `member`'s assignment.
///
/// A process without a registry (`member` is `None`) knows no owner, and only runs `call`.
pub(crate) async fn watched<T>(
    member: Option<&Arc<Member>>,
    config: &ShardingConfig,
    address: &EntityAddress,
    request_id: Snowflake,
    call: impl Future<Output = T>,
) -> T {
    let Some(member) = member.filter(|member| member.owner(&address.shard_id).is_none()) else {
        return call.await;
    };
    let started = tokio::time::Instant::now();
    let check_every = config.refresh_assignments_interval.max(Duration::from_millis(1));
    let mut warn_every = check_every;
    let mut next_warning = started + warn_every;
    let mut call = std::pin::pin!(call);
    let mut checks = tokio::time::interval_at(started + check_every, check_every);
    loop {
        tokio::select! {
            output = &mut call => return output,
            now = checks.tick() => {
                if now < next_warning || member.owner(&address.shard_id).is_some() {
                    continue;
                }
                warn(address, request_id, now - started);
                warn_every = warn_every.saturating_mul(2).min(WARNING_INTERVAL_MAX);
                next_warning = now + warn_every;
            }
        }
    }
}

fn warn(address: &EntityAddress, request_id: Snowflake, waited: Duration) {
    tracing::warn!(
        entity_type = %address.entity_type,
        entity_id = %address.entity_id,
        shard = %address.shard_id,
        %request_id,
        ?waited,
        "no runner holds the shard of this persisted request, so its caller waits; start a \
         runner that serves shard group `{}` on this database and table prefix, or check that \
         the runners reach the database; to stop waiting, bound the call with a timeout (dropping \
         the call interrupts the request)",
        address.shard_id.group(),
    );
}
