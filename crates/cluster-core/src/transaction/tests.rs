//! Tests of the typed transaction guard over sources that lend owned values.

use std::any::Any;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use super::{BackendLock, TransactionError, TransactionGuard, TransactionSource};
use crate::future::BoxFuture;
use crate::storage::MessageTransaction;
use crate::{Reply, StorageError};

/// A source whose lock lends a fresh value, or fails.
enum Source {
    Lends(fn() -> Box<dyn Any + Send>),
    Fails(TransactionError),
}

impl TransactionSource for Source {
    fn lock_backend(&self) -> BoxFuture<'_, Result<BackendLock<'_>, TransactionError>> {
        let lock = match self {
            Source::Lends(make) => Ok(Box::new(make()) as BackendLock<'_>),
            Source::Fails(error) => Err(error.clone()),
        };
        Box::pin(std::future::ready(lock))
    }
}

/// Polls a future that is ready at once (the sources above never wait).
fn now<F: Future>(future: F) -> F::Output {
    let mut context = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut context) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("the future waited"),
    }
}

fn numbers() -> Box<dyn Any + Send> {
    Box::new(vec![1_u32, 2])
}

#[test]
fn the_guard_derefs_to_the_backend_handle() {
    let source = Source::Lends(numbers);
    let mut guard = now(TransactionGuard::<Vec<u32>>::of(&source)).unwrap();
    assert_eq!(*guard, [1, 2]);
    guard.push(3);
    assert_eq!(guard.len(), 3);
    assert!(format!("{guard:?}").contains("Vec<u32>"), "{guard:?}");
}

#[test]
fn another_backend_is_a_typed_error() {
    let source = Source::Lends(numbers);
    let error = now(TransactionGuard::<String>::of(&source)).unwrap_err();
    assert_eq!(error, TransactionError::WrongBackend { expected: std::any::type_name::<String>() });
    assert!(error.to_string().contains("alloc::string::String"), "{error}");
}

#[test]
fn a_missing_or_ended_transaction_is_a_typed_error() {
    for error in [TransactionError::Missing, TransactionError::Finished] {
        let source = Source::Fails(error.clone());
        assert_eq!(now(TransactionGuard::<Vec<u32>>::of(&source)).unwrap_err(), error);
    }
}

/// A transaction whose backend handle is a number.
struct Numbered(u64);

impl MessageTransaction for Numbered {
    fn save_reply<'a>(&'a mut self, _: &'a Reply) -> BoxFuture<'a, Result<(), StorageError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn backend(&mut self) -> &mut (dyn Any + Send) {
        &mut self.0
    }

    fn savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn rollback_to_savepoint(&mut self) -> BoxFuture<'_, Result<(), StorageError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn commit(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(std::future::ready(Ok(())))
    }

    fn rollback(self: Box<Self>) -> BoxFuture<'static, Result<(), StorageError>> {
        Box::pin(std::future::ready(Ok(())))
    }
}

#[test]
fn a_held_transaction_lends_its_backend_typed() {
    let mut transaction: Box<dyn MessageTransaction> = Box::new(Numbered(7));
    *transaction.backend_as::<u64>().unwrap() += 1;
    assert_eq!(*transaction.backend_as::<u64>().unwrap(), 8);
    assert_eq!(
        transaction.backend_as::<u32>().unwrap_err(),
        TransactionError::WrongBackend { expected: "u32" }
    );
}
