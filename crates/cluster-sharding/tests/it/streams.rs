//! Streams in chunks: items a handler queues while its previous chunk is unacknowledged go
//! together into the next chunk, within the coalescing bounds; a batch goes as one chunk. The
//! persisted cases run with a caller that reaches the runner through storage only, on the
//! memory storage, SQLite, PostgreSQL and MySQL.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::envelope::{RawJson, Reply};
use cluster_core::storage::MessageStorage;
use cluster_core::{ShardingConfig, SystemClock};
use cluster_sharding::{
    CHUNK_BYTES_MAX, CHUNK_ITEMS_MAX, Chunks, Entity, EntityContext, Protocol, RequestContext,
    Sharding, StreamHandler, StreamRpc,
};
use cluster_testkit::databases::TestDatabase;
use cluster_testkit::memory::MemoryMessageStorage;
use serde::{Deserialize, Serialize};

/// An entity whose streams send as fast as they are let.
struct Streamer;

impl Entity for Streamer {
    const TYPE: &'static str = "Streamer";

    async fn create(_: &EntityContext) -> Streamer {
        Streamer
    }

    fn protocol(protocol: &mut Protocol<Streamer>) {
        protocol.stream::<Burst>().stream::<Batch>().stream::<Wide>().stream::<Tall>();
    }
}

/// A persisted stream of `0..n`, sent item by item.
#[derive(Serialize, Deserialize)]
struct Burst {
    key: String,
    n: u64,
}

impl StreamRpc for Burst {
    const TAG: &'static str = "Burst";
    const PERSISTED: bool = true;
    type Item = u64;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl StreamHandler<Burst> for Streamer {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Burst,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), String> {
        for item in 0..request.n {
            chunks.send(item).await.map_err(|error| error.to_string())?;
        }
        Ok(())
    }
}

/// A persisted stream of `0..n` sent as one batch, then `n` alone.
#[derive(Serialize, Deserialize)]
struct Batch {
    key: String,
    n: u64,
}

impl StreamRpc for Batch {
    const TAG: &'static str = "Batch";
    const PERSISTED: bool = true;
    type Item = u64;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl StreamHandler<Batch> for Streamer {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Batch,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), String> {
        chunks.send_batch(0..request.n).await.map_err(|error| error.to_string())?;
        chunks.flush().await.map_err(|error| error.to_string())?;
        chunks.send(request.n).await.map_err(|error| error.to_string())
    }
}

/// A volatile stream of `n` strings of `width` characters each, sent item by item.
#[derive(Serialize, Deserialize)]
struct Wide {
    n: usize,
    width: usize,
}

impl StreamRpc for Wide {
    const TAG: &'static str = "Wide";
    type Item = String;
    type Error = String;
}

impl StreamHandler<Wide> for Streamer {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Wide,
        chunks: &mut Chunks<'_, String>,
    ) -> Result<(), String> {
        for n in 0..request.n {
            let item = format!("{n:0width$}", width = request.width);
            chunks.send(item).await.map_err(|error| error.to_string())?;
        }
        Ok(())
    }
}

/// A persisted stream of `"a"`, a string of `width` characters, then `"c"`.
#[derive(Serialize, Deserialize)]
struct Tall {
    key: String,
    width: usize,
}

impl StreamRpc for Tall {
    const TAG: &'static str = "Tall";
    const PERSISTED: bool = true;
    type Item = String;
    type Error = String;

    fn primary_key(&self) -> Option<String> {
        Some(self.key.clone())
    }
}

impl StreamHandler<Tall> for Streamer {
    async fn handle(
        &mut self,
        _: &RequestContext,
        request: Tall,
        chunks: &mut Chunks<'_, String>,
    ) -> Result<(), String> {
        for item in ["a".to_owned(), "b".repeat(request.width), "c".to_owned()] {
            chunks.send(item).await.map_err(|error| error.to_string())?;
            chunks.flush().await.map_err(|error| error.to_string())?;
        }
        Ok(())
    }
}

/// The memory storage's value limit in these tests: small, so that a value over it is cheap.
const MEMORY_VALUE_BYTES_MAX: usize = 65_536;

fn config() -> ShardingConfig {
    ShardingConfig {
        entity_message_poll_interval: Duration::from_millis(100),
        entity_reply_poll_interval: Duration::from_millis(50),
        ..ShardingConfig::default()
    }
}

/// A runner and a storage-only caller (another process: its own storage handles) on one
/// backend, and the runner's storage; `None` when the backend's database is not configured.
struct Pair {
    runner: Sharding,
    caller: Sharding,
    storage: Arc<dyn MessageStorage>,
    /// The most bytes the storage keeps in one value.
    value_bytes_max: usize,
    /// Dropped last: removes the tables.
    _database: Option<TestDatabase>,
}

impl Pair {
    async fn on(database: Option<TestDatabase>) -> Pair {
        let (runner_storage, caller_storage): (Arc<dyn MessageStorage>, Arc<dyn MessageStorage>) =
            match &database {
                None => {
                    let memory = MemoryMessageStorage::new(Arc::new(SystemClock));
                    let memory = Arc::new(memory.with_value_bytes_max(MEMORY_VALUE_BYTES_MAX));
                    (memory.clone(), memory)
                }
                Some(database) => (
                    database.open(&config()).await.unwrap().0,
                    database.open(&config()).await.unwrap().0,
                ),
            };
        let runner =
            Sharding::standalone(config(), Arc::clone(&runner_storage)).start().await.unwrap();
        runner.entity::<Streamer>().register().unwrap();
        let caller_config = ShardingConfig { runner_address: None, ..config() };
        let caller = Sharding::client_only(caller_config, caller_storage).start().await.unwrap();
        let value_bytes_max = match database.as_ref().map(TestDatabase::kind) {
            None => MEMORY_VALUE_BYTES_MAX,
            // Its `TEXT` columns.
            Some("mysql") => 65_535,
            Some(_) => cluster_storage_sql::options::VALUE_BYTES_MAX_DEFAULT.get(),
        };
        Pair { runner, caller, storage: runner_storage, value_bytes_max, _database: database }
    }

    /// The stored chunks of the request `tag` with `key` to `id`, in sequence order.
    async fn stored_chunks(&self, id: &str, tag: &str, key: &str) -> Vec<Vec<u64>> {
        let address = self.caller.client::<Streamer>(id).address().clone();
        let key = cluster_core::envelope::primary_key(&address, tag, key);
        let request_id = self.storage.request_id_for_primary_key(&key).await.unwrap().unwrap();
        let replies = self.storage.replies_for_unfiltered(&[request_id]).await.unwrap();
        let mut chunks: Vec<_> = replies
            .into_iter()
            .filter_map(|reply| match reply {
                Reply::Chunk(chunk) => Some(chunk),
                Reply::WithExit(_) => None,
            })
            .collect();
        chunks.sort_by_key(cluster_core::envelope::Chunk::sequence);
        chunks
            .iter()
            .map(|chunk| chunk.values().iter().map(|value| value.decode().unwrap()).collect())
            .collect()
    }

    async fn shutdown(self) -> Option<TestDatabase> {
        self.caller.shutdown().await;
        self.runner.shutdown().await;
        self._database
    }
}

macro_rules! on_every_backend {
    ($($case:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(super::Pair::on(None).await).await;
                }
            )*
        }
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let database = cluster_testkit::databases::TestDatabase::sqlite(concat!("streams-", stringify!($case)));
                    super::$case(super::Pair::on(Some(database)).await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::postgres() else { return };
                    super::$case(super::Pair::on(Some(database)).await).await;
                }
            )*
        }
        mod mysql {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let Some(database) = cluster_testkit::databases::TestDatabase::mysql() else { return };
                    super::$case(super::Pair::on(Some(database)).await).await;
                }
            )*
        }
    };
}

on_every_backend!(
    fifty_items_to_a_storage_only_caller_arrive_in_few_chunks,
    a_batch_arrives_as_one_chunk,
    a_chunk_over_the_storage_limit_ends_the_stream_with_a_defect,
);

/// An item over the storage's limit cannot be stored as a chunk: the stream ends with a
/// `ReplyNotStored` defect after the items before it, instead of stalling for an
/// acknowledgement that never comes (before the fix the caller waited out the 60 s bound).
async fn a_chunk_over_the_storage_limit_ends_the_stream_with_a_defect(pair: Pair) {
    let client = pair.caller.client::<Streamer>("tall");
    let width = pair.value_bytes_max + 1;
    let read = async {
        let mut stream = client.stream(Tall { key: "tall".to_owned(), width }).await.unwrap();
        let mut items = Vec::new();
        while let Some(item) = stream.next().await {
            items.push(item.map_err(|error| format!("{error:?}")));
        }
        items
    };
    let items =
        tokio::time::timeout(Duration::from_secs(60), read).await.expect("the stream stalled");
    assert_eq!(items.first(), Some(&Ok("a".to_owned())), "{:?}", &items[..items.len().min(1)]);
    assert_eq!(items.len(), 2, "the stream ends after the refused chunk");
    assert!(
        matches!(&items[1], Err(defect) if defect.contains("ReplyNotStored")),
        "{:?}",
        items[1].as_ref().map(String::len)
    );
    let database = pair.shutdown().await;
    drop(database);
}

/// Fifty items a handler sends at once reach a caller that only sees storage in a couple of
/// chunks, not one chunk (and one storage round trip) per item.
async fn fifty_items_to_a_storage_only_caller_arrive_in_few_chunks(pair: Pair) {
    let client = pair.caller.client::<Streamer>("burst");
    let stream = client.stream(Burst { key: "fifty".to_owned(), n: 50 });
    let mut stream = tokio::time::timeout(Duration::from_secs(30), stream).await.unwrap().unwrap();
    let mut received = Vec::new();
    let read = async {
        while let Some(chunk) = stream.next_chunk().await {
            received.push(chunk.unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.expect("the stream stalled");
    assert_eq!(received.concat(), (0..50).collect::<Vec<u64>>());
    let stored = pair.stored_chunks("burst", "Burst", "fifty").await;
    assert_eq!(stored, received, "the caller read the stored chunks as they were");
    assert!(stored.len() <= 2, "50 items took {} chunks: {stored:?}", stored.len());
    pair.shutdown().await;
}

/// A batch goes out as one chunk, even past the coalescing bound on items.
async fn a_batch_arrives_as_one_chunk(pair: Pair) {
    let n = u64::try_from(CHUNK_ITEMS_MAX).unwrap() + 44;
    let client = pair.caller.client::<Streamer>("batch");
    let stream = client.stream(Batch { key: "batch".to_owned(), n });
    let mut stream = tokio::time::timeout(Duration::from_secs(30), stream).await.unwrap().unwrap();
    let mut received = Vec::new();
    let read = async {
        while let Some(chunk) = stream.next_chunk().await {
            received.push(chunk.unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.expect("the stream stalled");
    assert_eq!(received, [(0..n).collect::<Vec<u64>>(), vec![n]]);
    let stored = pair.stored_chunks("batch", "Batch", "batch").await;
    assert_eq!(stored, received);
    pair.shutdown().await;
}

/// Coalescing respects both bounds: at most `CHUNK_ITEMS_MAX` items and `CHUNK_BYTES_MAX`
/// encoded bytes a chunk, and a chunk is filled up to them when the items are there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalescing_respects_the_chunk_bounds() {
    let sharding = Sharding::volatile(ShardingConfig::default()).start().await.unwrap();
    sharding.entity::<Streamer>().register().unwrap();
    let client = sharding.client::<Streamer>("wide");
    for (n, width) in [(3 * CHUNK_ITEMS_MAX + 10, 1), (200, 1000)] {
        let mut stream = client.stream(Wide { n, width }).await.unwrap();
        let mut chunks = Vec::new();
        let read = async {
            while let Some(chunk) = stream.next_chunk().await {
                chunks.push(chunk.unwrap());
            }
        };
        tokio::time::timeout(Duration::from_secs(30), read).await.expect("the stream stalled");
        let items: Vec<String> = chunks.concat();
        let expected: Vec<String> = (0..n).map(|n| format!("{n:0width$}")).collect();
        assert_eq!(items, expected, "every item once, in order");
        let bytes = |chunk: &Vec<String>| -> usize {
            chunk.iter().map(|item| RawJson::encode(item).unwrap().json().unwrap().len()).sum()
        };
        for chunk in &chunks {
            assert!(chunk.len() <= CHUNK_ITEMS_MAX, "{} items in a chunk", chunk.len());
            assert!(chunk.len() == 1 || bytes(chunk) <= CHUNK_BYTES_MAX, "{} bytes", bytes(chunk));
        }
        // The handler never waits for anything but room: all but the last chunk are full.
        let full = |chunk: &Vec<String>| {
            chunk.len() == CHUNK_ITEMS_MAX || bytes(chunk) + width + 2 > CHUNK_BYTES_MAX
        };
        let before_last = &chunks[..chunks.len() - 1];
        assert!(before_last.iter().all(full), "chunk sizes: {:?}", sizes(&chunks));
        assert!(chunks.len() < n / 10, "{} chunks for {n} items", chunks.len());
    }
    sharding.shutdown().await;
}

fn sizes(chunks: &[Vec<String>]) -> Vec<usize> {
    chunks.iter().map(Vec::len).collect()
}

/// A chunk whose save was written but reported failed is saved again; a storage that rejects
/// the same chunk twice answers that with a conflict, which means it is stored: the local
/// caller gets it at once, not at the next reply poll (an hour away here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_whose_save_acknowledgement_was_lost_reaches_the_local_caller() {
    let memory = Arc::new(MemoryMessageStorage::new(Arc::new(SystemClock)));
    let (storage, faults) = cluster_testkit::faulty::FaultyMessageStorage::new(memory);
    let config =
        ShardingConfig { entity_reply_poll_interval: Duration::from_secs(3600), ..config() };
    let sharding = Sharding::standalone(config, Arc::new(storage)).start().await.unwrap();
    sharding.entity::<Streamer>().register().unwrap();
    faults.lose_reply_acknowledgement(1);
    let client = sharding.client::<Streamer>("lost-ack");
    let mut stream = client.stream(Burst { key: "lost".to_owned(), n: 3 }).await.unwrap();
    let mut received = Vec::new();
    let read = async {
        while let Some(item) = stream.next().await {
            received.push(item.unwrap());
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read).await.expect("the stream stalled");
    assert_eq!(received, [0, 1, 2]);
    sharding.shutdown().await;
}
