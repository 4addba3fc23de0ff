//! TLS to MySQL and MariaDB: the URL's `ssl-mode` and `ssl-ca` (the names of the `mysql`
//! client's options), applied to `mysql_async`'s rustls support (feature `tls`).
//!
//! - `DISABLED`: plaintext. `PREFERRED` (the default, as in the `mysql` client): TLS when the
//!   server offers it, without checking the certificate; one connection, made when the URL is
//!   read, finds out, and the pool keeps the answer. `REQUIRED`: TLS, without checking the
//!   certificate (and, as the `mysql` client does, without using `ssl-ca`).
//! - `VERIFY_CA`: a certificate that a trusted CA signed. `mysql_async` 0.36 also compares the
//!   host name under it (its name check skips on an error text that rustls 0.23 no longer
//!   writes), so `VERIFY_CA` is as strict as `VERIFY_IDENTITY` here; the error says so.
//! - `VERIFY_IDENTITY`: that, and valid for the host name (or IP address) of the URL.
//! - `ssl-ca=<file>`: the trusted CAs are that PEM file's, read when the URL is read; without
//!   it, the public CAs built into `mysql_async` (Mozilla's list).
//! - With TLS, `mysql_async` does not move to the server's Unix socket after connecting
//!   (`prefer_socket`), which would leave the checked TLS connection for another one, possibly
//!   to another server that has a socket at the same path.
//! - `mysql_async`'s own parameters (`require_ssl`, `verify_ca`, `verify_identity`,
//!   `built_in_roots`) still work alone; with `ssl-mode` or `ssl-ca` they are refused.

use cluster_core::error::StorageError;
use mysql_async::Opts;

use crate::tls::{TlsMode, check_compiled_in, invalid_url, take_query_params};

const SSL_MODE: &str = "ssl-mode";
const SSL_CA: &str = "ssl-ca";
const DATABASE: &str = "MySQL";

/// `mysql_async`'s own TLS parameters.
const DRIVER_PARAMETERS: [&str; 4] =
    ["require_ssl", "verify_ca", "verify_identity", "built_in_roots"];

/// The connection options of a URL, or the two to choose from (`PREFERRED`).
#[cfg_attr(not(feature = "tls"), expect(dead_code, reason = "PREFERRED is plaintext without TLS"))]
pub(crate) enum Parsed {
    /// The options to connect with.
    Ready(Opts),
    /// `PREFERRED`: `tls` if the server offers TLS, else `plain`.
    Preferred {
        /// With TLS, the certificate unchecked.
        tls: Box<Opts>,
        /// Without TLS.
        plain: Box<Opts>,
    },
}

/// The URL without `ssl-mode` and `ssl-ca`: what `mysql_async` can read.
pub(crate) fn driver_url(url: &str) -> Result<String, StorageError> {
    Ok(take_query_params(url, 0, &[SSL_MODE, SSL_CA], true, DATABASE)?.rest)
}

/// The options of the `mysql://` URL `url`, with its TLS parameters applied.
pub(crate) fn parse(url: &str) -> Result<Parsed, StorageError> {
    let split = take_query_params(url, 0, &[SSL_MODE, SSL_CA], true, DATABASE)?;
    let base = Opts::from_url(&split.rest).map_err(|error| {
        StorageError::with_source(
            cluster_core::error::StorageErrorKind::InvalidInput,
            "invalid MySQL URL",
            error,
        )
    })?;
    let driver_parameters =
        !take_query_params(&split.rest, 0, &DRIVER_PARAMETERS, true, DATABASE)?.taken.is_empty();
    if split.taken.is_empty() && driver_parameters {
        if base.ssl_opts().is_none() {
            return Ok(Parsed::Ready(base));
        }
        check_compiled_in(TlsMode::Require, "require_ssl=true", "mysql")?;
        let tls = mysql_async::OptsBuilder::from_opts(base).prefer_socket(false);
        return Ok(Parsed::Ready(tls.into()));
    }
    if driver_parameters {
        return Err(invalid_url(
            DATABASE,
            "give ssl-mode and ssl-ca, or mysql_async's require_ssl, verify_ca, verify_identity \
             and built_in_roots, not both",
        ));
    }
    let mut mode_value = None;
    let mut ca = None;
    for (key, value) in split.taken {
        if key == SSL_MODE {
            mode_value = Some(value);
        } else {
            ca = Some(value).filter(|path| !path.is_empty());
        }
    }
    let mode = match mode_value.as_deref().map(str::to_ascii_uppercase).as_deref() {
        None | Some("PREFERRED") => TlsMode::Prefer,
        Some("DISABLED") => TlsMode::Disable,
        Some("REQUIRED") => TlsMode::Require,
        Some("VERIFY_CA") => TlsMode::VerifyCa,
        Some("VERIFY_IDENTITY") => TlsMode::VerifyFull,
        Some(_) => {
            return Err(invalid_url(
                DATABASE,
                "ssl-mode is none of DISABLED, PREFERRED, REQUIRED, VERIFY_CA and VERIFY_IDENTITY",
            ));
        }
    };
    let setting = format!("ssl-mode={}", mode_value.as_deref().unwrap_or("PREFERRED"));
    check_compiled_in(mode, &setting, "mysql")?;
    with_mode(base, mode, ca.as_deref())
}

#[cfg(not(feature = "tls"))]
fn with_mode(base: Opts, mode: TlsMode, _ca: Option<&str>) -> Result<Parsed, StorageError> {
    // Only `DISABLED` and `PREFERRED` come here (`check_compiled_in`): plaintext.
    debug_assert!(!mode.requires_tls(), "a TLS mode in a build without TLS");
    Ok(Parsed::Ready(base))
}

#[cfg(feature = "tls")]
fn with_mode(base: Opts, mode: TlsMode, ca: Option<&str>) -> Result<Parsed, StorageError> {
    use std::path::Path;

    use mysql_async::SslOpts;

    let unchecked = SslOpts::default().with_danger_accept_invalid_certs(true);
    let ssl_opts = match mode {
        TlsMode::Disable => return Ok(Parsed::Ready(base)),
        TlsMode::Prefer | TlsMode::Require => {
            if ca.is_some() {
                tracing::warn!(
                    "ssl-ca is not used with ssl-mode=REQUIRED or PREFERRED, which do not check \
                     the server's certificate: use ssl-mode=VERIFY_IDENTITY (or VERIFY_CA)"
                );
            }
            unchecked
        }
        _ => {
            let checked =
                SslOpts::default().with_danger_skip_domain_validation(mode == TlsMode::VerifyCa);
            match ca {
                None => checked,
                Some(path) => {
                    // Read and checked now, so that a wrong file fails here and not at every
                    // connection; the driver gets each certificate's DER.
                    let roots = crate::tls::read_ca_file(Path::new(path), SSL_CA)?
                        .into_iter()
                        .map(|der| der.to_vec().into())
                        .collect();
                    checked.with_root_certs(roots).with_disable_built_in_roots(true)
                }
            }
        }
    };
    let tls =
        mysql_async::OptsBuilder::from_opts(base.clone()).ssl_opts(ssl_opts).prefer_socket(false);
    let tls = Opts::from(tls);
    if mode == TlsMode::Prefer {
        return Ok(Parsed::Preferred { tls: Box::new(tls), plain: Box::new(base) });
    }
    Ok(Parsed::Ready(tls))
}

#[cfg(test)]
mod tests;
