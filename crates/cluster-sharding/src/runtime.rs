//! The runtime of one runner: the entity managers and how requests reach them.
//!
//! - `manager`: one manager per entity type, its instances and their mailboxes;
//! - `registry`: the managers by type;
//! - `delivery`: what a manager is handed, and its interface whatever the type;
//! - `local`: requests to this runner's entities;
//! - `persisted`: saved requests, the storage read loop and the stored replies;
//! - `keep_alive` and `interrupt`: an instance's keep-alive latch, a request's interruption.

pub(crate) mod delivery;
pub(crate) mod interrupt;
pub(crate) mod keep_alive;
pub(crate) mod local;
pub(crate) mod manager;
pub(crate) mod persisted;
pub(crate) mod registry;
