//! Persisted delivery on one runner, on the memory storage and on SQLite (the persisted cases
//! of effect's `Sharding.test.ts`): requests are stored first, delivered by the
//! storage read loop, answered once, and survive a restart of the runner.

use cluster_sharding::Plumbing;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_core::error::StorageErrorKind;
use cluster_core::storage::{MessageStorage, UnprocessedOptions};
use cluster_core::{Clock, ClusterError, ShardGroup, ShardingConfig, SystemClock};
use cluster_sharding::{CallError, EntityOptions, Sharding};
use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use cluster_testkit::memory::MemoryMessageStorage;

use cluster_testkit::faulty::{Faults, FaultyMessageStorage};
use cluster_testkit::wait::eventually;

use crate::entities::{
    CallerId, Counter, Deposit, Hang, Probes, SetKeepAlive, StoredCallerId, Stubborn, spawn_send,
};

/// A storage shared by the runners of one test, and what to remove at the end.
struct Store {
    storage: Arc<dyn MessageStorage>,
    path: Option<std::path::PathBuf>,
}

impl Drop for Store {
    fn drop(&mut self) {
        if let Some(path) = &self.path {
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
        }
    }
}

async fn memory() -> Store {
    Store { storage: Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock))), path: None }
}

async fn sqlite() -> Store {
    static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let path = std::env::temp_dir().join(format!("cluster-sharding-{}-{n}.db", std::process::id()));
    let options = SqliteOptions::new(SqlStorageOptions {
        prefix: TablePrefix::default(),
        ..SqlStorageOptions::default()
    });
    let storage = SqliteMessageStorage::open(&path, options).await.unwrap();
    Store { storage: Arc::new(storage), path: Some(path) }
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(50),
        entity_registration_timeout: Duration::from_millis(500),
        entity_termination_timeout: Duration::from_millis(200),
        ..ShardingConfig::default()
    }
}

/// A client-only process on `store` (the builder drops the config's runner address).
async fn client_only(store: &Store, config: ShardingConfig) -> Sharding {
    Sharding::client_only(config, Arc::clone(&store.storage)).start().await.unwrap()
}

async fn runner(store: &Store) -> Sharding {
    let sharding =
        Sharding::standalone(config(), Arc::clone(&store.storage)).start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    sharding
}

/// The number of unprocessed messages (see [`crate::unprocessed`]).
async fn unprocessed(store: &Store) -> usize {
    crate::unprocessed(&*store.storage).await.len()
}

macro_rules! on_every_storage {
    ($($case:ident),* $(,)?) => {
        mod memory_storage {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::memory().await, concat!("memory-", stringify!($case))).await;
                }
            )*
        }
        mod sqlite_storage {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::sqlite().await, concat!("sqlite-", stringify!($case))).await;
                }
            )*
        }
    };
}

on_every_storage!(
    persists_durable_requests_until_the_entity_replies,
    a_primary_key_runs_the_request_once,
    discard_stores_the_request_and_returns,
    durable_interrupts_go_through_storage,
    an_interrupted_server_uninterruptible_request_runs_again,
    a_duplicate_whose_caller_gives_up_does_not_interrupt_the_stored_request,
    a_duplicate_stream_whose_reader_goes_away_does_not_interrupt_the_stored_stream,
    a_later_request_goes_ahead_only_of_earlier_ones_that_reached_the_entity,
    a_kept_alive_entity_is_activated_again_after_a_restart,
    durable_requests_survive_a_restart,
    claims_of_a_killed_runner_are_released_on_start,
    reset_runs_a_request_again,
    a_client_only_process_reaches_the_runner_through_storage,
    persisted_streams_deliver_every_item,
    with_transaction_commits_the_handler_writes_with_the_reply,
    a_persisted_stream_resumes_on_the_next_runner,
    unregistered_types_are_held_then_answered_with_a_defect,
    headers_belong_to_each_request,
    a_transaction_that_cannot_begin_is_retried,
    a_commit_whose_acknowledgement_is_lost_is_settled_from_storage,
    a_commit_that_failed_runs_the_request_again,
    a_local_request_goes_to_its_entity_without_a_storage_read,
    a_caller_that_leaves_while_its_transaction_begins_interrupts_the_request,
    requests_left_to_the_read_loop_keep_their_entitys_order,
    a_transaction_request_runs_once_while_its_transaction_begins,
    a_request_another_process_stored_comes_before_a_later_local_one,
    a_persisted_streams_final_reply_is_never_dropped,
    a_type_registered_late_is_not_refused_for_an_earlier_types_timeout,
    a_request_the_read_loop_answers_while_direct_delivery_checks_order_runs_once,
    a_request_whose_id_is_taken_is_saved_with_a_fresh_id,
);

/// Waits until the request `tag` with primary key `key` of `address` has a final reply (with
/// lookups that claim nothing, unlike [`unprocessed`], so a running runner is not disturbed).
async fn answered(store: &Store, address: &cluster_core::EntityAddress, tag: &str, key: &str) {
    let key = cluster_core::envelope::primary_key(address, tag, key);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(request_id) = store.storage.request_id_for_primary_key(&key).await.unwrap() {
            let replies = store.storage.replies_for_unfiltered(&[request_id]).await.unwrap();
            if replies.iter().any(cluster_core::envelope::Reply::is_final) {
                return;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "{tag} {key} is not answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A runner on `store` that counts its storage reads and whose read loop polls only hourly,
/// with `options` for its counters, and the faults of its storage.
async fn counted_runner(
    store: &Store,
    options: EntityOptions,
) -> (Sharding, Arc<std::sync::atomic::AtomicUsize>, Arc<Faults>) {
    let config =
        ShardingConfig { entity_message_poll_interval: Duration::from_secs(3600), ..config() };
    let (sharding, reads, faults) = observed_runner(store, config).await;
    sharding.entity::<Counter>().options(options).register().unwrap();
    (sharding, reads, faults)
}

/// A runner on `store` configured with `config`, with no entity type registered, that counts
/// its storage reads, and the faults of its storage.
async fn observed_runner(
    store: &Store,
    config: ShardingConfig,
) -> (Sharding, Arc<std::sync::atomic::AtomicUsize>, Arc<Faults>) {
    let (storage, faults) = FaultyMessageStorage::new(Arc::clone(&store.storage));
    let reads = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&reads);
    faults.observe(Arc::new(move |event| {
        if let cluster_testkit::faulty::StorageEvent::Read(_) = event {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    }));
    let sharding = Sharding::standalone(config, Arc::new(storage)).start().await.unwrap();
    (sharding, reads, faults)
}

/// Once the read loop has caught up with its shards, a persisted request saved by the runner
/// that serves its shard goes straight to its entity: no storage read per request (the
/// reference reads storage for each), and each is answered once.
async fn a_local_request_goes_to_its_entity_without_a_storage_read(store: Store, id: &str) {
    let (sharding, reads, _faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    let deposit = |n: u64| Deposit { key: format!("{id}-{n}"), amount: n };
    // The first one may wake the read loop, which then catches up.
    assert_eq!(counter.send(deposit(1)).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    let before = reads.load(Ordering::SeqCst);
    let mut balance = 1;
    for n in 2..=21 {
        balance += n;
        assert_eq!(counter.send(deposit(n)).await.unwrap(), balance);
    }
    // At most one read that was already due (a wake-up left from the first request).
    let during = reads.load(Ordering::SeqCst) - before;
    assert!(during <= 1, "{during} storage reads for 20 requests");
    assert_eq!(crate::entities::Probes::of(id).deposits.load(Ordering::SeqCst), 21);
    sharding.shutdown().await;
    assert_eq!(unprocessed(&store).await, 0);
}

/// A caller that goes away while its request's transaction begins interrupts the request
/// (dropping a persisted call stores an interrupt, which reaches the request although the read
/// loop polls only hourly): its handler never runs, nothing is committed, and the request is
/// answered with the interruption.
async fn a_caller_that_leaves_while_its_transaction_begins_interrupts_the_request(
    store: Store,
    id: &str,
) {
    let (sharding, reads, faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    // The first request may wake the read loop, which then catches up.
    assert_eq!(counter.send(Deposit { key: format!("{id}-first"), amount: 1 }).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    faults.delay_begin_transaction(Duration::from_millis(300));
    let left = tokio::time::timeout(Duration::from_millis(50), counter.send(book("left"))).await;
    assert!(left.is_err(), "the caller left before the transaction began");
    answered(&store, counter.address(), "Book", "left").await;
    assert_eq!(Probes::of(id).booked.load(Ordering::SeqCst), 0, "the handler ran");
    assert_eq!(faults.commits(), 0, "nothing was committed");
    assert_ledger(&store, "left", 0).await;
    sharding.shutdown().await;
}

/// Requests to an entity whose mailbox is full are left to the read loop, and the requests to
/// that entity after them follow them there: each deposit's stored reply is the balance after
/// the deposits before it, in the order they were sent.
async fn requests_left_to_the_read_loop_keep_their_entitys_order(store: Store, id: &str) {
    let capacity = cluster_core::config::Capacity::Bounded(std::num::NonZeroU32::MIN);
    let options = EntityOptions { mailbox_capacity: Some(capacity), ..EntityOptions::default() };
    let (sharding, _reads, _faults) = counted_runner(&store, options).await;
    let counter = sharding.client::<Counter>(id);
    let probes = crate::entities::Probes::of(id);
    // Occupy the entity: its handler waits for a permit.
    let gated = {
        let counter = counter.clone();
        tokio::spawn(async move { counter.send(crate::entities::Gated).await })
    };
    eventually("the gated request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1).await;
    let deposit = |n: u32| Deposit { key: format!("{id}-{n}"), amount: 1 << n };
    // One fits the mailbox; the next ones find it full or follow one that did.
    for n in 0..8 {
        counter.discard(deposit(n)).await.unwrap();
    }
    probes.gate.add_permits(1);
    assert_eq!(gated.await.unwrap().unwrap(), 1);
    for n in 0..8 {
        // Sent again: the stored reply of the first run.
        let reply = tokio::time::timeout(Duration::from_secs(20), counter.send(deposit(n)));
        let balance = reply.await.expect("answered in time").unwrap();
        assert_eq!(balance, (1 << (n + 1)) - 1, "deposit {n} ran out of order");
    }
    assert_eq!(probes.deposits.load(Ordering::SeqCst), 8);
    sharding.shutdown().await;
}

/// Direct delivery lets a request go ahead of an earlier request of its entity only once that
/// one reached the entity (`tracked::Earlier`). An earlier request whose outcome is being stored
/// (settling) counts as delivered: it ran, and a later request need not wait for its reply's
/// write. A request that waits behind a full mailbox has not reached the entity and keeps its
/// place: the later request waits behind it.
///
/// (Kept as the proof that counting settling requests as delivered lets no request run before
/// an earlier one's first run: a request settles only after it ran. The one that settles and
/// waits for room is an interrupted server-uninterruptible request about to run again; its
/// re-run comes after the requests queued meanwhile in any case, as the reference offers it to
/// the entity again behind them: `effect/src/cluster/internal/entityManager.ts`.)
async fn a_later_request_goes_ahead_only_of_earlier_ones_that_reached_the_entity(
    store: Store,
    id: &str,
) {
    let options = EntityOptions {
        mailbox_capacity: cluster_core::config::Capacity::bounded(1),
        ..EntityOptions::default()
    };
    let (sharding, reads, faults) = counted_runner(&store, options).await;
    let counter = sharding.client::<Counter>(id);
    let probes = Probes::of(id);
    let deposit = |key: &str| Deposit { key: key.to_owned(), amount: 1 };
    // The first one may wake the read loop, which then catches up.
    assert_eq!(counter.send(deposit("k0")).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    // Settling: k1 ran and its reply is being written (for 2 s); k2 goes directly meanwhile.
    faults.delay_replies(Duration::from_secs(2));
    let settling = spawn_send(&counter, deposit("k1"));
    eventually("k1 runs", || probes.deposits.load(Ordering::SeqCst) == 2).await;
    let read = reads.load(Ordering::SeqCst);
    let later = spawn_send(&counter, deposit("k2"));
    eventually("k2 runs", || probes.deposits.load(Ordering::SeqCst) == 3).await;
    assert!(!settling.is_finished(), "k2 ran before k1's reply was stored");
    assert_eq!(reads.load(Ordering::SeqCst), read, "k2 went to its entity directly");
    faults.delay_replies(Duration::ZERO);
    assert_eq!(settling.await.unwrap().unwrap(), 2);
    assert_eq!(later.await.unwrap().unwrap(), 3);
    // Behind a full mailbox: the gated request fills it, k3 waits in storage, and k4 after it.
    let gated = spawn_send(&counter, crate::entities::Gated);
    eventually("the gated request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1).await;
    let waiting = spawn_send(&counter, deposit("k3"));
    stored_deposit(&store, counter.address(), "k3").await;
    let behind = spawn_send(&counter, deposit("k4"));
    stored_deposit(&store, counter.address(), "k4").await;
    probes.gate.add_permits(1);
    for call in [waiting, behind] {
        tokio::time::timeout(Duration::from_secs(20), call).await.unwrap().unwrap().unwrap();
    }
    gated.await.unwrap().unwrap();
    let ran = probes.deposit_keys.lock().unwrap().clone();
    assert_eq!(ran, ["k0", "k1", "k2", "k3", "k4"], "the entity's requests ran in storage order");
    sharding.shutdown().await;
}

/// Waits until the `Deposit` with primary key `key` of `address` is stored.
async fn stored_deposit(store: &Store, address: &cluster_core::EntityAddress, key: &str) {
    let key = cluster_core::envelope::primary_key(address, "Deposit", key);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while store.storage.request_id_for_primary_key(&key).await.unwrap().is_none() {
        assert!(tokio::time::Instant::now() < deadline, "{key} is not stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A runner on `store` whose storage fails on demand. Its reply poller is too slow to help:
/// callers get their replies from the runner's own settlement or not in time.
async fn faulty_runner(store: &Store) -> (Sharding, Arc<Faults>) {
    let (storage, faults) = FaultyMessageStorage::new(Arc::clone(&store.storage));
    let config =
        ShardingConfig { entity_reply_poll_interval: Duration::from_secs(3600), ..config() };
    let sharding = Sharding::standalone(config, Arc::new(storage)).start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    (sharding, faults)
}

/// On SQLite, checks the handler's committed ledger rows for `key` (memory storage has none).
async fn assert_ledger(store: &Store, key: &str, rows: i64) {
    if let Some(found) = ledger_rows(store, key).await {
        assert_eq!(found, rows, "ledger rows of {key}");
    }
}

fn book(key: &str) -> crate::entities::Book {
    crate::entities::Book { key: key.to_owned(), fail: false }
}

/// Books `key`, failing the test instead of hanging.
async fn booked(counter: &cluster_sharding::EntityClient<Counter>, key: &str) -> u64 {
    let booking = tokio::time::timeout(Duration::from_secs(20), counter.send(book(key)));
    booking.await.expect("answered in time").unwrap()
}

/// A `WITH_TRANSACTION` request whose transaction cannot begin is released and read again
/// after `send_retry_interval`; it runs once the storage recovers.
async fn a_transaction_that_cannot_begin_is_retried(store: Store, id: &str) {
    let (sharding, faults) = faulty_runner(&store).await;
    faults.fail_begin_transaction(2);
    let counter = sharding.client::<Counter>(id);
    assert_eq!(booked(&counter, "later").await, 1, "ran once, after the failures");
    assert_eq!(faults.begin_transaction_calls(), 3);
    assert_eq!(faults.commits(), 1);
    assert_ledger(&store, "later", 1).await;
    sharding.shutdown().await;
}

/// A commit that happened but reported an error: the stored final reply settles it, the
/// caller gets it and the request does not run again.
async fn a_commit_whose_acknowledgement_is_lost_is_settled_from_storage(store: Store, id: &str) {
    let (sharding, faults) = faulty_runner(&store).await;
    faults.lose_commit_acknowledgement(1);
    let counter = sharding.client::<Counter>(id);
    assert_eq!(booked(&counter, "lost-ack").await, 1);
    // The next request to the instance shows that the first ran exactly once.
    assert_eq!(booked(&counter, "after").await, 2);
    assert_eq!(faults.commits(), 2);
    assert_ledger(&store, "lost-ack", 1).await;
    assert_eq!(unprocessed(&store).await, 0);
    sharding.shutdown().await;
}

/// A commit that failed: no final reply is stored, so the request is released and runs again;
/// the caller gets the second run's reply and only its writes are kept.
async fn a_commit_that_failed_runs_the_request_again(store: Store, id: &str) {
    let (sharding, faults) = faulty_runner(&store).await;
    faults.fail_commit(1);
    let counter = sharding.client::<Counter>(id);
    // The instance's own state saw both runs; storage only the second.
    assert_eq!(booked(&counter, "again").await, 2);
    assert_eq!(faults.commits(), 2);
    assert_ledger(&store, "again", 1).await;
    assert_eq!(unprocessed(&store).await, 0);
    sharding.shutdown().await;
}

/// Effect's `Sharding.test.ts`: the first caller's context is not frozen into the entity; headers
/// travel with each request, through storage for persisted ones.
async fn headers_belong_to_each_request(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let from_a = counter.with_headers([("caller-id", "A")]);
    // The call that creates the entity carries the header.
    assert_eq!(from_a.send(CallerId).await.unwrap().as_deref(), Some("A"));
    assert_eq!(counter.send(CallerId).await.unwrap(), None);
    assert_eq!(counter.send(StoredCallerId).await.unwrap(), None);
    assert_eq!(from_a.send(StoredCallerId).await.unwrap().as_deref(), Some("A"));
    let from_b = from_a.with_headers([("caller-id", "B")]);
    assert_eq!(from_b.send(StoredCallerId).await.unwrap().as_deref(), Some("B"));
    assert_eq!(counter.with_headers::<&str, &str>([]).send(CallerId).await.unwrap(), None);
    sharding.shutdown().await;
}

async fn persists_durable_requests_until_the_entity_replies(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let key = "k1".to_owned();
    assert_eq!(counter.send(Deposit { key, amount: 4 }).await.unwrap(), 4);
    assert_eq!(unprocessed(&store).await, 0, "the request is processed");
    sharding.shutdown().await;
}

async fn a_primary_key_runs_the_request_once(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    assert_eq!(counter.send(Deposit { key: "once".to_owned(), amount: 5 }).await.unwrap(), 5);
    // The same key again is answered from storage: the handler does not run again.
    assert_eq!(counter.send(Deposit { key: "once".to_owned(), amount: 5 }).await.unwrap(), 5);
    assert_eq!(counter.send(Deposit { key: "twice".to_owned(), amount: 1 }).await.unwrap(), 6);
    assert_eq!(Probes::of(id).deposits.load(Ordering::SeqCst), 2);
    sharding.shutdown().await;
}

async fn discard_stores_the_request_and_returns(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    counter.discard(Deposit { key: "d".to_owned(), amount: 3 }).await.unwrap();
    let probes = Probes::of(id);
    eventually("the discarded request runs", || probes.deposits.load(Ordering::SeqCst) == 1).await;
    // Its reply is stored: the same key is answered without running again.
    assert_eq!(counter.send(Deposit { key: "d".to_owned(), amount: 3 }).await.unwrap(), 3);
    assert_eq!(probes.deposits.load(Ordering::SeqCst), 1);
    sharding.shutdown().await;
}

async fn durable_interrupts_go_through_storage(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let probes = Probes::of(id);
    let call = spawn_send(&counter, Hang);
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    call.abort();
    eventually("the handler is interrupted", || probes.interrupted.load(Ordering::SeqCst) == 1)
        .await;
    // The interrupt exit is the request's final reply: nothing is left to deliver.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while unprocessed(&store).await != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the request was not answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sharding.shutdown().await;
}

/// A caller that sends a request again with the key of a stored, unanswered one (a retry, or
/// another caller of the same work) waits for that request, and when it gives up it does not
/// interrupt it: the request is the first caller's, who still waits. The reference's client
/// interrupts the request id it made, which a duplicate never stored
/// (`effect/src/cluster/Sharding.ts`, the client's `Interrupt`). Before, the second caller's
/// interrupt was stored for the first caller's request, which ended interrupted.
async fn a_duplicate_whose_caller_gives_up_does_not_interrupt_the_stored_request(
    store: Store,
    id: &str,
) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let probes = Probes::of(id);
    let first = spawn_send(&counter, crate::entities::Gated);
    eventually("the request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1).await;
    let again =
        tokio::time::timeout(Duration::from_millis(200), counter.send(crate::entities::Gated));
    assert!(again.await.is_err(), "the stored request is still running");
    // An interrupt stored now wakes the read loop, which hands it to the handler at once.
    let watched_until = tokio::time::Instant::now() + Duration::from_secs(1);
    while tokio::time::Instant::now() < watched_until {
        if first.is_finished() {
            panic!("the first caller's request ended early: {:?}", first.await);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    probes.gate.add_permits(1);
    let answer = tokio::time::timeout(Duration::from_secs(20), first).await;
    assert_eq!(answer.expect("answered in time").unwrap().unwrap(), 1);
    assert_eq!(probes.gated_runs.load(Ordering::SeqCst), 1, "it ran once");
    sharding.shutdown().await;
}

/// The same for a persisted stream: a second reader of a stored stream (opened with its key)
/// that goes away does not interrupt the stream, whose first reader still reads it.
async fn a_duplicate_stream_whose_reader_goes_away_does_not_interrupt_the_stored_stream(
    store: Store,
    id: &str,
) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let probes = Probes::of(id);
    // The handler stops before its second item, until it is interrupted.
    probes.hang_at.store(1, Ordering::SeqCst);
    let resume = || crate::entities::Resume { key: "s".to_owned(), n: 3 };
    let mut first = counter.stream(resume()).await.unwrap();
    assert_eq!(first.next().await.unwrap().unwrap(), 0);
    drop(counter.stream(resume()).await.unwrap());
    // An interrupt stored now wakes the read loop, which hands it to the handler at once, and
    // the stream ends with the interrupt.
    let next = tokio::time::timeout(Duration::from_secs(1), first.next()).await;
    assert!(next.is_err(), "the first reader's stream ended early: {next:?}");
    drop(first);
    sharding.shutdown().await;
}

async fn an_interrupted_server_uninterruptible_request_runs_again(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let probes = Probes::of(id);
    let call = spawn_send(&counter, Stubborn);
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    // Only the server side is uninterruptible: dropping the call sends a durable interrupt.
    call.abort();
    eventually("the handler is interrupted", || probes.interrupted.load(Ordering::SeqCst) == 1)
        .await;
    eventually("it runs again", || probes.probing.load(Ordering::SeqCst) == 2).await;
    // The second run's reply is the stored final reply: the same key answers with it.
    let reply = tokio::time::timeout(Duration::from_secs(20), counter.send(Stubborn)).await;
    assert_eq!(reply.expect("answered in time").unwrap(), 2);
    assert_eq!(probes.probing.load(Ordering::SeqCst), 2, "not run a third time");
    sharding.shutdown().await;
}

async fn a_kept_alive_entity_is_activated_again_after_a_restart(store: Store, id: &str) {
    let probes = Probes::of(id);
    let first = runner(&store).await;
    first.client::<Counter>(id).send(SetKeepAlive { enabled: true }).await.unwrap();
    assert_eq!(probes.created.load(Ordering::SeqCst), 1);
    first.shutdown().await;
    assert_eq!(unprocessed(&store).await, 1, "the keep-alive request stays stored");
    // The next run creates the entity from the stored keep-alive alone.
    let second = runner(&store).await;
    eventually("the entity is activated again", || probes.created.load(Ordering::SeqCst) == 2)
        .await;
    second.client::<Counter>(id).send(SetKeepAlive { enabled: false }).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while unprocessed(&store).await != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the keep-alive was not answered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    second.shutdown().await;
    assert_eq!(probes.created.load(Ordering::SeqCst), 2);
}

async fn durable_requests_survive_a_restart(store: Store, id: &str) {
    // The first run stops while the request is in flight: it is left stored, unanswered.
    let first = runner(&store).await;
    let counter = first.client::<Counter>(id);
    let probes = Probes::of(id);
    counter.discard(Hang).await.unwrap();
    eventually("the request runs", || probes.probing.load(Ordering::SeqCst) == 1).await;
    first.shutdown().await;
    assert_eq!(probes.interrupted.load(Ordering::SeqCst), 1);
    assert_eq!(unprocessed(&store).await, 1, "left for the next run");
    // The next run on the same storage delivers it again.
    let second = runner(&store).await;
    eventually("the request runs again", || probes.probing.load(Ordering::SeqCst) == 2).await;
    second.shutdown().await;
}

async fn unregistered_types_are_held_then_answered_with_a_defect(store: Store, id: &str) {
    let sharding =
        Sharding::standalone(config(), Arc::clone(&store.storage)).start().await.unwrap();
    let started = tokio::time::Instant::now();
    let error = sharding
        .client::<Counter>(id)
        .send(Deposit { key: "x".to_owned(), amount: 1 })
        .await
        .unwrap_err();
    let CallError::Defect(defect) = error else { panic!("{error:?}") };
    assert!(defect.contains("Entity type 'Counter' not registered"), "{defect}");
    // Held for twice the registration timeout when no entity registered at all.
    assert!(started.elapsed() >= Duration::from_millis(1000), "{:?}", started.elapsed());
    sharding.shutdown().await;
}

async fn claims_of_a_killed_runner_are_released_on_start(store: Store, id: &str) {
    // A runner that was killed left a claimed, unanswered request (claims hide a row for ten
    // minutes). Simulate it: store a request and claim it without answering.
    let stored = Sharding::standalone(config(), Arc::clone(&store.storage)).start().await.unwrap();
    let client = stored.client::<Counter>(id);
    client.discard(Deposit { key: "claimed".to_owned(), amount: 9 }).await.unwrap();
    stored.shutdown().await;
    let shards: Vec<_> =
        (1..=300).map(|id| cluster_core::ShardId::new(ShardGroup::default_group(), id)).collect();
    let claimed = store
        .storage
        .unprocessed_messages(&shards, SystemClock.now(), UnprocessedOptions::default())
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    // A new runner on the storage releases the claim and answers the request.
    let second = runner(&store).await;
    let probes = Probes::of(id);
    eventually("the claimed request runs", || probes.deposits.load(Ordering::SeqCst) == 1).await;
    second.shutdown().await;
}

async fn reset_runs_a_request_again(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    assert_eq!(counter.send(Deposit { key: "r".to_owned(), amount: 2 }).await.unwrap(), 2);
    let key = cluster_core::envelope::primary_key(counter.address(), "Deposit", "r");
    let request_id = store.storage.request_id_for_primary_key(&key).await.unwrap().unwrap();
    // A stale expected reply id changes nothing.
    sharding.reset(request_id, Some(cluster_core::Snowflake::new(1))).await.unwrap();
    sharding.reset(request_id, None).await.unwrap();
    let probes = Probes::of(id);
    eventually("the request runs again", || probes.deposits.load(Ordering::SeqCst) == 2).await;
    sharding.shutdown().await;
    // Without a message storage the error says so, and how to give one.
    let volatile = Sharding::volatile(config()).start().await.unwrap();
    let error = volatile.reset(request_id, None).await.unwrap_err();
    let kind = match &error {
        ClusterError::Persistence(cause) => Some(cause.kind()),
        _ => None,
    };
    assert_eq!(kind, Some(StorageErrorKind::InvalidInput), "{error:?}");
    assert!(error.to_string().contains("Sharding::standalone"), "{error}");
    volatile.shutdown().await;
}

mod single_runner {
    use std::sync::Arc;
    use std::time::Duration;

    use cluster_core::{RunnerAddress, ShardingConfig, SystemClock};
    use cluster_sharding::{Sharding, StartError};
    use cluster_testkit::memory::{
        MemoryMessageStorage, MemoryRunnerDatabase, MemoryRunnerStorage,
    };

    use crate::entities::{Counter, Gated};

    fn at(port: u16) -> ShardingConfig {
        ShardingConfig {
            runner_address: Some(RunnerAddress::new("localhost", port)),
            ..super::config()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_runner_on_the_same_database_is_refused_until_the_first_stops() {
        let clock = Arc::new(SystemClock);
        let messages = Arc::new(MemoryMessageStorage::new(clock.clone()));
        let database = MemoryRunnerDatabase::new(clock.clone());
        let runners =
            |expiration| Arc::new(MemoryRunnerStorage::new(Arc::clone(&database), expiration));
        // A single runner at `port` on the shared storages.
        let single = |port| {
            Sharding::single_runner(at(port), messages.clone(), runners(Duration::from_secs(60)))
                .clock(clock.clone())
                .start()
        };
        let first = single(1).await.unwrap();
        let refused = single(2).await;
        assert!(
            matches!(refused, Err(StartError::ShardsHeld { held: 300, total: 300 })),
            "{refused:?}"
        );
        first.shutdown().await;
        let second = single(2).await.unwrap();
        second.shutdown().await;
        let client_only = ShardingConfig { runner_address: None, ..super::config() };
        let refused =
            Sharding::single_runner(client_only, messages, runners(Duration::from_secs(60)))
                .clock(clock)
                .start()
                .await;
        assert!(matches!(refused, Err(StartError::NoRunnerAddress)), "{refused:?}");
    }

    /// A single runner frozen past its lease hands none of its own persisted requests to an
    /// entity until a lock refresh answers: its leases may have expired and another runner may
    /// hold the shards, which would run the unclaimed row too. It ran them at once before
    /// direct delivery checked the lease (seen 10 ms after the thaw): its flag of every shard
    /// served is set by the refreshes, and none had answered yet. Paused time makes the freeze
    /// exact.
    #[tokio::test(start_paused = true)]
    async fn a_single_runner_frozen_past_its_lease_runs_nothing_until_a_refresh_answers() {
        use cluster_testkit::faulty::FaultyRunnerStorage;

        let clock = Arc::new(SystemClock);
        let expiration = Duration::from_secs(3);
        let config = ShardingConfig {
            shard_lock_refresh_interval: Duration::from_millis(500),
            shard_lock_expiration: expiration,
            ..at(1)
        };
        let runners =
            MemoryRunnerStorage::new(MemoryRunnerDatabase::new(clock.clone()), expiration);
        let (runners, faults) = FaultyRunnerStorage::new(Arc::new(runners));
        let sharding = Sharding::single_runner(
            config,
            Arc::new(MemoryMessageStorage::new(clock)),
            Arc::new(runners),
        )
        .start()
        .await
        .unwrap();
        sharding.entity::<Counter>().register().unwrap();
        let id = "single-runner-frozen";
        let probes = crate::entities::Probes::of(id);
        // Answered once the read loop has read every shard: direct delivery is on.
        let warm = sharding.client::<Counter>("single-runner-frozen-warm");
        warm.send(crate::entities::Persist).await.unwrap();
        // Within the refresh's timeout (the refresh interval).
        let refresh_answers_after = Duration::from_millis(400);
        faults.delay_locks(refresh_answers_after);
        tokio::time::advance(expiration).await;
        let thawed = tokio::time::Instant::now();
        sharding.client::<Counter>(id).discard(crate::entities::Persist).await.unwrap();
        super::eventually("the request runs", || {
            probes.created.load(std::sync::atomic::Ordering::SeqCst) == 1
        })
        .await;
        let ran_after = thawed.elapsed();
        assert!(
            ran_after >= refresh_answers_after,
            "the frozen runner ran its request {ran_after:?} after it continued, before its \
             refresh answered"
        );
        faults.delay_locks(Duration::ZERO);
        sharding.shutdown().await;
    }

    /// Two single runners on one SQLite file never both answer a request. The first one's
    /// lock refreshes stop (a frozen process) while a request runs: once its leases could have
    /// expired it serves no shard and interrupts the request, which it leaves stored. A second
    /// runner then takes every shard and answers the request. When the first one's refreshes
    /// come back, it finds its locks lost and keeps away.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn two_single_runners_on_one_sqlite_file_never_both_answer() {
        use cluster_core::storage::{MessageStorage, RunnerStorage};
        use cluster_storage_sql::sqlite::{
            SqliteMessageStorage, SqliteOptions, SqliteRunnerStorage,
        };
        use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
        use cluster_testkit::faulty::FaultyRunnerStorage;

        let path =
            std::env::temp_dir().join(format!("cluster-two-runners-{}.db", std::process::id()));
        let config = |port| ShardingConfig {
            shard_lock_refresh_interval: Duration::from_millis(500),
            shard_lock_expiration: Duration::from_secs(3),
            ..at(port)
        };
        let options =
            SqliteOptions::new(SqlStorageOptions::from_config(&config(1), TablePrefix::default()));
        let messages: Arc<dyn MessageStorage> =
            Arc::new(SqliteMessageStorage::open(&path, options.clone()).await.unwrap());
        let runners = SqliteRunnerStorage::open(&path, options.clone()).await.unwrap();
        let (runners, faults) = FaultyRunnerStorage::new(Arc::new(runners));
        let clock = Arc::new(SystemClock);
        let first = Sharding::single_runner(config(1), messages.clone(), Arc::new(runners))
            .clock(clock.clone())
            .start()
            .await
            .unwrap();
        first.entity::<Counter>().register().unwrap();
        let id = "two-runners";
        let probes = crate::entities::Probes::of(id);
        let runs = || probes.gated_runs.load(std::sync::atomic::Ordering::SeqCst);
        let call = crate::entities::spawn_send(&first.client::<Counter>(id), Gated);
        super::eventually("the first run starts", || runs() == 1).await;
        faults.fail_refresh(true);
        super::eventually("the first runner stops serving", || first.acquired_shards().is_empty())
            .await;
        // Once the leases expired, a second runner takes every shard and runs the request.
        let runners: Arc<dyn RunnerStorage> =
            Arc::new(SqliteRunnerStorage::open(&path, options).await.unwrap());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let second = loop {
            let start = Sharding::single_runner(config(2), messages.clone(), runners.clone())
                .clock(clock.clone())
                .start();
            match start.await {
                Ok(second) => break second,
                Err(StartError::ShardsHeld { .. }) => {
                    assert!(tokio::time::Instant::now() < deadline, "the leases never expired");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(error) => panic!("{error}"),
            }
        };
        second.entity::<Counter>().register().unwrap();
        super::eventually("the second run starts", || runs() == 2).await;
        // Enough for both runs: only the second one may answer.
        probes.gate.add_permits(2);
        let caller = ShardingConfig { runner_address: None, ..super::config() };
        let caller = Sharding::client_only(caller, messages).clock(clock).start().await.unwrap();
        let counter = caller.client::<Counter>(id);
        let answer = tokio::time::timeout(Duration::from_secs(20), counter.send(Gated)).await;
        assert_eq!(answer.expect("answered in time").unwrap(), 2, "the second runner answered");
        faults.fail_refresh(false);
        // Its refreshes answer again, without its locks: it still serves nothing.
        let refreshed = faults.refreshes_with_shards();
        super::eventually("the first runner refreshes again", || {
            faults.refreshes_with_shards() > refreshed + 1
        })
        .await;
        assert!(first.acquired_shards().is_empty(), "the first runner serves shards it lost");
        call.abort();
        for sharding in [&caller, &second, &first] {
            sharding.shutdown().await;
        }
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
}

async fn a_client_only_process_reaches_the_runner_through_storage(store: Store, id: &str) {
    let runner = runner(&store).await;
    let client = client_only(&store, config()).await;
    assert!(!client.is_runner());
    client.entity::<Counter>().register().unwrap();
    assert_eq!(client.active_entity_count(), 0, "a client hosts nothing");
    let remote = client.client::<Counter>(id);
    assert_eq!(remote.send(Deposit { key: "c".to_owned(), amount: 8 }).await.unwrap(), 8);
    assert_eq!(Probes::of(id).deposits.load(Ordering::SeqCst), 1);
    let volatile = remote.send(crate::entities::Get).await.unwrap_err();
    assert!(
        matches!(
            volatile,
            CallError::Cluster(cluster_core::ClusterError::EntityNotAssignedToRunner { .. })
        ),
        "{volatile:?}"
    );
    client.shutdown().await;
    runner.shutdown().await;
}

async fn persisted_streams_deliver_every_item(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let mut stream =
        counter.stream(crate::entities::Resume { key: "s".to_owned(), n: 5 }).await.unwrap();
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push(item.unwrap());
    }
    assert_eq!(items, [0, 1, 2, 3, 4]);
    assert_eq!(unprocessed(&store).await, 0, "the stream and its acknowledgements are processed");
    sharding.shutdown().await;
}

async fn a_persisted_stream_resumes_on_the_next_runner(store: Store, id: &str) {
    let probes = Probes::of(id);
    probes.hang_at.store(2, Ordering::SeqCst);
    let first = runner(&store).await;
    // The caller lives in another process than both runners.
    let caller = client_only(&store, config()).await;
    let mut stream = caller
        .client::<Counter>(id)
        .stream(crate::entities::Resume { key: "r".to_owned(), n: 5 })
        .await
        .unwrap();
    assert_eq!(stream.next().await.unwrap().unwrap(), 0);
    assert_eq!(stream.next().await.unwrap().unwrap(), 1);
    // The first runner stops while its handler is stuck before item 2.
    first.shutdown().await;
    probes.hang_at.store(u64::MAX, Ordering::SeqCst);
    let second = runner(&store).await;
    let mut rest = Vec::new();
    while let Some(item) = stream.next().await {
        rest.push(item.unwrap());
    }
    assert_eq!(rest, [2, 3, 4], "resumed after the last sent chunk");
    caller.shutdown().await;
    second.shutdown().await;
}

/// The ledger rows with `key` (SQLite only; the memory storage has no tables of its own).
async fn ledger_rows(store: &Store, key: &str) -> Option<i64> {
    store.path.as_ref()?;
    let mut transaction = store.storage.begin_transaction().await.unwrap();
    let handle = transaction
        .backend_as::<cluster_storage_sql::sqlite::SqliteTransactionHandle>()
        .expect("an SQLite store's transaction");
    let key = key.to_owned();
    let rows = handle
        .run(move |connection| {
            connection.execute("CREATE TABLE IF NOT EXISTS ledger (key TEXT NOT NULL)", [])?;
            connection
                .query_row("SELECT COUNT(*) FROM ledger WHERE key = ?1", [key], |row| row.get(0))
        })
        .await
        .unwrap();
    transaction.rollback().await.unwrap();
    Some(rows)
}

async fn with_transaction_commits_the_handler_writes_with_the_reply(store: Store, id: &str) {
    let sharding = runner(&store).await;
    let counter = sharding.client::<Counter>(id);
    let booked = counter.send(crate::entities::Book { key: "ok".to_owned(), fail: false }).await;
    assert_eq!(booked.unwrap(), 1);
    // The same key is answered from the committed reply, without running again.
    assert_eq!(
        counter.send(crate::entities::Book { key: "ok".to_owned(), fail: false }).await.unwrap(),
        1
    );
    let failed = counter.send(crate::entities::Book { key: "bad".to_owned(), fail: true }).await;
    assert!(
        matches!(failed, Err(CallError::Failed(ref failure)) if failure.reason == "failed after writing"),
        "{failed:?}"
    );
    if store.path.is_some() {
        assert_eq!(ledger_rows(&store, "ok").await, Some(1), "the write committed with the reply");
        assert_eq!(
            ledger_rows(&store, "bad").await,
            Some(0),
            "a failed handler's write is rolled back"
        );
    }
    sharding.shutdown().await;
}

/// A `WITH_TRANSACTION` request that goes directly to its entity runs once, although the read
/// loop reads its row while its transaction begins: one transaction, one run, one step of the
/// entity's state.
async fn a_transaction_request_runs_once_while_its_transaction_begins(store: Store, id: &str) {
    let (sharding, reads, faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    assert_eq!(counter.send(Deposit { key: format!("{id}-first"), amount: 1 }).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    faults.delay_begin_transaction(Duration::from_millis(300));
    let booking = spawn_send(&counter, book("once"));
    eventually("its transaction begins", || faults.begin_transaction_calls() == 1).await;
    let before = reads.load(Ordering::SeqCst);
    sharding.poll_storage();
    eventually("the read loop reads meanwhile", || reads.load(Ordering::SeqCst) > before).await;
    let booked = tokio::time::timeout(Duration::from_secs(20), booking).await;
    assert_eq!(booked.expect("answered in time").unwrap().unwrap(), 2);
    faults.delay_begin_transaction(Duration::ZERO);
    // The next request shows that the entity's state advanced once.
    assert_eq!(self::booked(&counter, "after").await, 3);
    assert_eq!(faults.begin_transaction_calls(), 2, "one transaction per request");
    assert_eq!(Probes::of(id).booked.load(Ordering::SeqCst), 2, "one run per request");
    assert_ledger(&store, "once", 1).await;
    sharding.shutdown().await;
}

/// A request another process stored for an entity comes before a later request that the
/// entity's own runner sends: the entity sees them in storage order, although the runner's
/// read loop (polling hourly) has not read the other process's row yet.
async fn a_request_another_process_stored_comes_before_a_later_local_one(store: Store, id: &str) {
    let (sharding, reads, _faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    assert_eq!(counter.send(Deposit { key: format!("{id}-1"), amount: 1 }).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    let other = client_only(&store, config()).await;
    other
        .client::<Counter>(id)
        .discard(Deposit { key: format!("{id}-100"), amount: 100 })
        .await
        .unwrap();
    let stored_at = SystemClock.now();
    // SQLite orders rows by id, whose first bits are the millisecond it was made in: the next
    // request is made in a later one.
    eventually("a millisecond passes", || SystemClock.now() > stored_at).await;
    let sent = counter.send(Deposit { key: format!("{id}-10"), amount: 10 });
    let balance = tokio::time::timeout(Duration::from_secs(20), sent).await;
    assert_eq!(balance.expect("answered in time").unwrap(), 111, "delivered in storage order");
    other.shutdown().await;
    sharding.shutdown().await;
}

/// Every chunk and the final reply of a persisted stream reach its consumer although, while the
/// consumer's acknowledgement was being stored, the reply poller handed the unacknowledged chunk
/// over again and again, and the consumer asks for the end only once it is stored: the stream
/// ends with its final reply, not as interrupted.
async fn a_persisted_streams_final_reply_is_never_dropped(store: Store, id: &str) {
    let (sharding, _reads, faults) = observed_runner(&store, config()).await;
    sharding.entity::<Counter>().register().unwrap();
    // Eight reply polls (every 50 ms) while the acknowledgement is stored.
    faults.delay_acks(Duration::from_millis(400));
    let counter = sharding.client::<Counter>(id);
    let resume = crate::entities::Resume { key: format!("{id}-final"), n: 2 };
    let mut stream = counter.stream(resume).await.unwrap();
    for expected in 0..2 {
        let item = tokio::time::timeout(Duration::from_secs(20), stream.next()).await;
        assert_eq!(item.expect("in time").expect("an item").unwrap(), expected);
    }
    // A consumer slow to read on: the final reply is stored before it asks for it.
    answered(&store, counter.address(), "Resume", &format!("{id}-final")).await;
    let end = tokio::time::timeout(Duration::from_secs(20), stream.next()).await;
    assert!(end.expect("in time").is_none(), "the stream ends with its final reply");
    sharding.shutdown().await;
}

/// The registration deadline belongs to each entity type: a type registered a little after its
/// first request was read gets that request, although another type's requests timed out long
/// before.
async fn a_type_registered_late_is_not_refused_for_an_earlier_types_timeout(
    store: Store,
    id: &str,
) {
    let (sharding, reads, _faults) = observed_runner(&store, config()).await;
    let ghost =
        sharding.entity::<Counter>().named(cluster_core::EntityType::from("Ghost")).client(id);
    let error = ghost.send(Deposit { key: format!("{id}-ghost"), amount: 1 }).await.unwrap_err();
    let CallError::Defect(defect) = error else { panic!("{error:?}") };
    assert!(defect.contains("Entity type 'Ghost' not registered"), "{defect}");
    let late_type = cluster_core::EntityType::from("Late");
    let late = sharding.entity::<Counter>().named(late_type.clone()).client(id);
    let sending =
        tokio::spawn(async move { late.send(Deposit { key: "late".to_owned(), amount: 5 }).await });
    // Read twice while its type is unknown: held, not answered.
    let before = reads.load(Ordering::SeqCst);
    eventually("two reads", || reads.load(Ordering::SeqCst) >= before + 2).await;
    sharding.entity::<Counter>().named(late_type).register().unwrap();
    let sent = tokio::time::timeout(Duration::from_secs(20), sending).await;
    assert_eq!(sent.expect("answered in time").unwrap().unwrap(), 5);
    sharding.shutdown().await;
}

/// A request that direct delivery holds while it looks at the entity's earlier requests, and
/// that the read loop meanwhile reads, delivers and answers, runs once: direct delivery finds
/// it taken over and leaves it.
async fn a_request_the_read_loop_answers_while_direct_delivery_checks_order_runs_once(
    store: Store,
    id: &str,
) {
    let (sharding, reads, faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    assert_eq!(counter.send(Deposit { key: format!("{id}-first"), amount: 1 }).await.unwrap(), 1);
    eventually("the read loop read its shards", || reads.load(Ordering::SeqCst) > 0).await;
    let probes = Probes::of(id);
    faults.delay_order_checks(Duration::from_millis(500));
    let saved = faults.saved_requests();
    let sending = spawn_send(&counter, Deposit { key: format!("{id}-second"), amount: 2 });
    eventually("the request is saved", || faults.saved_requests() > saved).await;
    sharding.poll_storage();
    eventually("the read loop runs it", || probes.deposits.load(Ordering::SeqCst) == 2).await;
    let sent = tokio::time::timeout(Duration::from_secs(20), sending).await;
    assert_eq!(sent.expect("answered in time").unwrap().unwrap(), 3);
    faults.delay_order_checks(Duration::ZERO);
    // The next request shows the entity's state.
    assert_eq!(counter.send(Deposit { key: format!("{id}-third"), amount: 4 }).await.unwrap(), 7);
    assert_eq!(probes.deposits.load(Ordering::SeqCst), 3, "the second request ran twice");
    sharding.shutdown().await;
}

/// A caller that starts waiting while the reply poller sleeps is answered at the next poll
/// after its reply is stored, not one interval later: the poller reads who waits when it
/// polls, not when it starts to sleep.
#[tokio::test(start_paused = true)]
async fn a_reply_stored_during_the_pollers_sleep_is_read_at_its_next_poll() {
    let store = memory().await;
    let runner = runner(&store).await;
    let interval = Duration::from_secs(1);
    let client =
        client_only(&store, ShardingConfig { entity_reply_poll_interval: interval, ..config() })
            .await;
    let counter = client.client::<Counter>("poll-snapshot");
    // The first caller starts the poller's wait; its poll comes one interval later.
    let first = tokio::spawn({
        let counter = counter.clone();
        async move { counter.send(Deposit { key: "first".to_owned(), amount: 1 }).await }
    });
    tokio::time::sleep(interval / 4).await;
    let started = tokio::time::Instant::now();
    // The runner answers within its message poll (100 ms), well before that poll.
    let second = counter.send(Deposit { key: "second".to_owned(), amount: 2 }).await.unwrap();
    assert_eq!(second, 3);
    assert!(
        started.elapsed() < interval,
        "answered after {:?}: the poll before it left the second caller out",
        started.elapsed()
    );
    assert_eq!(first.await.unwrap().unwrap(), 1);
    client.shutdown().await;
    runner.shutdown().await;
}

/// A save that finds the request's id taken by another message (two processes sharing a
/// machine id made the same snowflake) is tried again with a fresh id: a call, a discard and
/// a stream each go through, and each handler runs once. Before the fix each failed with the
/// storage's `Conflict`.
async fn a_request_whose_id_is_taken_is_saved_with_a_fresh_id(store: Store, id: &str) {
    let (sharding, _reads, faults) = counted_runner(&store, EntityOptions::default()).await;
    let counter = sharding.client::<Counter>(id);
    faults.take_request_ids(2);
    assert_eq!(counter.send(Deposit { key: "taken".to_owned(), amount: 2 }).await.unwrap(), 2);
    faults.take_request_ids(2);
    counter.discard(Deposit { key: "taken-discard".to_owned(), amount: 3 }).await.unwrap();
    let probes = Probes::of(id);
    eventually("the discarded deposit runs", || probes.deposits.load(Ordering::SeqCst) == 2).await;
    faults.take_request_ids(2);
    let stream = counter.stream(crate::entities::Resume { key: "taken-stream".to_owned(), n: 3 });
    let mut stream = stream.await.unwrap();
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push(item.unwrap());
    }
    assert_eq!(items, [0, 1, 2]);
    assert_eq!(probes.deposits.load(Ordering::SeqCst), 2, "each deposit ran once");
    sharding.shutdown().await;
}
