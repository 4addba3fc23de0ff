//! Secret tokens: read from a variable or a file, kept as SHA-256 digests only, and compared in
//! constant time. The gateway's bearer tokens and the admin's tokens share these rules.

use std::path::Path;

use cluster_core::ConfigError;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// The fewest characters of a token: 32, the hexadecimal form of 128 random bits
/// (`openssl rand -hex 16`).
pub(crate) const TOKEN_CHARS_MIN: usize = 32;

/// The most characters of a token, and of the tokens one file may hold.
const TOKEN_CHARS_MAX: usize = 4096;
const TOKENS_MAX: usize = 16;

/// One or more tokens (several during a rotation), as digests. Its `Debug` output shows how
/// many it holds, never one of them.
#[derive(Clone)]
pub(crate) struct Tokens {
    /// `SHA-256(token)` of each token.
    digests: Vec<[u8; 32]>,
    /// `SHA-256(SHA-256(token))` of each token: what a session cookie (which holds
    /// `SHA-256(token)`, never the token) is checked against.
    #[cfg(feature = "console")]
    cookie_digests: Vec<[u8; 32]>,
}

impl Tokens {
    /// The tokens `tokens`, set by `variable` (named in errors, which never show a token).
    ///
    /// # Errors
    ///
    /// No token, more than 16, one shorter than [`TOKEN_CHARS_MIN`] or longer than 4096
    /// characters, or one with a character other than visible ASCII.
    pub(crate) fn any_of<'a>(
        tokens: impl IntoIterator<Item = &'a str>,
        variable: &str,
    ) -> Result<Tokens, ConfigError> {
        let refused = |reason: &str| ConfigError::new(variable, "<redacted>", reason);
        let mut digests = Vec::new();
        for token in tokens {
            let chars = token.chars().count();
            if chars < TOKEN_CHARS_MIN {
                return Err(refused(
                    "a token needs at least 32 characters, such as the output of `openssl rand -hex 16`",
                ));
            }
            if chars > TOKEN_CHARS_MAX {
                return Err(refused("a token has at most 4096 characters"));
            }
            if !token.bytes().all(|byte| byte.is_ascii_graphic()) {
                return Err(refused(
                    "a token is visible ASCII only (no space, no control character)",
                ));
            }
            digests.push(Sha256::digest(token.as_bytes()).into());
        }
        if digests.is_empty() {
            return Err(refused("holds no token"));
        }
        if digests.len() > TOKENS_MAX {
            return Err(refused("holds more than 16 tokens"));
        }
        Ok(Tokens {
            #[cfg(feature = "console")]
            cookie_digests: digests.iter().map(|digest| Sha256::digest(digest).into()).collect(),
            digests,
        })
    }

    /// The tokens of a file, set by `variable`: one per line; blank lines and lines that start
    /// with `#` are skipped.
    ///
    /// # Errors
    ///
    /// The file cannot be read, or its tokens are refused as by [`Tokens::any_of`].
    pub(crate) fn from_file(path: &Path, variable: &str) -> Result<Tokens, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| {
            ConfigError::new(variable, &shown, format!("cannot be read: {error}"))
        })?;
        let tokens =
            text.lines().map(str::trim).filter(|line| !line.is_empty() && !line.starts_with('#'));
        Tokens::any_of(tokens, variable)
            .map_err(|error| ConfigError::new(variable, &shown, error.reason()))
    }

    /// The tokens of `variable` or of the file `<variable>_FILE`, as `lookup` reads them;
    /// `None` when neither is set.
    ///
    /// # Errors
    ///
    /// Both are set, or the tokens are refused.
    pub(crate) fn from_lookup(
        lookup: &impl Fn(&str) -> Option<String>,
        variable: &str,
    ) -> Result<Option<Tokens>, ConfigError> {
        let file_variable = format!("{variable}_FILE");
        let token = lookup(variable).filter(|token| !token.is_empty());
        let file = lookup(&file_variable).filter(|file| !file.is_empty());
        match (token, file) {
            (Some(_), Some(file)) => Err(ConfigError::new(
                &file_variable,
                file,
                format!("is set together with {variable}: set one of them"),
            )),
            (Some(token), None) => Tokens::any_of([token.as_str()], variable).map(Some),
            (None, Some(file)) => Tokens::from_file(Path::new(&file), &file_variable).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// Whether `given` is one of the tokens, in time that depends on neither.
    pub(crate) fn accepts(&self, given: &[u8]) -> bool {
        let digest: [u8; 32] = Sha256::digest(given).into();
        any_equal(&self.digests, &digest)
    }

    #[cfg(feature = "console")]
    /// The value of a session cookie for `token`, if it is one of the tokens: the hexadecimal
    /// `SHA-256(token)`, so that a cookie that leaks does not show the token (which also opens
    /// the API).
    pub(crate) fn cookie_value(&self, token: &[u8]) -> Option<String> {
        if !self.accepts(token) {
            return None;
        }
        let digest: [u8; 32] = Sha256::digest(token).into();
        Some(digest.iter().map(|byte| format!("{byte:02x}")).collect())
    }

    #[cfg(feature = "console")]
    /// Whether `value` is a session cookie of one of the tokens ([`Tokens::cookie_value`]),
    /// in time that depends on neither.
    pub(crate) fn accepts_cookie(&self, value: &[u8]) -> bool {
        let Some(digest) = hex_32(value) else { return false };
        let checked: [u8; 32] = Sha256::digest(digest).into();
        any_equal(&self.cookie_digests, &checked)
    }
}

/// Whether `digest` is one of `expected`, comparing each in constant time.
fn any_equal(expected: &[[u8; 32]], digest: &[u8; 32]) -> bool {
    let found = expected
        .iter()
        .fold(subtle::Choice::from(0), |found, expected| found | expected.ct_eq(digest));
    found.into()
}

#[cfg(feature = "console")]
/// 32 bytes from 64 hexadecimal digits.
fn hex_32(text: &[u8]) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut bytes = [0_u8; 32];
    for (byte, pair) in bytes.iter_mut().zip(text.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(bytes)
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").field("tokens", &self.digests.len()).finish()
    }
}

/// The token of an `Authorization: Bearer <token>` value (the scheme in any case).
pub(crate) fn bearer_credentials(value: &[u8]) -> Option<&[u8]> {
    let scheme = value.get(..7)?;
    scheme.eq_ignore_ascii_case(b"bearer ").then(|| value[7..].trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn tokens_are_checked_and_never_shown() {
        let tokens = Tokens::any_of([TOKEN], "X_TOKEN").unwrap();
        assert!(tokens.accepts(TOKEN.as_bytes()));
        assert!(!tokens.accepts(b"0123456789abcdef0123456789abcdeX"));
        assert!(!tokens.accepts(b""));
        assert!(!format!("{tokens:?}").contains("0123"), "{tokens:?}");
        assert_eq!(bearer_credentials(b"Bearer abc"), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"bearer  abc "), Some(&b"abc"[..]));
        assert_eq!(bearer_credentials(b"Basic abc"), None);
        for short in ["", "short", &TOKEN[1..]] {
            let error = Tokens::any_of([short], "X_TOKEN").unwrap_err();
            assert_eq!(error.key(), "X_TOKEN");
            assert!(!error.to_string().contains("short"), "{error}");
        }
        let spaced = format!("{TOKEN} x");
        assert!(Tokens::any_of([spaced.as_str()], "X_TOKEN").is_err());
    }

    #[cfg(feature = "console")]
    #[test]
    fn a_cookie_holds_a_digest_and_opens_only_what_it_was_made_for() {
        let tokens = Tokens::any_of([TOKEN], "X_TOKEN").unwrap();
        let cookie = tokens.cookie_value(TOKEN.as_bytes()).unwrap();
        assert!(!cookie.contains(TOKEN), "the cookie never holds the token");
        assert!(tokens.accepts_cookie(cookie.as_bytes()));
        assert!(!tokens.accepts(cookie.as_bytes()), "a cookie is no bearer token");
        assert!(!tokens.accepts_cookie(TOKEN.as_bytes()), "a token is no cookie");
        assert!(tokens.cookie_value(b"0123456789abcdef0123456789abcdeX").is_none());
        let mut forged = cookie.into_bytes();
        forged[0] = if forged[0] == b'0' { b'1' } else { b'0' };
        assert!(!tokens.accepts_cookie(&forged));
        assert!(!tokens.accepts_cookie(b"zz"));
    }

    #[test]
    fn a_variable_and_its_file_exclude_each_other() {
        let both = |name: &str| Some(format!("{name}-value-0123456789abcdef0123456789"));
        let error = Tokens::from_lookup(&both, "X_TOKEN").unwrap_err();
        assert_eq!(error.key(), "X_TOKEN_FILE");
        assert!(Tokens::from_lookup(&|_: &str| None, "X_TOKEN").unwrap().is_none());
        let one = |name: &str| (name == "X_TOKEN").then(|| TOKEN.to_owned());
        assert!(Tokens::from_lookup(&one, "X_TOKEN").unwrap().is_some());
    }
}
