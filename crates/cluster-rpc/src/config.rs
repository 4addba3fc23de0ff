//! [`RpcConfig`]: the limits, timeouts and secret of the transport, with environment loading.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use cluster_core::config::parse_duration;
use cluster_core::error::ConfigError;

/// The largest accepted `max_frame_bytes`: 1 GiB.
pub const MAX_FRAME_BYTES_MAX: u32 = 1 << 30;

/// The shortest accepted shared secret, in bytes: 32, which is 128 bits of key material when
/// they are random hexadecimal digits (`openssl rand -hex 32` makes 64 of them, 256 bits).
pub const MIN_SECRET_BYTES: usize = 32;

/// The transport's options, shared by [`crate::RpcServer`] and [`crate::TcpTransport`].
///
/// Loaded from the environment by [`RpcConfig::from_env`]:
///
/// | variable                        | field                | default      |
/// | ------------------------------- | -------------------- | ------------ |
/// | `CLUSTER_RPC_SECRET`            | `secret`             | none         |
/// | `CLUSTER_RPC_MAX_FRAME_BYTES`   | `max_frame_bytes`    | 8 MiB        |
/// | `CLUSTER_RPC_CONNECT_TIMEOUT`   | `connect_timeout`    | 5 seconds    |
/// | `CLUSTER_RPC_FRAME_TIMEOUT`     | `frame_timeout`      | 30 seconds   |
/// | `CLUSTER_RPC_MAX_IN_FLIGHT`     | `max_in_flight`      | 1024         |
/// | `CLUSTER_RPC_MAX_PUSHED_IN_FLIGHT` | `max_pushed_in_flight` | 8192     |
/// | `CLUSTER_RPC_QUEUE_CAPACITY`    | `queue_capacity`     | 256          |
/// | `CLUSTER_RPC_STREAM_BUFFER`     | `stream_buffer`      | 16           |
/// | `CLUSTER_RPC_MAX_CONNECTIONS`   | `max_connections`    | 1024         |
/// | `CLUSTER_RPC_MAX_HANDSHAKES`    | `max_handshakes`     | 64           |
/// | `CLUSTER_RPC_HANDSHAKE_TIMEOUT` | `handshake_timeout`  | 3 seconds    |
/// | `CLUSTER_RPC_IDLE_EXPIRY`       | `idle_expiry`        | 3 minutes    |
/// | `CLUSTER_RPC_BACKOFF_BASE`      | `backoff_base`       | 100 millis   |
/// | `CLUSTER_RPC_BACKOFF_CAP`       | `backoff_cap`        | 10 seconds   |
/// | `CLUSTER_RPC_INSECURE`          | `insecure`           | `false`      |
///
/// # The shared secret
///
/// A non-empty secret must be at least [`MIN_SECRET_BYTES`] (32) bytes long, or
/// [`RpcConfig::validate`] refuses it with an error naming `CLUSTER_RPC_SECRET` (never its
/// value). Its length is all that can be checked, so make it random:
/// `openssl rand -hex 32` prints 64 hexadecimal digits (256 bits); 32 random hexadecimal digits
/// are the least that gives 128 bits. A phrase a person picks has far less entropy than its
/// length suggests.
///
/// # Secure by default
///
/// A server that listens on an address other than loopback must authenticate its peers:
/// with `CLUSTER_RPC_SECRET`, or with TLS client certificates
/// (`CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT`).
/// Otherwise [`crate::RpcServer::bind`] refuses to start, naming `CLUSTER_RPC_SECRET`.
/// `CLUSTER_RPC_INSECURE=true` accepts any peer that reaches the port; the server then logs a
/// warning when it starts.
///
/// Durations use the reference's syntax (`5 seconds`, `200 millis`, see
/// [`cluster_core::config::parse_duration`]). Unset and empty variables keep their defaults.
///
/// TLS (feature `tls`, field `tls`, off unless one of these is set):
///
/// | variable                              | meaning                                            |
/// | ------------------------------------- | -------------------------------------------------- |
/// | `CLUSTER_RPC_TLS_CERT`                | PEM file: certificate chain, leaf first (servers)  |
/// | `CLUSTER_RPC_TLS_KEY`                 | PEM file: its private key (set with the chain)     |
/// | `CLUSTER_RPC_TLS_CA`                  | PEM file: CA certificates that verify servers      |
/// | `CLUSTER_RPC_TLS_SERVER_NAME`         | name expected in server certificates (default: the runner's host) |
/// | `CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT` | `true`: servers require a client certificate signed by the CA, clients present theirs |
///
/// The files are read and parsed when the configuration is loaded; an unreadable file, bad PEM
/// or a key that does not match the certificate is a [`ConfigError`] naming the variable.
/// Built without the `tls` feature, any of these variables set is an error ("built without the
/// tls feature"), never silently ignored.
#[derive(Clone)]
pub struct RpcConfig {
    /// The shared secret of the handshake; `None` (or empty) means the empty key (no
    /// authentication). Both ends must agree. At least [`MIN_SECRET_BYTES`] bytes when set
    /// (see "The shared secret" above).
    pub secret: Option<Arc<[u8]>>,
    /// The largest frame sent or accepted, in bytes.
    pub max_frame_bytes: u32,
    /// The longest a connection attempt, TCP and handshake together, may take.
    pub connect_timeout: Duration,
    /// The longest a frame may take to arrive once its first byte has (both sides): a peer
    /// that starts a frame and stalls has its connection closed, and logged.
    pub frame_timeout: Duration,
    /// The most calls in flight on one connection (client and server side), pushed persisted
    /// requests apart.
    pub max_in_flight: u32,
    /// The most pushed persisted requests in flight on one connection (client and server side),
    /// in a lane of their own.
    ///
    /// Such a call lasts until its request's final reply is stored, as long as its handler
    /// runs, so it must not take the slots of the other calls (volatile requests, notices,
    /// pings).
    /// A push that finds its lane full fails at once: its caller waits on storage instead.
    pub max_pushed_in_flight: u32,
    /// The most frames queued for a connection's writer.
    pub queue_capacity: u32,
    /// The most replies of one streamed request buffered on the client before it reads them.
    pub stream_buffer: u32,
    /// The most connections a server serves at once, counted once they have passed the
    /// handshake: a connection beyond it is closed when it is accepted (or, when the last slot
    /// went while it was shaking hands, refused after its proof, as busy).
    pub max_connections: u32,
    /// The most connections a server lets shake hands at once, apart from `max_connections`:
    /// a connection accepted beyond it is closed at once, so that peers that never prove
    /// themselves hold at most this many sockets, and never an established connection's slot.
    pub max_handshakes: u32,
    /// The longest a server waits for an accepted connection to complete its handshake (TLS
    /// included) before it closes it.
    pub handshake_timeout: Duration,
    /// How long a client connection stays open with no call in flight.
    pub idle_expiry: Duration,
    /// The first delay before reconnecting to a runner that refused a connection.
    pub backoff_base: Duration,
    /// The longest such delay.
    pub backoff_cap: Duration,
    /// TLS around every connection; `None` (the default) is plain TCP. Both ends must agree.
    #[cfg(feature = "tls")]
    pub tls: Option<crate::tls::TlsConfig>,
    /// Whether a server may listen beyond loopback without authenticating its peers (see
    /// "Secure by default" above).
    pub insecure: bool,
}

impl Default for RpcConfig {
    fn default() -> RpcConfig {
        RpcConfig {
            secret: None,
            max_frame_bytes: 8 << 20,
            connect_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            max_in_flight: 1024,
            max_pushed_in_flight: 8192,
            queue_capacity: 256,
            stream_buffer: 16,
            max_connections: 1024,
            max_handshakes: 64,
            handshake_timeout: Duration::from_secs(3),
            idle_expiry: Duration::from_secs(180),
            backoff_base: Duration::from_millis(100),
            backoff_cap: Duration::from_secs(10),
            #[cfg(feature = "tls")]
            tls: None,
            insecure: false,
        }
    }
}

impl fmt::Debug for RpcConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut debug = f.debug_struct("RpcConfig");
        debug
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("max_frame_bytes", &self.max_frame_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("frame_timeout", &self.frame_timeout)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_pushed_in_flight", &self.max_pushed_in_flight)
            .field("queue_capacity", &self.queue_capacity)
            .field("stream_buffer", &self.stream_buffer)
            .field("max_connections", &self.max_connections)
            .field("max_handshakes", &self.max_handshakes)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("idle_expiry", &self.idle_expiry)
            .field("backoff_base", &self.backoff_base)
            .field("backoff_cap", &self.backoff_cap);
        #[cfg(feature = "tls")]
        debug.field("tls", &self.tls);
        debug.field("insecure", &self.insecure);
        debug.finish()
    }
}

impl RpcConfig {
    /// The default configuration with `secret` as the shared secret.
    pub fn with_secret(secret: impl AsRef<[u8]>) -> RpcConfig {
        RpcConfig { secret: Some(Arc::from(secret.as_ref())), ..RpcConfig::default() }
    }

    /// Loads the configuration from the process environment (see [`RpcConfig`] for the variables).
    pub fn from_env() -> Result<RpcConfig, ConfigError> {
        RpcConfig::from_env_with(|var| match std::env::var(var) {
            Ok(value) => Ok(Some(value)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(value)) => {
                Err(ConfigError::new(var, value.to_string_lossy(), "is not valid UTF-8"))
            }
        })
    }

    /// Loads the configuration from `lookup`, which maps a variable name to its value, then
    /// [validates](RpcConfig::validate) it. Every error names the variable.
    pub fn from_env_with(
        lookup: impl Fn(&str) -> Result<Option<String>, ConfigError>,
    ) -> Result<RpcConfig, ConfigError> {
        let get = |var: &str| -> Result<Option<String>, ConfigError> {
            Ok(lookup(var)?.filter(|value| !value.is_empty()))
        };
        let mut config = RpcConfig::default();
        if let Some(secret) = get("CLUSTER_RPC_SECRET")? {
            config.secret = Some(Arc::from(secret.as_bytes()));
        }
        let numbers = [
            ("CLUSTER_RPC_MAX_FRAME_BYTES", &mut config.max_frame_bytes),
            ("CLUSTER_RPC_MAX_IN_FLIGHT", &mut config.max_in_flight),
            ("CLUSTER_RPC_MAX_PUSHED_IN_FLIGHT", &mut config.max_pushed_in_flight),
            ("CLUSTER_RPC_QUEUE_CAPACITY", &mut config.queue_capacity),
            ("CLUSTER_RPC_STREAM_BUFFER", &mut config.stream_buffer),
            ("CLUSTER_RPC_MAX_CONNECTIONS", &mut config.max_connections),
            ("CLUSTER_RPC_MAX_HANDSHAKES", &mut config.max_handshakes),
        ];
        for (var, field) in numbers {
            if let Some(value) = get(var)? {
                *field = value.trim().parse().map_err(|_| {
                    ConfigError::new(var, &value, "must be an integer in 1..=4294967295")
                })?;
            }
        }
        let durations = [
            ("CLUSTER_RPC_CONNECT_TIMEOUT", &mut config.connect_timeout),
            ("CLUSTER_RPC_FRAME_TIMEOUT", &mut config.frame_timeout),
            ("CLUSTER_RPC_HANDSHAKE_TIMEOUT", &mut config.handshake_timeout),
            ("CLUSTER_RPC_IDLE_EXPIRY", &mut config.idle_expiry),
            ("CLUSTER_RPC_BACKOFF_BASE", &mut config.backoff_base),
            ("CLUSTER_RPC_BACKOFF_CAP", &mut config.backoff_cap),
        ];
        for (var, field) in durations {
            if let Some(value) = get(var)? {
                *field = parse_duration(value.trim())
                    .map_err(|error| ConfigError::new(var, &value, error.reason()))?;
            }
        }
        if let Some(value) = get("CLUSTER_RPC_INSECURE")? {
            config.insecure = match value.trim() {
                "true" => true,
                "false" => false,
                _ => {
                    return Err(ConfigError::new(
                        "CLUSTER_RPC_INSECURE",
                        &value,
                        "must be true or false",
                    ));
                }
            };
        }
        crate::tls::from_env(&get, &mut config)?;
        config.validate().map_err(|error| {
            let var = format!("CLUSTER_RPC_{}", error.key().to_ascii_uppercase());
            ConfigError::new(var, error.value(), error.reason())
        })?;
        Ok(config)
    }

    /// Checks the ranges: a secret, when set, has at least [`MIN_SECRET_BYTES`] bytes, every
    /// limit is at least 1, `max_frame_bytes` is at most [`MAX_FRAME_BYTES_MAX`], timeouts and
    /// expiry are positive and `backoff_base <= backoff_cap`; TLS settings make a usable server
    /// or client. The error names the field, and never shows the secret.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let Some(secret) = &self.secret
            && !secret.is_empty()
            && secret.len() < MIN_SECRET_BYTES
        {
            return Err(ConfigError::new(
                "secret",
                format!("<redacted, {} bytes>", secret.len()),
                format!(
                    "is too short: the shared secret needs at least {MIN_SECRET_BYTES} bytes of \
                     random key material (128 bits as 32 hexadecimal digits); make one with \
                     `openssl rand -hex 32` and give the same one to every runner and client"
                ),
            ));
        }
        #[cfg(feature = "tls")]
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        let limits = [
            ("max_frame_bytes", self.max_frame_bytes),
            ("max_in_flight", self.max_in_flight),
            ("max_pushed_in_flight", self.max_pushed_in_flight),
            ("queue_capacity", self.queue_capacity),
            ("stream_buffer", self.stream_buffer),
            ("max_connections", self.max_connections),
            ("max_handshakes", self.max_handshakes),
        ];
        for (key, value) in limits {
            if value == 0 {
                return Err(ConfigError::new(key, "0", "must be at least 1"));
            }
        }
        if self.max_frame_bytes > MAX_FRAME_BYTES_MAX {
            return Err(ConfigError::new(
                "max_frame_bytes",
                self.max_frame_bytes.to_string(),
                format!("must be at most {MAX_FRAME_BYTES_MAX}"),
            ));
        }
        let durations = [
            ("connect_timeout", self.connect_timeout),
            ("frame_timeout", self.frame_timeout),
            ("handshake_timeout", self.handshake_timeout),
            ("idle_expiry", self.idle_expiry),
            ("backoff_cap", self.backoff_cap),
        ];
        for (key, value) in durations {
            if value.is_zero() {
                return Err(ConfigError::new(key, "0", "must be positive"));
            }
        }
        if self.backoff_base > self.backoff_cap {
            return Err(ConfigError::new(
                "backoff_base",
                format!("{:?}", self.backoff_base),
                "must not exceed backoff_cap",
            ));
        }
        Ok(())
    }

    /// Whether a server listening on `listen` may start with these settings (see "Secure by
    /// default" above).
    ///
    /// # Errors
    ///
    /// `listen` is not a loopback address, and the settings neither authenticate peers nor
    /// opt out with `insecure`.
    /// The error names `CLUSTER_RPC_SECRET`; its value is empty.
    pub fn check_exposure(&self, listen: std::net::SocketAddr) -> Result<(), ConfigError> {
        if !self.accepts_anyone_on(listen) || self.insecure {
            return Ok(());
        }
        Err(ConfigError::new(
            "CLUSTER_RPC_SECRET",
            "",
            format!(
                "is required to listen on {listen}, which is not a loopback address: without it \
                 anyone who reaches the port can call every entity (or require TLS client \
                 certificates with CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT=true, or accept any peer \
                 with CLUSTER_RPC_INSECURE=true)"
            ),
        ))
    }

    /// Whether a server with these settings, listening on `listen`, lets in any peer that
    /// reaches it from another machine.
    pub(crate) fn accepts_anyone_on(&self, listen: std::net::SocketAddr) -> bool {
        !listen.ip().is_loopback() && !self.authenticates_peers()
    }

    /// Whether a server with these settings lets in only the peers it can authenticate.
    fn authenticates_peers(&self) -> bool {
        let secret = self.secret.as_ref().is_some_and(|secret| !secret.is_empty());
        #[cfg(feature = "tls")]
        let certificates =
            self.tls.as_ref().is_some_and(crate::tls::TlsConfig::authenticates_peers);
        #[cfg(not(feature = "tls"))]
        let certificates = false;
        secret || certificates
    }

    pub(crate) fn secret_bytes(&self) -> &[u8] {
        self.secret.as_deref().unwrap_or_default()
    }

    pub(crate) fn queue_capacity(&self) -> usize {
        usize::try_from(self.queue_capacity).unwrap_or(usize::MAX)
    }

    pub(crate) fn stream_buffer(&self) -> usize {
        usize::try_from(self.stream_buffer).unwrap_or(usize::MAX)
    }

    pub(crate) fn max_in_flight(&self) -> usize {
        usize::try_from(self.max_in_flight).unwrap_or(usize::MAX)
    }

    pub(crate) fn max_pushed_in_flight(&self) -> usize {
        usize::try_from(self.max_pushed_in_flight).unwrap_or(usize::MAX)
    }
}
