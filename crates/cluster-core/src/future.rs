//! The boxed future used by the object-safe contracts.
//!
//! Contracts cross crate boundaries as trait objects (`Arc<dyn MessageStorage>`), so their async
//! methods return a boxed future. A storage or network round-trip dwarfs one allocation.

use std::future::Future;
use std::pin::Pin;

/// An owned, sendable, type-erased future, as returned by the contracts of this crate.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
