//! Throughput measurements of storages, for benchmarks and notes (not for tests: timing goals
//! are checked by benchmarks, never asserted by tests).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use cluster_core::envelope::{Exit, RawJson, Reply, Request, TraceContext, WithExit};
use cluster_core::error::StorageError;
use cluster_core::snowflake::SnowflakeGenerator;
use cluster_core::storage::{MessageStorage, SaveRequestOptions, UnprocessedOptions};
use cluster_core::{
    Clock, EntityAddress, EntityId, EntityType, MachineId, ShardGroup, ShardId, SystemClock,
};
use tokio::time::Instant;

/// The result of [`storage_cycles`].
#[derive(Clone, Copy, Debug)]
pub struct CycleReport {
    /// Completed cycles.
    pub cycles: u64,
    /// How long they took.
    pub elapsed: Duration,
}

impl CycleReport {
    /// Cycles per second.
    pub fn per_second(&self) -> f64 {
        // u64 → f64 loses precision only past 2^53 cycles.
        #[expect(clippy::cast_precision_loss, reason = "cycle counts are far below 2^53")]
        let cycles = self.cycles as f64;
        cycles / self.elapsed.as_secs_f64()
    }
}

/// Runs `concurrency` workers for `duration`, each repeating the persisted-request cycle of a
/// runner: save a request (with a primary key), claim it with `unprocessed_messages`, save its
/// final reply. Worker `w` uses shard `w + 1`, as if each were a separate entity.
pub async fn storage_cycles(
    storage: Arc<dyn MessageStorage>,
    concurrency: u32,
    duration: Duration,
) -> Result<CycleReport, StorageError> {
    let cycles = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = started + duration;
    let mut workers = tokio::task::JoinSet::new();
    for worker in 0..concurrency {
        let storage = Arc::clone(&storage);
        let cycles = Arc::clone(&cycles);
        workers.spawn(async move { run_worker(&*storage, worker, deadline, &cycles).await });
    }
    while let Some(finished) = workers.join_next().await {
        finished.map_err(|error| {
            StorageError::new(cluster_core::error::StorageErrorKind::Other, error.to_string())
        })??;
    }
    Ok(CycleReport { cycles: cycles.load(Ordering::Relaxed), elapsed: started.elapsed() })
}

async fn run_worker(
    storage: &dyn MessageStorage,
    worker: u32,
    deadline: Instant,
    cycles: &AtomicU64,
) -> Result<(), StorageError> {
    let clock = SystemClock;
    let mut ids = SnowflakeGenerator::new(
        MachineId::new(i32::try_from(worker % 1024).unwrap_or(0)),
        clock.now(),
    );
    let shard_id = ShardId::new(ShardGroup::from("default"), worker + 1);
    let address = EntityAddress {
        shard_id: shard_id.clone(),
        entity_type: EntityType::from("Bench"),
        entity_id: EntityId::from(format!("bench-{worker}")),
    };
    let payload = RawJson::from_json(r#"{"by":1}"#.to_owned()).unwrap_or_default();
    while Instant::now() < deadline {
        let request_id = ids.next(clock.now());
        let request = Request {
            request_id,
            address: address.clone(),
            tag: "Increment".into(),
            payload: payload.clone(),
            headers: RawJson::empty_object(),
            trace: TraceContext::default(),
        };
        let options = SaveRequestOptions {
            primary_key: Some(format!("Bench/bench-{worker}/Increment/{request_id}")),
            deliver_at: None,
        };
        storage.save_request(&request, &options).await?;
        let claimed = storage
            .unprocessed_messages(
                std::slice::from_ref(&shard_id),
                clock.now(),
                UnprocessedOptions::default(),
            )
            .await?;
        for message in claimed.messages {
            let reply = Reply::WithExit(WithExit {
                request_id: message.envelope.request_id(),
                id: ids.next(clock.now()),
                exit: Exit::Success(RawJson::from_json("1".to_owned()).unwrap_or_default()),
            });
            storage.save_reply(&reply).await?;
        }
        cycles.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}
