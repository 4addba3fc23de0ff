//! The typed request protocol of an entity: [`Rpc`] (one request type with its reply and error
//! types and its delivery flags) and [`CallError`] (what a caller gets when it fails).
//!
//! A request is a plain serde type. Its payload is encoded once by the caller, carried as an
//! opaque JSON hole through storage and transport, and decoded once by the handler.

use cluster_core::ClusterError;
use cluster_core::Timestamp;
use serde::Serialize;
use serde::de::DeserializeOwned;

/// Whether interrupting a request reaches it (the reference's `ClusterSchema.Uninterruptible`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Uninterruptible {
    /// Dropping the caller's future interrupts the request (the default).
    #[default]
    No,
    /// The caller just stops waiting; no interrupt is sent.
    Client,
    /// A persisted request that ends by interruption runs again instead of being answered.
    Server,
    /// Both.
    Both,
}

impl Uninterruptible {
    /// Whether the caller side does not forward interrupts.
    pub fn client(self) -> bool {
        matches!(self, Uninterruptible::Client | Uninterruptible::Both)
    }

    /// Whether the server side re-runs an interrupted persisted request.
    pub fn server(self) -> bool {
        matches!(self, Uninterruptible::Server | Uninterruptible::Both)
    }
}

/// One request type of an entity's protocol.
///
/// ```
/// # use cluster_sharding::Rpc;
/// # use serde::{Deserialize, Serialize};
/// # #[derive(Serialize, Deserialize)]
/// # enum CounterError { Overflow }
/// #[derive(Serialize, Deserialize)]
/// struct Increment { by: u64 }
///
/// impl Rpc for Increment {
///     const TAG: &'static str = "Increment";
///     type Success = u64;
///     type Error = CounterError;
/// }
/// ```
pub trait Rpc: Serialize + DeserializeOwned + Send + 'static {
    /// The request's name within its entity type; stored with every message.
    const TAG: &'static str;
    /// Whether requests go through storage: saved first, deduplicated by
    /// [`primary_key`](Rpc::primary_key), delivered at least once and answered exactly once.
    /// Volatile (in memory) by default, as in the reference.
    const PERSISTED: bool = false;
    /// Whether interrupts reach the request.
    const UNINTERRUPTIBLE: Uninterruptible = Uninterruptible::No;
    /// Whether a running request is interrupted as soon as its entity starts stopping (runner
    /// shutdown) instead of getting `entity_termination_timeout` to finish (the reference's
    /// `InterruptOnTermination`). A persisted one is left stored for the next run; server-side
    /// [`Uninterruptible`] wins.
    const INTERRUPT_ON_TERMINATION: bool = false;
    /// Whether a persisted request's handler runs inside a storage transaction in which its
    /// final reply is saved (the reference's `WithTransaction`,
    /// `effect/src/cluster/SqlMessageStorage.ts`): the handler's own writes through
    /// [`RequestContext::transaction`](crate::RequestContext::transaction) and the reply commit
    /// together, or neither does (the request then runs again).
    const WITH_TRANSACTION: bool = false;
    /// Whether [`with_transaction`](Rpc::with_transaction) decides, request by request, whether
    /// a persisted request runs inside a storage transaction (the reference's
    /// `ClusterSchema.Dynamic` annotation adding `WithTransaction`, as the workflow engine's
    /// `activity` request does in `effect/src/cluster/ClusterWorkflowEngine.ts`). Off by
    /// default: [`WITH_TRANSACTION`](Rpc::WITH_TRANSACTION) decides for every request, and the
    /// runtime never decodes a payload to ask.
    const WITH_TRANSACTION_PER_REQUEST: bool = false;

    /// The reply of a successful request.
    type Success: Serialize + DeserializeOwned + Send + 'static;
    /// The request's own error.
    type Error: Serialize + DeserializeOwned + Send + 'static;

    /// The deduplication key of a persisted request: two requests to one entity with the same
    /// tag and key are one request. `None` (the default) never deduplicates.
    fn primary_key(&self) -> Option<String> {
        None
    }

    /// Not delivered before this time (persisted requests only).
    fn deliver_at(&self) -> Option<Timestamp> {
        None
    }

    /// Whether this request runs inside a storage transaction. Asked only when
    /// [`WITH_TRANSACTION_PER_REQUEST`](Rpc::WITH_TRANSACTION_PER_REQUEST) is set, and only for
    /// persisted requests; [`WITH_TRANSACTION`](Rpc::WITH_TRANSACTION) by default.
    fn with_transaction(&self) -> bool {
        Self::WITH_TRANSACTION
    }
}

/// A request whose response is a stream of items (the reference's stream RPCs): the handler
/// queues items, the runtime sends them in chunks with at most one unacknowledged by the caller
/// (see [`Chunks`](crate::Chunks)), and a persisted stream resumes after a restart from the last
/// chunk it sent.
pub trait StreamRpc: Serialize + DeserializeOwned + Send + 'static {
    /// The request's name within its entity type.
    const TAG: &'static str;
    /// Whether requests (and their chunks) go through storage.
    const PERSISTED: bool = false;

    /// One item of the response stream.
    type Item: Serialize + DeserializeOwned + Send + 'static;
    /// The request's own error, which ends the stream.
    type Error: Serialize + DeserializeOwned + Send + 'static;

    /// The deduplication key of a persisted request, as [`Rpc::primary_key`].
    fn primary_key(&self) -> Option<String> {
        None
    }
}

/// Why a call did not return the request's success value.
#[derive(Debug, thiserror::Error)]
pub enum CallError<E> {
    /// The handler returned the request's own error.
    #[error("the request failed")]
    Failed(E),
    /// The cluster could not deliver the request or its reply.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// The handler failed unexpectedly (a panic, a payload that cannot be decoded); the
    /// reference's `Die`, with the defect's JSON.
    #[error("the request died: {0}")]
    Defect(String),
    /// The request was interrupted.
    #[error("the request was interrupted")]
    Interrupted,
}

impl<E> CallError<E> {
    /// The cluster error, if that is what this is.
    pub fn cluster(&self) -> Option<&ClusterError> {
        match self {
            CallError::Cluster(error) => Some(error),
            _ => None,
        }
    }
}
