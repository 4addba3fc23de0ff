//! [`TestClient`]: an entity type's calls in process, an instance per entity id, persisted
//! requests included, handlers that do not see the caller's context, and replies over the
//! memory storage's limit.

use cluster_core::ClusterError;
use cluster_core::error::StorageErrorKind;
use cluster_sharding::{CallError, Entity, EntityContext, Handler, Protocol, RequestContext, Rpc};
use cluster_testkit::TestClient;
use serde::{Deserialize, Serialize};

/// A counter per entity id.
struct Counter {
    value: u64,
    id: String,
}

#[derive(Serialize, Deserialize)]
struct Add {
    by: u64,
}

impl Rpc for Add {
    const TAG: &'static str = "Add";
    type Success = u64;
    type Error = Refused;
}

/// A persisted request, deduplicated by its key.
#[derive(Serialize, Deserialize)]
struct Deposit {
    key: String,
    by: u64,
}

impl Rpc for Deposit {
    const TAG: &'static str = "Deposit";
    const PERSISTED: bool = true;
    type Success = u64;
    type Error = Refused;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// A persisted request answered with a text of `len` bytes; `pad` only makes it larger.
#[derive(Serialize, Deserialize)]
struct Blob {
    key: String,
    len: usize,
    pad: String,
}

impl Rpc for Blob {
    const TAG: &'static str = "Blob";
    const PERSISTED: bool = true;
    type Success = String;
    type Error = Refused;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

/// What the handler sees of its caller: the task-local and the headers.
#[derive(Serialize, Deserialize)]
struct Look;

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Seen {
    id: String,
    task_local: Option<u32>,
    headers: Vec<(String, String)>,
}

impl Rpc for Look {
    const TAG: &'static str = "Look";
    type Success = Seen;
    type Error = Refused;
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Refused {
    reason: String,
}

tokio::task_local! {
    static CALLER: u32;
}

impl Entity for Counter {
    const TYPE: &'static str = "TestCounter";

    async fn create(context: &EntityContext) -> Counter {
        Counter { value: 0, id: context.address().entity_id.as_str().to_owned() }
    }

    fn protocol(protocol: &mut Protocol<Counter>) {
        protocol.handle::<Add>();
        protocol.handle::<Deposit>();
        protocol.handle::<Look>();
        protocol.handle::<Blob>();
    }
}

impl Handler<Add> for Counter {
    async fn handle(&mut self, _: &RequestContext, add: Add) -> Result<u64, Refused> {
        if add.by == 0 {
            return Err(Refused { reason: "zero".to_owned() });
        }
        self.value += add.by;
        Ok(self.value)
    }
}

impl Handler<Deposit> for Counter {
    async fn handle(&mut self, _: &RequestContext, deposit: Deposit) -> Result<u64, Refused> {
        self.value += deposit.by;
        Ok(self.value)
    }
}

impl Handler<Blob> for Counter {
    async fn handle(&mut self, _: &RequestContext, blob: Blob) -> Result<String, Refused> {
        Ok("b".repeat(blob.len))
    }
}

impl Handler<Look> for Counter {
    async fn handle(&mut self, context: &RequestContext, _: Look) -> Result<Seen, Refused> {
        Ok(Seen {
            id: self.id.clone(),
            task_local: CALLER.try_with(|caller| *caller).ok(),
            headers: context.headers().into_iter().collect(),
        })
    }
}

#[tokio::test]
async fn each_entity_id_gets_its_own_instance_in_process() {
    let counters = TestClient::<Counter>::new().await.unwrap();
    let a = counters.client("a");
    assert_eq!(a.send(Add { by: 2 }).await.unwrap(), 2);
    assert_eq!(a.send(Add { by: 3 }).await.unwrap(), 5);
    assert_eq!(counters.client("b").send(Add { by: 1 }).await.unwrap(), 1);
    assert_eq!(counters.active_entity_count(), 2);
    let refused = a.send(Add { by: 0 }).await;
    assert!(matches!(refused, Err(CallError::Failed(Refused { reason })) if reason == "zero"));
    counters.shutdown().await;
}

#[tokio::test]
async fn persisted_requests_are_answered_once_per_key() {
    let counters = TestClient::<Counter>::new().await.unwrap();
    let c = counters.client("c");
    let first = Deposit { key: "k1".to_owned(), by: 10 };
    assert_eq!(c.send(first).await.unwrap(), 10);
    // The same key again: the stored reply, not a second run.
    let again = Deposit { key: "k1".to_owned(), by: 10 };
    assert_eq!(c.send(again).await.unwrap(), 10);
    assert_eq!(c.send(Deposit { key: "k2".to_owned(), by: 1 }).await.unwrap(), 11);
    counters.shutdown().await;
}

#[tokio::test]
async fn the_handler_does_not_see_the_callers_context() {
    let counters = TestClient::<Counter>::new().await.unwrap();
    let d = counters.client("d");
    let seen = CALLER.scope(7, d.send(Look)).await.unwrap();
    assert_eq!(seen, Seen { id: "d".to_owned(), task_local: None, headers: Vec::new() });
    // Headers reach it only when the client is given them.
    let with = d.with_headers([("tenant", "t1")]);
    let seen = CALLER.scope(7, with.send(Look)).await.unwrap();
    assert_eq!(seen.task_local, None);
    assert_eq!(seen.headers, [("tenant".to_owned(), "t1".to_owned())]);
    counters.shutdown().await;
}

/// Values over the memory storage's limit (16 MiB, as the SQL storages' default) meet what
/// they meet on a SQL storage. A persisted request over it is not saved: its caller gets the
/// storage's error. A reply over it cannot be stored: its caller is answered with the
/// `ReplyNotStored` defect that says why, instead of the request running again forever.
#[tokio::test]
async fn values_over_the_storage_limit_fail_their_caller() {
    let counters = TestClient::<Counter>::new().await.unwrap();
    let e = counters.client("e");
    let blob =
        |key: &str, len: usize, pad: usize| Blob { key: key.to_owned(), len, pad: "p".repeat(pad) };
    let fits = e.send(blob("small", 1_000, 0)).await.unwrap();
    assert_eq!(fits.len(), 1_000);
    let limit = cluster_testkit::memory::VALUE_BYTES_MAX_DEFAULT;
    let answer = e.send(blob("padded", 1, limit)).await;
    let Err(CallError::Cluster(ClusterError::Persistence(error))) = answer else {
        panic!("a request over the limit is not saved, not {:?}", answer.map(|text| text.len()));
    };
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput, "{error}");
    assert!(error.to_string().contains("the request's payload"), "{error}");
    let answer = e.send(blob("large", limit, 0)).await;
    let Err(CallError::Defect(defect)) = answer else {
        panic!("a reply over the limit is a defect, not {:?}", answer.map(|text| text.len()));
    };
    assert!(defect.contains("ReplyNotStored"), "{defect}");
    assert!(defect.contains("the reply's payload"), "{defect}");
    assert!(defect.contains(&format!("limit of {limit} bytes")), "{defect}");
    counters.shutdown().await;
}
