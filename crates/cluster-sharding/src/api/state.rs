//! Durable entity state: the part of an entity value that survives restarts, moves and
//! crashes ([`Protocol::durable`](crate::Protocol::durable)).
//!
//! The runtime loads the state once per activation, right after the entity value is made, and
//! keeps it in the value while the instance is resident. After each `&mut self` request it
//! encodes the state again and compares it with what is committed:
//!
//! - unchanged: nothing is written (a read costs one encoding);
//! - changed by a request that failed (`Err`, an interrupt): the value gets its committed state
//!   back, and nothing is written;
//! - changed by a request that succeeded: one conditional write, on the revision that was
//!   loaded. A persisted request's write commits in the transaction of its final reply; a
//!   volatile request's commits before its reply is sent.
//!
//! A write that does not commit (a stale revision, a lost shard, a storage failure) reloads the
//! state from storage before the next request runs.

use cluster_core::EntityAddress;
use cluster_core::entity_state::{StateWrite, StoredState};
use cluster_core::envelope::RawJson;
use cluster_core::error::DecodeError;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::oneshot;

/// Encodes the state of an entity value.
type Encode<E> = Box<dyn Fn(&mut E) -> Result<RawJson, DecodeError> + Send + Sync>;

/// Puts a decoded state in an entity value.
type Decode<E> = Box<dyn Fn(&mut E, &RawJson) -> Result<(), DecodeError> + Send + Sync>;

/// Reads and replaces an entity value's durable state, whatever its type.
pub(crate) struct Durability<E> {
    encode: Encode<E>,
    decode: Decode<E>,
}

impl<E: 'static> Durability<E> {
    /// The durability of the state that `field` reaches in an entity value.
    pub(crate) fn of<S>(field: fn(&mut E) -> &mut S) -> Durability<E>
    where
        S: Serialize + DeserializeOwned + 'static,
    {
        Durability {
            encode: Box::new(move |entity| RawJson::encode(&*field(entity))),
            decode: Box::new(move |entity, value| {
                *field(entity) = value.decode()?;
                Ok(())
            }),
        }
    }

    /// The state of `entity`, encoded.
    pub(crate) fn encode(&self, entity: &mut E) -> Result<RawJson, DecodeError> {
        (self.encode)(entity)
    }

    /// Puts `value` in `entity` as its state.
    pub(crate) fn decode(&self, entity: &mut E, value: &RawJson) -> Result<(), DecodeError> {
        (self.decode)(entity, value)
    }
}

/// What one resident instance knows of its stored state.
pub(crate) struct StateCell {
    /// The state as the entity's `create` made it. It is not stored: an entity whose state is
    /// this has no row, and a request that brings the state back to it deletes the row.
    initial: RawJson,
    /// The committed state: the row's value, or `initial` without a row.
    committed: RawJson,
    /// The row's revision; 0 without a row.
    revision: u64,
}

/// What became of an instance's state after a request ([`StateCell::after`]).
pub(crate) enum Change {
    /// Nothing to write.
    Unchanged,
    /// Nothing to write, but the committed state is now this one: the request brought the
    /// state back to the initial one, and there is no row.
    Initial(RawJson),
    /// The request changed the state: this write commits it.
    Write(StateWrite, RawJson),
}

impl StateCell {
    /// The cell of a value just made, with its state as `create` made it (`initial`) and the
    /// stored row, if any.
    pub(crate) fn new(initial: RawJson, stored: Option<StoredState>) -> StateCell {
        match stored {
            Some(stored) => {
                StateCell { initial, committed: stored.value, revision: stored.revision }
            }
            None => StateCell { committed: initial.clone(), initial, revision: 0 },
        }
    }

    /// The committed state (what the value gets back after a failed request).
    pub(crate) fn committed(&self) -> &RawJson {
        &self.committed
    }

    /// The write that commits `current`, the state after a successful request, if it differs
    /// from the committed one.
    pub(crate) fn after(&self, address: &EntityAddress, current: RawJson) -> Change {
        if same(&current, &self.committed) {
            return Change::Unchanged;
        }
        let value = (!same(&current, &self.initial)).then(|| current.clone());
        if value.is_none() && self.revision == 0 {
            return Change::Initial(current);
        }
        Change::Write(
            StateWrite { address: address.clone(), expected: self.revision, value },
            current,
        )
    }

    /// `write` committed, leaving the state `current`.
    pub(crate) fn committed_as(&mut self, write: &StateWrite, current: RawJson) {
        self.revision = write.revision_after();
        self.committed = current;
    }

    /// The state is back to the initial one without a row ([`Change::Initial`]).
    pub(crate) fn back_to_initial(&mut self, current: RawJson) {
        self.committed = current;
    }

    /// The stored row was read again (after a write that did not commit).
    pub(crate) fn reloaded(&mut self, stored: Option<StoredState>) {
        match stored {
            Some(stored) => {
                self.committed = stored.value;
                self.revision = stored.revision;
            }
            None => {
                self.committed = self.initial.clone();
                self.revision = 0;
            }
        }
    }
}

/// Whether two encodings are the same JSON text.
fn same(a: &RawJson, b: &RawJson) -> bool {
    a.json() == b.json()
}

/// Whether a persisted request's state write committed with its final reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Committed {
    /// The state and the reply are stored.
    Yes,
    /// They are not (or it is unknown): the instance reads its state again.
    No,
}

/// A persisted request's state write, handed by the instance to the task that stores the
/// request's final reply, which commits both in one transaction and says how it went.
pub(crate) struct StateHandOff {
    pub(crate) write: StateWrite,
    pub(crate) committed: oneshot::Sender<Committed>,
}

/// Where a persisted request's instance hands its state write ([`StateHandOff`]).
pub(crate) type StateSink = oneshot::Sender<StateHandOff>;
