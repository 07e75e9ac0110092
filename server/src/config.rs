//! Server configuration: defaults that work with no flags, and validation.
//!
//! Only `main.rs` parses flags; tests and embedders build a [`ServerConfig`]
//! directly.

use std::net::SocketAddr;

use crate::error::{Error, Result};

/// Default rows per streamed record batch when a plan says 0.
pub const DEFAULT_BATCH_ROWS: u32 = 16_384;
/// Default rows per block of `SHUFFLE_BLOCK` when a plan says 0.
pub const DEFAULT_BLOCK_ROWS: u32 = 1_024;
/// Largest accepted `batch_rows`: bounds the size of one streamed message.
pub const MAX_BATCH_ROWS: u32 = 1 << 24;
/// Largest accepted world size.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;
/// Most threads `--gather-threads` may give a read stream.
pub const MAX_GATHER_THREADS: usize = 64;
/// Default largest gRPC message the server accepts (pyarrow sends a whole
/// record batch as one message).
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 1 << 30;

/// Default folder for the server's files, relative to where it starts.
pub const DEFAULT_DATA_DIR: &str = "flightdeck-data";

/// Everything the server needs to run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Address to listen on (the binary binds it; `serve` takes a listener).
    pub listen: SocketAddr,
    /// Hard limit on cached bytes, staged attempts included.
    pub memory_limit: u64,
    /// Largest gRPC message accepted or sent, in bytes.
    pub max_message_bytes: usize,
    /// Rows per streamed record batch when a plan says 0.
    pub default_batch_rows: u32,
    /// Rows per block of `SHUFFLE_BLOCK` when a plan says 0.
    pub default_block_rows: u32,
    /// Folder for the server's own files; the default spill store lives in
    /// `<data_dir>/store`. Nothing is written there until a dataset spills
    /// or is persisted (with `persist`, the record that this server persists
    /// into the store, at start).
    pub data_dir: std::path::PathBuf,
    /// Spill and persistence store (`file://`, `memory://`, `s3://`, `gs://`,
    /// `az://` or a local path); `None` = `<data_dir>/store`.
    pub spill_url: Option<String>,
    /// Write every sealed dataset to the store and reload them at start.
    pub persist: bool,
    /// Size of the arena's slabs; `None` = 64 MiB, less for small budgets.
    pub slab_bytes: Option<usize>,
    /// Use the CUDA driver when one is present (pinned slabs, `place`).
    pub use_cuda: bool,
    /// The location other members and ranks reach this server at
    /// (`grpc://host:port`); `None` = `grpc://<bound address>` (the host
    /// name when bound to all interfaces).
    pub advertise: Option<String>,
    /// How long a writer that said its size, a read bringing a spilled
    /// dataset back, or a filter's selection waits for memory before it is
    /// refused.
    pub admission_wait: std::time::Duration,
    /// How long a `DoPut` may send nothing, or a `DoGet` reader take
    /// nothing, before the server ends the stream and frees what it holds.
    pub stream_idle_timeout: std::time::Duration,
    /// How long a dataset (or what a replacing write staged) may stay
    /// unsealed with no attempt committed or begun before the server drops
    /// it and refuses its writes' later attempts: a job that died without
    /// sealing or dropping what it wrote. `None` = keep it until dropped.
    pub unsealed_timeout: Option<std::time::Duration>,
    /// What read streams together may hold gathered ahead of their sockets,
    /// in bytes, beside `memory_limit`; `None` = an eighth of it, between
    /// 64 MiB and 4 GiB.
    pub read_ahead_bytes: Option<u64>,
    /// The folder where a local reader that asks for it gets its record
    /// batches through a shared-memory ring instead of the socket (a
    /// tmpfs: `/dev/shm` by default); `None` = every reader over the socket.
    pub shm_dir: Option<std::path::PathBuf>,
    /// Threads one read stream's batch of scattered rows is gathered on;
    /// `None` = half the machine's cores shared among the open streams, at
    /// most four (one a stream on a machine with few cores).
    pub gather_threads: Option<usize>,
    /// The folder training jobs may write checkpoints to and resume from;
    /// `None` = `<data_dir>/checkpoints`.
    pub checkpoint_root: Option<std::path::PathBuf>,
    /// Object-store URL prefixes (`s3://bucket/ckpt`, `memory://`) jobs may
    /// also use for checkpoints.
    pub checkpoint_prefixes: Vec<String>,
    /// Bearer tokens and their roles ([`crate::auth::Tokens::parse`]);
    /// `None` = every caller may do everything.
    pub auth_token_file: Option<std::path::PathBuf>,
    /// PEM certificate (chain) and private key: serve over TLS.
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of `tls_cert`.
    pub tls_key: Option<std::path::PathBuf>,
    /// PEM root certificates this server trusts in other members; `None` =
    /// its own certificate (members sharing one certificate).
    pub tls_ca: Option<std::path::PathBuf>,
    /// Where `/metrics` (Prometheus, OpenMetrics text) is served; `None` =
    /// nowhere.
    pub metrics_listen: Option<SocketAddr>,
    /// A Unix domain socket served beside `listen` for clients on this
    /// machine (`grpc+unix://PATH`): the same service without the TCP
    /// stack. `None` = none.
    pub unix_socket: Option<std::path::PathBuf>,
    /// The permission bits the Unix socket file gets (connecting needs
    /// write permission on it): [`DEFAULT_UNIX_SOCKET_MODE`], owner and
    /// group, unless told otherwise.
    pub unix_socket_mode: u32,
}

/// The default of [`ServerConfig::unix_socket_mode`]: the server's user and
/// group may connect, others not.
pub const DEFAULT_UNIX_SOCKET_MODE: u32 = 0o660;

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 50051)),
            memory_limit: default_memory_limit(),
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            default_batch_rows: DEFAULT_BATCH_ROWS,
            default_block_rows: DEFAULT_BLOCK_ROWS,
            data_dir: std::path::PathBuf::from(DEFAULT_DATA_DIR),
            spill_url: None,
            persist: false,
            slab_bytes: None,
            use_cuda: true,
            advertise: None,
            admission_wait: DEFAULT_ADMISSION_WAIT,
            stream_idle_timeout: DEFAULT_STREAM_IDLE_TIMEOUT,
            unsealed_timeout: Some(DEFAULT_UNSEALED_TIMEOUT),
            read_ahead_bytes: None,
            shm_dir: Some(std::path::PathBuf::from("/dev/shm")),
            gather_threads: None,
            checkpoint_root: None,
            checkpoint_prefixes: Vec::new(),
            auth_token_file: None,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            metrics_listen: None,
            unix_socket: None,
            unix_socket_mode: DEFAULT_UNIX_SOCKET_MODE,
        }
    }
}

impl ServerConfig {
    /// The location this server advertises when bound to `bound`.
    pub fn location(&self, bound: std::net::SocketAddr) -> String {
        if let Some(a) = &self.advertise {
            // Validated: a location without a port is reached at the one
            // the server listens on.
            return match advertised(a, self.tls_cert.is_some()) {
                Ok(url) if url.port_or_known_default().is_none() => {
                    format!("{}:{}", a.trim_end_matches('/'), bound.port())
                }
                _ => a.clone(),
            };
        }
        let scheme = if self.tls_cert.is_some() {
            "grpc+tls"
        } else {
            "grpc"
        };
        if bound.ip().is_unspecified() {
            let host = host_name().unwrap_or_else(|| "127.0.0.1".to_string());
            return format!("{scheme}://{host}:{}", bound.port());
        }
        format!("{scheme}://{bound}")
    }

    /// The spill store URL in effect.
    pub fn spill_url(&self) -> String {
        self.spill_url
            .clone()
            .unwrap_or_else(|| self.data_dir.join("store").display().to_string())
    }

    /// The read-ahead allowance in effect.
    pub fn read_ahead_bytes(&self) -> u64 {
        self.read_ahead_bytes
            .unwrap_or_else(|| (self.memory_limit / 8).clamp(64 << 20, 4 << 30))
    }

    /// The checkpoint root in effect.
    pub fn checkpoint_root(&self) -> std::path::PathBuf {
        self.checkpoint_root
            .clone()
            .unwrap_or_else(|| self.data_dir.join("checkpoints"))
    }

    /// Where a job's checkpoints (`field` names the job's setting) may be:
    /// `url` itself when it is under the checkpoint root or one of the
    /// allowed prefixes, as `file://<absolute path>` when local; a relative
    /// path is taken under the root. Anything else, `..` included, is
    /// `PERMISSION_DENIED`: a client must not make the server write or read
    /// wherever the server can.
    pub fn checkpoint_location(&self, url: &str, field: &str) -> Result<String> {
        use std::path::{Component, Path};
        let root = std::path::absolute(self.checkpoint_root()).map_err(|e| {
            Error::Internal(format!("the checkpoint root has no absolute path: {e}"))
        })?;
        let denied = || {
            let prefixes = if self.checkpoint_prefixes.is_empty() {
                "none".to_string()
            } else {
                self.checkpoint_prefixes.join(", ")
            };
            Error::PermissionDenied(format!(
                "{field} '{url}' is outside this server's checkpoint root {} (--checkpoint-root) \
                 and its allowed prefixes ({prefixes}; --checkpoint-prefix); give a path \
                 relative to the root, or one under it",
                root.display()
            ))
        };
        let local = match url.strip_prefix("file://") {
            Some(path) => Some(path),
            None if !url.contains("://") => Some(url),
            None => None,
        };
        let Some(local) = local else {
            let inside = !url.split('/').any(|c| c == "..")
                && self.checkpoint_prefixes.iter().any(|prefix| {
                    let prefix = prefix.trim_end_matches('/');
                    url.strip_prefix(prefix)
                        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
                });
            return if inside {
                Ok(url.to_string())
            } else {
                Err(denied())
            };
        };
        let path = Path::new(local);
        if local.is_empty() || path.components().any(|c| c == Component::ParentDir) {
            return Err(denied());
        }
        let path = if path.is_absolute() {
            path.to_path_buf()
        } else {
            root.join(path)
        };
        if !path.starts_with(&root) {
            return Err(denied());
        }
        Ok(format!("file://{}", path.display()))
    }

    /// Checks that the configuration can run.
    pub fn validate(&self) -> Result<()> {
        if self.tls_cert.is_some() != self.tls_key.is_some() {
            return Err(Error::invalid(
                "--tls-cert and --tls-key go together: give both to serve over TLS, or neither",
            ));
        }
        if self.memory_limit < MIN_MEMORY_LIMIT {
            // A number of bytes meant as MiB; none at all is not a unit away.
            let hint = match self.memory_limit {
                0 => ": it leaves the cache no memory; give a size such as 4GiB, or leave it out \
                      for half of this machine's memory"
                    .to_string(),
                n => format!("; give a unit, e.g. --memory-limit {n}MiB"),
            };
            return Err(Error::invalid(format!(
                "--memory-limit {} bytes is less than one slab of the cache ({}){hint}",
                self.memory_limit,
                show_size(MIN_MEMORY_LIMIT),
            )));
        }
        if self.stream_idle_timeout.is_zero() {
            return Err(Error::invalid(
                "--stream-idle-timeout must be more than 0: it is how long a writer may send \
                 nothing, or a reader take nothing, before its stream is ended (e.g. 10m)",
            ));
        }
        if let Some(machine) = machine_memory()
            && self.memory_limit > machine
        {
            return Err(Error::invalid(format!(
                "--memory-limit {} is more than this machine's memory and swap ({}); leave it \
                 out for half the memory, or give less",
                show_size(self.memory_limit),
                show_size(machine)
            )));
        }
        if let Some(limit) = cgroup_memory_limit()
            && self.memory_limit > limit
        {
            return Err(Error::invalid(format!(
                "--memory-limit {} is more than this server's container may use ({}, its \
                 cgroup's memory limit): the kernel would kill the server, and its cache with it, \
                 once the cache grew past that; give less, leaving room for read-ahead \
                 (--read-ahead-memory) and buffers, or leave it out for half the limit",
                show_size(self.memory_limit),
                show_size(limit)
            )));
        }
        if let Some(threads) = self.gather_threads
            && !(1..=MAX_GATHER_THREADS).contains(&threads)
        {
            return Err(Error::invalid(format!(
                "--gather-threads {threads} is out of range: give 1 to {MAX_GATHER_THREADS}, or \
                 leave it out to share half the cores among the streams"
            )));
        }
        if self.max_message_bytes < 1 << 20 {
            return Err(Error::invalid("--max-message-size must be at least 1MiB"));
        }
        if self.default_batch_rows == 0 || self.default_batch_rows > MAX_BATCH_ROWS {
            return Err(Error::invalid(format!(
                "default batch rows must be between 1 and {MAX_BATCH_ROWS}"
            )));
        }
        if self.default_block_rows == 0 {
            return Err(Error::invalid("default block rows must be at least 1"));
        }
        if self.slab_bytes.is_some_and(|b| b < 4096) {
            return Err(Error::invalid("--slab-size must be at least 4KiB"));
        }
        if let Some(a) = &self.advertise {
            advertised(a, self.tls_cert.is_some())?;
        }
        if let Some(path) = &self.unix_socket {
            // Clients name the socket `grpc+unix://` + an absolute path, and
            // the kernel takes at most 107 bytes of it.
            if !path.is_absolute() || path.as_os_str().len() > MAX_UNIX_SOCKET_PATH {
                return Err(Error::invalid(format!(
                    "--unix-socket '{}' must be an absolute path of at most \
                     {MAX_UNIX_SOCKET_PATH} bytes, e.g. /run/flightdeck.sock",
                    path.display()
                )));
            }
        }
        if self.unix_socket_mode > 0o777 {
            return Err(Error::invalid(format!(
                "--unix-socket-mode {:o} is not a file mode: give permission bits, 0 to 777 in \
                 octal (e.g. 660: the server's user and group may connect)",
                self.unix_socket_mode
            )));
        }
        Ok(())
    }
}

/// Permission bits as `chmod` takes them, in octal: `660`, `0660`, `0o660`.
pub fn parse_mode(s: &str) -> std::result::Result<u32, String> {
    let s = s.trim();
    let digits = s.strip_prefix("0o").unwrap_or(s);
    u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| !digits.is_empty() && *m <= 0o777)
        .ok_or_else(|| {
            format!(
                "'{s}' is not a file mode: give permission bits in octal as chmod takes them, e.g. \
                 660 (user and group) or 666 (everyone)"
            )
        })
}

/// The longest path a Unix domain socket can be bound to (`sun_path`,
/// less its terminating NUL).
const MAX_UNIX_SOCKET_PATH: usize = 107;

/// The default of [`ServerConfig::admission_wait`].
pub const DEFAULT_ADMISSION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The default of [`ServerConfig::unsealed_timeout`]: far longer than a
/// Spark job goes between two of its tasks' commits, short enough that what
/// a dead job left does not hold memory for days.
pub const DEFAULT_UNSEALED_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(6 * 3600);

/// Default for how long a stream may stall (a writer sending nothing, a
/// reader taking nothing) before the server ends it.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A GPU as a command line names it: its ordinal (`0`), or `cuda:0` as
/// PyTorch writes it.
pub fn parse_gpu(s: &str) -> std::result::Result<u32, String> {
    let s = s.trim();
    s.strip_prefix("cuda:")
        .unwrap_or(s)
        .parse::<u32>()
        .map_err(|_| format!("'{s}' is not a GPU: give its ordinal (0, 1, …) or cuda:N"))
}

/// An address to listen on: `IP:PORT` (`0.0.0.0:50051`, `[::]:50051`), or
/// `HOST:PORT` with a host name this machine resolves (`localhost:50051`;
/// its first IPv4 address, else its first).
pub fn parse_listen(s: &str) -> std::result::Result<SocketAddr, String> {
    use std::net::ToSocketAddrs;
    let s = s.trim();
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let usage = "give HOST:PORT, e.g. 127.0.0.1:50051, localhost:50051 or 0.0.0.0:50051 \
                 (every interface)";
    if !s.rsplit_once(':').is_some_and(|(host, port)| {
        !host.is_empty() && !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit())
    }) {
        return Err(format!("'{s}' is not an address to listen on: {usage}"));
    }
    let found: Vec<SocketAddr> = s
        .to_socket_addrs()
        .map_err(|e| format!("'{s}' is not an address to listen on ({e}): {usage}"))?
        .collect();
    found
        .iter()
        .find(|a| a.is_ipv4())
        .or(found.first())
        .copied()
        .ok_or_else(|| format!("'{s}' names no address of this machine: {usage}"))
}

/// A duration such as `5s`, `500ms`, `2m` or a plain number of seconds.
pub fn parse_duration(s: &str) -> std::result::Result<std::time::Duration, String> {
    let s = s.trim();
    let (number, unit) = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .map_or((s, ""), |i| s.split_at(i));
    let value: f64 = number
        .parse()
        .map_err(|_| format!("'{s}' is not a duration; write e.g. 5s, 500ms, 2m or 6h"))?;
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1e3,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "unknown unit '{other}' in '{s}'; use ms, s, m or h"
            ));
        }
    };
    std::time::Duration::try_from_secs_f64(seconds).map_err(|e| format!("'{s}': {e}"))
}

/// `--advertise` as a URL, checked: a scheme this server speaks
/// (`grpc://`, `grpc+tcp://` or `http://`; with `tls`, `grpc+tls://` or
/// `https://`), a host another machine can reach, and nothing after the
/// port. Members and ranks connect to it, so a plaintext location of a
/// server that speaks TLS, or `0.0.0.0` (which another machine reads as
/// itself), would send them elsewhere.
fn advertised(a: &str, tls: bool) -> Result<url::Url> {
    let want = if tls {
        "grpc+tls://HOST:PORT"
    } else {
        "grpc://HOST:PORT"
    };
    let url = url::Url::parse(a).map_err(|e| {
        Error::invalid(format!(
            "--advertise '{a}' is not a location ({e}); give {want}, where other nodes reach \
             this server"
        ))
    })?;
    let secure = match url.scheme() {
        "grpc" | "grpc+tcp" | "http" => false,
        "grpc+tls" | "https" => true,
        _ => {
            return Err(Error::invalid(format!(
                "--advertise '{a}' is not a location; give {want}, where other nodes reach this \
                 server"
            )));
        }
    };
    if secure && !tls {
        return Err(Error::invalid(format!(
            "--advertise '{a}' says TLS, but this server speaks plaintext: start it with \
             --tls-cert and --tls-key, or advertise grpc://HOST:PORT"
        )));
    }
    if tls && !secure {
        return Err(Error::invalid(format!(
            "--advertise '{a}' says plaintext, but this server speaks TLS only (--tls-cert): \
             advertise grpc+tls://HOST:PORT, or members and ranks could not reach it"
        )));
    }
    let host = url.host_str().unwrap_or_default();
    if host.is_empty() {
        return Err(Error::invalid(format!(
            "--advertise '{a}' names no host; give {want}"
        )));
    }
    let ip = host.trim_start_matches('[').trim_end_matches(']');
    if ip
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_unspecified())
    {
        return Err(Error::invalid(format!(
            "--advertise '{a}': {host} is no address another machine can reach (there it means \
             itself); advertise this node's address or host name (in Kubernetes \
             grpc://$(HOST_IP):PORT)"
        )));
    }
    if !matches!(url.path(), "" | "/")
        || url.query().is_some()
        || url.fragment().is_some()
        || !url.username().is_empty()
    {
        return Err(Error::invalid(format!(
            "--advertise '{a}': nothing may follow HOST:PORT; give {want}"
        )));
    }
    Ok(url)
}

/// Half of the memory this server may use — the machine's physical memory,
/// or its container's limit where that is less ([`cgroup_memory_limit`]) —
/// or 4 GiB where neither can be read.
pub fn default_memory_limit() -> u64 {
    let total = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| parse_meminfo_total(&s));
    match (total, cgroup_memory_limit()) {
        (Some(t), Some(c)) => t.min(c) / 2,
        (Some(m), None) | (None, Some(m)) => m / 2,
        (None, None) => 4 << 30,
    }
}

/// This machine's host name, where the kernel says one.
pub fn host_name() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
}

/// The memory limit of the control group this process runs in — a
/// container's `--memory`, a Kubernetes pod's `resources.limits.memory` —
/// where one is set: past it the kernel kills the process, whatever the
/// machine has.
pub fn cgroup_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroup_limit_under(&own, std::path::Path::new("/sys/fs/cgroup"))
}

/// The smallest memory limit set on the cgroup `own` (the text of
/// `/proc/self/cgroup`) names or on any cgroup above it, read from the
/// cgroup file systems under `root`: v2's `memory.max`, v1's
/// `memory/…/memory.limit_in_bytes`. `None` when none is set.
fn cgroup_limit_under(own: &str, root: &std::path::Path) -> Option<u64> {
    let mut files = Vec::new();
    for line in own.lines() {
        let mut fields = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        // v1 mounts a hierarchy under `memory`, or under its controllers'
        // names where memory shares it (`cpu,memory`) and no `memory` link
        // was made: both are read.
        let (hierarchies, file) = if controllers.is_empty() {
            (vec![root.to_path_buf()], "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            let mut at = vec![root.join("memory")];
            if controllers != "memory" {
                at.push(root.join(controllers));
            }
            (at, "memory.limit_in_bytes")
        } else {
            continue;
        };
        // In a container the hierarchy's root is often the container's own
        // cgroup, whatever path the line names: every level is read.
        for hierarchy in hierarchies {
            let mut dir = std::path::PathBuf::from(path.trim());
            loop {
                let relative = dir.strip_prefix("/").unwrap_or(&dir);
                files.push(hierarchy.join(relative).join(file));
                if !dir.pop() {
                    break;
                }
            }
        }
    }
    files
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .filter_map(|text| parse_cgroup_limit(&text))
        .min()
}

/// A cgroup memory limit file's value; `None` for no limit (v2's `max`,
/// v1's page-rounded `i64::MAX`).
fn parse_cgroup_limit(text: &str) -> Option<u64> {
    let bytes: u64 = text.trim().parse().ok()?;
    (bytes < 1 << 62).then_some(bytes)
}

fn parse_meminfo_total(meminfo: &str) -> Option<u64> {
    meminfo_field(meminfo, "MemTotal:")
}

/// A `/proc/meminfo` field in bytes.
fn meminfo_field(meminfo: &str, field: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The smallest `--memory-limit`: one slab of the smallest size.
pub const MIN_MEMORY_LIMIT: u64 = 64 << 10;

/// Physical memory plus swap, where the system says.
fn machine_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let swap = meminfo_field(&meminfo, "SwapTotal:").unwrap_or(0);
    meminfo_field(&meminfo, "MemTotal:")?.checked_add(swap)
}

/// `bytes` in the largest binary unit that keeps one decimal, e.g. `8.0GiB`.
pub fn show_size(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.1}{}", units[unit])
    }
}

/// `d` in its two largest units, for people: `40s`, `12m5s`, `5h12m`,
/// `3d4h`.
pub fn show_age(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let (days, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (days, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) => format!("{m}m{sec}s"),
        (0, _, _) => format!("{h}h{m}m"),
        _ => format!("{days}d{h}h"),
    }
}

/// Parses a byte size: a plain number of bytes, or a number with a binary
/// unit (`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, `T`/`TiB`: powers of 1024) or a
/// decimal one (`KB`, `MB`, `GB`, `TB`: powers of 1000), any case, e.g.
/// `8GiB`, `512m`, `1.5G`, `100MB`.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size; write e.g. 8GiB, 512MiB or 1073741824"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "ki" | "kib" => 1024.0,
        "m" | "mi" | "mib" => 1024f64.powi(2),
        "g" | "gi" | "gib" => 1024f64.powi(3),
        "t" | "ti" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => {
            return Err(format!(
                "unknown size unit '{other}' in '{s}'; use KiB, MiB, GiB or TiB (powers of 1024) \
                 or KB, MB, GB, TB (powers of 1000)"
            ));
        }
    };
    let bytes = (value * scale).round();
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("size '{s}' is out of range"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses_take_ips_and_host_names() {
        let at = |s| parse_listen(s).map(|a| a.to_string());
        assert_eq!(at("0.0.0.0:50051").as_deref(), Ok("0.0.0.0:50051"));
        assert_eq!(at("[::1]:0").as_deref(), Ok("[::1]:0"));
        assert_eq!(at(" localhost:50051 ").as_deref(), Ok("127.0.0.1:50051"));
        for bad in [
            "50051",
            "localhost",
            ":50051",
            "localhost:",
            "localhost:port",
        ] {
            let err = parse_listen(bad).expect_err(bad);
            assert!(
                err.contains(&format!("'{}' is not an address to listen on", bad.trim())),
                "{err}"
            );
            assert!(
                err.contains("give HOST:PORT, e.g. 127.0.0.1:50051"),
                "{err}"
            );
        }
    }

    #[test]
    fn ages_read_in_their_two_largest_units() {
        use std::time::Duration;
        let age = |s| show_age(Duration::from_secs(s));
        assert_eq!(
            [
                age(0),
                age(59),
                age(61),
                age(3600),
                age(18_720),
                age(86_400 + 7200 + 59)
            ],
            ["0s", "59s", "1m1s", "1h0m", "5h12m", "1d2h"]
        );
    }

    #[test]
    fn a_unix_socket_must_be_an_absolute_path_the_kernel_can_bind() {
        let with = |path: &str| ServerConfig {
            unix_socket: Some(path.into()),
            memory_limit: MIN_MEMORY_LIMIT,
            ..ServerConfig::default()
        };
        assert!(with("/run/flightdeck.sock").validate().is_ok());
        assert!(with(&format!("/{}", "s".repeat(106))).validate().is_ok());
        for bad in ["flightdeck.sock", "run/fd.sock", ""] {
            let e = with(bad).validate().expect_err(bad).to_string();
            assert!(
                e.contains("--unix-socket") && e.contains("absolute"),
                "{bad}: {e}"
            );
        }
        let e = with(&format!("/{}", "s".repeat(107)))
            .validate()
            .expect_err("a 108-byte path");
        assert!(e.to_string().contains("107 bytes"), "{e}");
    }

    #[test]
    fn a_socket_mode_is_permission_bits_in_octal() {
        for (text, mode) in [
            ("660", 0o660),
            ("0660", 0o660),
            ("0o600", 0o600),
            ("777", 0o777),
        ] {
            assert_eq!(parse_mode(text), Ok(mode), "{text}");
        }
        for bad in ["", "0o", "1000", "rw-rw----", "8", "-1", "0x1b6"] {
            let e = parse_mode(bad).expect_err(bad);
            assert!(e.contains("octal"), "{bad}: {e}");
        }
        let config = ServerConfig {
            unix_socket_mode: 0o4755,
            memory_limit: MIN_MEMORY_LIMIT,
            ..ServerConfig::default()
        };
        let e = config.validate().expect_err("setuid bits").to_string();
        assert!(e.contains("--unix-socket-mode 4755"), "{e}");
        assert_eq!(ServerConfig::default().unix_socket_mode, 0o660);
    }

    #[test]
    fn checkpoints_are_confined_to_the_root_and_the_allowed_prefixes() {
        let config = ServerConfig {
            checkpoint_root: Some("/srv/ckpt".into()),
            checkpoint_prefixes: vec!["s3://models/ckpt/".into(), "memory://".into()],
            ..ServerConfig::default()
        };
        let at = |url: &str| config.checkpoint_location(url, "checkpoint_url");
        for (url, want) in [
            ("run-1", "file:///srv/ckpt/run-1"),
            ("a/b", "file:///srv/ckpt/a/b"),
            ("/srv/ckpt", "file:///srv/ckpt"),
            ("file:///srv/ckpt/run-2/", "file:///srv/ckpt/run-2/"),
            (
                "/srv/ckpt/run-1/step-0000000005.safetensors",
                "file:///srv/ckpt/run-1/step-0000000005.safetensors",
            ),
            ("s3://models/ckpt/run", "s3://models/ckpt/run"),
            ("s3://models/ckpt", "s3://models/ckpt"),
            ("memory://x/y", "memory://x/y"),
        ] {
            assert_eq!(at(url).expect(url), want);
        }
        for url in [
            "/etc/passwd",
            "file:///etc",
            "/srv/ckpt/../etc",
            "../etc",
            "run/../../x",
            "/srv/ckptX/run",
            "file://",
            "",
            "s3://models/ckptX",
            "s3://models/ckpt/../other",
            "s3://other/ckpt",
            "gs://models/ckpt/run",
        ] {
            let err = at(url).expect_err(url);
            assert!(matches!(err, Error::PermissionDenied(_)), "{url}: {err}");
            assert!(err.to_string().contains("--checkpoint-root"), "{err}");
        }
        // By default: under the data folder, and no object store.
        let plain = ServerConfig::default();
        let root = std::path::absolute("flightdeck-data/checkpoints").expect("cwd");
        assert_eq!(
            plain
                .checkpoint_location("r", "resume_from")
                .expect("relative"),
            format!("file://{}/r", root.display())
        );
        assert!(
            plain
                .checkpoint_location("memory://x", "resume_from")
                .is_err()
        );
    }

    #[test]
    fn durations_parse() {
        use std::time::Duration;
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("6h"), Ok(Duration::from_secs(6 * 3600)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("3 weeks").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("8GiB"), Ok(8 << 30));
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("1.5G"), Ok(3 << 29));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("5 parsecs").is_err());
        // Decimal units mean decimal.
        assert_eq!(parse_size("8GB"), Ok(8_000_000_000));
        assert_eq!(parse_size("100MB"), Ok(100_000_000));
        assert_eq!(parse_size("2Gi"), Ok(2 << 30));
        let err = parse_size("8 gigs").expect_err("no such unit");
        assert!(err.contains("GiB") && err.contains("GB"), "{err}");
        assert!(parse_size("1e30TiB").is_err());
    }

    #[test]
    fn memory_limits_below_a_slab_or_above_the_machine_are_refused() {
        let with = |memory_limit| ServerConfig {
            memory_limit,
            ..ServerConfig::default()
        };
        let err = with(100).validate().expect_err("100 bytes");
        assert!(err.to_string().contains("--memory-limit 100MiB"), "{err}");
        // No unit to suggest for nothing at all.
        let err = with(0).validate().expect_err("0 bytes").to_string();
        assert!(
            err.contains("leaves the cache no memory") && !err.contains("0MiB"),
            "{err}"
        );
        with(MIN_MEMORY_LIMIT).validate().expect("one slab");
        if let Some(machine) = machine_memory() {
            let err = with(machine + 1)
                .validate()
                .expect_err("more than the machine");
            assert!(err.to_string().contains("memory and swap"), "{err}");
            if cgroup_memory_limit().is_none_or(|c| c >= machine) {
                with(machine).validate().expect("all of it");
            }
        }
        assert_eq!(show_size(8 << 30), "8.0GiB");
        assert_eq!(show_size(1536), "1.5KiB");
        assert_eq!(show_size(100), "100B");
    }

    #[test]
    fn advertise_names_a_location_other_machines_reach_as_the_server_speaks() {
        let with = |a: &str, tls: bool| ServerConfig {
            advertise: Some(a.to_string()),
            tls_cert: tls.then(|| "cert.pem".into()),
            tls_key: tls.then(|| "key.pem".into()),
            ..ServerConfig::default()
        };
        let bound: SocketAddr = "127.0.0.1:4242".parse().expect("addr");
        for (a, tls, location) in [
            ("grpc://node1:50051", false, "grpc://node1:50051"),
            ("grpc+tcp://10.0.0.1:5", false, "grpc+tcp://10.0.0.1:5"),
            ("http://x:1", false, "http://x:1"),
            ("grpc://[::1]:5", false, "grpc://[::1]:5"),
            ("grpc+tls://node1:50051", true, "grpc+tls://node1:50051"),
            // No port: the one it listens on.
            ("grpc://node1", false, "grpc://node1:4242"),
            ("grpc+tls://node1/", true, "grpc+tls://node1:4242"),
        ] {
            let config = with(a, tls);
            config.validate().unwrap_or_else(|e| panic!("{a}: {e}"));
            assert_eq!(config.location(bound), location, "{a}");
        }
        for (a, tls, said) in [
            (
                "node1:50051",
                false,
                "is not a location; give grpc://HOST:PORT",
            ),
            ("grpc://node1:99999", false, "is not a location"),
            ("s3://bucket", false, "is not a location"),
            (
                "grpc+tls://node1:1",
                false,
                "says TLS, but this server speaks plaintext",
            ),
            ("grpc://node1:1", true, "advertise grpc+tls://HOST:PORT"),
            (
                "grpc://0.0.0.0:50051",
                false,
                "no address another machine can reach",
            ),
            (
                "grpc://[::]:50051",
                false,
                "no address another machine can reach",
            ),
            (
                "grpc://node1:1/flight",
                false,
                "nothing may follow HOST:PORT",
            ),
            ("grpc://node1:1?x=1", false, "nothing may follow HOST:PORT"),
        ] {
            let err = with(a, tls).validate().expect_err(a);
            assert!(err.to_string().contains(said), "{a}: {err}");
            assert!(err.to_string().contains(a), "names what was given: {err}");
        }
    }

    #[test]
    fn a_containers_memory_limit_is_found_at_any_level_of_its_cgroup() {
        let root = std::env::temp_dir().join(format!("flightdeck-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let write = |path: &str, text: &str| {
            let file = root.join(path);
            std::fs::create_dir_all(file.parent().expect("parent")).expect("dir");
            std::fs::write(file, text).expect("write");
        };
        // v2: the pod's limit two levels up, none on the container itself.
        write("kubepods/pod1/memory.max", "17179869184\n");
        write("kubepods/pod1/ctr/memory.max", "max\n");
        write("memory.max", "max\n");
        let v2 = "0::/kubepods/pod1/ctr\n";
        assert_eq!(cgroup_limit_under(v2, &root), Some(16 << 30));
        assert_eq!(cgroup_limit_under("0::/elsewhere\n", &root), None);
        // v1: the memory hierarchy only; unlimited is a page-rounded i64::MAX.
        write(
            "memory/docker/abc/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let v1 = "4:memory:/docker/abc\n3:cpuset:/\n0::/\n";
        assert_eq!(cgroup_limit_under(v1, &root), None);
        // Seen from inside the container: its own cgroup at the root.
        write("memory/memory.limit_in_bytes", "8589934592\n");
        assert_eq!(cgroup_limit_under(v1, &root), Some(8 << 30));
        assert_eq!(
            cgroup_limit_under("12:cpu,memory:/\n", &root),
            Some(8 << 30)
        );
        // A hierarchy memory shares, mounted under its controllers' names.
        write("cpu,memory/memory.limit_in_bytes", "4294967296\n");
        assert_eq!(
            cgroup_limit_under("12:cpu,memory:/\n", &root),
            Some(4 << 30)
        );
        assert_eq!(cgroup_limit_under("garbage\n", &root), None);
        assert_eq!(parse_cgroup_limit("max"), None);
        assert_eq!(parse_cgroup_limit("1024\n"), Some(1024));
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn meminfo_parses() {
        let m = "MemTotal:       24591812 kB\nMemFree: 1 kB\n";
        assert_eq!(parse_meminfo_total(m), Some(24_591_812 * 1024));
        assert_eq!(parse_meminfo_total("nothing"), None);
    }

    #[test]
    fn defaults_validate() {
        ServerConfig::default()
            .validate()
            .expect("defaults are valid");
        let bad = ServerConfig {
            memory_limit: 0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let never = ServerConfig {
            stream_idle_timeout: std::time::Duration::ZERO,
            ..Default::default()
        };
        let err = never.validate().expect_err("no idle time").to_string();
        assert!(
            err.contains("--stream-idle-timeout must be more than 0"),
            "{err}"
        );
        for (threads, valid) in [(0, false), (1, true), (64, true), (65, false)] {
            let config = ServerConfig {
                gather_threads: Some(threads),
                ..Default::default()
            };
            match config.validate() {
                Ok(()) => assert!(valid, "{threads}"),
                Err(e) => {
                    assert!(!valid, "{threads}: {e}");
                    assert!(e.to_string().contains("give 1 to 64"), "{e}");
                }
            }
        }
    }
}
