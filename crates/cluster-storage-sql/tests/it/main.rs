//! Integration tests of the SQL storages: the testkit's conformance suite on every backend, plus
//! each backend's own tests (schema against the reference's DDL, lock sessions, faults).
//!
//! PostgreSQL and MySQL tests read their URLs from `CLUSTER_TEST_POSTGRES_URL` and
//! `CLUSTER_TEST_MYSQL_URL` (`cargo xtask ci` sets them for the local services). Without one,
//! that backend's tests print a note and pass, except under `CI=true`, where a missing database
//! fails them: CI never passes by skipping. Every test works on tables with its own prefix and
//! drops them at the end.

mod limits;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "postgres")]
mod postgres;
mod queue;
#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(all(feature = "tls", any(feature = "postgres", feature = "mysql")))]
mod tls;

use std::sync::atomic::{AtomicU32, Ordering};

use cluster_storage_sql::TablePrefix;
#[cfg(any(feature = "sqlite", feature = "postgres"))]
use cluster_storage_sql::options::ValueBytesMax;

/// The `value_bytes_max` of the conformance suites' SQLite and PostgreSQL storages: small, so
/// that the cases' values at the limit are cheap to write and read back. (MySQL's storages keep
/// the default, which their columns cap.)
#[cfg(any(feature = "sqlite", feature = "postgres"))]
pub(crate) fn suite_value_bytes_max() -> ValueBytesMax {
    ValueBytesMax::new(256 * 1024).expect("256 KiB is a valid limit")
}

/// A table prefix no other test, process or earlier run uses: `t<pid>_<counter>_<nanos>`.
pub(crate) fn unique_prefix() -> TablePrefix {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let counter = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Only the low bits of a fresh random-ish number are needed to keep runs apart.
    let entropy = std::collections::hash_map::RandomState::new();
    let salt = std::hash::BuildHasher::hash_one(&entropy, counter) % 100_000;
    let prefix = format!("t{}_{counter}_{salt}", std::process::id());
    TablePrefix::new(&prefix).expect("a generated prefix is an identifier")
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// The database URL in `variable`, or `None` (after a note) when it is not set. Under `CI=true`
/// a missing URL fails the test.
pub(crate) fn database_url(variable: &str) -> Option<String> {
    match std::env::var(variable) {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "{variable} is not set and CI=true: this database's tests must run in CI"
            );
            report(&format!("skipped: {variable} is not set"));
            None
        }
    }
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
#[expect(clippy::print_stderr, reason = "a skipped database is reported to the test output")]
fn report(message: &str) {
    eprintln!("{message}");
}

#[cfg(any(feature = "postgres", feature = "mysql"))]
/// A loopback port on which nothing listens: one the system just handed out and took back.
pub(crate) fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    listener.local_addr().expect("a bound address").port()
}
