//! Measures the persisted-request cycle of a runner (save a request, claim it, save its final
//! reply) on one SQL backend, and prints cycles per second as one JSON line.
//!
//! ```text
//! cargo run --release -p cluster-storage-sql --all-features --example storage_cycles -- \
//!     <sqlite|sqlite-normal|postgres|mysql> <concurrency> [seconds] [url or file]
//! ```
//!
//! PostgreSQL and MySQL default to the local services of the test suite, SQLite to a file in
//! the temporary directory. The tables get a fresh prefix and are dropped afterwards.

use std::sync::Arc;
use std::time::Duration;

use cluster_core::storage::MessageStorage;
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use cluster_testkit::measure::{CycleReport, storage_cycles};
use mysql_async::prelude::Queryable;

type Error = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = args.first().map_or("sqlite", String::as_str).to_owned();
    let concurrency: u32 = args.get(1).map_or(Ok(1), |value| value.parse())?;
    let duration = Duration::from_secs(args.get(2).map_or(Ok(5), |value| value.parse())?);
    let target = args.get(3).cloned();
    let prefix = TablePrefix::new(&format!("bench_{}", std::process::id()))?;
    let options = SqlStorageOptions { prefix, ..SqlStorageOptions::default() };
    let pool_size = usize::try_from(concurrency).unwrap_or(usize::MAX).max(16);
    let report = match backend.as_str() {
        "sqlite" | "sqlite-normal" => {
            sqlite(&backend, target, options, concurrency, duration).await?
        }
        "postgres" => {
            use cluster_storage_sql::postgres::{self, PgMessageStorage};
            let url =
                target.unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned());
            let pool = postgres::pool(postgres::parse_config(&url)?, pool_size)?;
            let storage = Arc::new(PgMessageStorage::new(pool.clone(), &options).await?);
            let report = storage_cycles(storage, concurrency, duration).await?;
            let client = pool.get().await?;
            let (messages, replies, migrations, state) = tables(&options.prefix);
            client
                .batch_execute(&format!("DROP TABLE {messages}, {replies}, {migrations}, {state}"))
                .await?;
            report
        }
        "mysql" => {
            use cluster_storage_sql::mysql::{self, MySqlMessageStorage};
            let url = target.unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned());
            let pool = mysql::pool(&url, pool_size).await?;
            let storage = Arc::new(MySqlMessageStorage::new(pool.clone(), &options.prefix).await?);
            let report = storage_cycles(storage, concurrency, duration).await?;
            let mut conn = pool.get_conn().await?;
            let (messages, replies, migrations, state) = tables(&options.prefix);
            conn.query_drop(format!("DROP TABLE {messages}, {replies}, {migrations}, {state}"))
                .await?;
            report
        }
        other => return Err(format!("unknown backend {other:?}").into()),
    };
    report_line(&format!(
        r#"{{"backend":"{backend}","concurrency":{concurrency},"cycles":{},"seconds":{:.2},"cycles_per_s":{:.0}}}"#,
        report.cycles,
        report.elapsed.as_secs_f64(),
        report.per_second()
    ));
    Ok(())
}

async fn sqlite(
    backend: &str,
    target: Option<String>,
    options: SqlStorageOptions,
    concurrency: u32,
    duration: Duration,
) -> Result<CycleReport, Error> {
    use cluster_storage_sql::sqlite::{SqliteMessageStorage, SqliteOptions, Synchronous};
    let path = target.map_or_else(
        || std::env::temp_dir().join(format!("storage-cycles-{}.db", std::process::id())),
        std::path::PathBuf::from,
    );
    let synchronous = if backend == "sqlite" { Synchronous::Full } else { Synchronous::Normal };
    let sqlite = SqliteOptions { synchronous, ..SqliteOptions::new(options) };
    let storage = Arc::new(SqliteMessageStorage::open(&path, sqlite).await?);
    let report =
        storage_cycles(Arc::clone(&storage) as Arc<dyn MessageStorage>, concurrency, duration)
            .await?;
    storage.close().await;
    for suffix in ["", "-wal", "-shm"] {
        let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
    }
    Ok(report)
}

/// The message storage's tables of `prefix`.
fn tables(prefix: &TablePrefix) -> (String, String, String, String) {
    let table = |name| prefix.table(name);
    (table("messages"), table("replies"), table("migrations"), table("entity_state"))
}

#[expect(clippy::print_stdout, reason = "the example prints its measurement")]
fn report_line(line: &str) {
    println!("{line}");
}
