//! Tests of `tls`: taking TLS parameters out of a URL's query.

use super::*;

fn split(url: &str, from: usize) -> (String, Vec<(String, String)>) {
    let split = take_query_params(url, from, &["sslmode", "ssl-ca"], true, "Test").unwrap();
    (split.rest, split.taken)
}

/// A URL, what remains of it, and the parameters taken out.
type Case = (&'static str, &'static str, &'static [(&'static str, &'static str)]);

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(key, value)| ((*key).to_owned(), (*value).to_owned())).collect()
}

#[test]
fn the_named_parameters_are_taken_and_the_rest_kept_as_written() {
    let cases: [Case; 6] = [
        ("m://h/db", "m://h/db", &[]),
        ("m://h/db?sslmode=require", "m://h/db", &[("sslmode", "require")]),
        ("m://h/db?a=%41&sslmode=x&b=2", "m://h/db?a=%41&b=2", &[("sslmode", "x")]),
        ("m://h/db?ssl-ca=%2Ftmp%2Fa+b.pem&&c", "m://h/db?c", &[("ssl-ca", "/tmp/a b.pem")]),
        ("m://h/db?sslmode=a&sslmode=b#f", "m://h/db#f", &[("sslmode", "a"), ("sslmode", "b")]),
        ("m://h/db?ssl%2Dca=x", "m://h/db", &[("ssl-ca", "x")]),
    ];
    for (url, rest, taken) in cases {
        assert_eq!(split(url, 0), (rest.to_owned(), pairs(taken)), "{url}");
    }
}

#[test]
fn the_query_starts_at_the_first_question_mark_after_the_offset() {
    let url = "m://u:pa?ss@h/db?sslmode=require";
    let at = url.find('@').unwrap() + 1;
    assert_eq!(split(url, at), ("m://u:pa?ss@h/db".to_owned(), pairs(&[("sslmode", "require")])));
}

#[test]
fn percent_decoding_keeps_what_is_not_an_escape() {
    assert_eq!(percent_decode("a%20b%zz%4", false).as_deref(), Some("a b%zz%4"));
    assert_eq!(percent_decode("a+b", false).as_deref(), Some("a+b"));
    assert_eq!(percent_decode("a+b", true).as_deref(), Some("a b"));
    assert_eq!(percent_decode("%C3%A9", false).as_deref(), Some("é"));
    assert_eq!(percent_decode("%FF", false), None);
}

#[test]
fn an_invalid_value_is_named_without_the_url() {
    let url = "m://user:Secret@h/db?sslmode=%FF";
    let error = take_query_params(url, 0, &["sslmode"], false, "Test").unwrap_err();
    assert_eq!(error.kind(), StorageErrorKind::InvalidInput);
    let shown = error.to_string();
    assert!(shown.contains("sslmode") && !shown.contains("Secret"), "{shown}");
}

#[test]
fn the_modes_are_ordered_from_the_weakest() {
    assert!(!TlsMode::Prefer.requires_tls() && TlsMode::Require.requires_tls());
    assert!(!TlsMode::Require.verifies_certificate() && TlsMode::VerifyCa.verifies_certificate());
    let refused = check_compiled_in(TlsMode::Require, "sslmode=require", "postgres");
    assert_eq!(refused.is_ok(), cfg!(feature = "tls"));
    assert!(check_compiled_in(TlsMode::Prefer, "sslmode=prefer", "postgres").is_ok());
}
