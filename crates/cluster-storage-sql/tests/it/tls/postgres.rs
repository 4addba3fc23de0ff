//! PostgreSQL over TLS, against the server of `CLUSTER_TEST_POSTGRES_URL` and its own
//! certificate (`ssl_cert_file`, Debian's self-signed "snakeoil" certificate on the project's
//! machines): the modes encrypt every connection, the pool's and the lock session's, and the
//! verifying modes refuse what they should, with the cause and the fix.

use std::path::PathBuf;

use cluster_core::storage::RunnerStorage;
use cluster_core::{RunnerAddress, ShardGroup, ShardId, ShardingConfig};
use cluster_storage_sql::postgres::{PgMessageStorage, PgRunnerStorage};
use cluster_storage_sql::{SqlStorageOptions, TablePrefix};
use tokio::task::JoinHandle;
use tokio_postgres::NoTls;

use super::{PASSWORD, ScratchDir, assert_refused, make_pki, openssl, with_params};

const URL_VARIABLE: &str = "CLUSTER_TEST_POSTGRES_URL";

/// The tables of a prefix, histories included.
const TABLES: [&str; 7] =
    ["messages", "replies", "migrations", "runners", "locks", "runner_migrations", "entity_state"];

/// The test's server: its URL (with a password it never checks), a plain connection for the
/// test's own statements, and the file of its certificate.
struct Server {
    url: String,
    admin: tokio_postgres::Client,
    connection: JoinHandle<()>,
    certificate: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

/// The server, or `None` (after a note) without `CLUSTER_TEST_POSTGRES_URL`. A server without
/// TLS fails the test: these tests are about its TLS.
async fn server() -> Option<Server> {
    let url = crate::database_url(URL_VARIABLE)?;
    let (admin, connection) = tokio_postgres::connect(&url, NoTls).await.expect("connect");
    let connection = tokio::spawn(async move {
        let _ended = connection.await;
    });
    let setting = |name: &'static str| {
        let admin = &admin;
        async move {
            let row = admin.query_one(&format!("SHOW {name}"), &[]).await.expect(name);
            row.get::<_, String>(0)
        }
    };
    assert_eq!(
        setting("ssl").await,
        "on",
        "the PostgreSQL of {URL_VARIABLE} has ssl off: these tests need its TLS (ssl = on and a \
         certificate in postgresql.conf)"
    );
    let certificate =
        PathBuf::from(setting("data_directory").await).join(setting("ssl_cert_file").await);
    Some(Server { url: with_password(&url), admin, connection, certificate })
}

impl Server {
    async fn drop_tables(&self, prefix: &TablePrefix) {
        let tables: Vec<String> =
            TABLES.iter().map(|table| format!("\"{}\"", prefix.table(table))).collect();
        let sql = format!("DROP TABLE IF EXISTS {}", tables.join(", "));
        self.admin.batch_execute(&sql).await.expect("drop the tables");
    }
}

fn options(prefix: &TablePrefix) -> SqlStorageOptions {
    SqlStorageOptions::from_config(&ShardingConfig::default(), prefix.clone())
}

/// Whether the session of a connection of `storage`'s pool runs over TLS.
async fn pooled_session_is_encrypted(storage: &PgMessageStorage) -> bool {
    let client = storage.pool().get().await.expect("a pooled connection");
    let sql = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    client.query_one(sql, &[]).await.expect("pg_stat_ssl").get(0)
}

/// `sslmode=require`: the pool's connections and the lock session are encrypted.
#[tokio::test]
async fn sslmode_require_encrypts_the_pool_and_the_lock_session() {
    let Some(server) = server().await else { return };
    let prefix = crate::unique_prefix();
    let application = format!("tls_{prefix}");
    let url = with_params(&server.url, &format!("sslmode=require&application_name={application}"));
    let messages = PgMessageStorage::connect(&url, &options(&prefix)).await.expect("connect");
    let runners = PgRunnerStorage::connect(&url, &options(&prefix)).await.expect("connect");
    let address = RunnerAddress::new("tls", 1);
    let shard = ShardId::new(ShardGroup::from("default"), 1);
    // The lock session opens with the first lock.
    let acquired = runners.acquire(&address, std::slice::from_ref(&shard)).await;
    assert_eq!(acquired.expect("acquire"), vec![shard]);
    assert!(pooled_session_is_encrypted(&messages).await, "a pooled session is plaintext");

    // The lock session keeps the configured name, followed by the runner it serves.
    let sql = "SELECT s.ssl FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
               WHERE a.application_name = $1 OR a.application_name LIKE $1 || ' %'";
    let sessions = server.admin.query(sql, &[&application]).await.expect("pg_stat_ssl");
    // The two pools' connections and the lock session, at least.
    assert!(sessions.len() >= 3, "{} sessions of the storages", sessions.len());
    assert!(sessions.iter().all(|row| row.get::<_, bool>(0)), "a session is plaintext");

    runners.release_all(&address).await.expect("release");
    server.drop_tables(&prefix).await;
}

/// Without `sslmode`, TLS is used when the server offers it (libpq's `prefer`);
/// `sslmode=disable` stays plaintext.
#[tokio::test]
async fn the_default_prefers_tls_and_disable_stays_plaintext() {
    let Some(server) = server().await else { return };
    let prefix = crate::unique_prefix();
    let storage = PgMessageStorage::connect(&server.url, &options(&prefix)).await.expect("connect");
    assert!(pooled_session_is_encrypted(&storage).await, "the default did not use TLS");

    let plain = with_params(&server.url, "sslmode=disable");
    let storage = PgMessageStorage::connect(&plain, &options(&prefix)).await.expect("connect");
    assert!(!pooled_session_is_encrypted(&storage).await, "sslmode=disable used TLS");
    server.drop_tables(&prefix).await;
}

/// The verifying modes refuse a certificate that no trusted CA signed: without `sslrootcert`
/// (the public CAs do not know the server's), and with a CA of another server; so does
/// `require` with `sslrootcert`, as in libpq.
#[tokio::test]
async fn the_verifying_modes_refuse_a_certificate_no_trusted_ca_signed() {
    let Some(server) = server().await else { return };
    let options = options(&crate::unique_prefix());
    let untrusted = ["not signed by a trusted CA", "sslrootcert="];
    for mode in ["verify-full", "verify-ca"] {
        let url = with_params(&server.url, &format!("sslmode={mode}"));
        assert_refused(PgMessageStorage::connect(&url, &options).await, &untrusted);
    }
    let pki = ScratchDir::new("pg-tls");
    make_pki(&pki.path, "DNS:localhost");
    let other_ca = pki.join("other-ca.pem");
    for mode in ["verify-ca", "require"] {
        let params = format!("sslmode={mode}&sslrootcert={}", other_ca.display());
        let url = with_params(&server.url, &params);
        assert_refused(PgRunnerStorage::connect(&url, &options).await, &untrusted);
    }
}

/// With the server's own certificate as its CA, `verify-ca` connects; `verify-full` connects
/// by a name the certificate holds (`hostaddr` for the address) and refuses another one.
#[tokio::test]
async fn the_servers_certificate_as_sslrootcert_passes_verify_ca_and_verify_full() {
    let Some(server) = server().await else { return };
    let prefix = crate::unique_prefix();
    let options = options(&prefix);
    let root = format!("sslrootcert={}", server.certificate.display());
    let url = with_params(&server.url, &format!("sslmode=verify-ca&{root}"));
    let storage = PgMessageStorage::connect(&url, &options).await.expect("verify-ca");
    assert!(pooled_session_is_encrypted(&storage).await);

    let config: tokio_postgres::Config = server.url.parse().expect("the test URL");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Tcp(host)) => host.clone(),
        other => panic!("{URL_VARIABLE} names no TCP host: {other:?}"),
    };
    let names = subject_alt_names(&server.certificate);
    if !names.contains(&host) {
        let url = with_params(&server.url, &format!("sslmode=verify-full&{root}"));
        let refused = PgMessageStorage::connect(&url, &options).await;
        assert_refused(refused, &["not valid for the host name", "sslmode=verify-ca"]);
    }
    let dns_name = names.iter().find(|name| name.parse::<std::net::IpAddr>().is_err());
    let Some(dns_name) = dns_name else {
        panic!("the server's certificate {} names no host", server.certificate.display())
    };
    // A key=value connection string: the name is checked, the address is connected to.
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let user = config.get_user().expect("a user");
    let database = config.get_dbname().unwrap_or(user);
    let text = format!(
        "host={dns_name} hostaddr={host} port={port} user={user} password={} dbname={database} \
         sslmode=verify-full sslrootcert='{}'",
        PASSWORD,
        server.certificate.display()
    );
    let storage = PgMessageStorage::connect(&text, &options).await.expect("verify-full");
    assert!(pooled_session_is_encrypted(&storage).await);
    server.drop_tables(&prefix).await;
}

/// The DNS names and IP addresses of the certificate in `file`.
fn subject_alt_names(file: &std::path::Path) -> Vec<String> {
    let file = file.to_str().expect("a UTF-8 path");
    let text = openssl(
        std::path::Path::new("."),
        &["x509", "-in", file, "-noout", "-ext", "subjectAltName"],
    );
    text.split([',', '\n'])
        .filter_map(|part| {
            let part = part.trim();
            part.strip_prefix("DNS:").or_else(|| part.strip_prefix("IP Address:"))
        })
        .map(str::to_owned)
        .collect()
}

/// `url` with the password [`PASSWORD`] (`scheme://user@…` becomes `scheme://user:…@…`).
pub(crate) fn with_password(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let (user, host) = rest.split_once('@').expect("a URL with a user");
    let user = user.split(':').next().unwrap_or(user);
    format!("{scheme}://{user}:{PASSWORD}@{host}")
}
