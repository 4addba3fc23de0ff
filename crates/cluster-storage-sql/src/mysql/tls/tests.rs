//! Tests of reading `ssl-mode` and `ssl-ca`, as the `mysql` client reads them.

use super::*;

/// The options of `url`: `(TLS, certificate checked, name checked)` of the one to connect with
/// (for `PREFERRED`, the TLS one), or the error's text.
fn tls_of(url: &str) -> Result<(bool, bool, bool), String> {
    let opts = match parse(url).map_err(|error| error.to_string())? {
        Parsed::Ready(opts) => opts,
        Parsed::Preferred { tls, plain } => {
            assert!(plain.ssl_opts().is_none(), "the fallback of PREFERRED uses no TLS");
            *tls
        }
    };
    let Some(ssl) = opts.ssl_opts() else { return Ok((false, false, false)) };
    assert!(!opts.prefer_socket(), "a TLS connection must not move to the Unix socket");
    Ok((true, !ssl.accept_invalid_certs(), !ssl.skip_domain_validation()))
}

#[test]
fn the_modes_are_the_mysql_clients() {
    let base = "mysql://u:Secret@h:3306/db";
    let cases = [
        ("", (true, false, true)),
        ("?ssl-mode=DISABLED", (false, false, false)),
        ("?ssl-mode=preferred", (true, false, true)),
        ("?ssl-mode=REQUIRED", (true, false, true)),
        ("?ssl-mode=VERIFY_CA", (true, true, false)),
        ("?ssl-mode=VERIFY_IDENTITY", (true, true, true)),
        // mysql_async's own parameters still work alone.
        ("?require_ssl=true&verify_ca=false", (true, false, true)),
        ("?require_ssl=false", (false, false, false)),
    ];
    for (query, expected) in cases {
        let url = format!("{base}{query}");
        let tls_needed =
            query.contains("REQUIRED") || query.contains("VERIFY") || query.contains("=true");
        if cfg!(feature = "tls") {
            assert_eq!(tls_of(&url), Ok(expected), "{query}");
        } else if tls_needed {
            let refused = tls_of(&url).unwrap_err();
            assert!(refused.contains("built without it"), "{query}: {refused}");
        } else {
            assert_eq!(tls_of(&url), Ok((false, false, false)), "{query}");
        }
    }
}

#[test]
fn wrong_values_are_refused_without_the_password() {
    let cases = [
        ("?ssl-mode=STRICT", "ssl-mode is none of"),
        ("?ssl-mode=REQUIRED&require_ssl=true", "not both"),
        ("?ssl-ca=/ca.pem&verify_identity=false", "not both"),
        ("?ssl-mode=VERIFY_IDENTITY&ssl-ca=/nonexistent/ca.pem", "cannot read the CA file"),
        ("?sslca=/ca.pem", "sslca"),
    ];
    for (query, expected) in cases {
        let url = format!("mysql://u:Secret@h/db{query}");
        let shown = tls_of(&url).unwrap_err();
        let built_without = !cfg!(feature = "tls") && shown.contains("built without it");
        assert!(shown.contains(expected) || built_without, "{query}: {shown}");
        assert!(!shown.contains("Secret"), "{query}: {shown}");
    }
}

#[test]
fn the_driver_url_is_the_url_without_ssl_mode_and_ssl_ca() {
    let url = "mysql://u:Secret@h/db?ssl-mode=REQUIRED&pool_max=3&ssl-ca=%2Fca.pem";
    assert_eq!(driver_url(url).unwrap(), "mysql://u:Secret@h/db?pool_max=3");
}
