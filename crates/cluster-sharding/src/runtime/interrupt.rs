//! [`InterruptSignal`]: the interruption signal of one request, cheap on the path every request
//! takes.
//!
//! A request used to carry a `CancellationToken`, and every step of its way touched the
//! token's mutex:
//!
//! - the clone into the delivery;
//! - the check before the handler starts;
//! - the clone into the request context;
//! - the drop guard of the caller;
//! - the drops of all of them.
//!
//! That was about 8 % of a volatile request's time in the W1 profile.
//!
//! An [`InterruptSignal`] is one atomic flag behind an `Arc`.
//! Cloning, checking and dropping it take no lock.
//!
//! - **Waiting.** Waiting for the signal goes through a [`Notify`].
//!   That is the rare case: a handler that does not finish on its first poll.
//! - **The handler's token.** The `CancellationToken` a handler may ask for
//!   ([`RequestContext::cancellation`]) is made only when asked.
//!   It is cancelled when the request is interrupted.
//!   Cancelling it interrupts the request, as when the token itself was the signal.
//!
//! [`RequestContext::cancellation`]: crate::RequestContext::cancellation

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The interruption signal of one request; clones share it.
#[derive(Clone, Default)]
pub(crate) struct InterruptSignal(Arc<State>);

#[derive(Default)]
struct State {
    fired: AtomicBool,
    /// Woken when the signal fires, and when the token is made (waiters then watch it too).
    waiters: Notify,
    /// The token handed to the handler, made on first request.
    token: OnceLock<CancellationToken>,
}

impl std::fmt::Debug for InterruptSignal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterruptSignal").field("cancelled", &self.is_cancelled()).finish()
    }
}

impl InterruptSignal {
    /// A signal that has not fired.
    pub(crate) fn new() -> InterruptSignal {
        InterruptSignal::default()
    }

    /// Fires the signal (once; later calls do nothing).
    pub(crate) fn cancel(&self) {
        if self.0.fired.swap(true, Ordering::SeqCst) {
            return;
        }
        self.0.waiters.notify_waiters();
        if let Some(token) = self.0.token.get() {
            token.cancel();
        }
    }

    /// Whether the signal fired, or the handler cancelled its token.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.0.fired.load(Ordering::SeqCst)
            || self.0.token.get().is_some_and(CancellationToken::is_cancelled)
    }

    /// Completes once [`is_cancelled`](InterruptSignal::is_cancelled) holds.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub(crate) async fn cancelled(&self) {
        loop {
            let woken = self.0.waiters.notified();
            tokio::pin!(woken);
            // Registered before the checks: a fire or a new token after them wakes it.
            woken.as_mut().enable();
            if self.is_cancelled() {
                return;
            }
            match self.0.token.get() {
                Some(token) => tokio::select! {
                    () = woken => {}
                    () = token.cancelled() => return,
                },
                None => woken.await,
            }
        }
    }

    /// The token of the handler's [`RequestContext`](crate::RequestContext), made on the first
    /// call: cancelled when the signal fires, and firing it when cancelled.
    pub(crate) fn token(&self) -> &CancellationToken {
        if let Some(token) = self.0.token.get() {
            return token;
        }
        let token = self.0.token.get_or_init(CancellationToken::new);
        // Waiters start watching the token; a signal that fired before it existed cancels it.
        // `cancel` stores the flag before it looks for the token.
        // Here the token is stored before the flag is read.
        // So one of the two sees the other.
        self.0.waiters.notify_waiters();
        if self.0.fired.load(Ordering::SeqCst) {
            token.cancel();
        }
        token
    }

    /// A guard that fires the signal when dropped, unless disarmed.
    pub(crate) fn drop_guard(self) -> InterruptGuard {
        InterruptGuard(Some(self))
    }
}

/// Fires its [`InterruptSignal`] when dropped, unless [`disarm`](InterruptGuard::disarm)ed.
pub(crate) struct InterruptGuard(Option<InterruptSignal>);

impl InterruptGuard {
    /// Drops the guard without firing.
    pub(crate) fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for InterruptGuard {
    fn drop(&mut self) {
        if let Some(interrupt) = self.0.take() {
            interrupt.cancel();
        }
    }
}

/// A `CancellationToken` whose state is also an atomic flag, set before the token is
/// cancelled.
///
/// Every request checks it (the runtime's shutdown, a manager's stop).
/// The flag is read without the token's lock.
/// The token still gives child tokens and waits.
#[derive(Default)]
pub(crate) struct FlaggedToken {
    flag: AtomicBool,
    token: CancellationToken,
}

impl FlaggedToken {
    /// Sets the flag, then cancels the token (and its children).
    pub(crate) fn cancel(&self) {
        self.flag.store(true, Ordering::SeqCst);
        self.token.cancel();
    }

    /// Whether [`cancel`](FlaggedToken::cancel) was called; no lock.
    pub(crate) fn is_cancelled(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// The token, for child tokens and waits.
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn firing_wakes_a_waiter_and_cancels_the_token() {
        let interrupt = InterruptSignal::new();
        let token = interrupt.token().clone();
        let waiter = tokio::spawn({
            let interrupt = interrupt.clone();
            async move { interrupt.cancelled().await }
        });
        tokio::task::yield_now().await;
        assert!(!interrupt.is_cancelled());
        assert!(!token.is_cancelled());
        interrupt.cancel();
        tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
        assert!(token.is_cancelled());
        assert!(interrupt.is_cancelled());
    }

    #[tokio::test]
    async fn a_token_made_after_the_signal_fired_is_cancelled() {
        let interrupt = InterruptSignal::new();
        interrupt.clone().drop_guard();
        assert!(interrupt.is_cancelled());
        assert!(interrupt.token().is_cancelled());
        // Completes at once.
        interrupt.cancelled().await;
    }

    #[tokio::test]
    async fn cancelling_a_token_made_while_waiting_fires_the_signal_for_the_waiter() {
        let interrupt = InterruptSignal::new();
        let waiter = tokio::spawn({
            let interrupt = interrupt.clone();
            async move { interrupt.cancelled().await }
        });
        tokio::task::yield_now().await;
        // The handler asks for its token after the runtime started waiting, then cancels it.
        interrupt.token().cancel();
        tokio::time::timeout(Duration::from_secs(10), waiter).await.unwrap().unwrap();
        assert!(interrupt.is_cancelled());
    }

    #[test]
    fn a_flagged_token_reads_cancelled_once_its_token_is() {
        let stop = FlaggedToken::default();
        let child = stop.token().child_token();
        assert!(!stop.is_cancelled());
        stop.cancel();
        assert!(stop.is_cancelled());
        assert!(stop.token().is_cancelled());
        assert!(child.is_cancelled());
    }

    #[tokio::test]
    async fn a_disarmed_guard_does_not_fire() {
        let interrupt = InterruptSignal::new();
        interrupt.clone().drop_guard().disarm();
        assert!(!interrupt.is_cancelled());
        assert!(futures_util::FutureExt::now_or_never(interrupt.cancelled()).is_none());
    }
}
