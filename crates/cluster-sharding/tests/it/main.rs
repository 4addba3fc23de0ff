//! Single-runner tests of the sharding runtime: typed volatile calls to local entities
//! (the volatile cases of effect's `Sharding.test.ts`).

mod client_spans;
mod cluster;
mod concurrency;
mod entities;
mod forked;
mod gauges;
mod macros;
mod persisted;
mod queue;
mod readiness;
mod residency;
mod retention;
mod shutdown;
mod singletons;
mod state;
mod streams;
mod transaction;
mod unserved;

use cluster_sharding::Plumbing;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::{ClusterError, ShardingConfig, SystemClock};
use cluster_sharding::{CallError, Defects, EntityOptions, RegisterError, Sharding};
pub(crate) use cluster_testkit::wait::eventually;

use entities::{
    Counter, Fail, Get, Increment, Persist, Probe, Probes, SetKeepAlive, Sleep, Stuck, spawn_send,
};

async fn sharding(config: ShardingConfig) -> Sharding {
    Sharding::volatile(config).start().await.unwrap()
}

async fn registered(config: ShardingConfig) -> Sharding {
    let sharding = sharding(config).await;
    sharding.entity::<Counter>().register().unwrap();
    sharding
}

#[tokio::test(start_paused = true)]
async fn delivers_volatile_requests_and_keeps_state_per_entity() {
    let sharding = registered(ShardingConfig::default()).await;
    let a = sharding.client::<Counter>("a");
    let b = sharding.client::<Counter>("b");
    assert_eq!(a.send(Increment { by: 2 }).await.unwrap(), 2);
    assert_eq!(a.send(Increment { by: 3 }).await.unwrap(), 5);
    assert_eq!(b.send(Increment { by: 1 }).await.unwrap(), 1);
    assert_eq!(a.send(Get).await.unwrap(), 5);
    assert_eq!(sharding.active_entity_count(), 2);
    assert_eq!(
        a.address().shard_id,
        sharding.shard_id("a", &cluster_core::ShardGroup::default_group())
    );
}

/// Types registered past the ones a delivery finds without a lock (the first 16) are found
/// under the registry's lock, and each keeps its own entities.
#[tokio::test(start_paused = true)]
async fn every_one_of_many_registered_types_gets_its_requests() {
    let sharding = sharding(ShardingConfig::default()).await;
    let types: Vec<cluster_core::EntityType> =
        (0..40).map(|n| cluster_core::EntityType::from(format!("Counter{n}"))).collect();
    for entity_type in &types {
        sharding.entity::<Counter>().named(entity_type.clone()).register().unwrap();
    }
    for (n, entity_type) in types.iter().enumerate() {
        let n = u64::try_from(n).unwrap();
        let client =
            sharding.entity::<Counter>().named(entity_type.clone()).client(format!("many-{n}"));
        assert_eq!(client.send(Increment { by: n + 1 }).await.unwrap(), n + 1, "{entity_type}");
    }
    // The same entity id under two types is two entities.
    let first = sharding.entity::<Counter>().named(types[0].clone()).client("shared-id");
    let last = sharding.entity::<Counter>().named(types[39].clone()).client("shared-id");
    assert_eq!(first.send(Increment { by: 5 }).await.unwrap(), 5);
    assert_eq!(last.send(Increment { by: 7 }).await.unwrap(), 7);
    assert_eq!(sharding.active_entity_count(), 42);
}

#[tokio::test(start_paused = true)]
async fn requests_to_one_entity_run_one_at_a_time_in_order() {
    let sharding = registered(ShardingConfig::default()).await;
    let counter = sharding.client::<Counter>("ordered");
    let mut calls = Vec::new();
    for by in 1..=20 {
        let counter = counter.clone();
        calls.push(tokio::spawn(async move { counter.send(Sleep { millis: 21 - by, by }).await }));
        tokio::task::yield_now().await;
    }
    let mut totals = Vec::new();
    for call in calls {
        totals.push(call.await.unwrap().unwrap());
    }
    // Each call sees the sum of the ones delivered before it, despite shorter sleeps later.
    let expected: Vec<u64> = (1..=20)
        .scan(0, |sum, by| {
            *sum += by;
            Some(*sum)
        })
        .collect();
    assert_eq!(totals, expected);
}

#[tokio::test(start_paused = true)]
async fn the_request_error_comes_back_typed() {
    let sharding = registered(ShardingConfig::default()).await;
    let error =
        sharding.client::<Counter>("x").send(Fail { reason: "nope".to_owned() }).await.unwrap_err();
    let CallError::Failed(error) = error else { panic!("{error:?}") };
    assert_eq!(error.reason, "nope");
}

#[tokio::test(start_paused = true)]
async fn fails_volatile_requests_immediately_when_the_mailbox_is_full() {
    let sharding = sharding(ShardingConfig::default()).await;
    let options =
        EntityOptions { mailbox_capacity: Capacity::bounded(2), ..EntityOptions::default() };
    sharding.entity::<Counter>().options(options).register().unwrap();
    let counter = sharding.client::<Counter>("busy");
    let mut stuck = Vec::new();
    for _ in 0..2 {
        let counter = counter.clone();
        stuck.push(tokio::spawn(async move { counter.send(Stuck).await }));
    }
    let probes = Probes::of("busy");
    eventually("the first request runs", || probes.stuck.load(Ordering::SeqCst) >= 1).await;
    tokio::task::yield_now().await;
    let error = counter.send(Increment { by: 1 }).await.unwrap_err();
    assert!(matches!(error, CallError::Cluster(ClusterError::MailboxFull { .. })), "{error:?}");
    for call in stuck {
        call.abort();
    }
}

#[tokio::test(start_paused = true)]
async fn reaps_idle_entities() {
    let config = ShardingConfig {
        entity_max_idle_time: Some(Duration::from_secs(1)),
        ..ShardingConfig::default()
    };
    let sharding = registered(config).await;
    assert_eq!(sharding.client::<Counter>("first").send(Increment { by: 7 }).await.unwrap(), 7);
    // After a second without requests the entity is reaped.
    eventually("the idle entity is reaped", || sharding.active_entity_count() == 0).await;
    // A reaped entity starts again with fresh state.
    assert_eq!(sharding.client::<Counter>("first").send(Get).await.unwrap(), 0);
}

#[tokio::test(start_paused = true)]
async fn keep_alive_holds_an_entity_until_it_is_released() {
    let config = ShardingConfig {
        entity_max_idle_time: Some(Duration::from_secs(1)),
        ..ShardingConfig::default()
    };
    let sharding = registered(config).await;
    let kept = sharding.client::<Counter>("kept-alive");
    kept.send(SetKeepAlive { enabled: true }).await.unwrap();
    // Enabling twice parks nothing more: one release is enough.
    kept.send(SetKeepAlive { enabled: true }).await.unwrap();
    kept.send(Increment { by: 3 }).await.unwrap();
    let other = sharding.client::<Counter>("not-kept");
    other.send(Increment { by: 1 }).await.unwrap();
    eventually("the other entity is reaped", || sharding.active_entity_count() == 1).await;
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(sharding.active_entity_count(), 1);
    assert_eq!(kept.send(Get).await.unwrap(), 3, "the same instance, state kept");
    kept.send(SetKeepAlive { enabled: false }).await.unwrap();
    eventually("released, it is reaped", || sharding.active_entity_count() == 0).await;
    assert_eq!(kept.send(Get).await.unwrap(), 0, "a fresh instance");
}

#[tokio::test(start_paused = true)]
async fn an_entity_without_max_idle_time_is_never_reaped() {
    let sharding = sharding(ShardingConfig::default()).await;
    sharding
        .entity::<Counter>()
        .options(EntityOptions { max_idle_time: Some(None), ..EntityOptions::default() })
        .register()
        .unwrap();
    let counter = sharding.client::<Counter>("kept");
    counter.send(Increment { by: 4 }).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3600)).await;
    assert_eq!(sharding.active_entity_count(), 1);
    assert_eq!(counter.send(Get).await.unwrap(), 4);
}

#[tokio::test(start_paused = true)]
async fn dropping_the_call_interrupts_the_handler() {
    let sharding = registered(ShardingConfig::default()).await;
    let counter = sharding.client::<Counter>("interrupted");
    let probes = Probes::of("interrupted");
    let call = spawn_send(&counter, Probe);
    eventually("the handler runs", || probes.probing.load(Ordering::SeqCst) > 0).await;
    assert_eq!(probes.interrupted.load(Ordering::SeqCst), 0);
    call.abort();
    eventually("the handler is interrupted", || probes.interrupted.load(Ordering::SeqCst) == 1)
        .await;
    // The entity is free for the next request.
    assert_eq!(counter.send(Increment { by: 1 }).await.unwrap(), 1);
}

/// With `Defects::Replay` (the reference's fatal defects), the request that panicked runs
/// again on the recreated instance.
#[tokio::test(start_paused = true)]
async fn a_panicking_handler_restarts_the_entity_and_replays_the_request() {
    let sharding = sharding(ShardingConfig::default()).await;
    let options = EntityOptions { defects: Some(Defects::Replay), ..EntityOptions::default() };
    sharding.entity::<Counter>().options(options).register().unwrap();
    let counter = sharding.client::<Counter>("panics");
    counter.send(Increment { by: 10 }).await.unwrap();
    let probes = Probes::of("panics");
    assert_eq!(probes.created.load(Ordering::SeqCst), 1);
    probes.panic_once.store(true, Ordering::SeqCst);
    // The state was lost with the restart; the replayed request runs on a fresh instance.
    assert_eq!(counter.send(Increment { by: 1 }).await.unwrap(), 1);
    assert_eq!(probes.created.load(Ordering::SeqCst), 2);
}

/// By default a panic answers its request with a defect at once (no replay, no wait for the
/// backoff) and recreates the instance, which serves the next request.
#[tokio::test(start_paused = true)]
async fn a_panicking_handler_answers_its_request_with_a_defect_at_once() {
    let sharding = registered(ShardingConfig::default()).await;
    let counter = sharding.client::<Counter>("panics-answered");
    counter.send(Increment { by: 10 }).await.unwrap();
    let probes = Probes::of("panics-answered");
    probes.panic_once.store(true, Ordering::SeqCst);
    let started = tokio::time::Instant::now();
    let error = counter.send(Increment { by: 1 }).await.unwrap_err();
    assert!(matches!(error, CallError::Defect(_)), "{error:?}");
    assert_eq!(started.elapsed(), Duration::ZERO, "answered before the restart's backoff");
    // The state was lost with the restart; the request that panicked did not run again.
    assert_eq!(counter.send(Increment { by: 2 }).await.unwrap(), 2);
    assert_eq!(probes.created.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn unknown_entity_types_fail_after_the_registration_timeout() {
    let config = ShardingConfig {
        entity_registration_timeout: Duration::from_secs(2),
        ..ShardingConfig::default()
    };
    let sharding = sharding(config).await;
    let started = tokio::time::Instant::now();
    let error = sharding.client::<Counter>("nobody").send(Get).await.unwrap_err();
    let CallError::Defect(defect) = error else { panic!("{error:?}") };
    assert!(defect.contains("Entity type 'Counter' not registered"), "{defect}");
    assert!(started.elapsed() >= Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_request_waits_for_its_entity_type_to_register() {
    let sharding = sharding(ShardingConfig::default()).await;
    let call = tokio::spawn({
        let counter = sharding.client::<Counter>("late");
        async move { counter.send(Increment { by: 3 }).await }
    });
    tokio::time::sleep(Duration::from_secs(5)).await;
    sharding.entity::<Counter>().register().unwrap();
    assert_eq!(call.await.unwrap().unwrap(), 3);
}

#[tokio::test(start_paused = true)]
async fn registrations_are_announced() {
    let sharding = sharding(ShardingConfig::default()).await;
    let mut events = sharding.registration_events();
    sharding.entity::<Counter>().register().unwrap();
    let event = events.recv().await.unwrap();
    assert_eq!(event, cluster_sharding::RegistrationEvent::EntityRegistered("Counter".into()));
}

#[tokio::test(start_paused = true)]
async fn registering_a_type_twice_is_an_error() {
    let sharding = registered(ShardingConfig::default()).await;
    let error = sharding.entity::<Counter>().register().unwrap_err();
    assert!(
        matches!(error, RegisterError::AlreadyRegistered(ref entity_type) if entity_type.as_str() == "Counter")
    );
}

#[tokio::test(start_paused = true)]
async fn discard_returns_once_delivered_and_the_entity_still_handles_it() {
    let sharding = registered(ShardingConfig::default()).await;
    let counter = sharding.client::<Counter>("discarded");
    counter.discard(Increment { by: 5 }).await.unwrap();
    assert_eq!(counter.send(Get).await.unwrap(), 5);
}

#[tokio::test(start_paused = true)]
async fn shutdown_interrupts_running_requests_and_refuses_new_ones() {
    let sharding = registered(ShardingConfig::default()).await;
    let counter = sharding.client::<Counter>("stopping");
    let running = spawn_send(&counter, Stuck);
    eventually("the request runs", || sharding.active_entity_count() == 1).await;
    tokio::task::yield_now().await;
    sharding.shutdown().await;
    assert!(sharding.is_shutdown());
    let interrupted = running.await.unwrap().unwrap_err();
    assert!(matches!(interrupted, CallError::Interrupted), "{interrupted:?}");
    let refused = counter.send(Get).await.unwrap_err();
    assert!(
        matches!(refused, CallError::Cluster(ClusterError::EntityNotAssignedToRunner { .. })),
        "{refused:?}"
    );
    assert_eq!(sharding.active_entity_count(), 0);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_lets_running_requests_finish_within_the_termination_timeout() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(10),
        ..ShardingConfig::default()
    };
    let sharding = registered(config).await;
    let counter = sharding.client::<Counter>("draining");
    let running = spawn_send(&counter, Sleep { millis: 3_000, by: 7 });
    eventually("the request runs", || sharding.active_entity_count() == 1).await;
    let started = tokio::time::Instant::now();
    sharding.shutdown().await;
    assert_eq!(running.await.unwrap().unwrap(), 7, "the running request finished");
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10), "{took:?}");
}

#[tokio::test(start_paused = true)]
async fn persisted_requests_need_message_storage() {
    let sharding = registered(ShardingConfig::default()).await;
    let error = sharding.client::<Counter>("durable").send(Persist).await.unwrap_err();
    let CallError::Defect(defect) = error else { panic!("{error:?}") };
    assert!(defect.contains("MessageStorage"), "{defect}");
}

#[tokio::test(start_paused = true)]
async fn persisted_requests_to_a_full_mailbox_are_retried_without_waiting_for_the_poll() {
    use cluster_testkit::memory::MemoryMessageStorage;

    let config = ShardingConfig {
        entity_message_poll_interval: Duration::from_secs(60),
        ..ShardingConfig::default()
    };
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config, storage).start().await.unwrap();
    let options =
        EntityOptions { mailbox_capacity: Capacity::bounded(1), ..EntityOptions::default() };
    sharding.entity::<Counter>().options(options).register().unwrap();
    let counter = sharding.client::<Counter>("full-mailbox");
    let started = tokio::time::Instant::now();
    let mut calls = Vec::new();
    for n in 0..5_u64 {
        let counter = counter.clone();
        calls.push(tokio::spawn(async move {
            counter.send(entities::Deposit { key: format!("k{n}"), amount: 1 }).await
        }));
    }
    let mut totals = Vec::new();
    for call in calls {
        totals.push(call.await.unwrap().unwrap());
    }
    totals.sort_unstable();
    assert_eq!(totals, [1, 2, 3, 4, 5]);
    // Each full mailbox was retried after `send_retry_interval`, not after the 60 s poll.
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn interrupt_on_termination_does_not_wait_for_the_drain() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(60),
        ..ShardingConfig::default()
    };
    let sharding = registered(config).await;
    let counter = sharding.client::<Counter>("impatient");
    let running = spawn_send(&counter, entities::Impatient);
    let probes = Probes::of("impatient");
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    let started = tokio::time::Instant::now();
    sharding.shutdown().await;
    assert!(started.elapsed() < Duration::from_secs(60), "{:?}", started.elapsed());
    assert!(matches!(running.await.unwrap(), Err(CallError::Interrupted)));
}

#[tokio::test(start_paused = true)]
async fn streams_items_in_order() {
    let sharding = registered(ShardingConfig::default()).await;
    let mut stream = sharding
        .client::<Counter>("streamer")
        .stream(entities::Count { n: 5, fail_after: None })
        .await
        .unwrap();
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push(item.unwrap());
    }
    assert_eq!(items, [0, 1, 2, 3, 4]);
    assert!(stream.next().await.is_none());
}

/// Backpressure: the handler gets at most one chunk unacknowledged and one more filled ahead
/// of its reader, and a chunk is acknowledged when the reader takes it up.
#[tokio::test(start_paused = true)]
async fn a_stream_is_held_back_by_its_reader() {
    let sharding = registered(ShardingConfig::default()).await;
    let probes = Probes::of("slow-reader");
    let mut stream = sharding
        .client::<Counter>("slow-reader")
        .stream(entities::Count { n: 2000, fail_after: None })
        .await
        .unwrap();
    let chunk = cluster_sharding::CHUNK_ITEMS_MAX;
    assert_eq!(stream.next().await.unwrap().unwrap(), 0);
    tokio::time::sleep(Duration::from_secs(10)).await;
    // The first chunk was acknowledged, the second waits for its acknowledgement, and the
    // third is full.
    assert_eq!(probes.probing.load(Ordering::SeqCst), 3 * chunk);
    for item in 1..=chunk {
        assert_eq!(stream.next().await.unwrap().unwrap(), u64::try_from(item).unwrap());
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(probes.probing.load(Ordering::SeqCst), 4 * chunk);
}

#[tokio::test(start_paused = true)]
async fn a_stream_error_ends_the_stream() {
    let sharding = registered(ShardingConfig::default()).await;
    let mut stream = sharding
        .client::<Counter>("failing-stream")
        .stream(entities::Count { n: 5, fail_after: Some(2) })
        .await
        .unwrap();
    assert_eq!(stream.next().await.unwrap().unwrap(), 0);
    assert_eq!(stream.next().await.unwrap().unwrap(), 1);
    let Some(Err(CallError::Failed(failure))) = stream.next().await else { panic!("a failure") };
    assert_eq!(failure.reason, "stopped at 2");
    assert!(stream.next().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn dropping_a_stream_interrupts_its_handler() {
    let sharding = registered(ShardingConfig::default()).await;
    let probes = Probes::of("dropped-stream");
    let mut stream = sharding
        .client::<Counter>("dropped-stream")
        .stream(entities::Count { n: 100, fail_after: None })
        .await
        .unwrap();
    assert_eq!(stream.next().await.unwrap().unwrap(), 0);
    drop(stream);
    eventually("the handler is interrupted", || probes.interrupted.load(Ordering::SeqCst) == 1)
        .await;
}

#[tokio::test(start_paused = true)]
async fn keeps_delivering_to_resident_entities_at_the_residency_cap() {
    use cluster_testkit::memory::MemoryMessageStorage;

    let config = ShardingConfig {
        max_resident_entities: Capacity::bounded(1).unwrap(),
        entity_max_idle_time: None,
        unprocessed_message_batch_size: std::num::NonZeroU32::new(2).unwrap(),
        ..ShardingConfig::default()
    };
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config, storage).start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    let resident = sharding.client::<Counter>("resident");
    // Kept alive, it is never passivated to make room for the newcomers.
    resident.send(SetKeepAlive { enabled: true }).await.unwrap();
    assert_eq!(
        resident.send(entities::Deposit { key: "first".to_owned(), amount: 1 }).await.unwrap(),
        1
    );
    // A backlog for entities that cannot become resident, saved before the resident's request.
    for n in 1..=3 {
        let newcomer = sharding.client::<Counter>(format!("newcomer-{n}"));
        newcomer.discard(entities::Deposit { key: format!("n{n}"), amount: 1 }).await.unwrap();
    }
    // Read before the backlog: without resident-first reads it would wait forever behind it.
    let second = resident.send(entities::Deposit { key: "second".to_owned(), amount: 1 });
    let answered = tokio::time::timeout(Duration::from_secs(60), second).await;
    assert_eq!(answered.expect("the resident's request starved").unwrap(), 2);
    assert_eq!(sharding.active_entity_count(), 1, "no newcomer was admitted");
    sharding.shutdown().await;
}

/// The messages still to deliver in `storage`, on every shard. The read claims them, so it
/// releases them again.
async fn unprocessed(
    storage: &dyn cluster_core::storage::MessageStorage,
) -> Vec<cluster_core::storage::UnprocessedMessage> {
    use cluster_core::storage::UnprocessedOptions;
    use cluster_core::{Clock, ShardGroup, ShardId};

    let shards: Vec<_> =
        (1..=300).map(|id| ShardId::new(ShardGroup::default_group(), id)).collect();
    let read = storage
        .unprocessed_messages(&shards, SystemClock.now(), UnprocessedOptions::default())
        .await
        .unwrap();
    storage.reset_shards(&shards).await.unwrap();
    read.messages
}

/// A runner on a fresh in-memory message storage, with `Counter` registered.
async fn on_memory_storage(
    config: ShardingConfig,
) -> (Sharding, Arc<cluster_testkit::memory::MemoryMessageStorage>) {
    let storage =
        Arc::new(cluster_testkit::memory::MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config, Arc::clone(&storage) as _).start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    (sharding, storage)
}

#[tokio::test(start_paused = true)]
async fn does_not_busy_poll_storage_at_the_residency_cap() {
    let config = ShardingConfig {
        max_resident_entities: Capacity::bounded(1).unwrap(),
        entity_max_idle_time: Some(Duration::from_secs(5)),
        ..ShardingConfig::default()
    };
    let (sharding, storage) = on_memory_storage(config).await;
    // The one slot is held by an entity with a request in flight.
    let resident = sharding.client::<Counter>("busy-resident");
    let call = spawn_send(&resident, entities::Hang);
    let probes = Probes::of("busy-resident");
    eventually("the resident runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    // A backlog for an entity that cannot become resident.
    let newcomer = sharding.client::<Counter>("waiting-newcomer");
    newcomer.discard(entities::Deposit { key: "w".to_owned(), amount: 1 }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let before = storage.unprocessed_reads();
    // Well inside the 10 s poll interval: at most one more read.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let extra = storage.unprocessed_reads() - before;
    assert!(extra <= 1, "{extra} reads in 4 s at the cap");
    // Once the resident is interrupted and reaped, the newcomer gets its slot.
    call.abort();
    let waiting = Probes::of("waiting-newcomer");
    eventually("the newcomer is served", || waiting.deposits.load(Ordering::SeqCst) == 1).await;
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn drains_a_full_batch_without_waiting_for_the_poll_interval() {
    let config = ShardingConfig {
        unprocessed_message_batch_size: std::num::NonZeroU32::new(2).unwrap(),
        ..ShardingConfig::default()
    };
    let (runner, storage) = on_memory_storage(config.clone()).await;
    // Saved by another process: nothing wakes the runner's read loop but its poll.
    let client_config = ShardingConfig { runner_address: None, ..config.clone() };
    let client = Sharding::client_only(client_config, storage as _).start().await.unwrap();
    let drained = client.client::<Counter>("drained");
    for n in 0..5 {
        drained.discard(entities::Deposit { key: format!("d{n}"), amount: 1 }).await.unwrap();
    }
    let started = tokio::time::Instant::now();
    let probes = Probes::of("drained");
    eventually("all five are delivered", || probes.deposits.load(Ordering::SeqCst) == 5).await;
    // Three batches of at most two, one poll: without draining it would take three polls.
    assert!(started.elapsed() < config.entity_message_poll_interval * 2, "{:?}", started.elapsed());
    client.shutdown().await;
    runner.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn unbounded_max_resident_entities_does_not_limit_spawning() {
    let config =
        ShardingConfig { max_resident_entities: Capacity::Unbounded, ..ShardingConfig::default() };
    let sharding = registered(config).await;
    for n in 0..15 {
        sharding.client::<Counter>(format!("many-{n}")).send(Increment { by: 1 }).await.unwrap();
    }
    assert_eq!(sharding.active_entity_count(), 15);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn persisted_calls_to_many_entities_stay_within_the_residency_cap() {
    let config = ShardingConfig {
        max_resident_entities: Capacity::bounded(2).unwrap(),
        entity_max_idle_time: Some(Duration::from_secs(1)),
        ..ShardingConfig::default()
    };
    let (sharding, _storage) = on_memory_storage(config).await;
    let calls: Vec<_> = (0..6)
        .map(|n| {
            let client = sharding.client::<Counter>(format!("capped-{n}"));
            tokio::spawn(async move {
                client.send(entities::Deposit { key: format!("c{n}"), amount: n }).await
            })
        })
        .collect();
    // Sampled until every call is answered, and once more after (the last ones are still
    // resident then).
    let mut most = 0;
    loop {
        let done = calls.iter().all(tokio::task::JoinHandle::is_finished);
        most = most.max(sharding.active_entity_count());
        assert!(most <= 2, "{most} entities resident with a cap of 2");
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for (n, call) in calls.into_iter().enumerate() {
        assert_eq!(call.await.unwrap().unwrap(), n as u64, "each entity got its deposit");
    }
    assert!(most >= 1);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn bounded_reads_advance_past_requests_in_flight() {
    let config = ShardingConfig {
        unprocessed_message_batch_size: std::num::NonZeroU32::new(2).unwrap(),
        ..ShardingConfig::default()
    };
    let (sharding, _storage) = on_memory_storage(config).await;
    let mut stuck = Vec::new();
    for n in 0..2 {
        let client = sharding.client::<Counter>(format!("in-flight-{n}"));
        stuck.push(tokio::spawn(async move { client.send(entities::Hang).await }));
    }
    for n in 0..2 {
        let probes = Probes::of(&format!("in-flight-{n}"));
        eventually("both run", || probes.probing.load(Ordering::SeqCst) == 1).await;
    }
    // Two claimed rows fill a batch of two; the next request is still read and answered.
    let behind = sharding.client::<Counter>("behind-them");
    let answered = behind.send(entities::Deposit { key: "b".to_owned(), amount: 4 });
    let answered = tokio::time::timeout(Duration::from_secs(60), answered).await;
    assert_eq!(answered.expect("the request behind the in-flight ones starved").unwrap(), 4);
    for call in stuck {
        call.abort();
    }
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_malformed_interrupt_row_answers_its_request_with_a_defect() {
    use cluster_core::storage::MessageStorage;

    let (sharding, storage) = on_memory_storage(ShardingConfig::default()).await;
    let client = sharding.client::<Counter>("malformed-interrupt");
    let call = spawn_send(&client, entities::Hang);
    let probes = Probes::of("malformed-interrupt");
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    let request_id = probes.hung.lock().unwrap()[0];
    // An interrupt row for it that cannot be decoded.
    let interrupt = cluster_core::envelope::Interrupt {
        id: cluster_core::Snowflake::new(u64::MAX >> 2),
        address: client.address().clone(),
        request_id,
    };
    storage.save_interrupt(&interrupt).await.unwrap();
    storage.corrupt_message(interrupt.id);
    sharding.poll_storage();
    let answered = tokio::time::timeout(Duration::from_secs(60), call).await;
    match answered.expect("the caller was left waiting").unwrap() {
        Err(CallError::Defect(defect)) => assert!(defect.contains("MalformedMessage"), "{defect}"),
        other => panic!("expected a defect, got {other:?}"),
    }
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn no_interrupt_is_stored_for_persisted_requests_at_shutdown() {
    let (sharding, storage) = on_memory_storage(ShardingConfig::default()).await;
    let client = sharding.client::<Counter>("stopped-under");
    let call = spawn_send(&client, entities::Hang);
    let probes = Probes::of("stopped-under");
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    sharding.shutdown().await;
    // The caller stops waiting with a typed error (the request is left for the next owner);
    // no interrupt is stored for it.
    let result = tokio::time::timeout(Duration::from_secs(60), call).await;
    match result.expect("the caller was left waiting").unwrap() {
        Err(CallError::Cluster(ClusterError::Abandoned { address, .. })) => {
            assert_eq!(address.entity_id.as_str(), "stopped-under");
        }
        other => panic!("expected Abandoned, got {other:?}"),
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let left = unprocessed(&*storage).await;
    assert_eq!(left.len(), 1, "only the request is left for the next run: {left:?}");
}

#[tokio::test(start_paused = true)]
async fn a_caller_dropped_during_shutdown_stores_no_interrupt() {
    let config = ShardingConfig {
        entity_termination_timeout: Duration::from_secs(10),
        ..ShardingConfig::default()
    };
    let (sharding, storage) = on_memory_storage(config).await;
    let client = sharding.client::<Counter>("dropped-while-stopping");
    let call = spawn_send(&client, entities::Hang);
    let probes = Probes::of("dropped-while-stopping");
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    // The drain waits for the running request; the caller gives up meanwhile.
    let stopping = tokio::spawn({
        let sharding = sharding.clone();
        async move { sharding.shutdown().await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!stopping.is_finished(), "still draining");
    call.abort();
    let _ = call.await;
    stopping.await.unwrap();
    let left = unprocessed(&*storage).await;
    assert_eq!(left.len(), 1, "only the request is left for the next run: {left:?}");
}

#[tokio::test(start_paused = true)]
async fn an_interrupt_for_a_request_held_back_by_a_full_mailbox_is_not_lost() {
    let config = ShardingConfig {
        entity_mailbox_capacity: Capacity::bounded(2).unwrap(),
        ..ShardingConfig::default()
    };
    let (sharding, storage) = on_memory_storage(config).await;
    let client = sharding.client::<Counter>("held-back");
    let probes = Probes::of("held-back");
    let hang = || spawn_send(&client, entities::Hang);
    // The first runs, the second waits in the mailbox, the third stays in storage.
    let first = hang();
    eventually("the first runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    let second = hang();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let third = hang();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Interrupt the third while it is held back, then free a slot.
    third.abort();
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.abort();
    eventually("the second runs", || probes.probing.load(Ordering::SeqCst) == 2).await;
    second.abort();
    eventually("two handlers interrupted", || probes.interrupted.load(Ordering::SeqCst) == 2).await;
    // The third is answered with its interrupt without ever running.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let left = unprocessed(&*storage).await;
        if left.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "left unanswered: {left:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(probes.probing.load(Ordering::SeqCst), 2, "the third never ran");
    sharding.shutdown().await;
}

/// Wall-clock time that follows tokio's paused clock, so that deliver-at times pass with it.
#[derive(Debug)]
struct TokioClock {
    start: tokio::time::Instant,
}

impl cluster_core::Clock for TokioClock {
    fn now(&self) -> cluster_core::Timestamp {
        cluster_core::Timestamp::from_unix_millis(1_800_000_000_000)
            .saturating_add(self.start.elapsed())
    }
}

#[tokio::test(start_paused = true)]
async fn a_persisted_request_waits_for_its_deliver_at_time() {
    use cluster_core::Clock;

    let clock = Arc::new(TokioClock { start: tokio::time::Instant::now() });
    let storage = Arc::new(cluster_testkit::memory::MemoryMessageStorage::new(clock.clone()));
    let sharding = Sharding::standalone(ShardingConfig::default(), storage)
        .clock(clock.clone())
        .start()
        .await
        .unwrap();
    sharding.entity::<Counter>().register().unwrap();
    let client = sharding.client::<Counter>("later");
    let probes = Probes::of("later");
    let at = clock.now().saturating_add(Duration::from_secs(30));
    let call = spawn_send(&client, entities::Later { at: at.unix_millis() });
    tokio::time::sleep(Duration::from_secs(20)).await;
    assert_eq!(probes.probing.load(Ordering::SeqCst), 0, "delivered before its time");
    assert!(!call.is_finished());
    let answered = tokio::time::timeout(Duration::from_secs(60), call).await;
    answered.expect("never delivered").unwrap().unwrap();
    assert!(clock.now() >= at);
    assert_eq!(probes.probing.load(Ordering::SeqCst), 1);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn a_persisted_stream_held_back_by_a_full_mailbox_completes() {
    let config = ShardingConfig {
        entity_mailbox_capacity: Capacity::bounded(1).unwrap(),
        ..ShardingConfig::default()
    };
    let (sharding, _storage) = on_memory_storage(config).await;
    let client = sharding.client::<Counter>("stream-behind");
    let probes = Probes::of("stream-behind");
    let first = spawn_send(&client, entities::Hang);
    eventually("the first request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    let streamed = tokio::spawn({
        let client = client.clone();
        async move {
            let resume = entities::Resume { key: "behind".to_owned(), n: 3 };
            let mut stream = client.stream(resume).await.unwrap();
            let mut items = Vec::new();
            while let Some(item) = stream.next().await {
                items.push(item.unwrap());
            }
            items
        }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!streamed.is_finished(), "the mailbox is full");
    first.abort();
    let items = tokio::time::timeout(Duration::from_secs(60), streamed).await;
    assert_eq!(items.expect("the stream never completed").unwrap(), [0, 1, 2]);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn persisted_requests_wait_for_an_entity_type_registered_late() {
    let config = ShardingConfig {
        entity_registration_timeout: Duration::from_secs(6),
        entity_message_poll_interval: Duration::from_millis(500),
        ..ShardingConfig::default()
    };
    let storage =
        Arc::new(cluster_testkit::memory::MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config, storage as _).start().await.unwrap();
    let call = tokio::spawn({
        let client = sharding.client::<Counter>("late-type");
        async move { client.send(entities::Deposit { key: "late".to_owned(), amount: 9 }).await }
    });
    // Past the registration timeout, but inside the window of twice that: still held.
    tokio::time::sleep(Duration::from_millis(7_500)).await;
    assert!(!call.is_finished(), "answered before the type registered");
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    sharding.entity::<Counter>().register().unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(60), call).await;
    assert_eq!(answered.expect("never answered").unwrap().unwrap(), 9);
    sharding.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn reads_stay_full_sized_when_approaching_the_residency_cap() {
    let config = ShardingConfig {
        max_resident_entities: Capacity::bounded(5).unwrap(),
        unprocessed_message_batch_size: std::num::NonZeroU32::new(100).unwrap(),
        entity_max_idle_time: None,
        ..ShardingConfig::default()
    };
    let (sharding, storage) = on_memory_storage(config).await;
    for n in 0..4 {
        let client = sharding.client::<Counter>(format!("near-cap-{n}"));
        client.send(entities::Deposit { key: format!("k{n}"), amount: 1 }).await.unwrap();
    }
    assert_eq!(sharding.active_entity_count(), 4);
    let before = storage.unprocessed_reads();
    let fifth = sharding.client::<Counter>("near-cap-4");
    fifth.send(entities::Deposit { key: "k4".to_owned(), amount: 1 }).await.unwrap();
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(storage.unprocessed_reads() > before + 1, "the loop kept reading");
    assert_eq!(storage.smallest_read_limit(), Some(100), "every read asked for a full batch");
    sharding.shutdown().await;
}

/// Entity options out of bounds are refused at registration with a typed error: an idle time
/// past what an instant can hold once killed the instance's task on its first request and left
/// the entity unreachable for good. The longest idle time allowed works.
#[tokio::test(start_paused = true)]
async fn entity_options_out_of_bounds_are_refused_at_registration() {
    let sharding = sharding(ShardingConfig::default()).await;
    let forever = EntityOptions { max_idle_time: Some(Some(Duration::MAX)), ..Default::default() };
    let error = sharding.entity::<Counter>().options(forever).register().unwrap_err();
    assert!(matches!(error, RegisterError::InvalidOptions { .. }), "{error}");
    assert!(error.to_string().contains("EntityOptions::max_idle_time"), "{error}");
    let slow_stop =
        EntityOptions { on_stop_timeout: Some(Duration::MAX), ..EntityOptions::default() };
    let error = sharding.entity::<Counter>().options(slow_stop).register().unwrap_err();
    assert!(error.to_string().contains("EntityOptions::on_stop_timeout"), "{error}");
    let longest = cluster_core::config::ENTITY_MAX_IDLE_TIME_MAX;
    let options = EntityOptions { max_idle_time: Some(Some(longest)), ..EntityOptions::default() };
    sharding.entity::<Counter>().options(options).register().unwrap();
    let counter = sharding.client::<Counter>("idle-longest");
    assert_eq!(counter.send(Increment { by: 1 }).await.unwrap(), 1);
    assert_eq!(counter.send(Increment { by: 2 }).await.unwrap(), 3);
    sharding.shutdown().await;
}

/// What each role's builder makes of its configuration, and the configuration it refuses.
mod builder {
    use std::sync::Arc;
    use std::time::Duration;

    use cluster_core::{RunnerAddress, ShardingConfig, SystemClock};
    use cluster_sharding::{Sharding, StartError};
    use cluster_testkit::memory::{
        MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage,
    };

    fn messages() -> Arc<MemoryMessageStorage> {
        Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)))
    }

    #[tokio::test]
    async fn client_only_drops_the_runner_address() {
        let config = ShardingConfig {
            runner_address: Some(RunnerAddress::new("localhost", 34_431)),
            ..ShardingConfig::default()
        };
        let client = Sharding::client_only(config, messages()).start().await.unwrap();
        assert!(!client.is_runner(), "a client-only process hosts no entity");
        assert_eq!(client.config().runner_address, None);
        client.shutdown().await;
    }

    #[tokio::test]
    async fn a_cluster_client_drops_the_runner_address() {
        let config = ShardingConfig {
            runner_address: Some(RunnerAddress::new("localhost", 34_432)),
            ..ShardingConfig::default()
        };
        let registry = MemoryRunnerDatabase::new(Arc::new(SystemClock));
        let runners = Arc::new(MemoryRunnerStorage::new(registry, Duration::from_secs(30)));
        let client = Sharding::cluster_client(config, messages(), runners).start().await.unwrap();
        assert!(!client.is_runner(), "a cluster client hosts no entity");
        assert_eq!(client.config().runner_address, None);
        assert!(client.acquired_shards().is_empty(), "a cluster client holds no lock");
        client.shutdown().await;
    }

    #[tokio::test]
    async fn an_invalid_configuration_is_a_config_error() {
        let config = ShardingConfig { shards_per_group: 0, ..ShardingConfig::default() };
        let started = Sharding::volatile(config).start().await;
        assert!(matches!(started, Err(StartError::Config(_))), "started: {started:?}");
    }
}
