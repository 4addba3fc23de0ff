//! Fair residency: at the runner's or a type's residency cap, a new entity makes room by
//! passivating the least recently used idle instances (Akka's least-recently-used passivation
//! strategy), instead of every newcomer failing with `MailboxFull` until idle ones expire.

use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::{ClusterError, ShardingConfig};
use cluster_sharding::{CallError, EntityOptions};

use crate::entities::{self, Counter, Get, Increment, Probes, SetKeepAlive, spawn_send};
use crate::{eventually, on_memory_storage, registered, sharding};

/// A runner holding at most `cap` instances, none ever reaped for idleness.
fn capped(cap: u32) -> ShardingConfig {
    ShardingConfig {
        max_resident_entities: Capacity::bounded(cap).unwrap(),
        entity_max_idle_time: None,
        ..ShardingConfig::default()
    }
}

#[tokio::test(start_paused = true)]
async fn at_the_cap_a_newcomer_passivates_the_least_recently_used_idle_entity() {
    let sharding = registered(capped(3)).await;
    let client = |id: &str| sharding.client::<Counter>(id);
    for id in ["lru-a", "lru-b", "lru-c"] {
        assert_eq!(client(id).send(Increment { by: 1 }).await.unwrap(), 1);
    }
    // `lru-a` is used again: `lru-b` is now the least recently used.
    assert_eq!(client("lru-a").send(Increment { by: 1 }).await.unwrap(), 2);
    assert_eq!(
        client("lru-d").send(Increment { by: 1 }).await.unwrap(),
        1,
        "a newcomer at the cap"
    );
    eventually("the passivated instance is gone", || sharding.active_entity_count() == 3).await;
    // The others kept their state; `lru-b` starts afresh.
    assert_eq!(client("lru-a").send(Get).await.unwrap(), 2);
    assert_eq!(client("lru-c").send(Get).await.unwrap(), 1);
    assert_eq!(Probes::of("lru-b").created.load(Ordering::SeqCst), 1);
    assert_eq!(client("lru-b").send(Get).await.unwrap(), 0, "passivated, then created again");
    assert_eq!(Probes::of("lru-b").created.load(Ordering::SeqCst), 2);
    eventually("never above the cap", || sharding.active_entity_count() == 3).await;
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_new_ids_keeps_serving_new_entities_and_the_busy_one() {
    let sharding = registered(capped(10)).await;
    let regular = sharding.client::<Counter>("flood-regular");
    for n in 0..300 {
        let newcomer = sharding.client::<Counter>(format!("flood-{n}"));
        assert_eq!(newcomer.send(Increment { by: 1 }).await.unwrap(), 1, "newcomer {n}");
        if n % 5 == 0 {
            // Used often, it is never the least recently used: it keeps its state.
            regular.send(Increment { by: 1 }).await.unwrap();
        }
        assert!(
            sharding.active_entity_count() <= 20,
            "{} resident",
            sharding.active_entity_count()
        );
    }
    assert_eq!(regular.send(Get).await.unwrap(), 60);
    assert_eq!(Probes::of("flood-regular").created.load(Ordering::SeqCst), 1);
    eventually("back under the cap", || sharding.active_entity_count() <= 10).await;
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn busy_and_kept_alive_entities_are_never_passivated_to_make_room() {
    // `Hang` is persisted: it needs a message storage.
    let (sharding, _storage) = on_memory_storage(capped(2)).await;
    let busy = sharding.client::<Counter>("held-busy");
    let call = spawn_send(&busy, entities::Hang);
    let probes = Probes::of("held-busy");
    eventually("the busy one runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    let kept = sharding.client::<Counter>("held-kept");
    kept.send(SetKeepAlive { enabled: true }).await.unwrap();
    kept.send(Increment { by: 4 }).await.unwrap();
    let error = sharding.client::<Counter>("held-new").send(Get).await.unwrap_err();
    assert!(matches!(error, CallError::Cluster(ClusterError::MailboxFull { .. })), "{error:?}");
    assert_eq!(probes.interrupted.load(Ordering::SeqCst), 0, "the busy one still runs");
    assert_eq!(kept.send(Get).await.unwrap(), 4, "the kept-alive one kept its state");
    // Released, the kept-alive one is idle: the newcomer takes its place, once the quiet
    // period after the scan that found nothing idle (50 ms) is over.
    kept.send(SetKeepAlive { enabled: false }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(sharding.client::<Counter>("held-new").send(Get).await.unwrap(), 0);
    call.abort();
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_per_type_cap_passivates_within_the_type() {
    let sharding =
        sharding(ShardingConfig { entity_max_idle_time: None, ..ShardingConfig::default() }).await;
    let options = EntityOptions { max_resident: Capacity::bounded(2), ..EntityOptions::default() };
    sharding.entity::<Counter>().options(options).register().unwrap();
    for id in ["typed-a", "typed-b", "typed-c", "typed-d"] {
        assert_eq!(sharding.client::<Counter>(id).send(Increment { by: 1 }).await.unwrap(), 1);
    }
    eventually("two resident", || sharding.active_entity_count() == 2).await;
    assert_eq!(sharding.client::<Counter>("typed-d").send(Get).await.unwrap(), 1);
    assert_eq!(Probes::of("typed-a").created.load(Ordering::SeqCst), 1);
    assert_eq!(sharding.client::<Counter>("typed-a").send(Get).await.unwrap(), 0);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_persisted_newcomer_at_the_cap_passivates_an_idle_resident() {
    let (sharding, _storage) = on_memory_storage(capped(1)).await;
    let resident = sharding.client::<Counter>("stored-resident");
    assert_eq!(resident.send(Increment { by: 1 }).await.unwrap(), 1);
    let newcomer = sharding.client::<Counter>("stored-newcomer");
    newcomer.discard(entities::Deposit { key: "n".to_owned(), amount: 1 }).await.unwrap();
    let probes = Probes::of("stored-newcomer");
    // Without passivation it waits for the resident's idle expiry, which never comes.
    tokio::time::timeout(Duration::from_secs(60), async {
        while probes.deposits.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the newcomer's stored request was never delivered");
    sharding.shutdown().await;
}
