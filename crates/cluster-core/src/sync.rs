//! The one way this workspace takes a `std` lock: [`lock`] for a mutex, [`read`] and
//! [`write`](fn@write) for a read-write lock, all ignoring poisoning.

use std::sync::{Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Locks `mutex`, taking the guard even when a thread panicked while holding it.
///
/// Every critical section in the workspace keeps its data consistent at each step:
/// - it only inserts, reads, replaces or removes map entries and flags, or
/// - it calls a state machine that checks its invariants before it changes anything.
///
/// So a panic inside one leaves the previous or the next valid state, never a half-applied
/// change. Failing every later caller because of one panic would turn one bug into an outage.
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Takes `rw` for reading, ignoring poisoning as [`lock`] does, for the same reasons.
pub fn read<T>(rw: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    rw.read().unwrap_or_else(PoisonError::into_inner)
}

/// Takes `rw` for writing, ignoring poisoning as [`lock`] does, for the same reasons.
pub fn write<T>(rw: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    rw.write().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_mutex_is_still_locked_and_read() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let poisoner = std::sync::Arc::clone(&mutex);
        let panicked = std::thread::spawn(move || {
            let mut guard = poisoner.lock().unwrap_or_else(PoisonError::into_inner);
            *guard = 2;
            panic!("poison the mutex");
        })
        .join();
        assert!(panicked.is_err());
        assert!(mutex.is_poisoned());
        assert_eq!(*lock(&mutex), 2);
    }
}
