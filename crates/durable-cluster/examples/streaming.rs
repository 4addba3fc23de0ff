//! A streaming entity: one runner on a SQLite file, a volatile stream and a persisted one.
//!
//! ```text
//! cargo run -p durable-cluster --example streaming
//! ```
//!
//! The `Sensor` entity answers `Readings` with a stream of items. The handler queues them; the
//! runtime keeps one chunk unacknowledged by the caller at a time and puts the items queued
//! meanwhile into the next (backpressure without a round trip per item). `Readings` is
//! volatile (nothing is stored); `Export` is persisted with a primary key, so every chunk is
//! stored as a reply (a re-delivered export resumes after its last stored chunk), and sending
//! the same export again finds it complete: as in the reference, the new stream ends at once,
//! with the stored outcome and no item, and the handler does not run again. The example checks
//! both and exits non-zero if anything differs.

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};

use durable_cluster::{
    CallError, Chunks, EntityContext, Never, ShardingConfig, SingleRunner, StreamRpc, entity,
};
use serde::{Deserialize, Serialize};

/// The next `count` readings, as they come (volatile).
#[derive(Serialize, Deserialize)]
struct Readings {
    count: u64,
}

/// An export of `count` readings, stored chunk by chunk under `key` (persisted).
#[derive(Serialize, Deserialize)]
struct Export {
    key: String,
    count: u64,
}

/// How many times the export handler ran (in this process).
static EXPORTS_RUN: AtomicUsize = AtomicUsize::new(0);

/// A sensor's readings (the stand-in for a real source).
struct Sensor {
    base: u64,
}

#[entity]
impl Sensor {
    async fn create(context: &EntityContext) -> Self {
        // Each sensor starts from a base derived from its id, to tell them apart.
        let base = context.address().entity_id.as_str().len() as u64 * 100;
        Sensor { base }
    }

    #[rpc(stream)]
    async fn readings(
        &mut self,
        request: Readings,
        chunks: &mut Chunks<'_, u64>,
    ) -> Result<(), Never> {
        for n in 0..request.count {
            // `send` queues the item: items queued while the caller has not acknowledged the
            // previous chunk go out together in the next one. It fails only when the caller
            // went away, and then the stream ends.
            if chunks.send(self.base + n).await.is_err() {
                break;
            }
        }
        Ok(())
    }

    #[rpc(stream, persisted, primary_key = key)]
    async fn export(&mut self, request: Export, chunks: &mut Chunks<'_, u64>) -> Result<(), Never> {
        EXPORTS_RUN.fetch_add(1, Ordering::SeqCst);
        // A re-delivered export (after a restart) resumes after its last stored item.
        let start = chunks.last_sent().map_or(0, |last: u64| last.saturating_sub(self.base) + 1);
        for n in start..request.count {
            if chunks.send(self.base + n).await.is_err() {
                break;
            }
        }
        Ok(())
    }
}

/// Collects a stream's items.
async fn collect<R: StreamRpc>(
    mut stream: durable_cluster::ChunkStream<R>,
) -> Result<Vec<R::Item>, CallError<R::Error>> {
    let mut items = Vec::new();
    while let Some(item) = stream.next().await {
        items.push(item?);
    }
    Ok(items)
}

async fn run(path: &std::path::Path) -> Result<(), String> {
    let sharding = SingleRunner::sqlite(path, ShardingConfig::default())
        .await
        .map_err(|error| error.to_string())?;
    sharding.entity::<Sensor>().register().map_err(|error| error.to_string())?;
    let sensors = Sensor::client(&sharding);
    let failed = |error: CallError<Never>| error.to_string();

    let readings =
        collect(sensors.readings("kitchen", Readings { count: 5 }).await.map_err(failed)?)
            .await
            .map_err(failed)?;
    say(&format!("volatile readings: {readings:?}"));
    let expected: Vec<u64> = (700..705).collect();
    if readings != expected {
        return Err(format!("readings {readings:?}, expected {expected:?}"));
    }

    let export = || Export { key: "2026-11-30".into(), count: 4 };
    let first = collect(sensors.export("kitchen", export()).await.map_err(failed)?)
        .await
        .map_err(failed)?;
    say(&format!("persisted export: {first:?}"));
    let again = collect(sensors.export("kitchen", export()).await.map_err(failed)?)
        .await
        .map_err(failed)?;
    say(&format!("the same export again (already complete): {again:?}"));
    let runs = EXPORTS_RUN.load(Ordering::SeqCst);
    sharding.shutdown().await;
    let expected: Vec<u64> = (700..704).collect();
    if first != expected || !again.is_empty() || runs != 1 {
        return Err(format!(
            "export {first:?} then {again:?} with {runs} handler runs; expected {expected:?}, then nothing, with one run"
        ));
    }
    Ok(())
}

#[expect(clippy::print_stdout, reason = "the example narrates what happens")]
fn say(line: &str) {
    println!("{line}");
}

#[tokio::main]
async fn main() -> ExitCode {
    let path = std::env::temp_dir().join(format!("streaming-example-{}.db", std::process::id()));
    let result = run(&path).await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    match result {
        Ok(()) => {
            say("streaming: both streams arrived in order; the export ran once");
            ExitCode::SUCCESS
        }
        Err(error) => {
            #[expect(clippy::print_stderr, reason = "the example reports its failure")]
            {
                eprintln!("streaming: {error}");
            }
            ExitCode::FAILURE
        }
    }
}
