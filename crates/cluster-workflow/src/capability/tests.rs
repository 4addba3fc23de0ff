//! Signed tokens and execution handles: made and checked with one key, refused otherwise.

use super::{TokenKey, TokenKeyError};
use crate::id::{ExecutionId, Token};

fn key(byte: u8) -> TokenKey {
    TokenKey::new(&[byte; 32]).unwrap()
}

fn token() -> Token {
    Token {
        workflow: "Approval".into(),
        execution_id: ExecutionId::derive("Approval", "order-1"),
        deferred: "Manager".into(),
    }
}

#[test]
fn a_signed_token_reads_back_with_its_key_only() {
    let signed = key(1).sign(&token());
    assert!(signed.starts_with(&token().encode()), "the plain token stays readable");
    assert_eq!(key(1).verify(&signed), Ok(token()));
    // Another key, a plain token, a forged tag, another deferred under the same tag.
    assert!(key(2).verify(&signed).is_err());
    assert!(key(1).verify(&token().encode()).is_err());
    let (text, tag) = signed.rsplit_once('.').unwrap();
    let mut forged_tag = tag.to_owned();
    forged_tag.replace_range(0..1, if tag.starts_with('A') { "B" } else { "A" });
    assert!(key(1).verify(&format!("{text}.{forged_tag}")).is_err());
    let other = Token { deferred: "Workflow/InterruptSignal".into(), ..token() };
    assert!(key(1).verify(&format!("{}.{tag}", other.encode())).is_err());
    for bad in ["", ".", "x.y", "a.AAAAAAAAAAAAAAAAAAAAAA"] {
        assert!(key(1).verify(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn an_execution_handle_is_not_a_token_and_names_its_execution() {
    let id = ExecutionId::derive("Approval", "order-1");
    let handle = key(1).sign_execution("Approval", &id);
    assert_eq!(key(1).verify_execution(&handle), Ok(("Approval".to_owned(), id)));
    assert!(key(2).verify_execution(&handle).is_err());
    assert!(key(1).verify(&handle).is_err(), "a handle is not a deferred token");
    assert!(key(1).verify_execution(&key(1).sign(&token())).is_err(), "nor the other way");
}

#[test]
fn short_or_malformed_key_material_is_refused_with_the_way_out() {
    assert_eq!(TokenKey::new(&[7; 15]).unwrap_err(), TokenKeyError::TooShort(15));
    let short = TokenKey::from_hex("00112233445566778899aabbccddee").unwrap_err();
    assert!(short.to_string().contains("openssl rand -hex 32"), "{short}");
    assert_eq!(TokenKey::from_hex("zz").unwrap_err(), TokenKeyError::NotHex);
    assert_eq!(TokenKey::from_hex("abc").unwrap_err(), TokenKeyError::NotHex);
    let hex = "00112233445566778899aabbccddeeff";
    let from_hex = TokenKey::from_hex(&format!(" {hex}\n")).unwrap();
    let raw = TokenKey::new(&[
        0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee,
        0xff,
    ])
    .unwrap();
    assert_eq!(raw.verify(&from_hex.sign(&token())), Ok(token()));
    assert_eq!(format!("{from_hex:?}"), "TokenKey(..)", "the key never shows");
}
