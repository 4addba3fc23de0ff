//! The unwind guard of [`guarded`]: a panic before or after the future exists is caught.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use super::guarded;

fn poll_once<F: Future>(future: std::pin::Pin<&mut F>) -> Poll<F::Output> {
    future.poll(&mut Context::from_waker(Waker::noop()))
}

fn message(panic: &(dyn std::any::Any + Send)) -> &str {
    panic.downcast_ref::<&str>().copied().unwrap_or("")
}

#[test]
fn a_value_passes_through() {
    let mut future = pin!(guarded(|| async { 7 }));
    assert!(matches!(poll_once(future.as_mut()), Poll::Ready(Ok(7))));
}

#[test]
fn a_panic_before_the_future_exists_is_caught() {
    #[expect(unreachable_code, reason = "the closure panics before it returns its future")]
    let make = || -> std::future::Ready<u32> {
        std::panic::panic_any("before");
        std::future::ready(1)
    };
    let mut future = pin!(guarded(make));
    match poll_once(future.as_mut()) {
        Poll::Ready(Err(panic)) => assert_eq!(message(&*panic), "before"),
        other => panic!("the panic escaped or was lost: {:?}", other.map(|r| r.is_ok())),
    }
}

#[test]
fn a_panic_while_the_future_runs_is_caught_after_a_pending_poll() {
    let mut polls = 0;
    let make = || {
        std::future::poll_fn(move |_| -> Poll<u32> {
            polls += 1;
            if polls < 2 {
                return Poll::Pending;
            }
            std::panic::panic_any("during");
        })
    };
    let mut future = pin!(guarded(make));
    assert!(poll_once(future.as_mut()).is_pending());
    match poll_once(future.as_mut()) {
        Poll::Ready(Err(panic)) => assert_eq!(message(&*panic), "during"),
        other => panic!("the panic escaped or was lost: {:?}", other.map(|r| r.is_ok())),
    }
    // Resolved once: it stays pending, it never panics or calls the closure again.
    assert!(poll_once(future.as_mut()).is_pending());
}
