//! SQL implementations of the storage contracts of `cluster-core`.
//!
//! This crate will hold `MessageStorage` and `RunnerStorage` for PostgreSQL (tokio-postgres and
//! deadpool-postgres), MySQL (mysql_async) and SQLite (rusqlite on its own thread), each behind
//! the cargo feature of the same name (`sqlite` is the default), with their migrations and the
//! shard lock modes (advisory locks and lease rows).
//! The tables, columns and lock keys are the reference's, so a database can be shared with
//! TypeScript runners (see `ARCHITECTURE.md`).
//!
//! Status: the contracts live in `cluster_core::storage`; the implementations are the subject of
//! the SQL storage issue and are not written yet.
