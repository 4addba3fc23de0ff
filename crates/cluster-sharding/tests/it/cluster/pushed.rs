//! Persisted requests pushed to their owner over the transport: the owner runs a stored request
//! at once and answers on the call with the final reply it stored; storage stays the fallback
//! (effect 4.1.0's persisted `Effect` RPC).

use cluster_sharding::Plumbing;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use cluster_core::clock::{Clock, SystemClock};
use cluster_core::storage::{MessageStorage, RunnerStorage};
use cluster_core::transport::Transport;
use cluster_core::{RunnerAddress, ShardingConfig};
use cluster_rpc::{RpcConfig, RpcServer, ServerHandle, TcpTransport};
use cluster_sharding::{CallError, EntityClient, Sharding};
use cluster_testkit::faulty::{FaultyMessageStorage, FaultyRunnerStorage};
use cluster_testkit::transport::{MemoryNetwork, NetworkFaults};

use super::{Net, config, eventually, final_gated_replies, split};
use crate::entities::{Counter, Deposit, Failure, Gated, Increment, Probes, Resume, spawn_send};
use cluster_testkit::wait::eventually_within;

/// A process's own handles on the shared storage.
type Storages = (Arc<dyn MessageStorage>, Arc<dyn RunnerStorage>);

/// A runner at `port` reachable on `network`, with the test's settings changed by `tune`.
async fn runner(
    net: &Net,
    port: u16,
    network: &Arc<MemoryNetwork>,
    tune: impl FnOnce(&mut ShardingConfig),
) -> Sharding {
    runner_with(net, port, network, |storages| storages, tune).await
}

/// [`runner`], whose storages go through `wrap` (to inject faults).
async fn runner_with(
    net: &Net,
    port: u16,
    network: &Arc<MemoryNetwork>,
    wrap: impl FnOnce(Storages) -> Storages,
    tune: impl FnOnce(&mut ShardingConfig),
) -> Sharding {
    let address = RunnerAddress::new("127.0.0.1", port);
    let sharding = member(net, address.clone(), network.transport(), wrap, tune).await;
    network.attach(address, sharding.runner_handler());
    sharding
}

/// A runner on the TCP transport of `cluster-rpc` with `rpc`'s limits, listening on a port of
/// its own, and its server; the test's settings changed by `tune`.
async fn tcp_runner(
    net: &Net,
    rpc: &RpcConfig,
    tune: impl FnOnce(&mut ShardingConfig),
) -> (Sharding, ServerHandle) {
    let listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let server = RpcServer::bind(listen, rpc.clone()).await.unwrap();
    let address = RunnerAddress::new("127.0.0.1", server.local_addr().port());
    let transport = TcpTransport::new(rpc.clone()).unwrap();
    let sharding = member(net, address, transport, |storages| storages, tune).await;
    let server = server.serve(sharding.runner_handler());
    (sharding, server)
}

/// A runner at `address` on `transport` (the caller makes it reachable), with `net`'s
/// storages through `wrap` and the test's settings changed by `tune`.
async fn member(
    net: &Net,
    address: RunnerAddress,
    transport: Arc<dyn Transport>,
    wrap: impl FnOnce(Storages) -> Storages,
    tune: impl FnOnce(&mut ShardingConfig),
) -> Sharding {
    let (messages, locks) = wrap(net.storages().await);
    let mut config =
        ShardingConfig { shard_lock_expiration: net.expiration, ..config(Some(address)) };
    tune(&mut config);
    let sharding =
        Sharding::member(config, messages, locks).transport(transport).start().await.unwrap();
    sharding.entity::<Counter>().register().unwrap();
    sharding
}

/// A client-only process on `network`, with the test's settings changed by `tune`.
async fn client(
    net: &Net,
    network: &Arc<MemoryNetwork>,
    tune: impl FnOnce(&mut ShardingConfig),
) -> Sharding {
    client_on(net, network.transport(), tune).await
}

/// A client-only process on `transport`, with the test's settings changed by `tune`.
async fn client_on(
    net: &Net,
    transport: Arc<dyn Transport>,
    tune: impl FnOnce(&mut ShardingConfig),
) -> Sharding {
    let (messages, locks) = net.storages().await;
    let mut config = config(None);
    tune(&mut config);
    Sharding::cluster_client(config, messages, locks).transport(transport).start().await.unwrap()
}

/// Waits until `client` routes to the owner of `counter`'s entity: its first assignment comes from
/// its registry poll, and a persisted request sent before goes through storage alone. A
/// volatile request is retried until it is routed.
async fn routed(counter: &EntityClient<Counter>) {
    let routed = counter.send(Increment { by: 0 });
    tokio::time::timeout(Duration::from_secs(20), routed).await.expect("routed").unwrap();
}

/// A runner holding every shard, and a client-only process routed to one entity of it, on one
/// memory network.
struct Pushing {
    network: Arc<MemoryNetwork>,
    owner: Sharding,
    client: Sharding,
    /// The entity's id (its `Probes`).
    id: String,
    counter: EntityClient<Counter>,
}

impl Pushing {
    /// The runner at `port`, the entity `name`; `tune` changes both processes' settings.
    async fn start(
        net: &Net,
        port: u16,
        name: &str,
        tune: impl Fn(&mut ShardingConfig),
    ) -> Pushing {
        let network = MemoryNetwork::new();
        let owner = runner(net, port, &network, &tune).await;
        eventually("the runner holds every shard", || split(&[&owner])).await;
        let client = client(net, &network, &tune).await;
        let id = net.id(name);
        let counter = client.client::<Counter>(id.as_str());
        routed(&counter).await;
        Pushing { network, owner, client, id, counter }
    }

    async fn shutdown(self) {
        self.client.shutdown().await;
        self.owner.shutdown().await;
    }
}

/// Waits until the `Gated` request of `counter`'s entity has a stored final reply.
async fn until_gated_reply_stored(net: &Net, counter: &EntityClient<Counter>) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while final_gated_replies(net, counter).await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "no final reply was stored");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A runner holding every shard, a client-only process routed to one entity of it, and a
/// `Gated` request of that entity pushed and running (its handler waits at the gate).
struct GatedCall {
    network: Arc<MemoryNetwork>,
    owner: Sharding,
    client: Sharding,
    counter: EntityClient<Counter>,
    probes: Arc<Probes>,
    call: tokio::task::JoinHandle<Result<usize, CallError<Failure>>>,
}

impl GatedCall {
    /// The runner at `port`, the entity `name`.
    async fn start(net: &Net, port: u16, name: &str) -> GatedCall {
        let Pushing { network, owner, client, id, counter } =
            Pushing::start(net, port, name, |_| {}).await;
        let probes = Probes::of(&id);
        let call = tokio::spawn({
            let counter = counter.clone();
            async move { counter.send(Gated).await }
        });
        eventually("the request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1).await;
        GatedCall { network, owner, client, counter, probes, call }
    }
}

/// Polls of storage so slow that only a push answers in time.
fn slow_polls(config: &mut ShardingConfig) {
    config.entity_message_poll_interval = Duration::from_secs(60);
    config.entity_reply_poll_interval = Duration::from_secs(60);
}

/// The owner hears of the request on the call and answers on it: neither its read loop's poll
/// nor the caller's reply poll is waited for.
async fn a_pushed_request_is_answered_on_the_call_without_waiting_for_a_poll(net: Net) {
    let pushing = Pushing::start(&net, 8101, "pushed", slow_polls).await;
    let (network, counter) = (&pushing.network, &pushing.counter);
    let sends = network.sends();
    let deposit = counter.send(Deposit { key: "k".to_owned(), amount: 7 });
    let answer = tokio::time::timeout(Duration::from_secs(20), deposit).await;
    assert_eq!(answer.expect("answered before any poll").unwrap(), 7);
    assert_eq!(network.sends() - sends, 1, "one push");
    assert_eq!(net.final_replies(counter, "Deposit", "k").await, 1);
    pushing.shutdown().await;
}

/// A request sent again with the key of a stored one (after a `discard`, or by a caller that
/// retries) waits for the stored request: it is pushed under the stored request's id, and the
/// owner answers with that request's reply, without a poll. Here the push reaches the owner only
/// after the request was answered, so the owner's waiter comes after the reply was stored: the
/// owner finds the stored reply and answers at once.
async fn a_request_sent_again_with_its_key_is_answered_on_the_call(net: Net) {
    let pushing = Pushing::start(&net, 8701, "pushed-again", slow_polls).await;
    let (network, counter) = (&pushing.network, &pushing.counter);
    let probes = Probes::of(&pushing.id);
    counter.discard(Gated).await.unwrap();
    eventually("the discarded request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1)
        .await;
    let delay = Duration::from_secs(1);
    network.set_faults(
        NetworkFaults { delay_min: delay, delay_max: delay, ..NetworkFaults::default() },
        3,
    );
    let sends = network.sends();
    let call = tokio::spawn({
        let counter = counter.clone();
        async move { counter.send(Gated).await }
    });
    // Stored (a duplicate, unanswered) and pushed: the push is on its way.
    eventually("the request is pushed", || network.sends() > sends).await;
    probes.gate.add_permits(1);
    until_gated_reply_stored(&net, counter).await;
    let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
    assert_eq!(answer.expect("answered before any poll").unwrap().unwrap(), 1);
    assert_eq!(probes.gated_runs.load(Ordering::SeqCst), 1, "the request ran once");
    network.clear_faults();
    pushing.shutdown().await;
}

/// A persisted stream's chunks and final reply come back on the call as the owner stores them,
/// and the caller's acknowledgements reach the owner at once: neither side waits for a poll.
async fn a_pushed_stream_is_answered_on_the_call_without_waiting_for_a_poll(net: Net) {
    let pushing = Pushing::start(&net, 8901, "pushed-stream", slow_polls).await;
    let counter = &pushing.counter;
    let streamed = async {
        let mut stream = counter.stream(Resume { key: "s".to_owned(), n: 5 }).await.unwrap();
        let mut items = Vec::new();
        while let Some(item) = stream.next().await {
            items.push(item.unwrap());
        }
        items
    };
    let items = tokio::time::timeout(Duration::from_secs(20), streamed).await;
    assert_eq!(items.expect("streamed before any poll"), vec![0, 1, 2, 3, 4]);
    pushing.shutdown().await;
}

/// The owner ran the request and stored its reply, but the reply on the call is lost: the
/// caller answers with the stored reply, which it reads from storage; the request ran once.
async fn a_pushed_reply_lost_in_transit_is_read_from_storage(net: Net) {
    // The reply poll comes well after the push's answer would, so the lost answer is what the
    // caller misses.
    let pushing = Pushing::start(&net, 8201, "pushed-lost", |config| {
        config.entity_reply_poll_interval = Duration::from_secs(2);
    })
    .await;
    let (network, counter) = (&pushing.network, &pushing.counter);
    network.lose_next_replies(RunnerAddress::new("127.0.0.1", 8201), 1);
    let deposit = counter.send(Deposit { key: "k".to_owned(), amount: 3 });
    let answer = tokio::time::timeout(Duration::from_secs(20), deposit).await;
    assert_eq!(answer.expect("answered").unwrap(), 3);
    assert_eq!(network.replies_lost(), 1, "the pushed reply was lost");
    assert_eq!(Probes::of(&pushing.id).deposits.load(Ordering::SeqCst), 1, "the request ran once");
    assert_eq!(net.final_replies(counter, "Deposit", "k").await, 1);
    pushing.shutdown().await;
}

/// The owner stores the reply and dies before its answer reaches the caller: the caller reads
/// the stored reply.
async fn the_owner_dying_after_storing_the_reply_leaves_it_to_storage(net: Net) {
    let GatedCall { network, owner, client, counter, probes, call } =
        GatedCall::start(&net, 8301, "pushed-owner-dies").await;
    let address = RunnerAddress::new("127.0.0.1", 8301);
    // Its answer will not reach the caller, and nothing more reaches the owner.
    network.lose_next_replies(address.clone(), 1);
    probes.gate.add_permits(1);
    until_gated_reply_stored(&net, &counter).await;
    network.detach(&address);
    let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
    assert_eq!(answer.expect("answered").unwrap().unwrap(), 1);
    assert_eq!(probes.gated_runs.load(Ordering::SeqCst), 1, "the request ran once");
    assert_eq!(final_gated_replies(&net, &counter).await, 1);
    client.shutdown().await;
    owner.shutdown().await;
}

/// The caller's connection goes away while its request runs. The owner does not stop the
/// request: it is stored, and only a stored interrupt stops it. It stores the reply, which the
/// caller reads from storage.
async fn a_pushed_request_outlives_its_broken_call(net: Net) {
    let GatedCall { network, owner, client, counter, probes, call } =
        GatedCall::start(&net, 8401, "pushed-cut").await;
    network.cut_calls_to(&RunnerAddress::new("127.0.0.1", 8401));
    probes.gate.add_permits(1);
    let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
    assert_eq!(answer.expect("answered").unwrap().unwrap(), 1);
    assert_eq!(probes.gated_runs.load(Ordering::SeqCst), 1, "the request ran once");
    assert_eq!(final_gated_replies(&net, &counter).await, 1);
    client.shutdown().await;
    owner.shutdown().await;
}

/// Every call reaches the owner twice, and its read loop reads often: each request is taken up
/// by two pushes and by reads at once, and still runs once and is answered once.
async fn a_request_pushed_twice_and_read_at_once_runs_once(net: Net) {
    let network = MemoryNetwork::new();
    let a = runner(&net, 8501, &network, |config| {
        config.entity_message_poll_interval = Duration::from_millis(5);
    })
    .await;
    eventually("the runner holds every shard", || split(&[&a])).await;
    let client = client(&net, &network, |_| {}).await;
    for n in 0..5_u64 {
        routed(&client.client::<Counter>(net.id(&format!("pushed-twice-{n}")))).await;
    }
    network.set_faults(NetworkFaults { duplicate_per_mille: 1000, ..NetworkFaults::default() }, 7);
    let mut calls = Vec::new();
    for n in 0..20_u64 {
        let id = net.id(&format!("pushed-twice-{}", n % 5));
        let counter = client.client::<Counter>(id.as_str());
        let deposit = Deposit { key: format!("k{n}"), amount: 1 };
        calls.push((id, n, tokio::spawn(async move { counter.send(deposit).await })));
    }
    for (_, _, call) in &mut calls {
        let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
        answer.expect("answered").unwrap().unwrap();
    }
    assert!(network.duplicated() >= 20, "the pushes were delivered twice");
    for n in 0..5_u64 {
        let id = net.id(&format!("pushed-twice-{n}"));
        assert_eq!(
            Probes::of(&id).deposits.load(Ordering::SeqCst),
            4,
            "{id}: each deposit ran once"
        );
    }
    for (id, n, _) in &calls {
        let counter = client.client::<Counter>(id.as_str());
        assert_eq!(net.final_replies(&counter, "Deposit", &format!("k{n}")).await, 1);
    }
    network.clear_faults();
    client.shutdown().await;
    a.shutdown().await;
}

/// The owner lets the shard go while the pushed request runs (it shuts down): the call ends
/// without a reply, the request runs again on the next owner, and the caller gets that owner's
/// stored reply, once.
async fn the_shard_moving_while_a_pushed_request_runs_leaves_the_answer_to_the_next_owner(
    net: Net,
) {
    let GatedCall { network, owner, client, counter, probes, call } =
        GatedCall::start(&net, 8601, "pushed-moves").await;
    let next = runner(&net, 8602, &network, |_| {}).await;
    // Its handler does not finish within the termination timeout: it is interrupted, and the
    // request is left stored for the next owner.
    owner.shutdown().await;
    eventually("the next owner holds every shard", || split(&[&next])).await;
    eventually("the request runs again", || probes.gated_runs.load(Ordering::SeqCst) == 2).await;
    probes.gate.add_permits(1);
    let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
    assert_eq!(answer.expect("answered").unwrap().unwrap(), 2);
    assert_eq!(final_gated_replies(&net, &counter).await, 1);
    client.shutdown().await;
    next.shutdown().await;
}

/// Direct delivery (a runner's own request, or a pushed one) reads at most 16 of the entity's
/// earlier unprocessed requests. When it finds that many, more may lie beyond them, unread here:
/// the request is left to the read loop, which delivers in storage order. Here the 18th request
/// to a busy entity finds the 16 oldest delivered, while the 17th, stored by another process,
/// is not: it must still run after the 17th.
async fn a_request_behind_more_earlier_requests_than_direct_delivery_reads_keeps_its_order(
    net: Net,
) {
    let network = MemoryNetwork::new();
    let a = runner(&net, 8801, &network, |config| {
        config.entity_message_poll_interval = Duration::from_secs(1);
    })
    .await;
    eventually("the runner holds every shard", || split(&[&a])).await;
    let id = net.id("pushed-beyond-the-limit");
    let own = a.client::<Counter>(id.as_str());
    let probes = Probes::of(&id);
    // The entity is busy: its next requests wait in its mailbox, delivered in order.
    own.discard(Gated).await.unwrap();
    eventually("the entity is busy", || probes.gated_runs.load(Ordering::SeqCst) == 1).await;
    for n in 0..16 {
        own.discard(Deposit { key: format!("k{n}"), amount: 1 }).await.unwrap();
    }
    // The 17th is stored by a process that tells nobody: only a read finds it.
    let quiet = net.client().await;
    let quiet_counter = quiet.client::<Counter>(id.as_str());
    quiet_counter.discard(Deposit { key: "k16".to_owned(), amount: 1000 }).await.unwrap();
    // The 18th is made in a later millisecond than the 17th. On SQLite (the reference's table)
    // a message's id is its row's order, and two ids made by two processes within one
    // millisecond are ordered by their machine bits, not by which was stored first
    // (docs/storage.md, "Order").
    let stored_by = SystemClock.now().unix_millis();
    eventually("a later millisecond", || SystemClock.now().unix_millis() > stored_by).await;
    let last = tokio::spawn({
        let own = own.clone();
        async move { own.send(Deposit { key: "k17".to_owned(), amount: 1 }).await }
    });
    probes.gate.add_permits(1);
    let answer = tokio::time::timeout(Duration::from_secs(20), last).await;
    let value = answer.expect("answered").unwrap().unwrap();
    assert_eq!(value, 1017, "the 18th request ran before the 17th (it saw {value})");
    quiet.shutdown().await;
    a.shutdown().await;
}

/// Requests pushed one after the other to a few entities, while the owner's read loop reads
/// every millisecond: the pushes and the reads race to hand each request to its entity, and
/// every entity still runs its requests in storage order.
async fn pushed_requests_racing_the_read_loop_run_in_storage_order(net: Net) {
    let network = MemoryNetwork::new();
    let a = runner(&net, 9001, &network, |config| {
        config.entity_message_poll_interval = Duration::from_millis(1);
    })
    .await;
    eventually("the runner holds every shard", || split(&[&a])).await;
    let client = client(&net, &network, |_| {}).await;
    let ids: Vec<String> = (0..4).map(|n| net.id(&format!("pushed-race-{n}"))).collect();
    for id in &ids {
        routed(&client.client::<Counter>(id.as_str())).await;
    }
    const EACH: usize = 60;
    let mut senders = Vec::new();
    for id in &ids {
        let counter = client.client::<Counter>(id.as_str());
        senders.push(tokio::spawn(async move {
            // Each is stored after the one before: storage order is the key order.
            for n in 0..EACH {
                counter.discard(Deposit { key: format!("k{n:03}"), amount: 1 }).await.unwrap();
            }
        }));
    }
    for sender in senders {
        sender.await.unwrap();
    }
    for id in &ids {
        let probes = Probes::of(id);
        eventually("every request ran", || probes.deposits.load(Ordering::SeqCst) == EACH).await;
        let ran = probes.deposit_keys.lock().unwrap().clone();
        let stored: Vec<String> = (0..EACH).map(|n| format!("k{n:03}")).collect();
        assert_eq!(ran, stored, "{id} ran its requests out of storage order");
    }
    client.shutdown().await;
    a.shutdown().await;
}

/// A runner frozen past its lease runs no pushed request until a lock refresh answers: it may
/// have lost the shard without knowing yet, and the pushed request's row is unclaimed, so the
/// next owner would run it too. Before the owner checked the lease on this path, it ran the
/// request at once (seen 0 ms after the thaw). Paused time makes the freeze exact, as in
/// `a_runner_frozen_past_its_lease_reads_nothing_until_a_refresh_answers`.
#[tokio::test(start_paused = true)]
async fn a_runner_frozen_past_its_lease_runs_no_pushed_request_until_a_refresh_answers() {
    let net = Net::memory().await.unwrap();
    let network = MemoryNetwork::new();
    let mut faults = None;
    let wrap = |(messages, locks)| {
        let (locks, lock_faults) = FaultyRunnerStorage::new(locks);
        faults = Some(lock_faults);
        (messages, Arc::new(locks) as Arc<dyn RunnerStorage>)
    };
    let owner = runner_with(&net, 8121, &network, wrap, slow_polls).await;
    let faults = faults.expect("the runner was built");
    eventually("the runner holds every shard", || split(&[&owner])).await;
    let client = client(&net, &network, slow_polls).await;
    let id = net.id("frozen-pushed");
    let counter = client.client::<Counter>(id.as_str());
    routed(&counter).await;
    let probes = Probes::of(&id);
    let refresh_answers_after = Duration::from_millis(400);
    faults.delay_locks(refresh_answers_after);
    tokio::time::advance(super::EXPIRATION).await;
    let thawed = tokio::time::Instant::now();
    let sends = network.sends();
    let call = tokio::spawn({
        let counter = counter.clone();
        async move { counter.send(Deposit { key: "k".to_owned(), amount: 2 }).await }
    });
    eventually("the request runs", || probes.deposits.load(Ordering::SeqCst) == 1).await;
    let ran_after = thawed.elapsed();
    assert_eq!(network.sends() - sends, 1, "the request was pushed");
    assert!(
        ran_after >= refresh_answers_after,
        "the frozen runner ran the pushed request {ran_after:?} after it continued, before its \
         refresh answered"
    );
    assert_eq!(call.await.unwrap().unwrap(), 2);
    faults.delay_locks(Duration::ZERO);
    client.shutdown().await;
    owner.shutdown().await;
}

/// A pushed request whose final reply was fenced by a failed lock confirmation (the owner still
/// holds the shard) runs again at once and its call is answered with the second run's stored
/// reply, without waiting for the owner's next poll (a minute here) as it did before the fence
/// woke the read loop.
async fn a_fenced_pushed_request_runs_again_without_waiting_for_a_poll(net: Net) {
    let network = MemoryNetwork::new();
    let mut confirms = None;
    let wrap = |(messages, locks)| {
        let failing = super::FailingConfirms::wrap(locks);
        confirms = Some(Arc::clone(&failing));
        (messages, failing as Arc<dyn RunnerStorage>)
    };
    let owner = runner_with(&net, 8131, &network, wrap, slow_polls).await;
    let confirms = confirms.expect("the runner was built");
    eventually("the runner holds every shard", || split(&[&owner])).await;
    let client = client(&net, &network, slow_polls).await;
    let id = net.id("pushed-fenced");
    let counter = client.client::<Counter>(id.as_str());
    routed(&counter).await;
    confirms.fail_next(1);
    let sends = network.sends();
    let deposit = counter.send(Deposit { key: "k".to_owned(), amount: 3 });
    let answer = tokio::time::timeout(Duration::from_secs(20), deposit).await;
    // The second run's: the entity's state kept the first run's deposit.
    assert_eq!(answer.expect("answered before any poll").unwrap(), 6);
    assert_eq!(network.sends() - sends, 1, "one push");
    assert!(!confirms.armed(), "the first run's reply was fenced");
    assert_eq!(Probes::of(&id).deposits.load(Ordering::SeqCst), 2, "the request ran again");
    assert_eq!(net.final_replies(&counter, "Deposit", "k").await, 1);
    client.shutdown().await;
    owner.shutdown().await;
}

/// A pushed call lasts as long as its request's handler runs. Such calls must not take the call
/// slots of the connection that every other call to the owner needs. Over TCP, with
/// `max_in_flight = 2` and two pushed requests held at their gates, a volatile call and a
/// persisted call to other entities of the same owner are answered at once. Before pushes had a
/// lane of their own, both waited for the held requests (unanswered after 5 s).
async fn pushed_requests_held_by_their_handlers_leave_the_connection_to_other_calls(net: Net) {
    let rpc = RpcConfig { max_in_flight: 2, ..RpcConfig::default() };
    let (owner, server) = tcp_runner(&net, &rpc, slow_polls).await;
    eventually("the runner holds every shard", || split(&[&owner])).await;
    let client = client_on(&net, TcpTransport::new(rpc).unwrap(), slow_polls).await;
    let counter = |name: &str| client.client::<Counter>(net.id(name));
    routed(&counter("tcp-volatile")).await;
    let held = ["tcp-held-0", "tcp-held-1"];
    let calls: Vec<_> = held.iter().map(|name| spawn_send(&counter(name), Gated)).collect();
    for name in held {
        let probes = Probes::of(&net.id(name));
        eventually("the pushed request runs", || probes.gated_runs.load(Ordering::SeqCst) == 1)
            .await;
    }
    let (volatile, persisted) = (counter("tcp-volatile"), counter("tcp-persisted"));
    let volatile = volatile.send(Increment { by: 1 });
    let volatile = tokio::time::timeout(Duration::from_secs(5), volatile).await;
    assert_eq!(volatile.expect("the volatile call answered while pushes are held").unwrap(), 1);
    let persisted = persisted.send(Deposit { key: "k".to_owned(), amount: 4 });
    let persisted = tokio::time::timeout(Duration::from_secs(5), persisted).await;
    assert_eq!(persisted.expect("the persisted call answered while pushes are held").unwrap(), 4);
    for name in held {
        Probes::of(&net.id(name)).gate.add_permits(1);
    }
    for call in calls {
        let answer = tokio::time::timeout(Duration::from_secs(20), call).await;
        assert_eq!(answer.expect("answered").unwrap().unwrap(), 1);
    }
    client.shutdown().await;
    owner.shutdown().await;
    server.shutdown().await;
}

/// The owner takes up the requests it is told of (a persisted notice: a discarded request, one
/// whose push failed) in a bounded number of tasks; past the bound, its read loop delivers
/// them. Before, each notice spawned a task of its own: here 1,000 notices, while the owner's
/// reads of a request's entity were slow, left about 1,000 of them waiting at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_takes_up_what_it_is_told_of_in_a_bounded_number_of_tasks() {
    const NOTICES: usize = 1_000;
    let net = Net::memory().await.unwrap();
    let network = MemoryNetwork::new();
    let mut faults = None;
    let wrap = |(messages, locks)| {
        let (messages, storage_faults) = FaultyMessageStorage::new(messages);
        faults = Some(storage_faults);
        (Arc::new(messages) as Arc<dyn MessageStorage>, locks)
    };
    // A small mailbox: requests its read loop delivers wait there, each with a task that
    // stores its outcome; the mailbox bounds those, as the take-ups are bounded.
    let tune = |config: &mut ShardingConfig| {
        slow_polls(config);
        config.entity_mailbox_capacity = cluster_core::config::Capacity::bounded(64).unwrap();
    };
    let owner = runner_with(&net, 8141, &network, wrap, tune).await;
    let faults = faults.expect("the runner was built");
    eventually("the runner holds every shard", || split(&[&owner])).await;
    let client = client(&net, &network, slow_polls).await;
    let id = net.id("take-up-bound");
    let counter = client.client::<Counter>(id.as_str());
    routed(&counter).await;
    let tasks = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
    let before = tasks();
    // A take-up reads the request and its entity's earlier ones: that read takes 5 s now.
    faults.delay_order_checks(Duration::from_secs(5));
    let notices = network.notifies();
    for n in 0..NOTICES {
        counter.discard(Deposit { key: format!("k{n}"), amount: 1 }).await.unwrap();
    }
    let told = || usize::try_from(network.notifies() - notices).unwrap();
    eventually("the owner is told of every request", || told() == NOTICES).await;
    // The caller's tasks that carried the notices end at once; the owner's take-ups wait out
    // the slow read. One task per notice would hold about 1,000 for those 5 s, far past the 2 s
    // given here.
    let alive = || tasks().saturating_sub(before);
    let settled = format!("fewer than {} tasks alive after {NOTICES} notices", NOTICES / 2);
    eventually_within(&settled, Duration::from_secs(2), || alive() < NOTICES / 2).await;
    faults.delay_order_checks(Duration::ZERO);
    let probes = Probes::of(&id);
    eventually("every request runs", || probes.deposits.load(Ordering::SeqCst) == NOTICES).await;
    client.shutdown().await;
    owner.shutdown().await;
}

on_every_backend!(
    pushed_requests_held_by_their_handlers_leave_the_connection_to_other_calls,
    a_fenced_pushed_request_runs_again_without_waiting_for_a_poll,
    a_pushed_request_is_answered_on_the_call_without_waiting_for_a_poll,
    a_request_sent_again_with_its_key_is_answered_on_the_call,
    a_pushed_stream_is_answered_on_the_call_without_waiting_for_a_poll,
    a_pushed_reply_lost_in_transit_is_read_from_storage,
    the_owner_dying_after_storing_the_reply_leaves_it_to_storage,
    a_pushed_request_outlives_its_broken_call,
    a_request_pushed_twice_and_read_at_once_runs_once,
    the_shard_moving_while_a_pushed_request_runs_leaves_the_answer_to_the_next_owner,
    a_request_behind_more_earlier_requests_than_direct_delivery_reads_keeps_its_order,
    pushed_requests_racing_the_read_loop_run_in_storage_order,
);
