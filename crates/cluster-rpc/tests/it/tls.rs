//! TLS (feature `tls`): certificates made at test time with the `openssl` command line, in a
//! temporary directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use cluster_core::error::{ClusterError, ConfigError};
use cluster_core::transport::Transport;
use cluster_rpc::{RpcConfig, RpcError, RpcServer, TcpTransport, TlsConfig};

use crate::support::{FakeHandler, config, request, runner_address, serve, within};

/// A CA, a certificate it signed for `localhost` and `127.0.0.1` (server and client use), and
/// an unrelated CA, as PEM files in a directory removed on drop.
struct Pki {
    dir: PathBuf,
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn openssl(dir: &Path, args: &[&str]) {
    let output = Command::new("openssl").args(args).current_dir(dir).output().expect("openssl");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

impl Pki {
    fn new() -> Pki {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "cluster-rpc-tls-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let pki = Pki { dir };
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        for ca in ["ca", "other-ca"] {
            let (key, cert, subject) =
                (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN={ca}"));
            let mut args = vec!["req", "-x509", "-days", "2"];
            args.extend(ec);
            args.extend(["-keyout", &key, "-out", &cert, "-subj", &subject]);
            args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
            args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
            openssl(&pki.dir, &args);
        }
        let mut args = vec!["req", "-new"];
        args.extend(ec);
        args.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
        openssl(&pki.dir, &args);
        std::fs::write(
            pki.dir.join("server.ext"),
            "basicConstraints=CA:FALSE\n\
             subjectAltName=DNS:localhost,IP:127.0.0.1\n\
             extendedKeyUsage=serverAuth,clientAuth\n",
        )
        .expect("ext file");
        openssl(
            &pki.dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                "server.ext",
                "-out",
                "server.pem",
            ],
        );
        pki
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    fn read(&self, name: &str) -> Vec<u8> {
        std::fs::read(self.dir.join(name)).expect("pem file")
    }

    /// A runner's settings: the identity and the CA.
    fn runner(&self) -> TlsConfig {
        self.client("ca.pem")
            .with_identity_pem(&self.read("server.pem"), &self.read("server.key"))
            .expect("identity")
    }

    /// A client's settings: only a CA (`ca.pem` or `other-ca.pem`).
    fn client(&self, ca: &str) -> TlsConfig {
        TlsConfig::new().with_ca_pem(&self.read(ca)).expect("ca")
    }
}

fn with_tls(tls: TlsConfig) -> RpcConfig {
    RpcConfig { tls: Some(tls), ..config() }
}

/// `from_env_with` over a fixed list of variables.
fn from_vars(vars: &[(&str, &str)]) -> Result<RpcConfig, ConfigError> {
    RpcConfig::from_env_with(|var| {
        Ok(vars.iter().find(|(name, _)| *name == var).map(|(_, value)| (*value).to_owned()))
    })
}

#[tokio::test]
async fn a_round_trip_over_tls_configured_from_the_environment() {
    let pki = Pki::new();
    let (cert, key, ca) = (pki.path("server.pem"), pki.path("server.key"), pki.path("ca.pem"));
    let server_config = from_vars(&[
        ("CLUSTER_RPC_SECRET", "s3cret-0123456789abcdef0123456789abcdef"),
        ("CLUSTER_RPC_TLS_CERT", &cert),
        ("CLUSTER_RPC_TLS_KEY", &key),
        ("CLUSTER_RPC_TLS_CA", &ca),
    ])
    .expect("server config");
    assert!(server_config.tls.is_some());
    let client_config = from_vars(&[
        ("CLUSTER_RPC_SECRET", "s3cret-0123456789abcdef0123456789abcdef"),
        ("CLUSTER_RPC_TLS_CA", &ca),
        ("CLUSTER_RPC_TLS_SERVER_NAME", "localhost"),
    ])
    .expect("client config");
    let handler = FakeHandler::new();
    let server = serve(server_config, handler.clone()).await;
    let address = runner_address(&server);
    // The secret is checked inside TLS: both are configured on both ends.
    let runners = TcpTransport::new(client_config).expect("client");
    let reply = within(runners.send(&address, request(1, "Echo"), false)).await;
    assert!(reply.expect("reply over TLS").is_final());
    within(runners.ping(&address)).await.expect("ping over TLS");
    assert_eq!(handler.calls(), 1);
    assert_eq!(server.connection_count(), 1);
    // TLS alone is not enough: the handshake inside it still wants the secret.
    let runners = TcpTransport::new(RpcConfig {
        secret: Some(b"guess-0123456789abcdef0123456789abcdef"[..].into()),
        tls: Some(pki.client("ca.pem")),
        ..config()
    })
    .expect("client");
    let error = within(runners.send(&address, request(2, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::HandshakeFailed { .. })), "{error:?}");
    assert_eq!(handler.calls(), 1);
}

#[tokio::test]
async fn the_server_name_defaults_to_the_runner_host() {
    let pki = Pki::new();
    let handler = FakeHandler::new();
    let server = serve(with_tls(pki.runner()), handler.clone()).await;
    let address = runner_address(&server);
    // `127.0.0.1` is in the certificate.
    let runners = TcpTransport::new(with_tls(pki.client("ca.pem"))).expect("client");
    let reply = within(runners.send(&address, request(1, "Echo"), false)).await;
    assert!(reply.expect("reply").is_final());
    // A name the certificate does not hold is refused.
    let wrong = pki.client("ca.pem").with_server_name("elsewhere.example").expect("name");
    let runners = TcpTransport::new(with_tls(wrong)).expect("client");
    let error = within(runners.send(&address, request(2, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(handler.calls(), 1);
}

#[tokio::test]
async fn a_client_that_does_not_trust_the_ca_is_refused() {
    let pki = Pki::new();
    let handler = FakeHandler::new();
    let server = serve(with_tls(pki.runner()), handler.clone()).await;
    let address = runner_address(&server);
    let runners = TcpTransport::new(with_tls(pki.client("other-ca.pem"))).expect("client");
    let error = within(runners.send(&address, request(1, "Echo"), false)).await;
    assert!(
        matches!(&error, Err(ClusterError::RunnerUnavailable { address: at }) if *at == address),
        "{error:?}"
    );
    assert!(within(runners.ping(&address)).await.is_err());
    assert!(!runners.is_connected(&address));
    assert_eq!(handler.calls(), 0);
    assert_eq!(server.connection_count(), 0);
}

#[tokio::test]
async fn plaintext_and_tls_do_not_mix() {
    let pki = Pki::new();
    let handler = FakeHandler::new();
    let tls_server = serve(with_tls(pki.runner()), handler.clone()).await;
    let plain = TcpTransport::new(config()).expect("client");
    let error = within(plain.send(&runner_address(&tls_server), request(1, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(tls_server.connection_count(), 0);

    let plain_server = serve(config(), handler.clone()).await;
    let tls = TcpTransport::new(with_tls(pki.client("ca.pem"))).expect("client");
    let error = within(tls.send(&runner_address(&plain_server), request(2, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(plain_server.connection_count(), 0);
    assert_eq!(handler.calls(), 0);
}

#[tokio::test]
async fn a_server_that_requires_client_certificates_refuses_clients_without_one() {
    let pki = Pki::new();
    let handler = FakeHandler::new();
    let server =
        serve(with_tls(pki.runner().with_client_cert_required(true)), handler.clone()).await;
    let address = runner_address(&server);
    let anonymous = TcpTransport::new(with_tls(pki.client("ca.pem"))).expect("client");
    let error = within(anonymous.send(&address, request(1, "Echo"), false)).await;
    assert!(matches!(error, Err(ClusterError::RunnerUnavailable { .. })), "{error:?}");
    assert_eq!(handler.calls(), 0);
    // A runner presents its certificate.
    let runner = TcpTransport::new(with_tls(pki.runner())).expect("client");
    let reply = within(runner.send(&address, request(2, "Echo"), false)).await;
    assert!(reply.expect("reply with a client certificate").is_final());
}

#[tokio::test]
async fn tls_config_errors_name_the_variable() {
    let pki = Pki::new();
    let (cert, key, ca) = (pki.path("server.pem"), pki.path("server.key"), pki.path("ca.pem"));
    let missing = pki.path("missing.pem");
    let not_pem = pki.path("server.ext");
    let wrong_key = pki.path("ca.key");
    let cases: [(&[(&str, &str)], &str); 9] = [
        (
            &[("CLUSTER_RPC_TLS_CERT", &missing), ("CLUSTER_RPC_TLS_KEY", &key)],
            "CLUSTER_RPC_TLS_CERT",
        ),
        (
            &[("CLUSTER_RPC_TLS_CERT", &not_pem), ("CLUSTER_RPC_TLS_KEY", &key)],
            "CLUSTER_RPC_TLS_CERT",
        ),
        (
            &[("CLUSTER_RPC_TLS_CERT", &cert), ("CLUSTER_RPC_TLS_KEY", &not_pem)],
            "CLUSTER_RPC_TLS_KEY",
        ),
        (&[("CLUSTER_RPC_TLS_CERT", &cert)], "CLUSTER_RPC_TLS_KEY"),
        (&[("CLUSTER_RPC_TLS_KEY", &key)], "CLUSTER_RPC_TLS_CERT"),
        (
            &[("CLUSTER_RPC_TLS_CERT", &cert), ("CLUSTER_RPC_TLS_KEY", &wrong_key)],
            "CLUSTER_RPC_TLS_KEY",
        ),
        (&[("CLUSTER_RPC_TLS_CA", &not_pem)], "CLUSTER_RPC_TLS_CA"),
        (
            &[("CLUSTER_RPC_TLS_CA", &ca), ("CLUSTER_RPC_TLS_SERVER_NAME", "not a name!")],
            "CLUSTER_RPC_TLS_SERVER_NAME",
        ),
        (
            &[("CLUSTER_RPC_TLS_CA", &ca), ("CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT", "maybe")],
            "CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT",
        ),
    ];
    for (vars, expected) in cases {
        let error = from_vars(vars).expect_err("a bad TLS setting");
        assert_eq!(error.key(), expected, "{vars:?}: {error}");
    }
    let error = from_vars(&[
        ("CLUSTER_RPC_TLS_CERT", &cert),
        ("CLUSTER_RPC_TLS_KEY", &key),
        ("CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT", "true"),
    ])
    .expect_err("client certificates need a CA");
    assert_eq!(error.key(), "CLUSTER_RPC_TLS_REQUIRE_CLIENT_CERT");
    let error = from_vars(&[("CLUSTER_RPC_TLS_SERVER_NAME", "localhost")])
        .expect_err("a name alone is no TLS setting");
    assert_eq!(error.key(), "CLUSTER_RPC_TLS_CERT");
    // Unset or empty variables leave TLS off.
    assert!(from_vars(&[("CLUSTER_RPC_TLS_CA", "")]).expect("empty").tls.is_none());

    // A server needs an identity, a client needs a CA.
    let localhost = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let error = RpcServer::bind(localhost, with_tls(pki.client("ca.pem"))).await.expect_err("bind");
    assert!(matches!(&error, RpcError::Config(error) if error.key() == "tls_cert"), "{error:?}");
    let identity_only = TlsConfig::new()
        .with_identity_pem(&pki.read("server.pem"), &pki.read("server.key"))
        .expect("identity");
    let error = TcpTransport::new(with_tls(identity_only)).expect_err("client");
    assert!(matches!(&error, RpcError::Config(error) if error.key() == "tls_ca"), "{error:?}");
}

/// Beyond loopback, TLS that requires client certificates authenticates peers without a
/// secret; TLS that does not is no authentication.
#[tokio::test]
async fn client_certificates_let_a_server_listen_beyond_loopback() {
    let pki = Pki::new();
    let everywhere = std::net::SocketAddr::from(([0, 0, 0, 0], 0));
    let required = with_tls(pki.runner().with_client_cert_required(true));
    assert!(RpcServer::bind(everywhere, required).await.is_ok());
    let error = RpcServer::bind(everywhere, with_tls(pki.runner())).await.expect_err("bind");
    assert!(
        matches!(&error, RpcError::Config(error) if error.key() == "CLUSTER_RPC_SECRET"),
        "{error:?}"
    );
}
