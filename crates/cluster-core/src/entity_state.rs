//! Durable entity state: the value an entity keeps across activations, crashes and moves.
//!
//! The reference keeps entity state in memory only. This is our own addition: one row per
//! entity that has state, in a table of our own per prefix (`<prefix>_entity_state`), which
//! TypeScript runners neither read nor write.
//!
//! A row holds the state's JSON and its *revision*: 1 when the row is made, one more on every
//! write. Every write names the revision its writer loaded ([`StateWrite::expected`]), and
//! storage applies it only if the row still has that revision (optimistic concurrency, as
//! Orleans' ETags and Akka's durable-state revisions). A writer that lost its shard to another
//! runner, which wrote since, is refused with [`StorageErrorKind::StaleState`]: its state
//! change is dropped, and so is the final reply it was to be saved with.
//!
//! [`StorageErrorKind::StaleState`]: crate::error::StorageErrorKind::StaleState

use crate::envelope::RawJson;
use crate::error::{StorageError, StorageErrorKind};
use crate::ids::EntityAddress;

/// An entity's stored state, as loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredState {
    /// The state's JSON.
    pub value: RawJson,
    /// The row's revision: 1 when made, one more per write.
    pub revision: u64,
}

/// One conditional write of an entity's state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateWrite {
    /// The entity. The row's key is its type and id; its shard is kept for operators.
    pub address: EntityAddress,
    /// The revision the writer loaded; 0 when it found no row.
    pub expected: u64,
    /// The new state; `None` deletes the row.
    pub value: Option<RawJson>,
}

impl StateWrite {
    /// The revision the row has after this write (0 for a deletion: no row).
    pub fn revision_after(&self) -> u64 {
        match self.value {
            Some(_) => self.expected.saturating_add(1),
            None => 0,
        }
    }

    /// The error of a write whose expected revision is not the stored one: someone else wrote
    /// the entity's state since it was loaded here.
    pub fn stale(&self) -> StorageError {
        StorageError::new(
            StorageErrorKind::StaleState,
            format!(
                "the state of {} was written elsewhere since revision {} was loaded here: \
                 this runner no longer owns the entity (its write and reply are dropped, and \
                 the request runs on the owner)",
                self.address, self.expected
            ),
        )
    }
}

/// The error of a storage that keeps no entity state (the default of the
/// [`MessageStorage`](crate::storage::MessageStorage) methods).
pub fn unsupported(backend: &str) -> StorageError {
    StorageError::new(
        StorageErrorKind::Other,
        format!(
            "the {backend} storage does not keep entity state: register entities with durable \
             state on a runtime whose message storage is SQLite, PostgreSQL, MySQL or memory"
        ),
    )
}
