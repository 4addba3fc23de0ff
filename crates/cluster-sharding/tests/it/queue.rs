//! Queue-style entities (the reference's `Entity.toLayerQueue` and `Replier`) through the real
//! runtime, with persisted requests on the memory storage, SQLite and PostgreSQL: unary and
//! streaming replies, replies out of order, and a failing behaviour failing every pending
//! request.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::storage::MessageStorage;
use cluster_core::{ShardingConfig, SystemClock};
use cluster_sharding::{
    Accepts, AcceptsStream, BehaviourError, CallError, EntityContext, QueueEntity, QueueProtocol,
    Queued, Replier, RequestQueue, Rpc, Sharding, StreamRpc,
};
use cluster_testkit::databases::TestDatabase;
use cluster_testkit::memory::MemoryMessageStorage;
use serde::{Deserialize, Serialize};

/// A queue entity whose behaviour answers from the queue as the requests ask.
struct Desk;

macro_rules! persisted_rpc {
    ($name:ident, $success:ty) => {
        impl Rpc for $name {
            const TAG: &'static str = stringify!($name);
            const PERSISTED: bool = true;
            type Success = $success;
            type Error = String;
        }
        impl Accepts<$name> for Desk {}
    };
}

/// Answered with twice `n` at once.
#[derive(Serialize, Deserialize)]
struct Double {
    n: u64,
}
persisted_rpc!(Double, u64);

/// Held until a `Release`, then answered with `n`.
#[derive(Serialize, Deserialize)]
struct Hold {
    n: u64,
}
persisted_rpc!(Hold, u64);

/// Answers the held requests, the last held first, then itself with how many there were.
#[derive(Serialize, Deserialize)]
struct Release;
persisted_rpc!(Release, usize);

/// Answered with the number of requests held.
#[derive(Serialize, Deserialize)]
struct Held;
persisted_rpc!(Held, usize);

/// Answered with its own error.
#[derive(Serialize, Deserialize)]
struct Refuse;
persisted_rpc!(Refuse, ());

/// Answered with a defect.
#[derive(Serialize, Deserialize)]
struct Break;
persisted_rpc!(Break, ());

/// Makes the behaviour fail.
#[derive(Serialize, Deserialize)]
struct Crash;
persisted_rpc!(Crash, ());

/// Streams `0..n` in two chunks.
#[derive(Serialize, Deserialize)]
struct Count {
    n: u64,
}

impl StreamRpc for Count {
    const TAG: &'static str = "Count";
    const PERSISTED: bool = true;
    type Item = u64;
    type Error = String;
}

impl AcceptsStream<Count> for Desk {}

impl QueueEntity for Desk {
    const TYPE: &'static str = "Desk";

    fn protocol(protocol: &mut QueueProtocol<'_, Desk>) {
        protocol
            .handle::<Double>()
            .handle::<Hold>()
            .handle::<Release>()
            .handle::<Held>()
            .handle::<Refuse>()
            .handle::<Break>()
            .handle::<Crash>()
            .stream::<Count>();
    }

    async fn behaviour(
        _: EntityContext,
        mut requests: RequestQueue,
        replier: Replier,
    ) -> Result<(), BehaviourError> {
        let mut held = Vec::new();
        while let Some(request) = requests.next().await {
            match request.tag() {
                "Double" => {
                    let n = request.decode::<Double>()?.n;
                    replier.succeed::<Double>(&request, n * 2).await;
                }
                "Hold" => held.push(request),
                "Release" => {
                    let count = held.len();
                    for request in held.drain(..).rev() {
                        let n = request.decode::<Hold>()?.n;
                        replier.succeed::<Hold>(&request, n).await;
                    }
                    replier.succeed::<Release>(&request, count).await;
                }
                "Held" => replier.succeed::<Held>(&request, held.len()).await,
                "Refuse" => replier.fail::<Refuse>(&request, "refused".to_owned()).await,
                "Break" => replier.fail_cause(&request, "broken on purpose").await,
                "Crash" => return Err("crashed on purpose".into()),
                "Count" => {
                    let n = request.decode_stream::<Count>()?.n;
                    replier.chunk::<Count>(&request, 0..n / 2).await?;
                    replier.chunk::<Count>(&request, n / 2..n).await?;
                    replier.complete(&request).await;
                }
                other => replier.fail_cause(&request, format!("unknown {other}")).await,
            }
        }
        Ok(())
    }
}

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    }
}

/// A runner with `Queued<Desk>` on the backend's storage, and the database to drop last.
async fn runner(database: Option<TestDatabase>) -> (Sharding, Option<TestDatabase>) {
    let storage: Arc<dyn MessageStorage> = match &database {
        None => Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock))),
        Some(database) => database.open(&config()).await.unwrap().0,
    };
    let sharding = Sharding::standalone(config(), storage).start().await.unwrap();
    sharding.entity::<Queued<Desk>>().register().unwrap();
    (sharding, database)
}

macro_rules! on_backends {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let (sharding, _database) = super::runner(None).await;
                    super::$case(&sharding).await;
                    sharding.shutdown().await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let database = cluster_testkit::databases::TestDatabase::sqlite(concat!("queue-", stringify!($case)));
                    let (sharding, _database) = super::runner(Some(database)).await;
                    super::$case(&sharding).await;
                    sharding.shutdown().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::postgres() else { return };
                    let (sharding, _database) = super::runner(Some(database)).await;
                    super::$case(&sharding).await;
                    sharding.shutdown().await;
                }
            )*
        }
    };
}

on_backends!(
    unary_replies_come_through_the_replier,
    streaming_replies_come_through_the_replier,
    replies_may_come_out_of_order,
    a_failing_behaviour_fails_every_pending_request,
);

/// Waits at most a minute for `call`.
async fn within<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(60), call).await.expect("no reply")
}

async fn unary_replies_come_through_the_replier(sharding: &Sharding) {
    let desk = sharding.client::<Queued<Desk>>("unary");
    assert_eq!(within(desk.send(Double { n: 21 })).await.unwrap(), 42);
    let refused = within(desk.send(Refuse)).await.unwrap_err();
    assert!(matches!(&refused, CallError::Failed(error) if error == "refused"), "{refused:?}");
    let broken = within(desk.send(Break)).await.unwrap_err();
    assert!(
        matches!(&broken, CallError::Defect(defect) if defect.contains("broken on purpose")),
        "{broken:?}"
    );
    // The behaviour goes on after a failed request.
    assert_eq!(within(desk.send(Double { n: 2 })).await.unwrap(), 4);
}

async fn streaming_replies_come_through_the_replier(sharding: &Sharding) {
    let desk = sharding.client::<Queued<Desk>>("streaming");
    let mut stream = within(desk.stream(Count { n: 10 })).await.unwrap();
    let mut chunks = Vec::new();
    while let Some(chunk) = within(stream.next_chunk()).await {
        chunks.push(chunk.unwrap());
    }
    assert_eq!(chunks.concat(), (0..10).collect::<Vec<u64>>());
    assert!(chunks.len() <= 2, "two replier chunks: {chunks:?}");
}

async fn replies_may_come_out_of_order(sharding: &Sharding) {
    let desk = sharding.client::<Queued<Desk>>("out-of-order");
    let first = tokio::spawn({
        let desk = desk.clone();
        async move { desk.send(Hold { n: 1 }).await }
    });
    let second = tokio::spawn({
        let desk = desk.clone();
        async move { desk.send(Hold { n: 2 }).await }
    });
    // Both are held (pending) while the behaviour takes and answers more requests.
    until_held(&desk, 2).await;
    assert_eq!(within(desk.send(Double { n: 5 })).await.unwrap(), 10);
    assert!(!first.is_finished() && !second.is_finished());
    // Answered in the reverse order, each with its own value.
    assert_eq!(within(desk.send(Release)).await.unwrap(), 2);
    assert_eq!(within(first).await.unwrap().unwrap(), 1);
    assert_eq!(within(second).await.unwrap().unwrap(), 2);
}

/// Waits until the behaviour holds `count` requests.
async fn until_held(desk: &cluster_sharding::EntityClient<Queued<Desk>>, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while within(desk.send(Held)).await.unwrap() < count {
        assert!(tokio::time::Instant::now() < deadline, "{count} requests were never held");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn a_failing_behaviour_fails_every_pending_request(sharding: &Sharding) {
    let desk = sharding.client::<Queued<Desk>>("failing");
    let held: Vec<_> = (0..3)
        .map(|n| {
            let desk = desk.clone();
            tokio::spawn(async move { desk.send(Hold { n }).await })
        })
        .collect();
    // Once the holds are pending, the behaviour fails.
    until_held(&desk, 3).await;
    let crashed = within(desk.send(Crash)).await.unwrap_err();
    assert!(
        matches!(&crashed, CallError::Defect(defect) if defect.contains("crashed on purpose")),
        "{crashed:?}"
    );
    for call in held {
        let failed = within(call).await.unwrap().unwrap_err();
        assert!(
            matches!(&failed, CallError::Defect(defect) if defect.contains("crashed on purpose")),
            "{failed:?}"
        );
    }
}

/// A queue entity whose behaviour panics before it returns its future.
struct Hasty;

impl Accepts<Double> for Hasty {}

impl QueueEntity for Hasty {
    const TYPE: &'static str = "Hasty";

    fn protocol(protocol: &mut QueueProtocol<'_, Hasty>) {
        protocol.handle::<Double>();
    }

    fn behaviour(
        context: EntityContext,
        _: RequestQueue,
        _: Replier,
    ) -> impl std::future::Future<Output = Result<(), BehaviourError>> + Send {
        if !context.address().entity_id.as_str().is_empty() {
            std::panic::panic_any("a behaviour that panics before returning its future");
        }
        std::future::ready(Ok(()))
    }
}

/// A behaviour that panics before it returns its future ends its entity like one that panics
/// while it runs: requests get the defect instead of waiting for an entity that never starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_behaviour_panicking_before_its_future_answers_requests_with_a_defect() {
    let storage = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let sharding = Sharding::standalone(config(), storage).start().await.unwrap();
    sharding.entity::<Queued<Hasty>>().register().unwrap();
    let hasty = sharding.client::<Queued<Hasty>>("hasty");
    let answer = tokio::time::timeout(Duration::from_secs(10), hasty.send(Double { n: 1 }))
        .await
        .expect("the request waits for an entity that never starts");
    assert!(
        matches!(&answer, Err(CallError::Defect(defect)) if defect.contains("panicked")),
        "{answer:?}"
    );
    sharding.shutdown().await;
}
