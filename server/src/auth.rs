//! Bearer tokens and their roles (`--auth-token-file`).
//!
//! A *reader* may plan, read, describe and ask for stats and job status; a
//! *writer* may also put, seal, drop, place, evict and train. Clients send
//! `authorization: Bearer <token>` on every call (what pyarrow sends with
//! `FlightCallOptions(headers=…)`); members send a writer token of the same
//! file on their calls to each other. Tokens are compared in constant time
//! and never logged or echoed.

use flightdeck_protos::actions;
use subtle::ConstantTimeEq;

use crate::error::{Error, Result};

/// What a caller may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    /// Plans, reads, describes, stats and job status.
    Reader,
    /// Everything a reader may do, and every call that changes the server.
    Writer,
}

impl Role {
    fn name(self) -> &'static str {
        match self {
            Role::Reader => "reader",
            Role::Writer => "writer",
        }
    }
}

/// The tokens a server accepts, each with its role.
#[derive(Clone)]
pub struct Tokens {
    tokens: Vec<(Vec<u8>, Role)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} tokens)", self.tokens.len())
    }
}

/// gRPC paths of the Flight calls that change the server.
const DO_PUT: &str = "/arrow.flight.protocol.FlightService/DoPut";
const DO_EXCHANGE: &str = "/arrow.flight.protocol.FlightService/DoExchange";

impl Tokens {
    /// Tokens from the text of a token file: one `reader TOKEN` or
    /// `writer TOKEN` per line; blank lines and lines starting with `#` are
    /// skipped. At least one token is needed.
    pub fn parse(text: &str) -> Result<Self> {
        let mut tokens = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let role = match parts.next() {
                Some("reader") => Role::Reader,
                Some("writer") => Role::Writer,
                _ => {
                    return Err(Error::invalid(format!(
                        "line {} of the token file does not start with 'reader' or 'writer'",
                        i + 1
                    )));
                }
            };
            let (Some(token), None) = (parts.next(), parts.next()) else {
                return Err(Error::invalid(format!(
                    "line {} of the token file must be '{} TOKEN', one token without spaces",
                    i + 1,
                    role.name()
                )));
            };
            tokens.push((token.as_bytes().to_vec(), role));
        }
        if tokens.is_empty() {
            return Err(Error::invalid(
                "the token file holds no tokens; add lines 'writer TOKEN' and 'reader TOKEN'",
            ));
        }
        Ok(Self { tokens })
    }

    /// The token this server sends to other members: the file's first
    /// writer token, else its first token. Members share the file.
    pub fn peer_token(&self) -> String {
        let (token, _) = self
            .tokens
            .iter()
            .find(|(_, r)| *r == Role::Writer)
            .unwrap_or(&self.tokens[0]);
        String::from_utf8_lossy(token).into_owned()
    }

    /// The role of the caller whose `authorization` header is `header`.
    /// Every token is compared, each in constant time.
    pub fn role_of(&self, header: Option<&[u8]>) -> Result<Role> {
        let Some(header) = header else {
            return Err(Error::Unauthenticated(
                "this server needs a token: send 'authorization: Bearer TOKEN' (FLIGHTDECK_TOKEN \
                 for flightdeck's clients)"
                    .into(),
            ));
        };
        let given = header
            .strip_prefix(b"Bearer ")
            .or_else(|| header.strip_prefix(b"bearer "))
            .ok_or_else(|| {
                Error::Unauthenticated("the authorization header must be 'Bearer TOKEN'".into())
            })?;
        let mut found = None;
        for (token, role) in &self.tokens {
            if bool::from(token.as_slice().ct_eq(given)) {
                found = found.max(Some(*role));
            }
        }
        found.ok_or_else(|| {
            Error::Unauthenticated("the token is not one this server accepts".into())
        })
    }
}

/// The role a call needs: `path` is its gRPC path, `action` the type of a
/// `DoAction`.
pub fn needed(path: &str, action: Option<&str>) -> Role {
    if path == DO_PUT || path == DO_EXCHANGE {
        return Role::Writer;
    }
    match action {
        Some(actions::DESCRIBE | actions::STATS | actions::JOB | actions::MEMBER_SELECT) | None => {
            Role::Reader
        }
        Some(_) => Role::Writer,
    }
}

/// Checks that `role` may make the call `what` needing `need`.
pub fn check(role: Role, need: Role, what: &str) -> Result<()> {
    if role >= need {
        return Ok(());
    }
    Err(Error::PermissionDenied(format!(
        "a {} token may not call {what}; it needs a {} token",
        role.name(),
        need.name()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "# tokens\nreader r-123\n\nwriter w-456\nreader w-456\n";

    #[test]
    fn tokens_give_their_roles() {
        let t = Tokens::parse(FILE).expect("file");
        assert_eq!(
            t.role_of(Some(b"Bearer r-123")).expect("reader"),
            Role::Reader
        );
        // A token listed twice has its higher role.
        assert_eq!(
            t.role_of(Some(b"Bearer w-456")).expect("writer"),
            Role::Writer
        );
        for bad in [
            &b"Bearer r-12"[..],
            b"Bearer r-1234",
            b"Bearer ",
            b"r-123",
            b"Basic r-123",
        ] {
            let err = t.role_of(Some(bad)).expect_err("refused");
            assert!(matches!(err, Error::Unauthenticated(_)), "{err}");
            assert!(!err.to_string().contains("r-123"), "never echoed: {err}");
        }
        assert!(matches!(t.role_of(None), Err(Error::Unauthenticated(_))));
        assert_eq!(t.peer_token(), "w-456");
        assert!(format!("{t:?}").contains("3 tokens") && !format!("{t:?}").contains("456"));
    }

    #[test]
    fn bad_files_are_refused_without_their_tokens() {
        for (text, needle) in [
            ("", "no tokens"),
            ("admin a-1", "line 1"),
            ("# c\nwriter", "line 2"),
            ("reader a b", "one token"),
        ] {
            let err = Tokens::parse(text).expect_err(text);
            assert!(err.to_string().contains(needle), "{err}");
            assert!(!err.to_string().contains("a-1"), "{err}");
        }
    }

    #[test]
    fn calls_need_their_roles() {
        assert_eq!(needed(DO_PUT, None), Role::Writer);
        assert_eq!(
            needed("/arrow.flight.protocol.FlightService/DoGet", None),
            Role::Reader
        );
        for a in [actions::DESCRIBE, actions::STATS, actions::JOB] {
            assert_eq!(needed("", Some(a)), Role::Reader, "{a}");
        }
        for a in [
            actions::SEAL,
            actions::DROP,
            actions::PLACE,
            actions::EVICT,
            actions::TRAIN,
            actions::MEMBER_PREPARE,
            actions::MEMBER_COMMIT,
            "made-up",
        ] {
            assert_eq!(needed("", Some(a)), Role::Writer, "{a}");
        }
        assert!(check(Role::Writer, Role::Reader, "x").is_ok());
        let err = check(Role::Reader, Role::Writer, "action 'seal'").expect_err("denied");
        assert!(matches!(err, Error::PermissionDenied(_)), "{err}");
        assert!(
            err.to_string()
                .contains("a reader token may not call action 'seal'")
        );
    }
}
