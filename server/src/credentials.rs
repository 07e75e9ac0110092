//! Credentials read from files — the bearer tokens (`--auth-token-file`),
//! the TLS certificate and key (`--tls-cert`, `--tls-key`) and the roots
//! other members are checked against (`--tls-ca`) — and read again while
//! the server runs, so that tokens and certificates rotate without a
//! restart (which would empty the cache of a server without `--persist`).
//!
//! [`Credentials::refresh`] reads every file again and takes what changed;
//! the server calls it on `SIGHUP` and every [`CHECK_EVERY`]. A file that
//! changed to something the server cannot use (a token file cut short, a
//! key that is not the certificate's) is refused with a warning naming it,
//! and the server goes on with what it had; so is a certificate that has
//! expired (at start too: every client that checks it would refuse it).
//! Calls check the newest tokens; connections opened after a refresh get
//! the newest certificate, and those already open keep the one they were
//! opened with. [`Expiry`] says when the certificate in use expires, for
//! the log's warnings and the metrics.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use tracing::{info, warn};
use x509_cert::der::Decode;

use crate::auth::Tokens;
use crate::config::ServerConfig;
use crate::error::{Error, Result};

/// How often the server reads its credential files again on its own
/// (`SIGHUP` reads them at once).
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// A file a credential is read from, and the flag that named it.
type File = (PathBuf, &'static str);

/// What a credential's files give, read in the order they are named.
type Parse<T> = fn(&[Vec<u8>], &[File]) -> Result<T>;

/// One credential: the files it is read from (each with the flag that
/// named it), the bytes last read, and what they gave.
struct Watched<T> {
    files: Vec<File>,
    read: Mutex<LastRead>,
    current: RwLock<Arc<T>>,
    parse: Parse<T>,
}

/// What reading a credential's files again found.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refresh {
    /// The files hold what they held.
    Unchanged,
    /// They changed, and the server now uses what they hold.
    Taken,
    /// They changed to something the server cannot use (the reason): it
    /// goes on with what it had.
    Refused(String),
}

fn read_file(path: &Path, flag: &str) -> Result<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| Error::invalid(format!("{flag} {} cannot be read: {e}", path.display())))
}

impl<T> Watched<T> {
    /// Reads and parses `files`; an error names the file and the flag.
    fn open(files: Vec<File>, parse: Parse<T>) -> Result<Self> {
        let read = files
            .iter()
            .map(|(path, flag)| read_file(path, flag))
            .collect::<Result<Vec<_>>>()?;
        let current = parse(&read, &files)?;
        Ok(Self {
            files,
            read: Mutex::new(LastRead {
                files: Ok(read),
                refused: false,
            }),
            current: RwLock::new(Arc::new(current)),
            parse,
        })
    }

    fn get(&self) -> Arc<T> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Reads the files again and takes what they hold if it changed and
    /// can be used. What was refused once (bytes that cannot be used, a
    /// file that cannot be read) is not tried, nor warned about, again
    /// until it changes.
    fn refresh(&self) -> Refresh {
        let read = self
            .files
            .iter()
            .map(|(path, flag)| read_file(path, flag))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| e.to_string());
        let mut last = self.read.lock().unwrap_or_else(|p| p.into_inner());
        if last.files == read {
            return Refresh::Unchanged;
        }
        last.files = read.clone();
        match read.and_then(|read| (self.parse)(&read, &self.files).map_err(|e| e.to_string())) {
            Ok(value) => {
                *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(value);
                last.refused = false;
                Refresh::Taken
            }
            Err(why) => {
                last.refused = true;
                Refresh::Refused(why)
            }
        }
    }

    /// Whether the files as last read were refused: the server goes on
    /// with what it read before, until they change to something it can use.
    fn refused(&self) -> bool {
        self.read.lock().unwrap_or_else(|p| p.into_inner()).refused
    }

    /// The files, as a log names them.
    fn named(&self) -> String {
        self.files
            .iter()
            .map(|(path, flag)| format!("{flag} {}", path.display()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

fn parse_tokens(read: &[Vec<u8>], files: &[File]) -> Result<Tokens> {
    let path = files[0].0.display();
    let text = std::str::from_utf8(&read[0]).map_err(|_| {
        Error::invalid(format!(
            "--auth-token-file {path} is not text: write one 'reader TOKEN' or 'writer TOKEN' a \
             line"
        ))
    })?;
    Tokens::parse(text).map_err(|e| Error::invalid(format!("--auth-token-file {path}: {e}")))
}

/// The certificates a PEM file holds; an error when it holds none.
fn certificates(pem: &[u8], path: &Path, flag: &str) -> Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| {
            Error::invalid(format!(
                "{flag} {} is not PEM certificates: {e}",
                path.display()
            ))
        })?;
    if certs.is_empty() {
        return Err(Error::invalid(format!(
            "{flag} {} holds no certificate (a PEM 'BEGIN CERTIFICATE' block)",
            path.display()
        )));
    }
    Ok(certs)
}

/// How long before its certificate expires the server starts warning, once
/// a day.
pub const WARN_BEFORE: Duration = Duration::from_secs(14 * 24 * 3600);

/// What the log says about the validity of the certificate in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ExpiryWarning {
    /// Its `notBefore` is still ahead (a clock behind the issuer's, or a
    /// certificate issued for later): clients that check it refuse new
    /// connections until then.
    NotYetValid,
    /// It expires within [`WARN_BEFORE`], in this many whole days (0: within
    /// a day).
    Soon {
        /// Whole days left.
        days: u64,
    },
    /// It has expired: clients that check it refuse new connections.
    Expired,
}

/// When a certificate chain stops being valid: its earliest `notAfter`;
/// and when it starts to be: its latest `notBefore`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiry {
    /// The moment, as time since the Unix epoch.
    pub at: Duration,
    /// The moment as the certificate states it (`2027-03-01T00:00:00Z`).
    pub text: String,
    /// The moment it starts to be valid, as time since the Unix epoch.
    pub from: Duration,
    /// The subject of the certificate that expires first (`CN=…`; empty
    /// when not read from a certificate).
    pub subject: String,
}

/// `now` as time since the Unix epoch (0 before it).
fn since_epoch(now: SystemTime) -> Duration {
    now.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
}

/// A moment (time since the Unix epoch) as a certificate states it
/// (`2027-03-01T00:00:00Z`).
fn moment_text(at: Duration) -> String {
    x509_cert::der::DateTime::from_unix_duration(at).map_or_else(
        |_| format!("{} (Unix seconds)", at.as_secs()),
        |d| d.to_string(),
    )
}

impl Expiry {
    /// The moment `at` (time since the Unix epoch), with its text; valid
    /// from the epoch on.
    pub fn at(at: Duration) -> Self {
        Self {
            at,
            text: moment_text(at),
            from: Duration::ZERO,
            subject: String::new(),
        }
    }

    /// The start of its validity as the certificate states it.
    pub fn from_text(&self) -> String {
        moment_text(self.from)
    }

    /// The earliest `notAfter` (with its certificate's subject) and latest
    /// `notBefore` of `certs` (at least one: [`certificates`]); an error
    /// names the file whose certificate is not X.509.
    fn of(certs: &[CertificateDer<'_>], path: &Path, flag: &str) -> Result<Self> {
        let (mut earliest, mut latest, mut subject) = (Duration::MAX, Duration::ZERO, None);
        for der in certs {
            let cert = x509_cert::Certificate::from_der(der.as_ref()).map_err(|e| {
                Error::invalid(format!(
                    "{flag} {} holds a certificate that is not X.509: {e}",
                    path.display()
                ))
            })?;
            let validity = cert.tbs_certificate().validity();
            let not_after = validity.not_after.to_unix_duration();
            if not_after < earliest {
                earliest = not_after;
                subject = Some(cert.tbs_certificate().subject().to_string());
            }
            latest = latest.max(validity.not_before.to_unix_duration());
        }
        Ok(Self {
            from: latest,
            subject: subject.unwrap_or_default(),
            ..Self::at(earliest)
        })
    }

    /// How long from `now` until it expires; `None` once it has.
    pub fn left(&self, now: SystemTime) -> Option<Duration> {
        self.at
            .checked_sub(since_epoch(now))
            .filter(|left| !left.is_zero())
    }

    /// What to warn of at `now`: `None` from its `notBefore` on while more
    /// than [`WARN_BEFORE`] is left. The warning changes once a day, so a
    /// log that says each new one warns daily.
    pub fn warning(&self, now: SystemTime) -> Option<ExpiryWarning> {
        if since_epoch(now) < self.from {
            return Some(ExpiryWarning::NotYetValid);
        }
        match self.left(now) {
            None => Some(ExpiryWarning::Expired),
            Some(left) if left <= WARN_BEFORE => Some(ExpiryWarning::Soon {
                days: left.as_secs() / (24 * 3600),
            }),
            Some(_) => None,
        }
    }
}

/// A certificate (with its chain and key) and when it expires.
struct Identity {
    key: Arc<CertifiedKey>,
    expiry: Expiry,
}

fn parse_identity(read: &[Vec<u8>], files: &[File]) -> Result<Identity> {
    let ((cert_path, cert_flag), (key_path, key_flag)) = (&files[0], &files[1]);
    let certs = certificates(&read[0], cert_path, cert_flag)?;
    let expiry = Expiry::of(&certs, cert_path, cert_flag)?;
    if expiry.left(SystemTime::now()).is_none() {
        return Err(Error::invalid(format!(
            "{cert_flag} {} expired at {} (its notAfter): clients refuse it; install a renewed \
             certificate and key",
            cert_path.display(),
            expiry.text
        )));
    }
    let key = PrivateKeyDer::from_pem_slice(&read[1]).map_err(|e| {
        Error::invalid(format!(
            "{key_flag} {} holds no PEM private key: {e}",
            key_path.display()
        ))
    })?;
    let provider = rustls::crypto::aws_lc_rs::default_provider();
    let key = CertifiedKey::from_der(certs, key, &provider).map_err(|e| {
        let why = match e {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                "it is not the private key of the (first) certificate there".to_string()
            }
            e => e.to_string(),
        };
        Error::invalid(format!(
            "{key_flag} {} cannot serve {cert_flag} {}: {why}",
            key_path.display(),
            cert_path.display()
        ))
    })?;
    Ok(Identity {
        key: Arc::new(key),
        expiry,
    })
}

/// The roots other members are checked against, and — when they come from
/// `--tls-ca` (not from the server's own certificate, which is watched as
/// such) — when the first of them expires.
struct Roots {
    pem: Arc<Vec<u8>>,
    expiry: Option<Expiry>,
}

fn parse_roots(read: &[Vec<u8>], files: &[File]) -> Result<Roots> {
    let (path, flag) = &files[0];
    let certs = certificates(&read[0], path, flag)?;
    let expiry = (*flag == "--tls-ca")
        .then(|| Expiry::of(&certs, path, flag))
        .transpose()?;
    Ok(Roots {
        pem: Arc::new(read[0].clone()),
        expiry,
    })
}

/// The server's credentials, as last read from their files.
pub struct Credentials {
    tokens: Option<Watched<Tokens>>,
    identity: Option<Arc<Watched<Identity>>>,
    roots: Option<Watched<Roots>>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("tokens", &self.tokens.is_some())
            .field("tls", &self.identity.is_some())
            .finish()
    }
}

/// What reading a credential's files gave last.
struct LastRead {
    /// Their bytes, or why they could not be read.
    files: std::result::Result<Vec<Vec<u8>>, String>,
    /// Whether the server refused them (it uses what it read before).
    refused: bool,
}

/// What [`Credentials::refresh`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Refreshed {
    /// The tokens callers may send, and the one sent to other members.
    pub tokens: bool,
    /// The certificate new connections get.
    pub identity: bool,
    /// The roots other members are checked against.
    pub roots: bool,
    /// The files that changed to something the server cannot use, each
    /// with the reason; it goes on with what it had.
    pub refused: Vec<String>,
}

impl Credentials {
    /// Reads the files `config` names; an error names the file that cannot
    /// be read or used.
    pub fn open(config: &ServerConfig) -> Result<Self> {
        let tokens = config
            .auth_token_file
            .as_ref()
            .map(|path| Watched::open(vec![(path.clone(), "--auth-token-file")], parse_tokens))
            .transpose()?;
        let identity = match (&config.tls_cert, &config.tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(Watched::open(
                vec![(cert.clone(), "--tls-cert"), (key.clone(), "--tls-key")],
                parse_identity,
            )?)),
            _ => None,
        };
        // Members sharing one certificate trust it unless told otherwise.
        let roots = match (&config.tls_ca, &config.tls_cert) {
            (Some(ca), _) => Some((ca.clone(), "--tls-ca")),
            (None, Some(cert)) => Some((cert.clone(), "--tls-cert")),
            (None, None) => None,
        }
        .map(|file| Watched::open(vec![file], parse_roots))
        .transpose()?;
        Ok(Self {
            tokens,
            identity,
            roots,
        })
    }

    /// No credentials: every caller may do everything, over plain TCP.
    pub fn none() -> Self {
        Self {
            tokens: None,
            identity: None,
            roots: None,
        }
    }

    /// Whether any file is read (and so worth reading again).
    pub fn is_empty(&self) -> bool {
        self.tokens.is_none() && self.identity.is_none() && self.roots.is_none()
    }

    /// The tokens callers must send; `None` = none needed.
    pub fn tokens(&self) -> Option<Arc<Tokens>> {
        self.tokens.as_ref().map(Watched::get)
    }

    /// Whether callers must send a token.
    pub fn needs_tokens(&self) -> bool {
        self.tokens.is_some()
    }

    /// The token this server sends to other members.
    pub fn peer_token(&self) -> Option<String> {
        self.tokens().map(|t| t.peer_token())
    }

    /// How many credentials (tokens, certificate and key, member roots)
    /// the server reads from files it refused when they last changed: it
    /// uses what it read before until they change to something it can use.
    pub fn refused_now(&self) -> usize {
        [
            self.tokens.as_ref().map(Watched::refused),
            self.identity.as_ref().map(|w| w.refused()),
            self.roots.as_ref().map(Watched::refused),
        ]
        .into_iter()
        .filter(|r| *r == Some(true))
        .count()
    }

    /// When the certificate in use expires (`None` without `--tls-cert`).
    pub fn certificate_expiry(&self) -> Option<Expiry> {
        self.identity.as_ref().map(|w| w.get().expiry.clone())
    }

    /// When the first authority of `--tls-ca` stops (or starts) being valid
    /// (`None` without `--tls-ca`).
    pub fn authority_expiry(&self) -> Option<Expiry> {
        self.roots.as_ref().and_then(|w| w.get().expiry.clone())
    }

    /// The PEM roots other members served over TLS are checked against
    /// (the same `Arc` until they are read again changed).
    pub fn peer_roots(&self) -> Option<Arc<Vec<u8>>> {
        self.roots.as_ref().map(|w| w.get().pem.clone())
    }

    /// What accepts TLS on the server's TCP listener — always with the
    /// newest certificate — when it serves over TLS (`Ok(None)` when it
    /// does not); an error where TLS cannot be set up, never plaintext in
    /// its place.
    pub fn tls_acceptor(&self) -> Result<Option<tokio_rustls::TlsAcceptor>> {
        let Some(identity) = &self.identity else {
            return Ok(None);
        };
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| Error::Internal(format!("cannot set up TLS: {e}")))?
            .with_no_client_auth()
            .with_cert_resolver(Arc::new(Newest(identity.clone())));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(config))))
    }

    /// Reads every file again and takes what changed and can be used;
    /// logs what it took and what it refused.
    pub fn refresh(&self) -> Refreshed {
        let mut out = Refreshed::default();
        let mut note = |named: String, what: &str, refresh: Refresh| -> bool {
            match refresh {
                Refresh::Unchanged => false,
                Refresh::Taken => {
                    info!(files = %named, "read again: new {what} in use");
                    true
                }
                Refresh::Refused(why) => {
                    warn!(
                        files = %named,
                        "{what} not changed: {why}; the server goes on with the previous {what} \
                         (fix the file; it is read again on SIGHUP and every {}s)",
                        CHECK_EVERY.as_secs()
                    );
                    out.refused.push(why);
                    false
                }
            }
        };
        if let Some(w) = &self.tokens {
            let r = w.refresh();
            out.tokens = note(w.named(), "tokens", r);
        }
        if let Some(w) = &self.identity {
            let r = w.refresh();
            out.identity = note(w.named(), "certificate", r);
        }
        if let Some(w) = &self.roots {
            let r = w.refresh();
            out.roots = note(w.named(), "member roots", r);
        }
        out
    }
}

/// Hands every TLS handshake the newest certificate.
struct Newest(Arc<Watched<Identity>>);

impl std::fmt::Debug for Newest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Newest")
    }
}

impl rustls::server::ResolvesServerCert for Newest {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get().key.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flightdeck-credentials-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn tokens_are_taken_when_the_file_changes_and_kept_when_it_breaks() {
        let dir = temp_dir("tokens");
        let file = dir.join("tokens");
        std::fs::write(&file, "writer w-1\nreader r-1\n").expect("write");
        let config = ServerConfig {
            auth_token_file: Some(file.clone()),
            ..ServerConfig::default()
        };
        let creds = Credentials::open(&config).expect("open");
        let role = |c: &Credentials, t: &str| {
            c.tokens()
                .expect("tokens")
                .role_of(Some(format!("Bearer {t}").as_bytes()))
                .ok()
        };
        assert_eq!(role(&creds, "w-1"), Some(crate::auth::Role::Writer));
        assert_eq!(creds.refresh(), Refreshed::default(), "nothing changed");

        std::fs::write(&file, "writer w-2\nreader r-1\n").expect("write");
        let refreshed = creds.refresh();
        assert!(
            refreshed.tokens && refreshed.refused.is_empty(),
            "{refreshed:?}"
        );
        assert_eq!(role(&creds, "w-1"), None);
        assert_eq!(role(&creds, "w-2"), Some(crate::auth::Role::Writer));
        assert_eq!(creds.peer_token().as_deref(), Some("w-2"));

        // Cut short, then gone: refused by name, the last tokens kept; the
        // same broken bytes are not reported twice.
        for broken in [&b"writer"[..], b"\xff\xfe"] {
            std::fs::write(&file, broken).expect("write");
            let refreshed = creds.refresh();
            assert!(!refreshed.tokens, "{refreshed:?}");
            assert_eq!(refreshed.refused.len(), 1, "{refreshed:?}");
            assert!(
                refreshed.refused[0].contains("--auth-token-file"),
                "{refreshed:?}"
            );
            assert_eq!(creds.refresh(), Refreshed::default(), "reported once");
            assert_eq!(creds.refused_now(), 1, "still refused");
            assert_eq!(role(&creds, "w-2"), Some(crate::auth::Role::Writer));
        }
        std::fs::remove_file(&file).expect("remove");
        let refreshed = creds.refresh();
        assert!(
            refreshed.refused[0].contains("cannot be read"),
            "{refreshed:?}"
        );
        assert_eq!(creds.refresh(), Refreshed::default(), "reported once");
        assert_eq!(role(&creds, "w-2"), Some(crate::auth::Role::Writer));
        std::fs::write(&file, "writer w-3\n").expect("write");
        assert!(creds.refresh().tokens);
        assert_eq!(creds.refused_now(), 0, "taken: nothing refused now");
        assert_eq!(role(&creds, "w-3"), Some(crate::auth::Role::Writer));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_certificate_is_warned_of_daily_from_two_weeks_before_it_expires() {
        let day = 24 * 3600;
        let at = Duration::from_secs(1_800_000_000);
        let expiry = Expiry::at(at);
        assert_eq!(expiry.text, "2027-01-15T08:00:00Z");
        let seen = |before: i64| {
            let now = SystemTime::UNIX_EPOCH + at;
            let now = match u64::try_from(before) {
                Ok(b) => now - Duration::from_secs(b),
                Err(_) => now + Duration::from_secs(before.unsigned_abs()),
            };
            (expiry.left(now), expiry.warning(now))
        };
        let soon = |days| Some(ExpiryWarning::Soon { days });
        assert_eq!(
            seen(30 * day),
            (Some(Duration::from_secs(30 * 86400)), None)
        );
        assert_eq!(seen(14 * day + 1).1, None);
        assert_eq!(seen(14 * day).1, soon(14));
        assert_eq!(seen(14 * day - 1).1, soon(13));
        assert_eq!(seen(3 * day + day / 2).1, soon(3));
        assert_eq!(seen(1), (Some(Duration::from_secs(1)), soon(0)));
        assert_eq!(seen(0), (None, Some(ExpiryWarning::Expired)));
        assert_eq!(seen(-5), (None, Some(ExpiryWarning::Expired)));
        // The log says each new warning: one a day, then one at expiry.
        let said: std::collections::BTreeSet<_> = (0..=20 * 24)
            .map(|hours: i64| seen(hours * 3600 - 3600).1)
            .collect();
        assert_eq!(said.len(), 15 + 1 + 1, "{said:?}");
    }

    #[test]
    fn a_certificate_not_valid_yet_is_warned_of_until_it_is() {
        let from = Duration::from_secs(1_800_000_000);
        let expiry = Expiry {
            from,
            ..Expiry::at(from + Duration::from_secs(90 * 24 * 3600))
        };
        assert_eq!(expiry.from_text(), "2027-01-15T08:00:00Z");
        let at = |secs: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(secs);
        assert_eq!(
            expiry.warning(at(1_800_000_000 - 1)),
            Some(ExpiryWarning::NotYetValid)
        );
        assert_eq!(expiry.warning(at(1_800_000_000)), None);
        // A moment alone (stats' expiry) is valid from the epoch on.
        assert_eq!(Expiry::at(from).warning(at(1)), None);
    }

    #[test]
    fn unusable_tls_files_are_refused_naming_them() {
        let dir = temp_dir("tls");
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, "not a certificate\n").expect("write");
        std::fs::write(&key, "not a key\n").expect("write");
        let config = ServerConfig {
            tls_cert: Some(cert.clone()),
            tls_key: Some(key.clone()),
            ..ServerConfig::default()
        };
        let err = Credentials::open(&config).expect_err("no certificate");
        assert!(
            err.to_string().contains("--tls-cert") && err.to_string().contains("no certificate"),
            "{err}"
        );
        let missing = ServerConfig {
            tls_ca: Some(dir.join("absent.pem")),
            ..ServerConfig::default()
        };
        let err = Credentials::open(&missing).expect_err("no file");
        assert!(err.to_string().contains("--tls-ca"), "{err}");
        assert!(Credentials::none().is_empty());
        assert!(
            Credentials::none()
                .tls_acceptor()
                .expect("no TLS")
                .is_none()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
