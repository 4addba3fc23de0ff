//! Measures the persisted-request cycle of a runner (save a request, claim it, save its final
//! reply) on one SQL backend, and prints cycles per second as one JSON line.
//!
//! ```text
//! cargo run --release -p cluster-storage-sql --all-features --example storage_cycles -- \
//!     <sqlite|sqlite-normal|postgres|mysql> <concurrency> [seconds] [url or file]
//! ```
//!
//! PostgreSQL and MySQL default to the local services of the test suite; SQLite defaults to a
//! file in the temporary directory. Tables get a fresh prefix and are left behind for
//! inspection only under SQLite (the file is removed).

use std::sync::Arc;
use std::time::Duration;

use cluster_core::storage::MessageStorage;
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use cluster_testkit::measure::storage_cycles;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = args.first().map_or("sqlite", String::as_str).to_owned();
    let concurrency: u32 = args.get(1).map_or(Ok(1), |value| value.parse())?;
    let seconds: u64 = args.get(2).map_or(Ok(5), |value| value.parse())?;
    let target = args.get(3).cloned();
    let prefix = TablePrefix::new(&format!("bench_{}", std::process::id()))?;
    let options = SqlStorageOptions { prefix, ..SqlStorageOptions::default() };
    let mut cleanup: Option<std::path::PathBuf> = None;
    let storage: Arc<dyn MessageStorage> = match backend.as_str() {
        "sqlite" | "sqlite-normal" => {
            use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, Synchronous};
            let path = target.map_or_else(
                || std::env::temp_dir().join(format!("storage-cycles-{}.db", std::process::id())),
                std::path::PathBuf::from,
            );
            cleanup = Some(path.clone());
            let synchronous =
                if backend == "sqlite" { Synchronous::Full } else { Synchronous::Normal };
            let sqlite = SqliteOptions { synchronous, ..SqliteOptions::new(options) };
            Arc::new(SqliteMessageStorage::open(&path, sqlite).await?)
        }
        "postgres" => {
            let url =
                target.unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
            Arc::new(
                cluster_storage_sql::postgres::PgMessageStorage::connect(&url, &options).await?,
            )
        }
        "mysql" => {
            use cluster_storage_sql::mysql::{self, MySqlMessageStorage};
            let url = target.unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned());
            let pool =
                mysql::pool(&url, mysql::POOL_SIZE_DEFAULT.max(concurrency_pool(concurrency)))?;
            Arc::new(MySqlMessageStorage::new(pool, &options.prefix).await?)
        }
        other => return Err(format!("unknown backend {other:?}").into()),
    };
    let report =
        storage_cycles(Arc::clone(&storage), concurrency, Duration::from_secs(seconds)).await?;
    report_line(&format!(
        r#"{{"backend":"{backend}","concurrency":{concurrency},"cycles":{},"seconds":{:.2},"cycles_per_s":{:.0}}}"#,
        report.cycles,
        report.elapsed.as_secs_f64(),
        report.per_second()
    ));
    if let Some(path) = cleanup {
        for suffix in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
        }
    }
    Ok(())
}

/// A pool as large as the number of workers, so that they do not queue for connections.
fn concurrency_pool(concurrency: u32) -> usize {
    usize::try_from(concurrency).unwrap_or(usize::MAX)
}

#[expect(clippy::print_stdout, reason = "the example prints its measurement")]
fn report_line(line: &str) {
    println!("{line}");
}
