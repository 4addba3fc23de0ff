//! Typed access to the storage transaction a handler runs in.
//!
//! A persisted request type with `WITH_TRANSACTION`, and a workflow activity called
//! `with_transaction`, runs its handler inside a [`MessageTransaction`] in which its result is
//! saved.
//! The handler's context is a [`TransactionSource`]: [`TransactionGuard::of`] locks the
//! transaction and lends the backend's own handle, typed, in one call.
//! Statements run through the guard commit with the saved result, or roll back with it.
//!
//! Each storage names its guard type: `cluster-storage-sql` has `PgTransactionGuard`
//! (PostgreSQL), `MySqlTransactionGuard` (MySQL) and `SqliteTransactionGuard` (SQLite).
//! Asking for the guard of another backend than the one the transaction is on fails with
//! [`TransactionError::WrongBackend`], so the storage crates need not know the runtime and the
//! runtime need not know them.

use std::any::{Any, type_name};
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

use crate::future::BoxFuture;
use crate::storage::MessageTransaction;

/// The backend handle of a locked transaction ([`MessageTransaction::backend`]): the
/// transaction stays locked while the box lives.
pub type BackendLock<'a> = Box<dyn DerefMut<Target = dyn Any + Send> + Send + 'a>;

/// Something that may run in a storage transaction: the context of an entity's request handler
/// (`cluster_sharding::RequestContext`) or of a workflow activity
/// (`cluster_workflow::ActivityContext`).
pub trait TransactionSource {
    /// Locks the transaction and lends its backend handle, until the returned box is dropped.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Missing`] when there is no transaction, and
    /// [`TransactionError::Finished`] when it has already ended.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future holds no lock.
    fn lock_backend(&self) -> BoxFuture<'_, Result<BackendLock<'_>, TransactionError>>;
}

/// Why a handler cannot have its storage transaction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransactionError {
    /// The request or activity runs outside a storage transaction: its request type is not
    /// `WITH_TRANSACTION`, the activity was not called `with_transaction`, or the engine has no
    /// storage (the in-memory workflow engine).
    #[error("the handler runs outside a storage transaction")]
    Missing,
    /// The transaction has already ended (the handler's request was answered).
    #[error("the storage transaction has already ended")]
    Finished,
    /// The transaction belongs to another backend than the one asked for.
    #[error("the storage transaction is not on the backend of `{expected}`")]
    WrongBackend {
        /// The backend handle type asked for.
        expected: &'static str,
    },
}

/// The locked storage transaction of a handler, as its backend's handle `T`: it derefs to `T`.
///
/// The transaction stays locked while the guard lives: drop it before locking the transaction
/// again (a second [`of`](TransactionGuard::of) while the first guard lives waits forever).
/// The runtime saves the handler's result in the transaction after the handler returns, then
/// commits; the handler must not commit or roll back through `T` itself.
///
/// ```
/// use cluster_core::transaction::{TransactionError, TransactionGuard, TransactionSource};
///
/// /// Counts a visit in the handler's transaction (`Vec<String>` stands in for a backend's
/// /// handle, such as `cluster-storage-sql`'s `PgTransactionGuard`).
/// async fn visit(context: &impl TransactionSource) -> Result<usize, TransactionError> {
///     let mut log = TransactionGuard::<Vec<String>>::of(context).await?;
///     log.push("visit".to_owned());
///     Ok(log.len())
/// }
/// ```
pub struct TransactionGuard<'a, T> {
    lock: BackendLock<'a>,
    backend: PhantomData<fn() -> T>,
}

impl<'a, T: Any + Send> TransactionGuard<'a, T> {
    /// Locks the transaction `source` runs in, as the backend handle `T`.
    ///
    /// # Errors
    ///
    /// [`TransactionError::Missing`] when `source` runs outside a transaction,
    /// [`TransactionError::Finished`] when its transaction has ended, and
    /// [`TransactionError::WrongBackend`] when the transaction's handle is not a `T`.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a dropped future holds no lock.
    pub fn of<S>(source: &'a S) -> impl Future<Output = Result<Self, TransactionError>> + Send + 'a
    where
        S: TransactionSource + ?Sized,
    {
        let lock = source.lock_backend();
        async move { TransactionGuard::new(lock.await?) }
    }

    fn new(lock: BackendLock<'a>) -> Result<Self, TransactionError> {
        if (*lock).is::<T>() {
            Ok(TransactionGuard { lock, backend: PhantomData })
        } else {
            Err(TransactionError::WrongBackend { expected: type_name::<T>() })
        }
    }
}

/// What a guard's lock lends was checked to be a `T` when the guard was made, and a lock lends
/// one value for its whole life.
const CHECKED: &str = "a transaction guard's backend handle changed its type";

impl<T: Any> Deref for TransactionGuard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        (*self.lock).downcast_ref::<T>().expect(CHECKED)
    }
}

impl<T: Any> DerefMut for TransactionGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        (*self.lock).downcast_mut::<T>().expect(CHECKED)
    }
}

impl<T> fmt::Debug for TransactionGuard<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionGuard").field("backend", &type_name::<T>()).finish()
    }
}

impl dyn MessageTransaction {
    /// The transaction's backend handle ([`MessageTransaction::backend`]) as its type `T`, for
    /// code that holds the transaction itself (a handler reaches its transaction with
    /// [`TransactionGuard::of`]).
    ///
    /// # Errors
    ///
    /// [`TransactionError::WrongBackend`] when the handle is not a `T`.
    pub fn backend_as<T: Any>(&mut self) -> Result<&mut T, TransactionError> {
        self.backend()
            .downcast_mut::<T>()
            .ok_or(TransactionError::WrongBackend { expected: type_name::<T>() })
    }
}

#[cfg(test)]
mod tests;
