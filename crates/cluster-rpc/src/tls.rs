//! The optional TLS layer (feature `tls`): rustls with the `ring` provider, TLS 1.3 only.
//!
//! TLS wraps the TCP stream before the HMAC handshake of [`crate::handshake`], which still runs
//! inside it. Both sides then see one boxed [`Stream`], so the rest of the transport has a
//! single code path with and without TLS.
//!
//! Without the feature, [`ServerTls`] and [`ClientTls`] only box the TCP stream, and
//! [`RpcConfig::from_env`](crate::RpcConfig::from_env) refuses every `CLUSTER_RPC_TLS_*`
//! variable rather than ignoring it.

use std::io;

use cluster_core::error::ConfigError;
use cluster_core::ids::RunnerAddress;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use crate::config::RpcConfig;

/// The certificate chain (PEM file): the server's certificate, also presented by clients when
/// the server requires client certificates.
pub(crate) const TLS_CERT: &str = "CLUSTER_RPC_TLS_CERT";
/// The private key of [`TLS_CERT`] (PEM file).
pub(crate) const TLS_KEY: &str = "CLUSTER_RPC_TLS_KEY";
/// The CA certificates (PEM file) clients verify servers with (and servers verify clients
/// with, when they require client certificates).
pub(crate) const TLS_CA: &str = "CLUSTER_RPC_TLS_CA";
/// The name clients expect in the server's certificate; default the runner's host.
pub(crate) const TLS_SERVER_NAME: &str = "CLUSTER_RPC_TLS_SERVER_NAME";
/// `true` makes servers require a client certificate signed by [`TLS_CA`].
pub(crate) const TLS_REQUIRE_CLIENT_CERT: &str = "CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT";

/// Every TLS variable.
#[cfg(not(feature = "tls"))]
pub(crate) const TLS_VARS: [&str; 5] =
    [TLS_CERT, TLS_KEY, TLS_CA, TLS_SERVER_NAME, TLS_REQUIRE_CLIENT_CERT];

/// A connection's byte stream: plain TCP or TLS over TCP.
pub(crate) trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// A boxed [`Stream`].
pub(crate) type BoxStream = Box<dyn Stream>;

/// Reads the TLS variables through `get` (which already drops empty values).
#[cfg(not(feature = "tls"))]
pub(crate) fn from_env(
    get: &dyn Fn(&str) -> Result<Option<String>, ConfigError>,
    _config: &mut RpcConfig,
) -> Result<(), ConfigError> {
    for var in TLS_VARS {
        if let Some(value) = get(var)? {
            return Err(ConfigError::new(
                var,
                value,
                "cluster-rpc was built without the tls feature",
            ));
        }
    }
    Ok(())
}

/// The server side of TLS: an acceptor when TLS is configured.
#[derive(Clone)]
pub(crate) struct ServerTls {
    #[cfg(feature = "tls")]
    acceptor: Option<tokio_rustls::TlsAcceptor>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        #[cfg(feature = "tls")]
        let enabled = self.acceptor.is_some();
        #[cfg(not(feature = "tls"))]
        let enabled = false;
        f.debug_struct("ServerTls").field("enabled", &enabled).finish()
    }
}

impl ServerTls {
    /// The server side of `config`'s TLS settings; TLS needs a certificate and key.
    #[cfg_attr(not(feature = "tls"), allow(clippy::unnecessary_wraps))]
    pub(crate) fn new(config: &RpcConfig) -> Result<ServerTls, ConfigError> {
        #[cfg(feature = "tls")]
        {
            let acceptor = config.tls.as_ref().map(enabled::TlsConfig::acceptor).transpose()?;
            Ok(ServerTls { acceptor })
        }
        #[cfg(not(feature = "tls"))]
        {
            let _ = config;
            Ok(ServerTls {})
        }
    }

    /// Wraps an accepted connection. Not cancel safe; bounded by the connect timeout.
    pub(crate) async fn accept(&self, tcp: TcpStream) -> io::Result<BoxStream> {
        #[cfg(feature = "tls")]
        if let Some(acceptor) = &self.acceptor {
            return Ok(Box::new(acceptor.accept(tcp).await?));
        }
        Ok(Box::new(tcp))
    }
}

/// The client side of TLS: a connector when TLS is configured.
#[derive(Clone)]
pub(crate) struct ClientTls {
    #[cfg(feature = "tls")]
    connector: Option<(tokio_rustls::TlsConnector, Option<enabled::ServerName<'static>>)>,
}

impl ClientTls {
    /// The client side of `config`'s TLS settings; TLS needs a CA.
    #[cfg_attr(not(feature = "tls"), allow(clippy::unnecessary_wraps))]
    pub(crate) fn new(config: &RpcConfig) -> Result<ClientTls, ConfigError> {
        #[cfg(feature = "tls")]
        {
            let connector = match &config.tls {
                Some(tls) => Some((tls.connector()?, tls.server_name.clone())),
                None => None,
            };
            Ok(ClientTls { connector })
        }
        #[cfg(not(feature = "tls"))]
        {
            let _ = config;
            Ok(ClientTls {})
        }
    }

    /// Wraps a connection to `address`. Not cancel safe; bounded by the connect timeout.
    pub(crate) async fn connect(
        &self,
        address: &RunnerAddress,
        tcp: TcpStream,
    ) -> io::Result<BoxStream> {
        #[cfg(feature = "tls")]
        if let Some((connector, name)) = &self.connector {
            let name = match name {
                Some(name) => name.clone(),
                None => enabled::ServerName::try_from(address.host().to_owned())
                    .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))?,
            };
            return Ok(Box::new(connector.connect(name, tcp).await?));
        }
        let _ = address;
        Ok(Box::new(tcp))
    }
}

#[cfg(feature = "tls")]
pub use enabled::TlsConfig;

#[cfg(feature = "tls")]
pub(crate) use enabled::from_env;

#[cfg(feature = "tls")]
mod enabled {
    use std::fmt;
    use std::sync::Arc;

    use cluster_core::error::ConfigError;
    use tokio_rustls::rustls::crypto::{CryptoProvider, ring};
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
    use tokio_rustls::rustls::server::WebPkiClientVerifier;
    use tokio_rustls::rustls::{ClientConfig, RootCertStore, ServerConfig, version};
    use tokio_rustls::{TlsAcceptor, TlsConnector};

    pub(crate) use tokio_rustls::rustls::pki_types::ServerName;

    use super::{TLS_CA, TLS_CERT, TLS_KEY, TLS_REQUIRE_CLIENT_CERT, TLS_SERVER_NAME};
    use crate::config::RpcConfig;

    /// TLS settings of the transport (feature `tls`), kept in [`RpcConfig::tls`].
    ///
    /// A server needs a certificate chain and its key ([`with_identity_pem`]); a client needs
    /// the CA certificates to verify servers with ([`with_ca_pem`]). A runner, both server and
    /// client, usually has all three. With [`with_client_cert_required`] servers also demand a
    /// client certificate signed by the CA, and clients present their own chain.
    ///
    /// Errors name the field (`tls_cert`, `tls_key`, `tls_ca`, `tls_server_name`,
    /// `tls_require_client_cert`), which [`RpcConfig::from_env`] reports as the variable
    /// `CLUSTER_RPC_TLS_*`.
    ///
    /// [`with_identity_pem`]: TlsConfig::with_identity_pem
    /// [`with_ca_pem`]: TlsConfig::with_ca_pem
    /// [`with_client_cert_required`]: TlsConfig::with_client_cert_required
    #[derive(Clone, Default)]
    pub struct TlsConfig {
        cert_chain: Vec<CertificateDer<'static>>,
        key: Option<Arc<PrivateKeyDer<'static>>>,
        roots: Option<Arc<RootCertStore>>,
        pub(crate) server_name: Option<ServerName<'static>>,
        require_client_cert: bool,
    }

    impl fmt::Debug for TlsConfig {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("TlsConfig")
                .field("cert_chain", &self.cert_chain.len())
                .field("key", &self.key.as_ref().map(|_| "<redacted>"))
                .field("roots", &self.roots.as_ref().map(|roots| roots.len()))
                .field("server_name", &self.server_name)
                .field("require_client_cert", &self.require_client_cert)
                .finish()
        }
    }

    fn provider() -> Arc<CryptoProvider> {
        Arc::new(ring::default_provider())
    }

    fn certificates(key: &str, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, ConfigError> {
        let certs = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|error| ConfigError::new(key, "", format!("bad PEM: {error}")))?;
        if certs.is_empty() {
            return Err(ConfigError::new(key, "", "holds no PEM certificate"));
        }
        Ok(certs)
    }

    impl TlsConfig {
        /// Empty settings: add an identity, a CA or both.
        pub fn new() -> TlsConfig {
            TlsConfig::default()
        }

        /// Sets the certificate chain (leaf first) and its private key (PKCS#8, PKCS#1 or
        /// SEC1), both PEM.
        pub fn with_identity_pem(
            mut self,
            cert_chain: &[u8],
            key: &[u8],
        ) -> Result<TlsConfig, ConfigError> {
            self.cert_chain = certificates("tls_cert", cert_chain)?;
            let key = PrivateKeyDer::from_pem_slice(key).map_err(|error| {
                ConfigError::new("tls_key", "", format!("bad PEM key: {error}"))
            })?;
            self.key = Some(Arc::new(key));
            Ok(self)
        }

        /// Sets the CA certificates (PEM) that verify servers (and clients, when required).
        pub fn with_ca_pem(mut self, ca: &[u8]) -> Result<TlsConfig, ConfigError> {
            let mut roots = RootCertStore::empty();
            for cert in certificates("tls_ca", ca)? {
                roots.add(cert).map_err(|error| {
                    ConfigError::new("tls_ca", "", format!("bad CA certificate: {error}"))
                })?;
            }
            self.roots = Some(Arc::new(roots));
            Ok(self)
        }

        /// Sets the name clients expect in every server's certificate, instead of the host of
        /// the runner's address.
        pub fn with_server_name(mut self, name: &str) -> Result<TlsConfig, ConfigError> {
            let parsed = ServerName::try_from(name.to_owned()).map_err(|_| {
                ConfigError::new("tls_server_name", name, "is not a DNS name or IP address")
            })?;
            self.server_name = Some(parsed);
            Ok(self)
        }

        /// Whether servers require a client certificate signed by the CA: only peers with
        /// such a certificate get in.
        pub(crate) fn authenticates_peers(&self) -> bool {
            self.require_client_cert && self.roots.is_some()
        }

        /// Whether servers require a client certificate signed by the CA.
        pub fn with_client_cert_required(mut self, required: bool) -> TlsConfig {
            self.require_client_cert = required;
            self
        }

        /// Checks that the settings make at least one side and that each side they make
        /// builds (for instance that the key matches the certificate).
        pub(crate) fn validate(&self) -> Result<(), ConfigError> {
            if self.key.is_none() && self.roots.is_none() {
                return Err(ConfigError::new(
                    "tls_cert",
                    "",
                    "TLS needs a certificate and key (server) or a CA (client)",
                ));
            }
            if self.key.is_some() {
                self.acceptor()?;
            }
            if self.roots.is_some() {
                self.connector()?;
            }
            Ok(())
        }

        /// The server side; needs the identity (and the CA when client certificates are
        /// required).
        pub(crate) fn acceptor(&self) -> Result<TlsAcceptor, ConfigError> {
            let Some(key) = &self.key else {
                return Err(ConfigError::new(
                    "tls_cert",
                    "",
                    "a TLS server needs a certificate and its key",
                ));
            };
            let builder = ServerConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&version::TLS13])
                .map_err(|error| ConfigError::new("tls_cert", "", error.to_string()))?;
            let builder = if self.require_client_cert {
                let Some(roots) = &self.roots else {
                    return Err(ConfigError::new(
                        "tls_require_client_cert",
                        "true",
                        "requiring client certificates needs a CA (tls_ca)",
                    ));
                };
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::clone(roots), provider())
                        .build()
                        .map_err(|error| ConfigError::new("tls_ca", "", error.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            } else {
                builder.with_no_client_auth()
            };
            let config = builder
                .with_single_cert(self.cert_chain.clone(), key.clone_key())
                .map_err(|error| {
                    ConfigError::new("tls_key", "", format!("unusable certificate or key: {error}"))
                })?;
            Ok(TlsAcceptor::from(Arc::new(config)))
        }

        /// The client side; needs the CA (and presents the identity when it has one).
        pub(crate) fn connector(&self) -> Result<TlsConnector, ConfigError> {
            let Some(roots) = &self.roots else {
                return Err(ConfigError::new(
                    "tls_ca",
                    "",
                    "a TLS client needs the CA certificates to verify servers with",
                ));
            };
            let builder = ClientConfig::builder_with_provider(provider())
                .with_protocol_versions(&[&version::TLS13])
                .map_err(|error| ConfigError::new("tls_ca", "", error.to_string()))?
                .with_root_certificates(Arc::clone(roots));
            let config = match &self.key {
                Some(key) => builder
                    .with_client_auth_cert(self.cert_chain.clone(), key.clone_key())
                    .map_err(|error| {
                        ConfigError::new(
                            "tls_key",
                            "",
                            format!("unusable certificate or key: {error}"),
                        )
                    })?,
                None => builder.with_no_client_auth(),
            };
            Ok(TlsConnector::from(Arc::new(config)))
        }
    }

    /// Reads the file named by `var`, if set.
    fn read(
        get: &dyn Fn(&str) -> Result<Option<String>, ConfigError>,
        var: &str,
    ) -> Result<Option<(String, Vec<u8>)>, ConfigError> {
        let Some(path) = get(var)? else { return Ok(None) };
        match std::fs::read(&path) {
            Ok(bytes) => Ok(Some((path, bytes))),
            Err(error) => {
                Err(ConfigError::new(var, path, format!("cannot read the file: {error}")))
            }
        }
    }

    /// Names `var` (and the file) in an error of a [`TlsConfig`] setter.
    fn rename(var: &str, path: &str) -> impl Fn(ConfigError) -> ConfigError {
        move |error| ConfigError::new(var, path, error.reason())
    }

    /// Reads the `CLUSTER_RPC_TLS_*` variables through `get` (which already drops empty
    /// values) into `config.tls`; TLS stays off when none is set.
    pub(crate) fn from_env(
        get: &dyn Fn(&str) -> Result<Option<String>, ConfigError>,
        config: &mut RpcConfig,
    ) -> Result<(), ConfigError> {
        let cert = read(get, TLS_CERT)?;
        let key = read(get, TLS_KEY)?;
        let ca = read(get, TLS_CA)?;
        let server_name = get(TLS_SERVER_NAME)?;
        let required = get(TLS_REQUIRE_CLIENT_CERT)?;
        if cert.is_none()
            && key.is_none()
            && ca.is_none()
            && server_name.is_none()
            && required.is_none()
        {
            return Ok(());
        }
        let mut tls = TlsConfig::new();
        match (cert, key) {
            (Some((cert_path, cert)), Some((key_path, key))) => {
                // Parse each file on its own first, so the error names the right variable.
                certificates(TLS_CERT, &cert).map_err(rename(TLS_CERT, &cert_path))?;
                tls = tls.with_identity_pem(&cert, &key).map_err(rename(TLS_KEY, &key_path))?;
            }
            (Some(_), None) => {
                return Err(ConfigError::new(TLS_KEY, "", format!("must be set with {TLS_CERT}")));
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(TLS_CERT, "", format!("must be set with {TLS_KEY}")));
            }
            (None, None) => {}
        }
        if let Some((path, ca)) = ca {
            tls = tls.with_ca_pem(&ca).map_err(rename(TLS_CA, &path))?;
        }
        if let Some(name) = server_name {
            tls = tls.with_server_name(name.trim()).map_err(rename(TLS_SERVER_NAME, &name))?;
        }
        if let Some(value) = required {
            let required = match value.trim() {
                "true" => true,
                "false" => false,
                _ => {
                    return Err(ConfigError::new(
                        TLS_REQUIRE_CLIENT_CERT,
                        value,
                        "must be true or false",
                    ));
                }
            };
            tls = tls.with_client_cert_required(required);
        }
        config.tls = Some(tls);
        Ok(())
    }
}
