//! TLS to PostgreSQL and MySQL: what a URL asks for ([`TlsOptions`]: the mode and the CAs that
//! verify the server), reading those parameters out of a URL, and, with the feature `tls`, what
//! a certificate failure means and how to fix it.
//!
//! - The modes are libpq's `sslmode` and MySQL's `ssl-mode`, from the weakest to the strongest
//!   ([`TlsMode`]).
//! - The CAs are the certificates of a PEM file named in the URL (`sslrootcert`, `ssl-ca`), or
//!   else the public CAs built into the binary (Mozilla's list, from `webpki-roots`), so that a
//!   managed database whose certificate a public CA signed needs no file.
//! - Without the feature `tls`, `disable` and `prefer` connect in plaintext, and a mode that
//!   requires TLS is refused when the URL is read, naming the feature.
//! - Errors never show the URL: it may hold the password.

use std::path::PathBuf;

use cluster_core::error::{StorageError, StorageErrorKind};

/// What a connection asks of the server, from the weakest to the strongest.
///
/// The names are libpq's `sslmode` values; MySQL's `ssl-mode` has the same five (`DISABLED`,
/// `PREFERRED`, `REQUIRED`, `VERIFY_CA`, `VERIFY_IDENTITY`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum TlsMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked.
    Prefer,
    /// TLS or no connection; the certificate is not checked, so the connection is encrypted
    /// but the server is not authenticated.
    Require,
    /// TLS with a certificate that a trusted CA signed, whatever names it holds.
    VerifyCa,
    /// TLS with a certificate that a trusted CA signed and that is valid for the host name (or
    /// IP address) of the URL.
    VerifyFull,
}

impl TlsMode {
    /// Whether a connection without TLS is refused.
    pub fn requires_tls(self) -> bool {
        self >= TlsMode::Require
    }

    /// Whether the server's certificate is checked against the CAs.
    pub fn verifies_certificate(self) -> bool {
        self >= TlsMode::VerifyCa
    }
}

/// The CAs that verify the server's certificate.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TlsRoots {
    /// The public CAs built into the binary (Mozilla's list, `webpki-roots`).
    BuiltIn,
    /// Only the certificates of this PEM file (a private CA, or the server's own self-signed
    /// certificate). It is read when the URL is read.
    File(PathBuf),
}

/// The TLS of a connection: its mode and the CAs that verify the server.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TlsOptions {
    /// What the connection asks of the server.
    pub mode: TlsMode,
    /// The CAs, used when the mode verifies the certificate.
    pub roots: TlsRoots,
}

impl TlsOptions {
    /// Plaintext only.
    pub const DISABLED: TlsOptions =
        TlsOptions { mode: TlsMode::Disable, roots: TlsRoots::BuiltIn };
}

/// A URL whose TLS parameters were taken out of its query.
#[derive(Debug)]
pub(crate) struct SplitUrl {
    /// The URL without them, for the driver's own parser.
    pub(crate) rest: String,
    /// Their names and percent-decoded values, in the URL's order.
    pub(crate) taken: Vec<(String, String)>,
}

/// Takes the query parameters named in `names` out of `url`, whose query starts at the first
/// `?` at or after `search_from`. A `+` in a value is a space when `plus_is_space` (the URL
/// form encoding that MySQL's URL parser follows; libpq's does not).
///
/// `database` names the database in errors, which never show the URL.
pub(crate) fn take_query_params(
    url: &str,
    search_from: usize,
    names: &[&str],
    plus_is_space: bool,
    database: &str,
) -> Result<SplitUrl, StorageError> {
    let Some(offset) = url.get(search_from..).and_then(|tail| tail.find('?')) else {
        return Ok(SplitUrl { rest: url.to_owned(), taken: Vec::new() });
    };
    let query_start = search_from + offset + 1;
    // A fragment, which no database URL should have, is left where it is.
    let query_end = url[query_start..].find('#').map_or(url.len(), |end| query_start + end);
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for pair in url[query_start..query_end].split('&').filter(|pair| !pair.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let decoded_key = percent_decode(key, plus_is_space);
        match decoded_key {
            Some(decoded_key) if names.contains(&decoded_key.as_str()) => {
                let value = percent_decode(value, plus_is_space).ok_or_else(|| {
                    invalid_url(database, format!("the value of {decoded_key} is not UTF-8"))
                })?;
                taken.push((decoded_key, value));
            }
            _ => kept.push(pair),
        }
    }
    let mut rest = url[..query_start - 1].to_owned();
    if !kept.is_empty() {
        rest.push('?');
        rest.push_str(&kept.join("&"));
    }
    rest.push_str(&url[query_end..]);
    Ok(SplitUrl { rest, taken })
}

/// `text` with its `%XX` escapes decoded (and `+` as a space when `plus_is_space`); `None` when
/// the result is not UTF-8. A `%` not followed by two hex digits stays as it is.
pub(crate) fn percent_decode(text: &str, plus_is_space: bool) -> Option<String> {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut idx = 0;
    while idx < bytes.len() {
        let byte = bytes[idx];
        let escaped = (byte == b'%')
            .then(|| bytes.get(idx + 1..idx + 3))
            .flatten()
            .and_then(|hex| std::str::from_utf8(hex).ok())
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(value) => {
                decoded.push(value);
                idx += 3;
            }
            None => {
                decoded.push(if byte == b'+' && plus_is_space { b' ' } else { byte });
                idx += 1;
            }
        }
    }
    String::from_utf8(decoded).ok()
}

/// An invalid URL of `database`, with what is wrong (never the URL itself).
pub(crate) fn invalid_url(database: &str, what: impl std::fmt::Display) -> StorageError {
    StorageError::new(StorageErrorKind::InvalidInput, format!("invalid {database} URL: {what}"))
}

/// Refuses `setting` (such as `sslmode=require`), whose mode is `mode`, in a build without TLS;
/// `feature` is durable-cluster's feature of the database, which turns TLS on.
pub(crate) fn check_compiled_in(
    mode: TlsMode,
    setting: &str,
    feature: &str,
) -> Result<(), StorageError> {
    if mode.requires_tls() && !cfg!(feature = "tls") {
        return Err(StorageError::new(
            StorageErrorKind::InvalidInput,
            format!(
                "{setting} needs TLS, and this binary was built without it: enable the `tls` \
                 feature of cluster-storage-sql (durable-cluster's `{feature}` feature does)"
            ),
        ));
    }
    Ok(())
}

#[cfg(feature = "tls")]
pub(crate) use with_rustls::*;

#[cfg(feature = "tls")]
mod with_rustls {
    use std::error::Error as StdError;
    use std::path::Path;

    use cluster_core::error::{StorageError, StorageErrorKind};
    use tokio_rustls::rustls::pki_types::CertificateDer;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::{self, CertificateError};

    /// The certificates of the PEM file `path`, named by the URL parameter `parameter`.
    pub(crate) fn read_ca_file(
        path: &Path,
        parameter: &str,
    ) -> Result<Vec<CertificateDer<'static>>, StorageError> {
        let pem = std::fs::read(path).map_err(|error| {
            StorageError::with_source(
                StorageErrorKind::InvalidInput,
                format!("cannot read the CA file of {parameter} ({})", path.display()),
                error,
            )
        })?;
        let certificates = CertificateDer::pem_slice_iter(&pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::InvalidInput,
                    format!("the CA file of {parameter} ({}) is not PEM", path.display()),
                    error,
                )
            })?;
        if certificates.is_empty() {
            return Err(StorageError::new(
                StorageErrorKind::InvalidInput,
                format!(
                    "the CA file of {parameter} ({}) holds no certificate (PEM `BEGIN \
                     CERTIFICATE` blocks)",
                    path.display()
                ),
            ));
        }
        Ok(certificates)
    }

    /// The spelling of one database's TLS parameters, for the advice of [`explain`].
    pub(crate) struct TlsParameters {
        /// The parameter of the CA file: `sslrootcert`, `ssl-ca`.
        pub(crate) ca: &'static str,
        /// The mode parameter and the value that encrypts without checking: `sslmode=require`.
        pub(crate) encrypt_only: &'static str,
        /// What to do about a certificate that is not valid for the host name.
        pub(crate) name_advice: &'static str,
    }

    /// What the TLS failure among `error`'s causes means, and how to fix it; `None` when no
    /// cause is a TLS failure.
    pub(crate) fn explain(
        error: &(dyn StdError + 'static),
        parameters: &TlsParameters,
    ) -> Option<String> {
        let failure = rustls_error(error)?;
        let ca = parameters.ca;
        let encrypt_only = parameters.encrypt_only;
        let message = match failure {
            rustls::Error::InvalidCertificate(certificate) => match certificate {
                CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
                    "the server's certificate is not signed by a trusted CA: pass {ca}=<the \
                     PEM file of the CA that signed it> (a managed database documents where to \
                     download it), or use {encrypt_only} to encrypt without checking the \
                     certificate"
                ),
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => format!(
                    "the server's certificate is not valid for the host name of the URL \
                     ({certificate}): {}",
                    parameters.name_advice
                ),
                CertificateError::Expired
                | CertificateError::ExpiredContext { .. }
                | CertificateError::NotValidYet
                | CertificateError::NotValidYetContext { .. } => format!(
                    "the server's certificate is outside its validity period ({certificate}): \
                     renew it, or check this machine's clock"
                ),
                _ => format!(
                    "the server's certificate was refused ({certificate}): check {ca} and the \
                     server's certificate"
                ),
            },
            other => format!(
                "the TLS handshake failed ({other}): the server must speak TLS 1.2 or 1.3 with \
                 a certificate this client can check"
            ),
        };
        Some(message)
    }

    /// The rustls error among `error` and its causes. An `io::Error` hides the error it wraps
    /// from `source()` (it returns that error's own source), so each is opened by `get_ref`.
    fn rustls_error<'e>(error: &'e (dyn StdError + 'static)) -> Option<&'e rustls::Error> {
        let mut cause = Some(error);
        while let Some(current) = cause {
            if let Some(failure) = current.downcast_ref::<rustls::Error>() {
                return Some(failure);
            }
            if let Some(inner) = current
                .downcast_ref::<std::io::Error>()
                .and_then(std::io::Error::get_ref)
                .and_then(|inner| rustls_error(inner as &(dyn StdError + 'static)))
            {
                return Some(inner);
            }
            cause = current.source();
        }
        None
    }
}

#[cfg(test)]
mod tests;
