//! Tests of the errors' texts: a storage error shows every cause down its source chain, once.

use std::error::Error as StdError;
use std::fmt;

use super::*;

/// A driver's error that says only what it was doing, its cause kept as its source.
#[derive(Debug)]
struct Driver {
    what: &'static str,
    cause: Option<std::io::Error>,
}

impl fmt::Display for Driver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.what)
    }
}

impl StdError for Driver {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.cause.as_ref().map(|cause| cause as &(dyn StdError + 'static))
    }
}

/// A pool's error that prints its source in its own text, and returns it as its source too.
#[derive(Debug)]
struct Pool(Driver);

impl fmt::Display for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot create a connection: {}", self.0)
    }
}

impl StdError for Pool {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.0)
    }
}

fn refused() -> Driver {
    let os = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
    Driver { what: "error connecting to server", cause: Some(os) }
}

#[test]
fn a_storage_error_shows_the_causes_down_its_source_chain() {
    let error = StorageError::with_source(StorageErrorKind::Unavailable, "migrate", refused());
    assert_eq!(
        error.to_string(),
        "migrate (unavailable): error connecting to server: Connection refused"
    );
}

#[test]
fn a_cause_that_shows_its_own_source_is_not_repeated() {
    let error =
        StorageError::with_source(StorageErrorKind::Unavailable, "migrate", Pool(refused()));
    assert_eq!(
        error.to_string(),
        "migrate (unavailable): cannot create a connection: error connecting to server: \
         Connection refused"
    );
}

#[test]
fn a_storage_error_as_a_cause_shows_its_own_causes_once() {
    let inner = StorageError::with_source(StorageErrorKind::Unavailable, "migrate", refused());
    let outer = StorageError::with_source(StorageErrorKind::Unavailable, "cannot open", inner);
    assert_eq!(
        outer.to_string(),
        "cannot open (unavailable): migrate (unavailable): error connecting to server: \
         Connection refused"
    );
    let plain = StorageError::new(StorageErrorKind::Conflict, "duplicate");
    assert_eq!(plain.to_string(), "duplicate (conflict)");
}
