//! Which servers use a store, so that what a stopped server left there is
//! found and removed, and what a running one holds is never taken.
//!
//! A server that stops without shutting down (killed, out of memory, its
//! machine gone) leaves its spill files behind, and nothing else would ever
//! remove them: they would fill the disk restart by restart. And two
//! servers persisting into one store (one `--spill-url` given to every node)
//! would write each other's datasets, since each numbers its generations
//! from 1. Both are settled by records of who is there:
//!
//! ```text
//! spill/<session>/server.json   a server with spill files, refreshed every beat
//! datasets/server.json          the one server persisting into the store
//! ```
//!
//! A record names the server (session, host, location) and, where another
//! process on the same machine can check it, its process (boot id, pid
//! namespace, pid and start time). [`judge`] decides from a record and its
//! age whether its server has stopped; it does no I/O.
//!
//! - A spill session whose server has stopped is removed, by every server
//!   now and then ([`Store::remove_stopped_sessions`]).
//! - A server started with `--persist` claims the store
//!   ([`Store::claim`]): it refuses to start while another server holds it,
//!   and takes it over from one that stopped — at once when it can tell,
//!   otherwise after watching the record for missed beats. It then removes
//!   the generations that a stopped server's overwrite or persist left
//!   half done, as it reloads them ([`Store::persisted`]).

use std::time::Duration;

use futures::TryStreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::spill::{PersistedDataset, Store, age_of, store_error};
use crate::error::{Error, Result};

/// Name of the records, in a spill session's folder and in `datasets/`.
const RECORD: &str = "server.json";

/// How often a server rewrites its records, and how long a claim watches a
/// record it cannot judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// Between two rewrites of a server's records.
    pub beat: Duration,
    /// How long a claim watches a record for a new beat before it takes
    /// the store over (several beats).
    pub watch: Duration,
    /// A record older than this, by this machine's clock, is a stopped
    /// server's whatever the clocks' skew.
    pub stopped_after: Duration,
}

impl Timing {
    /// A beat every 10 s; a claim watches for 30 s; 10 minutes of silence
    /// is a stop.
    pub const DEFAULT: Timing = Timing {
        beat: Duration::from_secs(10),
        watch: Duration::from_secs(30),
        stopped_after: Duration::from_secs(600),
    };
}

/// A process as another process on the same machine can find it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Process {
    /// The kernel's boot id: the same machine, and the same boot of it.
    pub machine: String,
    /// The pid namespace (`/proc/self/ns/pid`): pids mean the same thing.
    pub pid_namespace: String,
    /// Its pid.
    pub pid: u32,
    /// Its start, in clock ticks after boot: a pid reused later has another.
    pub start: u64,
}

impl Process {
    /// This process, where `/proc` says it.
    pub fn current() -> Option<Self> {
        let machine = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let pid_namespace = std::fs::read_link("/proc/self/ns/pid").ok()?;
        let pid = std::process::id();
        let (_, start) = running(pid)?;
        Some(Self {
            machine: machine.trim().to_string(),
            pid_namespace: pid_namespace.to_string_lossy().into_owned(),
            pid,
            start,
        })
    }

    /// Whether pids of `other` mean processes here.
    fn beside(&self, other: &Process) -> bool {
        self.machine == other.machine && self.pid_namespace == other.pid_namespace
    }
}

/// The state letter and start time of process `pid`, from `/proc/PID/stat`;
/// `None` where there is none.
fn running(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: the name may hold spaces and parentheses.
    let fields: Vec<&str> = stat
        .get(stat.rfind(')')? + 1..)?
        .split_whitespace()
        .collect();
    let state = fields.first()?.chars().next()?;
    // Field 22 of the file, the 20th after the name.
    let start = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// The start time of process `pid` while it runs (a zombie — killed and
/// not yet reaped — has stopped); `None` where it does not.
pub fn start_of_running(pid: u32) -> Option<u64> {
    match running(pid)? {
        ('Z' | 'X' | 'x', _) => None,
        (_, start) => Some(start),
    }
}

/// Who holds something in a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The server's session (unique per run; its spill folder's name).
    pub session: String,
    /// The machine's host name, for people reading messages.
    pub host: String,
    /// The location the server serves at.
    pub location: String,
    /// Its process, where `/proc` told it.
    pub process: Option<Process>,
}

impl Holder {
    /// The record's body at beat `beat`.
    fn to_json(&self, beat: u64) -> Vec<u8> {
        let process = self.process.as_ref().map(|p| {
            json!({
                "machine": p.machine,
                "pid_namespace": p.pid_namespace,
                "pid": p.pid,
                "start": p.start,
            })
        });
        let doc = json!({
            "session": self.session,
            "host": self.host,
            "location": self.location,
            "process": process,
            "beat": beat,
        });
        doc.to_string().into_bytes()
    }

    /// A record's holder and beat; `None` where it is not one.
    fn parse(bytes: &[u8]) -> Option<(Self, u64)> {
        let doc: Value = serde_json::from_slice(bytes).ok()?;
        let text = |v: &Value, k: &str| v.get(k)?.as_str().map(str::to_string);
        let process = doc.get("process").filter(|p| !p.is_null()).and_then(|p| {
            Some(Process {
                machine: text(p, "machine")?,
                pid_namespace: text(p, "pid_namespace")?,
                pid: u32::try_from(p.get("pid")?.as_u64()?).ok()?,
                start: p.get("start")?.as_u64()?,
            })
        });
        let holder = Holder {
            session: text(&doc, "session")?,
            host: text(&doc, "host").unwrap_or_default(),
            location: text(&doc, "location").unwrap_or_default(),
            process,
        };
        Some((holder, doc.get("beat")?.as_u64()?))
    }

    /// How a message names it.
    fn describe(&self) -> String {
        let pid = match &self.process {
            Some(p) => format!("pid {} ", p.pid),
            None => String::new(),
        };
        let at = if self.location.is_empty() {
            String::new()
        } else {
            format!(", serving at {}", self.location)
        };
        format!("{pid}on host '{}'{at}", self.host)
    }
}

/// What a record says of its server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// It has stopped: what it holds may be taken or removed.
    Stopped,
    /// It runs (its process was found here).
    Running,
    /// It cannot be told from here: another machine's, or a record this
    /// old by a clock that may be skewed.
    Unsure,
}

/// Whether the server of a record, `there` (`None` where the record is
/// damaged or missing) last written `age` ago, has stopped, as seen by the
/// process `here`. `start_of` gives the start time of a running process by
/// pid ([`start_of_running`]).
pub fn judge(
    here: Option<&Process>,
    there: Option<&Holder>,
    age: Duration,
    stopped_after: Duration,
    start_of: impl Fn(u32) -> Option<u64>,
) -> Verdict {
    let process = there.and_then(|t| t.process.as_ref());
    match (here, process) {
        (Some(h), Some(t)) if h.beside(t) => {
            if start_of(t.pid) == Some(t.start) {
                Verdict::Running
            } else {
                Verdict::Stopped
            }
        }
        _ if age >= stopped_after => Verdict::Stopped,
        _ => Verdict::Unsure,
    }
}

/// A record as read: its holder (`None` where damaged), beat and age.
struct Seen {
    holder: Option<Holder>,
    beat: u64,
    age: Duration,
}

/// `path` without its last part.
fn parent(path: &Path) -> Path {
    let parts: Vec<_> = path.parts().collect();
    Path::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned())
}

impl Store {
    fn session_record(&self) -> Path {
        self.spill_root()
            .join(self.holder.session.as_str())
            .join(RECORD)
    }

    fn spill_root(&self) -> Path {
        self.root.clone().join("spill")
    }

    fn persist_record(&self) -> Path {
        self.root.clone().join("datasets").join(RECORD)
    }

    async fn read_record(&self, path: &Path) -> Result<Option<Seen>> {
        let what = || format!("reading {path} from {}", self.url);
        let got = match self.store.get(path).await {
            Ok(got) => got,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(store_error(&what(), e)),
        };
        let age = age_of(&got.meta);
        let bytes = got.bytes().await.map_err(|e| store_error(&what(), e))?;
        let (holder, beat) = match Holder::parse(&bytes) {
            Some((h, b)) => (Some(h), b),
            None => (None, 0),
        };
        Ok(Some(Seen { holder, beat, age }))
    }

    async fn write_record(&self, path: &Path, mode: PutMode) -> object_store::Result<()> {
        let beat = self
            .beats
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let body = PutPayload::from(self.holder.to_json(beat));
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        self.store.put_opts(path, body, opts).await.map(|_| ())
    }

    /// A spill folder of this session is about to be written: the first
    /// one writes the session's record, so that a session with files
    /// always says whose they are.
    pub(super) async fn spill_begins(&self) -> object_store::Result<()> {
        let mut folders = self.spill_folders.lock().await;
        if *folders == 0 {
            self.write_record(&self.session_record(), PutMode::Overwrite)
                .await?;
        }
        *folders += 1;
        Ok(())
    }

    /// A spill folder of this session is gone (or its write failed): the
    /// last one takes the session's record with it.
    pub(super) async fn spill_ends(&self) -> Result<()> {
        let mut folders = self.spill_folders.lock().await;
        *folders = folders.saturating_sub(1);
        if *folders == 0 {
            self.delete_each(&[self.session_record()]).await?;
        }
        Ok(())
    }

    /// This session's files are all gone (shutdown).
    pub(super) async fn spills_cleared(&self) {
        *self.spill_folders.lock().await = 0;
    }

    /// One beat: rewrites this session's record (while it has spill files) and,
    /// with `persist`, the record that it holds the store's persisted
    /// datasets — unless another server took them over meanwhile (it
    /// judged this one stopped), which is an error to log: this server's
    /// later persists would write over that one's. Whether it wrote any.
    pub async fn beat(&self, persist: bool) -> Result<bool> {
        let spilled = {
            // Held while writing: a spill's end must not delete the record
            // between the check and the write.
            let folders = self.spill_folders.lock().await;
            if *folders > 0 {
                let path = self.session_record();
                self.write_record(&path, PutMode::Overwrite)
                    .await
                    .map_err(|e| store_error(&format!("writing {path} to {}", self.url), e))?;
            }
            *folders > 0
        };
        if persist {
            let path = self.persist_record();
            if let Some(Seen {
                holder: Some(h), ..
            }) = self.read_record(&path).await?
                && h.session != self.holder.session
            {
                return Err(Error::FailedPrecondition(format!(
                    "another server ({}) has taken over the persisted datasets of {} after \
                     this one missed its beats; stop this server: what it persists from now \
                     on would write over that one's",
                    h.describe(),
                    self.url
                )));
            }
            self.write_record(&path, PutMode::Overwrite)
                .await
                .map_err(|e| store_error(&format!("writing {path} to {}", self.url), e))?;
        }
        Ok(spilled || persist)
    }

    /// Removes the spill folders of servers that stopped without shutting
    /// down ([`judge`]); a folder whose record is missing is judged by its
    /// newest file. Returns how many folders it removed.
    pub async fn remove_stopped_sessions(&self) -> Result<usize> {
        let dir = self.spill_root();
        let listing = match self.store.list_with_delimiter(Some(&dir)).await {
            Ok(l) => l,
            Err(object_store::Error::NotFound { .. }) => return Ok(0),
            Err(e) => return Err(store_error(&format!("listing {dir} in {}", self.url), e)),
        };
        let here = self.holder.process.as_ref();
        let stopped = |holder: Option<&Holder>, age| {
            let verdict = judge(
                here,
                holder,
                age,
                self.timing.stopped_after,
                start_of_running,
            );
            verdict == Verdict::Stopped
        };
        let mut removed = 0;
        for session in listing.common_prefixes {
            if session.filename() == Some(self.holder.session.as_str()) {
                continue;
            }
            // The record first: a running server's files are not listed.
            let seen = self.read_record(&session.clone().join(RECORD)).await?;
            if let Some(seen) = &seen
                && !stopped(seen.holder.as_ref(), seen.age)
            {
                continue;
            }
            let files: Vec<object_store::ObjectMeta> = self
                .store
                .list(Some(&session))
                .try_collect()
                .await
                .map_err(|e| store_error(&format!("listing {session} in {}", self.url), e))?;
            if files.is_empty() {
                continue;
            }
            let (holder, age) = match seen {
                Some(seen) => (seen.holder, seen.age),
                None => {
                    // No record (written before a session's first file):
                    // judged by its newest file.
                    let age = files.iter().map(age_of).min().unwrap_or(Duration::MAX);
                    if !stopped(None, age) {
                        continue;
                    }
                    (None, age)
                }
            };
            let bytes: u64 = files.iter().map(|f| f.size).sum();
            let paths: Vec<Path> = files.iter().map(|f| f.location.clone()).collect();
            self.delete_each(&paths).await?;
            removed += 1;
            let server = holder.map_or_else(|| "unknown".to_string(), |h| h.describe());
            info!(
                session = %session,
                server = %server,
                files = files.len(),
                bytes,
                last_written_secs = age.as_secs(),
                "removed the spill files of a server that stopped without shutting down"
            );
        }
        Ok(removed)
    }

    /// Claims the store's persisted datasets for this server (`--persist`):
    /// refuses, naming it, while another server holds them; takes them over
    /// from one that stopped — at once where [`judge`] can tell, otherwise
    /// after watching its record for [`Timing::watch`] without a new beat.
    pub async fn claim(&self) -> Result<()> {
        let path = self.persist_record();
        let write_error = |e| store_error(&format!("writing {path} to {}", self.url), e);
        // A few rounds: another server may claim between a read and a write.
        for _ in 0..3 {
            let Some(seen) = self.read_record(&path).await? else {
                match self.write_record(&path, PutMode::Create).await {
                    Ok(()) => return Ok(()),
                    Err(object_store::Error::AlreadyExists { .. }) => continue,
                    // Stores without conditional writes: first come.
                    Err(object_store::Error::NotImplemented { .. }) => {
                        return self
                            .write_record(&path, PutMode::Overwrite)
                            .await
                            .map_err(write_error);
                    }
                    Err(e) => return Err(write_error(e)),
                }
            };
            let holder = seen.holder.as_ref();
            if holder.is_some_and(|h| h.session == self.holder.session) {
                return Ok(());
            }
            let named = holder.map_or_else(
                || "a server whose record is damaged".to_string(),
                |h| format!("another flightdeck server ({})", h.describe()),
            );
            let in_use = |seen_ago: Duration| {
                Error::FailedPrecondition(format!(
                    "the persisted datasets in {} are held by {named}, which wrote its record \
                     {}s ago: every server started with --persist needs a store of its own \
                     (servers persisting into one would write over each other's datasets); \
                     give this one another --data-dir or --spill-url (one prefix per node, \
                     e.g. s3://bucket/flightdeck/NODE_NAME), or stop that server first",
                    self.url,
                    seen_ago.as_secs()
                ))
            };
            let verdict = judge(
                self.holder.process.as_ref(),
                holder,
                seen.age,
                self.timing.stopped_after,
                start_of_running,
            );
            match verdict {
                Verdict::Running => return Err(in_use(seen.age)),
                Verdict::Unsure => {
                    info!(
                        store = %self.url,
                        holder = %named,
                        last_written_secs = seen.age.as_secs(),
                        watch_secs = self.timing.watch.as_secs(),
                        "the store's persisted datasets are held by another server that this \
                         one cannot check: watching its record for a beat before taking over"
                    );
                    if let Some(ago) = self.beats_within(&path, seen.beat).await? {
                        return Err(in_use(ago));
                    }
                }
                Verdict::Stopped => {}
            }
            warn!(
                store = %self.url,
                holder = %named,
                last_written_secs = seen.age.as_secs(),
                "taking over the persisted datasets of a server that stopped without \
                 shutting down"
            );
            return self
                .write_record(&path, PutMode::Overwrite)
                .await
                .map_err(write_error);
        }
        Err(Error::Unavailable(format!(
            "the record of who holds the persisted datasets in {} kept changing while this \
             server read it: another server is starting on the same store; give each server a \
             store of its own",
            self.url
        )))
    }

    /// Watches the record at `path`, last seen at `beat`, for
    /// [`Timing::watch`]: how long ago it was rewritten, if it was.
    async fn beats_within(&self, path: &Path, beat: u64) -> Result<Option<Duration>> {
        let until = tokio::time::Instant::now() + self.timing.watch;
        let every = (self.timing.beat / 4).max(Duration::from_millis(10));
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(every).await;
            match self.read_record(path).await? {
                Some(seen) if seen.beat != beat => return Ok(Some(seen.age)),
                // Released (it shut down) or rewritten the same: keep watching.
                _ => {}
            }
        }
        Ok(None)
    }

    /// Gives the store's persisted datasets up at shutdown, if this server
    /// still holds them.
    pub async fn release(&self) -> Result<()> {
        let path = self.persist_record();
        if let Some(Seen {
            holder: Some(h), ..
        }) = self.read_record(&path).await?
            && h.session == self.holder.session
        {
            self.delete_each(&[path]).await?;
        }
        Ok(())
    }

    /// Removes the generations of persisted datasets that nothing serves:
    /// one older than its dataset's served generation (an overwrite stopped
    /// before it removed the old files) and one without a manifest (a
    /// persist stopped before it finished). `files` are those under `dir`
    /// (`datasets/`), listed as `served` was reloaded from them; only the
    /// holder of the store ([`Store::claim`]) may, at start: nothing is
    /// being written then. Returns how many it removed.
    pub(super) async fn remove_superseded(
        &self,
        dir: &Path,
        files: &[object_store::ObjectMeta],
        served: &[PersistedDataset],
    ) -> Result<usize> {
        let depth = dir.parts().count();
        // …/datasets/NAME/GENERATION/FILE: each generation's files, and
        // whether it has a manifest.
        let mut generations: std::collections::BTreeMap<
            Path,
            (Vec<&object_store::ObjectMeta>, bool),
        > = Default::default();
        for f in files
            .iter()
            .filter(|f| f.location.parts().count() == depth + 3)
        {
            let (files, manifest) = generations.entry(parent(&f.location)).or_default();
            files.push(f);
            *manifest |= f.location.filename() == Some("manifest.json");
        }
        let mut removed = 0;
        for (generation, (files, has_manifest)) in generations {
            let number: Option<u64> = generation.filename().and_then(|g| g.parse().ok());
            let superseded = served.iter().any(|ds| {
                parent(&ds.stored.dir) == parent(&generation)
                    && number.is_some_and(|n| n < ds.generation)
            });
            let why = match (has_manifest, superseded) {
                (false, _) => "never finished (no manifest)",
                (true, true) => "superseded by a newer generation",
                (true, false) => continue,
            };
            let paths: Vec<Path> = files.iter().map(|f| f.location.clone()).collect();
            self.delete_each(&paths).await?;
            removed += 1;
            info!(
                generation = %generation,
                files = files.len(),
                bytes = files.iter().map(|f| f.size).sum::<u64>(),
                why,
                "removed a persisted generation that nothing serves"
            );
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use arrow::array::{Int64Array, RecordBatch};
    use proptest::prelude::*;

    use super::*;
    use crate::catalog::SealedData;
    use crate::memory::spill::Stored;

    fn process(machine: &str, pid: u32, start: u64) -> Process {
        Process {
            machine: machine.to_string(),
            pid_namespace: "pid:[1]".to_string(),
            pid,
            start,
        }
    }

    fn holder(process: Option<Process>) -> Holder {
        Holder {
            session: "7-1".to_string(),
            host: "node-a".to_string(),
            location: "grpc://10.0.0.1:50051".to_string(),
            process,
        }
    }

    const MINUTE: Duration = Duration::from_secs(60);

    /// Each way a record can be judged, as a table.
    #[test]
    fn a_server_is_stopped_only_where_that_can_be_told() {
        let here = process("boot-a", 10, 500);
        // Process 20 runs here, started at tick 900.
        let start_of = |pid: u32| (pid == 20).then_some(900);
        let cases = [
            (Some(process("boot-a", 20, 900)), MINUTE, Verdict::Running),
            // Running however old its record: its beats may be failing.
            (
                Some(process("boot-a", 20, 900)),
                MINUTE * 60,
                Verdict::Running,
            ),
            // Its pid now another process's, or no one's.
            (Some(process("boot-a", 20, 800)), MINUTE, Verdict::Stopped),
            (Some(process("boot-a", 30, 900)), MINUTE, Verdict::Stopped),
            // Another machine (or boot): only its silence tells.
            (Some(process("boot-b", 20, 900)), MINUTE, Verdict::Unsure),
            (
                Some(process("boot-b", 20, 900)),
                MINUTE * 10,
                Verdict::Stopped,
            ),
            (None, MINUTE, Verdict::Unsure),
            (None, MINUTE * 11, Verdict::Stopped),
        ];
        for (there, age, verdict) in cases {
            let there = holder(there);
            assert_eq!(
                judge(Some(&here), Some(&there), age, MINUTE * 10, start_of),
                verdict,
                "{there:?} {age:?}"
            );
        }
        // Another pid namespace: its pids mean other processes.
        let mut there = process("boot-a", 20, 900);
        there.pid_namespace = "pid:[2]".to_string();
        let there = holder(Some(there));
        assert_eq!(
            judge(Some(&here), Some(&there), MINUTE, MINUTE * 10, start_of),
            Verdict::Unsure
        );
        // A damaged record, or a process that cannot see /proc.
        assert_eq!(
            judge(Some(&here), None, MINUTE, MINUTE * 10, start_of),
            Verdict::Unsure
        );
        assert_eq!(
            judge(None, Some(&there), MINUTE * 10, MINUTE * 10, start_of),
            Verdict::Stopped
        );
    }

    proptest! {
        /// A record is judged running only when its very process runs
        /// beside this one, and stopped, whoever wrote it, once silent for
        /// `stopped_after` unless its process runs here.
        #[test]
        fn running_means_its_process_is_found(
            same_machine: bool,
            pid in 1u32..50,
            start in 0u64..4,
            age_secs in 0u64..2000,
            running in proptest::option::of(0u64..4),
        ) {
            let here = process("boot-a", 99, 0);
            let machine = if same_machine { "boot-a" } else { "boot-b" };
            let there = holder(Some(process(machine, pid, start)));
            let age = Duration::from_secs(age_secs);
            let verdict = judge(Some(&here), Some(&there), age, MINUTE * 10, |_| running);
            let runs_here = same_machine && running == Some(start);
            prop_assert_eq!(verdict == Verdict::Running, runs_here);
            if age >= MINUTE * 10 && !runs_here {
                prop_assert_eq!(verdict, Verdict::Stopped);
            }
        }
    }

    #[test]
    fn a_record_round_trips_and_a_damaged_one_is_none() {
        for h in [holder(Some(process("boot-a", 3, 4))), holder(None)] {
            assert_eq!(Holder::parse(&h.to_json(17)), Some((h, 17)));
        }
        assert_eq!(Holder::parse(b"{\"session\": 3}"), None);
        assert_eq!(Holder::parse(b"not json"), None);
    }

    /// This process runs; a child killed and not yet reaped (a zombie) has
    /// stopped, though its pid is still taken.
    #[test]
    fn a_killed_process_has_stopped_before_it_is_reaped() {
        let me = Process::current().expect("/proc tells this process");
        assert_eq!(start_of_running(me.pid), Some(me.start));
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("starts sleep");
        let pid = child.id();
        assert!(start_of_running(pid).is_some());
        child.kill().expect("kills");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while running(pid).is_some_and(|(state, _)| state != 'Z') {
            assert!(std::time::Instant::now() < deadline, "not killed");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(running(pid).is_some(), "still a zombie, not reaped");
        assert_eq!(start_of_running(pid), None);
        child.wait().expect("reaps");
    }

    /// Another server's session on the same store (same objects, its own
    /// session and record).
    fn other(store: &Store, session: &str, process: Option<Process>) -> Store {
        Store {
            holder: Holder {
                session: session.to_string(),
                process,
                ..store.holder.clone()
            },
            beats: Arc::default(),
            spill_folders: Arc::default(),
            ..store.clone()
        }
    }

    /// Rewrites the record of `store`'s session to say it is `process`'s.
    async fn says(store: &Store, process: Process) {
        let rewritten = other(store, &store.holder.session, Some(process));
        *rewritten.spill_folders.lock().await = 1;
        rewritten.beat(false).await.expect("beats");
    }

    fn data() -> SealedData {
        let ids: arrow::array::ArrayRef = Arc::new(Int64Array::from_iter_values(0..100));
        let batch = RecordBatch::try_from_iter([("id", ids)]).expect("batch");
        SealedData::from_batches(batch.schema(), vec![], vec![batch])
    }

    /// `rel` (`a/b/c`) under the store's root.
    fn under(store: &Store, rel: &str) -> Path {
        let rel = Path::parse(rel).expect("path");
        Path::from_iter(store.root.parts().chain(rel.parts()))
    }

    async fn files(store: &Store, rel: &str) -> Vec<String> {
        let dir = under(store, rel);
        let mut found: Vec<String> = store
            .store
            .list(Some(&dir))
            .map_ok(|m| m.location.to_string())
            .try_collect()
            .await
            .expect("lists");
        found.sort();
        found
    }

    /// A session's record comes with its first spill and goes with its
    /// last; a stopped server's spill files are removed by another
    /// server, a running one's are kept.
    #[tokio::test]
    async fn a_stopped_servers_spill_files_are_removed_and_a_running_ones_kept() {
        let a = Store::open("memory://").expect("opens");
        let me = a.holder.process.clone().expect("/proc tells this process");
        let x = a.write("x", 1, &data(), None).await.expect("spills");
        let y = a.write("y", 2, &data(), None).await.expect("spills");
        let session = format!("spill/{}", a.holder.session);
        assert_eq!(
            files(&a, &session).await.len(),
            3,
            "two files and the record"
        );
        a.delete(&x).await.expect("deletes");
        assert_eq!(files(&a, &session).await.len(), 2);
        a.delete(&y).await.expect("deletes");
        assert_eq!(
            files(&a, &session).await,
            Vec::<String>::new(),
            "the record went last"
        );
        a.write("x", 3, &data(), None).await.expect("spills");

        // Another server in this very process: `a`'s process runs.
        let b = other(&a, "b", Some(me.clone()));
        assert_eq!(b.remove_stopped_sessions().await.expect("cleans"), 0);
        assert_eq!(files(&a, &session).await.len(), 2);
        // `a`'s record now says it ran on another machine: not told apart
        // from a running server until it has been silent long enough.
        says(&a, process("boot-elsewhere", me.pid, me.start)).await;
        assert_eq!(b.remove_stopped_sessions().await.expect("cleans"), 0);
        let impatient = Store {
            timing: Timing {
                stopped_after: Duration::ZERO,
                ..Timing::DEFAULT
            },
            ..b.clone()
        };
        assert_eq!(
            impatient.remove_stopped_sessions().await.expect("cleans"),
            1
        );
        assert_eq!(files(&a, &session).await, Vec::<String>::new());

        // A record naming this machine's process that is gone: at once.
        a.write("z", 4, &data(), None).await.expect("spills");
        let gone = Process {
            start: me.start + 1,
            ..me.clone()
        };
        says(&a, gone.clone()).await;
        assert_eq!(b.remove_stopped_sessions().await.expect("cleans"), 1);
        assert_eq!(files(&a, &session).await, Vec::<String>::new());
        // Its own session is never another's to remove.
        b.write("w", 1, &data(), None).await.expect("spills");
        says(&b, gone).await;
        assert_eq!(b.remove_stopped_sessions().await.expect("cleans"), 0);
        assert_eq!(files(&b, "spill/b").await.len(), 2);
    }

    /// Spill files of a session without a record (a server of an earlier
    /// build, or files whose record is lost) are judged by the newest.
    #[tokio::test]
    async fn a_session_without_a_record_is_judged_by_its_newest_file() {
        let dir = std::env::temp_dir().join(format!("flightdeck-beat-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let old = dir.join("spill/1-1/x/1/data.parquet");
        let new = dir.join("spill/2-2/x/1/data.parquet");
        for f in [&old, &new] {
            std::fs::create_dir_all(f.parent().expect("parent")).expect("dirs");
            std::fs::write(f, b"PAR1").expect("writes");
        }
        let an_hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
        std::fs::File::options()
            .write(true)
            .open(&old)
            .and_then(|f| f.set_modified(an_hour_ago))
            .expect("sets mtime");
        let store = Store::open(&dir.display().to_string()).expect("opens");
        assert_eq!(store.remove_stopped_sessions().await.expect("cleans"), 1);
        assert!(!old.exists() && new.exists());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    /// One server at a time holds a store's persisted datasets: a second
    /// is refused, naming the first, until the first gives them up; a
    /// holder that was taken over learns it at its next beat.
    #[tokio::test]
    async fn a_second_server_is_refused_the_persisted_datasets_while_the_first_holds_them() {
        let a = Store::open("memory://")
            .expect("opens")
            .serving_at("grpc://10.0.0.1:50051");
        let me = a.holder.process.clone().expect("/proc tells this process");
        a.claim().await.expect("claims an empty store");
        a.claim().await.expect("claims again what it holds");
        let b = other(&a, "b", Some(me.clone()));
        let err = b.claim().await.expect_err("held by a");
        let text = err.to_string();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err:?}");
        for said in [
            format!("pid {} ", me.pid),
            "serving at grpc://10.0.0.1:50051".to_string(),
            "needs a store of its own".to_string(),
        ] {
            assert!(text.contains(&said), "{said:?} not in: {text}");
        }
        a.release().await.expect("releases");
        b.claim().await.expect("claims what a gave up");
        b.release().await.expect("releases");

        // `a` stopped without shutting down: taken over at once.
        let a_gone = other(
            &a,
            &a.holder.session,
            Some(Process {
                start: me.start + 1,
                ..me.clone()
            }),
        );
        a_gone.claim().await.expect("claims");
        b.claim().await.expect("takes over from a stopped server");
        let err = a.beat(true).await.expect_err("taken over");
        assert!(err.to_string().contains("has taken over"), "{err}");
    }

    /// A holder this process cannot check (another machine's) is watched:
    /// refused while it beats, taken over once it stops beating.
    #[tokio::test]
    async fn a_holder_on_another_machine_is_watched_for_beats() {
        let timing = Timing {
            beat: Duration::from_millis(20),
            watch: Duration::from_millis(300),
            stopped_after: Duration::from_secs(600),
        };
        let b = Store {
            timing,
            ..Store::open("memory://").expect("opens")
        };
        let remote = other(&b, "remote", Some(process("boot-elsewhere", 1, 1)));
        remote.claim().await.expect("claims");
        let beating = {
            let remote = remote.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    let _ = remote.beat(true).await;
                }
            })
        };
        let err = b.claim().await.expect_err("the holder beats");
        assert!(err.to_string().contains("on host"), "{err}");
        beating.abort();
        let _ = beating.await;
        let started = tokio::time::Instant::now();
        b.claim().await.expect("takes over a silent holder");
        assert!(started.elapsed() >= timing.watch);
    }

    /// Generations nothing serves — older than the served one, or without
    /// a manifest — are removed; the served one and a damaged manifest's
    /// (left for an operator to look at) are kept.
    #[tokio::test]
    async fn generations_nothing_serves_are_removed() {
        let store = Store::open("memory://").expect("opens");
        let put = |rel: &str| {
            let path = under(&store, &format!("datasets/{rel}"));
            let s = store.store.clone();
            async move {
                s.put(&path, PutPayload::from_static(b"x"))
                    .await
                    .expect("puts");
            }
        };
        for p in [
            "a/1/data.parquet",
            "a/1/manifest.json",
            "a/2/data.parquet",
            "a/2/manifest.json",
            "b/5/data.parquet",
            "c/3/data.parquet",
            "c/3/manifest.json",
        ] {
            put(p).await;
        }
        let served = PersistedDataset {
            name: "a".to_string(),
            generation: 2,
            schema: Arc::new(arrow::datatypes::Schema::empty()),
            partitions: vec![],
            stored: Stored {
                dir: under(&store, "datasets/a/2"),
                persisted: true,
            },
            cluster: None,
        };
        let dir = under(&store, "datasets");
        let listed: Vec<object_store::ObjectMeta> = store
            .store
            .list(Some(&dir))
            .try_collect()
            .await
            .expect("lists");
        assert_eq!(
            store
                .remove_superseded(&dir, &listed, &[served])
                .await
                .expect("removes"),
            2
        );
        let left: Vec<String> = files(&store, "datasets")
            .await
            .into_iter()
            .map(|f| f.rsplit("datasets/").next().unwrap_or_default().to_string())
            .collect();
        assert_eq!(
            left,
            [
                "a/2/data.parquet",
                "a/2/manifest.json",
                "c/3/data.parquet",
                "c/3/manifest.json"
            ]
        );
    }
}
