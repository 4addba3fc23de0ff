//! Entities: keyed, single-writer actors with a typed protocol.
//!
//! An entity is a Rust type that implements [`Entity`] (its type name, how an instance is
//! created, which requests it handles) and one [`Handler`] per request type. The runtime keeps
//! at most one instance per entity id on the runner that owns the id's shard, creates it on the
//! first request, and hands it requests one at a time, in delivery order (the reference's
//! default concurrency of 1), so handlers take `&mut self` and need no locks.
//!
//! ```ignore
//! struct Counter { value: u64 }
//!
//! impl Entity for Counter {
//!     const TYPE: &'static str = "Counter";
//!     async fn create(_address: &EntityAddress) -> Counter { Counter { value: 0 } }
//!     fn protocol(protocol: &mut Protocol<Counter>) { protocol.handle::<Increment>(); }
//! }
//!
//! impl Handler<Increment> for Counter {
//!     async fn handle(&mut self, _: &RequestContext, request: Increment) -> Result<u64, Never> {
//!         self.value += request.by;
//!         Ok(self.value)
//!     }
//! }
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use cluster_core::config::Capacity;
use cluster_core::envelope::{Exit, RawJson};
use cluster_core::future::BoxFuture;
use cluster_core::{EntityAddress, ShardGroup, Snowflake};
use tokio_util::sync::CancellationToken;

use crate::rpc::Rpc;

/// An entity type.
pub trait Entity: Sized + Send + 'static {
    /// The entity type's name, such as `Counter`; part of every stored message.
    const TYPE: &'static str;

    /// The shard group of an entity id (`default` unless overridden).
    fn shard_group(_entity_id: &str) -> ShardGroup {
        ShardGroup::default_group()
    }

    /// A new instance for `address`, created on its first request (and again after it was
    /// reaped for idleness, or restarted after a panic).
    fn create(address: &EntityAddress) -> impl Future<Output = Self> + Send;

    /// Declares the requests the entity handles: `protocol.handle::<R>()` for each.
    fn protocol(protocol: &mut Protocol<Self>);
}

/// Handles one request type `R`.
pub trait Handler<R: Rpc>: Entity {
    /// Handles `request`. Dropping the returned future interrupts the request (the caller
    /// went away, the entity is stopping); `context.cancellation()` tells the same to code that
    /// prefers to check.
    fn handle(
        &mut self,
        context: &RequestContext,
        request: R,
    ) -> impl Future<Output = Result<R::Success, R::Error>> + Send;
}

/// What a handler knows about the request it handles.
#[derive(Clone, Debug)]
pub struct RequestContext {
    address: EntityAddress,
    request_id: Snowflake,
    cancellation: CancellationToken,
}

impl RequestContext {
    pub(crate) fn new(
        address: EntityAddress,
        request_id: Snowflake,
        cancellation: CancellationToken,
    ) -> RequestContext {
        RequestContext { address, request_id, cancellation }
    }

    /// The entity's address.
    pub fn address(&self) -> &EntityAddress {
        &self.address
    }

    /// The request's id.
    pub fn request_id(&self) -> Snowflake {
        self.request_id
    }

    /// Cancelled when the request is interrupted.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancellation
    }
}

/// A type-erased handler call: decode the payload, run the handler, encode its outcome.
pub(crate) type Call<E> =
    for<'a> fn(&'a mut E, &'a RequestContext, &'a RawJson) -> BoxFuture<'a, Exit>;

/// One request type of a protocol.
pub(crate) struct HandlerEntry<E> {
    pub(crate) call: Call<E>,
    /// Interrupted as soon as the entity starts stopping.
    pub(crate) interrupt_on_termination: bool,
}

/// The requests an entity type handles, by tag.
pub struct Protocol<E> {
    handlers: BTreeMap<&'static str, HandlerEntry<E>>,
}

impl<E: Entity> Protocol<E> {
    pub(crate) fn of() -> Protocol<E> {
        let mut protocol = Protocol { handlers: BTreeMap::new() };
        E::protocol(&mut protocol);
        protocol
    }

    /// Declares that the entity handles `R`.
    pub fn handle<R: Rpc>(&mut self) -> &mut Protocol<E>
    where
        E: Handler<R>,
    {
        let entry = HandlerEntry {
            call: call::<E, R>,
            interrupt_on_termination: R::INTERRUPT_ON_TERMINATION && !R::UNINTERRUPTIBLE.server(),
        };
        self.handlers.insert(R::TAG, entry);
        self
    }

    pub(crate) fn get(&self, tag: &str) -> Option<&HandlerEntry<E>> {
        self.handlers.get(tag)
    }
}

fn call<'a, E: Handler<R>, R: Rpc>(
    entity: &'a mut E,
    context: &'a RequestContext,
    payload: &'a RawJson,
) -> BoxFuture<'a, Exit> {
    Box::pin(async move {
        let request: R = match payload.decode() {
            Ok(request) => request,
            Err(error) => return malformed(&error.to_string()),
        };
        match entity.handle(context, request).await {
            Ok(success) => RawJson::encode(&success)
                .map_or_else(|error| malformed(&error.to_string()), Exit::Success),
            Err(error) => RawJson::encode(&error)
                .map_or_else(|error| malformed(&error.to_string()), Exit::fail),
        }
    })
}

/// The defect of a payload or reply that cannot be encoded or decoded (reference §6.2).
pub(crate) fn malformed(message: &str) -> Exit {
    Exit::die_with_message("MalformedMessage", message)
}

/// How an entity type runs; `None` fields take the runner's [`ShardingConfig`] default.
///
/// [`ShardingConfig`]: cluster_core::ShardingConfig
#[derive(Clone, Copy, Debug, Default)]
pub struct EntityOptions {
    /// How long an instance with no request in flight lives before it is reaped; `Some(None)`
    /// never reaps (`entity_max_idle_time` by default).
    pub max_idle_time: Option<Option<Duration>>,
    /// How many requests an instance holds, running and waiting, before further ones fail with
    /// `MailboxFull` (`entity_mailbox_capacity` by default).
    pub mailbox_capacity: Option<Capacity>,
}
