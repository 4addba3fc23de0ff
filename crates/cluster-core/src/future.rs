//! The boxed future used by the object-safe contracts.
//!
//! Contracts cross crate boundaries as trait objects (`Arc<dyn MessageStorage>`), so their async
//! methods return a boxed future. A storage or network round-trip dwarfs one allocation.

use std::future::Future;
use std::pin::Pin;

/// An owned, sendable, type-erased future, as returned by the contracts of this crate.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Calls `make` and polls the future it returns, both inside one unwind guard.
///
/// A user closure may panic before it returns its future, or while the future runs.
/// `AssertUnwindSafe(make()).catch_unwind()` guards only the second: the call itself runs
/// before the guard exists, and its panic unwinds through the caller.
/// This guards both, and resolves to `Err` with the panic's payload in either case.
pub fn guarded<T, F, Fut>(make: F) -> Guarded<F, Fut>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = T>,
{
    Guarded { make: Some(make), future: None }
}

/// The future of [`guarded`].
#[must_use = "futures do nothing unless polled"]
pub struct Guarded<F, Fut> {
    make: Option<F>,
    future: Option<Pin<Box<Fut>>>,
}

impl<F, Fut> std::fmt::Debug for Guarded<F, Fut> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guarded").field("started", &self.future.is_some()).finish()
    }
}

// The future is boxed and the closure is never pinned: nothing is projected.
impl<F, Fut> Unpin for Guarded<F, Fut> {}

impl<T, F, Fut> Future for Guarded<F, Fut>
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = T>,
{
    type Output = std::thread::Result<T>;

    fn poll(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::thread::Result<T>> {
        use std::panic::{AssertUnwindSafe, catch_unwind};
        let this = self.get_mut();
        if let Some(make) = this.make.take() {
            match catch_unwind(AssertUnwindSafe(make)) {
                Ok(future) => this.future = Some(Box::pin(future)),
                Err(panic) => return std::task::Poll::Ready(Err(panic)),
            }
        }
        let Some(future) = this.future.as_mut() else {
            // Polled again after it resolved: the contract of `Future` allows anything but
            // undefined behaviour; it stays pending.
            return std::task::Poll::Pending;
        };
        match catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(std::task::Poll::Ready(value)) => {
                this.future = None;
                std::task::Poll::Ready(Ok(value))
            }
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(panic) => {
                this.future = None;
                std::task::Poll::Ready(Err(panic))
            }
        }
    }
}

#[cfg(test)]
mod tests;
