//! TLS to PostgreSQL: the URL's `sslmode` and `sslrootcert`, read as libpq reads them, and the
//! rustls connector of the pool and the lock session (feature `tls`).
//!
//! - `disable`: plaintext. `prefer` (the default, as in libpq) and `allow`: TLS when the server
//!   offers it, without checking the certificate. `require`: TLS, without checking the
//!   certificate, unless `sslrootcert` names a file: then the chain is checked, as with
//!   `verify-ca` (libpq's rule).
//! - `verify-ca`: a certificate that a trusted CA signed; `verify-full`: that, and valid for the
//!   host name of the URL.
//! - `sslrootcert=<file>`: the trusted CAs are that PEM file's. `sslrootcert=system`: the
//!   public CAs built into the binary, with `verify-full` (libpq 16's rule). Without
//!   `sslrootcert`, the built-in public CAs too (libpq reads `~/.postgresql/root.crt` instead).
//! - The tokio-postgres parser refuses what it does not know, so these two parameters are taken
//!   out of the URL before it reads the rest.
//! - The `tls-server-end-point` channel binding is not offered: SCRAM authenticates without it,
//!   and `channel_binding=require` fails.

use cluster_core::error::StorageError;

use crate::tls::{
    SplitUrl, TlsMode, TlsOptions, TlsRoots, check_compiled_in, invalid_url, take_query_params,
};

const SSLMODE: &str = "sslmode";
const SSLROOTCERT: &str = "sslrootcert";
const DATABASE: &str = "PostgreSQL";

/// The driver's configuration of `url` (a `postgres://` URL or a `key=value` connection string)
/// and the TLS it asks for.
pub(crate) fn parse(url: &str) -> Result<(tokio_postgres::Config, TlsOptions), StorageError> {
    let split = match ["postgres://", "postgresql://"].iter().find(|p| url.starts_with(**p)) {
        // The driver reads the credentials up to the first `@`, then the query after a `?`.
        Some(prefix) => {
            let search_from = url.find('@').map_or(prefix.len(), |at| at + 1);
            take_query_params(url, search_from, &[SSLMODE, SSLROOTCERT], false, DATABASE)?
        }
        None => take_key_value_params(url)?,
    };
    // As in libpq, the last occurrence of a parameter wins.
    let mut mode = None;
    let mut root_cert = None;
    for (key, value) in split.taken {
        if key == SSLMODE {
            mode = Some(value);
        } else {
            root_cert = Some(value);
        }
    }
    let tls = tls_options(mode.as_deref(), root_cert.as_deref())?;
    let config = split.rest.parse::<tokio_postgres::Config>().map_err(|error| {
        StorageError::with_source(
            cluster_core::error::StorageErrorKind::InvalidInput,
            "invalid PostgreSQL URL",
            error,
        )
    })?;
    Ok((config, tls))
}

/// The TLS of the values of `sslmode` and `sslrootcert`.
fn tls_options(
    mode_value: Option<&str>,
    root_cert: Option<&str>,
) -> Result<TlsOptions, StorageError> {
    let system = root_cert == Some("system");
    let roots = match root_cert {
        None | Some("" | "system") => TlsRoots::BuiltIn,
        Some(path) => TlsRoots::File(path.into()),
    };
    let parsed = match mode_value {
        None if system => TlsMode::VerifyFull,
        None => TlsMode::Prefer,
        Some("disable") => TlsMode::Disable,
        Some("allow" | "prefer") => TlsMode::Prefer,
        Some("require") => TlsMode::Require,
        Some("verify-ca") => TlsMode::VerifyCa,
        Some("verify-full") => TlsMode::VerifyFull,
        Some(_) => {
            return Err(invalid_url(
                DATABASE,
                "sslmode is none of disable, allow, prefer, require, verify-ca and verify-full",
            ));
        }
    };
    if system && parsed != TlsMode::VerifyFull {
        return Err(invalid_url(
            DATABASE,
            "sslrootcert=system needs sslmode=verify-full (libpq's rule: a weaker mode would \
             not check the certificate against the system's CAs)",
        ));
    }
    let mode = match (parsed, &roots) {
        (TlsMode::Require, TlsRoots::File(_)) => TlsMode::VerifyCa,
        _ => parsed,
    };
    let setting = format!("sslmode={}", mode_value.unwrap_or("prefer"));
    check_compiled_in(mode, &setting, "postgres")?;
    Ok(TlsOptions { mode, roots })
}

/// Takes `sslmode` and `sslrootcert` out of a `key=value` connection string; the rest is
/// written again with every value quoted.
fn take_key_value_params(text: &str) -> Result<SplitUrl, StorageError> {
    let pairs = key_value_pairs(text).ok_or_else(|| {
        invalid_url(DATABASE, "a key=value connection string that cannot be read")
    })?;
    let mut rest = Vec::new();
    let mut taken = Vec::new();
    for (key, value) in pairs {
        if key == SSLMODE || key == SSLROOTCERT {
            taken.push((key.to_owned(), value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            rest.push(format!("{key}='{quoted}'"));
        }
    }
    Ok(SplitUrl { rest: rest.join(" "), taken })
}

/// The pairs of a `key=value` connection string, read as the driver reads them: values are
/// plain (up to a space) or quoted with `'`, and `\` escapes the next character.
fn key_value_pairs(text: &str) -> Option<Vec<(&str, String)>> {
    let mut pairs = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let key_end = rest.find(|c: char| c.is_whitespace() || c == '=')?;
        let key = &rest[..key_end];
        rest = rest[key_end..].trim_start().strip_prefix('=')?.trim_start();
        let quoted = rest.starts_with('\'');
        if quoted {
            rest = &rest[1..];
        }
        let mut value = String::new();
        let mut chars = rest.char_indices();
        let mut end = rest.len();
        let mut closed = false;
        while let Some((idx, c)) = chars.next() {
            match c {
                '\\' => value.extend(chars.next().map(|(_, escaped)| escaped)),
                '\'' if quoted => {
                    end = idx + 1;
                    closed = true;
                    break;
                }
                c if c.is_whitespace() && !quoted => {
                    end = idx;
                    break;
                }
                c => value.push(c),
            }
        }
        if key.is_empty() || (quoted && !closed) || (!quoted && value.is_empty()) {
            return None;
        }
        pairs.push((key, value));
        rest = rest[end..].trim_start();
    }
    Some(pairs)
}

#[cfg(feature = "tls")]
pub(crate) use connector::MakeRustls;

#[cfg(feature = "tls")]
mod connector {
    use std::future::Future;
    use std::io;
    use std::net::{IpAddr, Ipv4Addr};
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::{Context, Poll};

    use cluster_core::error::{StorageError, StorageErrorKind};
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
    use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect, TlsStream};
    use tokio_rustls::TlsConnector;
    use tokio_rustls::rustls::client::WebPkiServerVerifier;
    use tokio_rustls::rustls::client::danger::{
        HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
    };
    use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
    use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use tokio_rustls::rustls::{
        self, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    };

    use crate::postgres::tls::SSLROOTCERT;
    use crate::tls::{TlsMode, TlsOptions, TlsRoots, read_ca_file};

    /// The TLS connector of the pool and of the lock session: one rustls configuration, made
    /// when the URL is read (the CA file included), shared by every connection.
    #[derive(Clone)]
    pub(crate) struct MakeRustls {
        config: Arc<ClientConfig>,
    }

    impl MakeRustls {
        /// The connector of `tls`.
        pub(crate) fn new(tls: &TlsOptions) -> Result<MakeRustls, StorageError> {
            let provider = Arc::new(ring::default_provider());
            let verifier: Arc<dyn ServerCertVerifier> = match tls.mode {
                TlsMode::Disable | TlsMode::Prefer | TlsMode::Require => {
                    Arc::new(Unchecked { provider: Arc::clone(&provider) })
                }
                TlsMode::VerifyCa => Arc::new(ChainOnly(webpki(&tls.roots, &provider)?)),
                TlsMode::VerifyFull => webpki(&tls.roots, &provider)?,
            };
            let config = ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|error| {
                    StorageError::with_source(StorageErrorKind::Other, "TLS versions", error)
                })?
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_no_client_auth();
            Ok(MakeRustls { config: Arc::new(config) })
        }
    }

    /// The verifier of `verify-full` on `roots`.
    fn webpki(
        roots: &TlsRoots,
        provider: &Arc<CryptoProvider>,
    ) -> Result<Arc<WebPkiServerVerifier>, StorageError> {
        let mut store = RootCertStore::empty();
        match roots {
            TlsRoots::BuiltIn => store.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
            TlsRoots::File(path) => {
                for certificate in read_ca_file(path, SSLROOTCERT)? {
                    store.add(certificate).map_err(|error| {
                        StorageError::with_source(
                            StorageErrorKind::InvalidInput,
                            format!(
                                "a certificate of {SSLROOTCERT} ({}) is unusable",
                                path.display()
                            ),
                            error,
                        )
                    })?;
                }
            }
        }
        WebPkiServerVerifier::builder_with_provider(Arc::new(store), Arc::clone(provider))
            .build()
            .map_err(|error| {
                StorageError::with_source(
                    StorageErrorKind::InvalidInput,
                    format!("cannot verify certificates with the CAs of {SSLROOTCERT}"),
                    error,
                )
            })
    }

    /// `prefer` and `require`: any certificate, as libpq; the handshake's signatures are still
    /// checked, so the session is with the holder of the certificate's key.
    #[derive(Debug)]
    struct Unchecked {
        provider: Arc<CryptoProvider>,
    }

    impl ServerCertVerifier for Unchecked {
        fn verify_server_cert(
            &self,
            _end_entity: &CertificateDer<'_>,
            _intermediates: &[CertificateDer<'_>],
            _server_name: &ServerName<'_>,
            _ocsp_response: &[u8],
            _now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            Ok(ServerCertVerified::assertion())
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algorithms = &self.provider.signature_verification_algorithms;
            rustls::crypto::verify_tls12_signature(message, cert, dss, algorithms)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            let algorithms = &self.provider.signature_verification_algorithms;
            rustls::crypto::verify_tls13_signature(message, cert, dss, algorithms)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.provider.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `verify-ca`: the chain to a trusted CA, whatever names the certificate holds. The
    /// webpki verifier checks the chain before the name, so a name mismatch means the chain
    /// was good.
    #[derive(Debug)]
    struct ChainOnly(Arc<WebPkiServerVerifier>);

    impl ServerCertVerifier for ChainOnly {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp_response: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, rustls::Error> {
            let verified = self.0.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            );
            match verified {
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }

        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls12_signature(message, cert, dss)
        }

        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            self.0.verify_tls13_signature(message, cert, dss)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }

    impl<S> MakeTlsConnect<S> for MakeRustls
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        type Stream = RustlsStream<S>;
        type TlsConnect = RustlsConnect;
        type Error = io::Error;

        fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, io::Error> {
            // Without a host name (a `hostaddr` alone), an unspecified address stands in: rustls
            // sends no SNI for an address, and only `verify-full` compares names, which then
            // fails with the certificate's names in its error.
            let server_name = ServerName::try_from(domain.to_owned())
                .unwrap_or(ServerName::IpAddress(IpAddr::V4(Ipv4Addr::UNSPECIFIED).into()));
            Ok(RustlsConnect { config: Arc::clone(&self.config), server_name })
        }
    }

    /// The handshake of one connection.
    pub(crate) struct RustlsConnect {
        config: Arc<ClientConfig>,
        server_name: ServerName<'static>,
    }

    impl<S> TlsConnect<S> for RustlsConnect
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        type Stream = RustlsStream<S>;
        type Error = io::Error;
        type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

        fn connect(self, stream: S) -> Self::Future {
            let connector = TlsConnector::from(self.config);
            Box::pin(
                async move { connector.connect(self.server_name, stream).await.map(RustlsStream) },
            )
        }
    }

    /// A connection's TLS stream.
    pub(crate) struct RustlsStream<S>(tokio_rustls::client::TlsStream<S>);

    impl<S> TlsStream for RustlsStream<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        fn channel_binding(&self) -> ChannelBinding {
            ChannelBinding::none()
        }
    }

    impl<S> AsyncRead for RustlsStream<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        fn poll_read(
            mut self: Pin<&mut Self>,
            context: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_read(context, buf)
        }
    }

    impl<S> AsyncWrite for RustlsStream<S>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        fn poll_write(
            mut self: Pin<&mut Self>,
            context: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Pin::new(&mut self.0).poll_write(context, buf)
        }

        fn poll_flush(mut self: Pin<&mut Self>, context: &mut Context<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_flush(context)
        }

        fn poll_shutdown(
            mut self: Pin<&mut Self>,
            context: &mut Context<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.0).poll_shutdown(context)
        }
    }
}

#[cfg(test)]
mod tests;
