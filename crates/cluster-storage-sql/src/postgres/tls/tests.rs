//! Tests of reading `sslmode` and `sslrootcert`, as libpq reads them.

use super::*;

/// The TLS of `url`, or the error's text.
fn tls_of(url: &str) -> Result<TlsOptions, String> {
    parse(url).map(|(_, tls)| tls).map_err(|error| error.to_string())
}

fn options(mode: TlsMode, roots: TlsRoots) -> Result<TlsOptions, String> {
    Ok(TlsOptions { mode, roots })
}

#[test]
fn the_modes_are_libpqs() {
    let base = "postgres://u:Secret@h:5432/db";
    let file = TlsRoots::File("/ca.pem".into());
    let cases = [
        ("", TlsMode::Prefer, TlsRoots::BuiltIn),
        ("?sslmode=disable", TlsMode::Disable, TlsRoots::BuiltIn),
        ("?sslmode=allow", TlsMode::Prefer, TlsRoots::BuiltIn),
        ("?sslmode=prefer&sslrootcert=/ca.pem", TlsMode::Prefer, file.clone()),
        ("?sslmode=require", TlsMode::Require, TlsRoots::BuiltIn),
        // libpq: `require` with a CA file checks the chain, as `verify-ca`.
        ("?sslmode=require&sslrootcert=/ca.pem", TlsMode::VerifyCa, file.clone()),
        ("?sslmode=verify-ca&sslrootcert=/ca.pem", TlsMode::VerifyCa, file),
        ("?sslmode=verify-full", TlsMode::VerifyFull, TlsRoots::BuiltIn),
        ("?sslrootcert=system", TlsMode::VerifyFull, TlsRoots::BuiltIn),
        ("?sslmode=disable&sslmode=verify-full", TlsMode::VerifyFull, TlsRoots::BuiltIn),
    ];
    for (query, mode, roots) in cases {
        let url = format!("{base}{query}");
        if mode.requires_tls() && !cfg!(feature = "tls") {
            let refused = tls_of(&url).unwrap_err();
            assert!(refused.contains("built without it"), "{query}: {refused}");
        } else {
            assert_eq!(tls_of(&url), options(mode, roots), "{query}");
        }
    }
}

#[test]
fn the_rest_of_the_url_goes_to_the_driver() {
    let url = "postgresql://u:p%3Fss@h1:5433/db?application_name=app&sslmode=disable";
    let (config, _) = parse(url).unwrap();
    assert_eq!(config.get_application_name(), Some("app"));
    assert_eq!(config.get_password(), Some(&b"p?ss"[..]));
    assert_eq!(config.get_ports(), [5433]);
    let text = "host=h user=u password='it''s' sslmode=disable dbname='my db'";
    assert!(parse(text).is_err(), "a doubled quote ends the value, as the driver reads it");
    let text = r"host=h user=u password='it\'s a\\b' sslmode=disable dbname='my db'";
    let (config, tls) = parse(text).unwrap();
    assert_eq!(tls.mode, TlsMode::Disable);
    assert_eq!(config.get_password(), Some(&br"it's a\b"[..]));
    assert_eq!(config.get_dbname(), Some("my db"));
}

#[test]
fn wrong_values_are_refused_without_the_password() {
    let cases = [
        ("?sslmode=strict", "sslmode is none of"),
        ("?sslmode=require&sslrootcert=system", "sslrootcert=system needs sslmode=verify-full"),
        ("?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem", "cannot read the CA file"),
        ("?sslcert=/client.pem", "unknown option `sslcert`"),
    ];
    for (query, expected) in cases {
        let url = format!("postgres://u:Secret@h/db{query}");
        let refused = parse(&url).and_then(|(driver, tls)| PgConfig::new(driver, tls).map(drop));
        let shown = refused.map_err(|error| error.to_string()).unwrap_err();
        let built_without = !cfg!(feature = "tls") && shown.contains("built without it");
        assert!(shown.contains(expected) || built_without, "{query}: {shown}");
        assert!(!shown.contains("Secret"), "{query}: {shown}");
    }
    let shown = parse("host=h password='Secret").unwrap_err().to_string();
    assert!(shown.contains("cannot be read") && !shown.contains("Secret"), "{shown}");
}

use super::super::PgConfig;
