//! TLS to the database, against real servers: the local PostgreSQL's own TLS (its certificate
//! read from `ssl_cert_file`), and a throwaway MariaDB that the test starts with a certificate
//! of a CA it makes. Certificates are made with the `openssl` command line.
//!
//! URLs carry a password the server never checks (`Hunter2Secret`), so that every error can be
//! shown not to contain it.

#[cfg(feature = "mysql")]
mod mariadb;
#[cfg(feature = "postgres")]
mod postgres;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use cluster_core::error::StorageError;

/// The password in the tests' URLs, which no error may show.
pub(crate) const PASSWORD: &str = "Hunter2Secret";

/// A scratch directory, removed on drop (also when the test panicked).
pub(crate) struct ScratchDir {
    pub(crate) path: PathBuf,
}

impl ScratchDir {
    pub(crate) fn new(label: &str) -> ScratchDir {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "cluster-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let path = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&path).expect("a scratch directory");
        ScratchDir { path }
    }

    pub(crate) fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Runs the `openssl` command line in `dir`.
pub(crate) fn openssl(dir: &Path, args: &[&str]) -> String {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("the openssl command line (Debian's openssl package)");
    assert!(
        output.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Two CAs in `dir` (`ca.pem`, `other-ca.pem`, with their keys), and a server certificate of
/// `ca` for the names `san` (such as `DNS:localhost`): `server.pem`, `server.key`.
pub(crate) fn make_pki(dir: &Path, san: &str) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
    for ca in ["ca", "other-ca"] {
        let (key, cert, subject) = (format!("{ca}.key"), format!("{ca}.pem"), format!("/CN={ca}"));
        let mut args = vec!["req", "-x509", "-days", "2"];
        args.extend(ec);
        args.extend(["-keyout", &key, "-out", &cert, "-subj", &subject]);
        args.extend(["-addext", "basicConstraints=critical,CA:TRUE"]);
        args.extend(["-addext", "keyUsage=critical,keyCertSign,cRLSign"]);
        openssl(dir, &args);
    }
    let mut args = vec!["req", "-new"];
    args.extend(ec);
    args.extend(["-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost"]);
    openssl(dir, &args);
    let extensions =
        format!("basicConstraints=CA:FALSE\nsubjectAltName={san}\nextendedKeyUsage=serverAuth\n");
    std::fs::write(dir.join("server.ext"), extensions).expect("the extensions file");
    let mut args = vec!["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key"];
    args.extend(["-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "server.pem"]);
    openssl(dir, &args);
}

/// `url` with the query parameters `params` (`a=1&b=2`) added.
pub(crate) fn with_params(url: &str, params: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{params}")
}

/// The error of a connection that should have failed, checked to name each of `expected`
/// and not to show the password, in its text or its `Debug`.
pub(crate) fn assert_refused<T>(result: Result<T, StorageError>, expected: &[&str]) {
    let Err(error) = result else {
        panic!("connected, but it should have failed with {expected:?}")
    };
    let shown = error.to_string();
    for part in expected {
        assert!(shown.contains(part), "the error names {part:?}: {shown}");
    }
    let debug = format!("{error:?}");
    assert!(!shown.contains(PASSWORD), "the error shows the password: {shown}");
    assert!(!debug.contains(PASSWORD), "the error's Debug shows the password: {debug}");
}
