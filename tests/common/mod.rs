//! Fixture for end-to-end tests: a real flightdeck server on a loopback port
//! chosen by the OS, real Flight clients, and a synthetic dataset whose every
//! value can be recomputed from its row id and attempt, so a test can check
//! every column of every row it reads.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arrow::array::{
    Array, ArrayRef, AsArray, BooleanArray, FixedSizeListArray, Float32Array, Int64Array,
    ListArray, RecordBatch, StringArray, TimestampMicrosecondArray, UInt32Array,
};
use arrow::datatypes::{
    DataType, Field, Float32Type, Int32Type, Int64Type, Schema, SchemaRef, TimeUnit,
    TimestampMicrosecondType, UInt32Type,
};
use flightdeck_client::Client;
use flightdeck_server::{ServeError, ServerConfig};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Upper bound for any single step of a test on this machine (see
/// [`scaled`]); a hung server fails the test instead of hanging CI.
pub const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// `d` times `FLIGHTDECK_TEST_TIME_SCALE` (default 1): every wall-clock
/// bound in the tests goes through it, so a slower machine (or a sanitizer
/// build) scales them all with one variable instead of failing.
pub fn scaled(d: Duration) -> Duration {
    let scale = std::env::var("FLIGHTDECK_TEST_TIME_SCALE")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0)
        .unwrap_or(1.0);
    d.mul_f64(scale)
}

/// Waits until `probe` finds what it looks for (`Some`), asking again after
/// a pause that grows from 5 ms to 100 ms, within [`STEP_TIMEOUT`],
/// [`scaled`]; panics naming `what` and the last value seen otherwise. For
/// server state no call waits on (live bytes, a job's state): a changed
/// state is seen within a pause of its change.
pub async fn eventually<T, S: std::fmt::Debug, Fut>(what: &str, mut probe: impl FnMut() -> Fut) -> T
where
    Fut: Future<Output = Result<T, S>>,
{
    let limit = scaled(STEP_TIMEOUT);
    let deadline = tokio::time::Instant::now() + limit;
    let mut pause = Duration::from_millis(5);
    loop {
        match probe().await {
            Ok(found) => return found,
            Err(seen) => assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: not within {limit:?}; last seen {seen:?}"
            ),
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

/// Runs `f` under [`STEP_TIMEOUT`], [`scaled`].
pub async fn timed<T>(what: &str, f: impl Future<Output = T>) -> T {
    let limit = scaled(STEP_TIMEOUT);
    match tokio::time::timeout(limit, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {limit:?}"),
    }
}

/// Every shard of `p`, each read from the member its endpoint names.
pub async fn read_all(c: &mut Client, p: &flightdeck_client::Plan) -> Vec<Vec<RecordBatch>> {
    let mut out = Vec::new();
    for shard in &p.shards {
        out.push(read_shard(c, shard).await);
    }
    out
}

/// One shard's batches, read from the member its endpoint names.
pub async fn read_shard(c: &mut Client, shard: &flightdeck_client::Shard) -> Vec<RecordBatch> {
    use futures::TryStreamExt;
    let stream = timed("read", c.read_shard(shard)).await.expect("read");
    timed("rows", stream.try_collect()).await.expect("rows")
}

/// The raw bytes of a `DoGet` stream (every message's IPC header and
/// body), for byte-for-byte comparisons.
pub async fn raw_bytes(client: &mut Client, ticket: bytes::Bytes) -> Vec<u8> {
    use futures::StreamExt;
    let mut stream = timed(
        "do_get",
        client
            .flight()
            .inner_mut()
            .do_get(arrow_flight::Ticket::new(ticket)),
    )
    .await
    .expect("do_get")
    .into_inner();
    let mut out = Vec::new();
    while let Some(msg) = timed("next message", stream.next()).await {
        let msg = msg.expect("message");
        out.extend_from_slice(&msg.data_header);
        out.extend_from_slice(&msg.data_body);
    }
    out
}

/// A fresh folder under the system's temporary directory, removed with
/// everything in it when dropped (kept, and named on stderr, when the test
/// is failing, so its logs and files can be read).
pub struct TempDir(std::path::PathBuf);

impl TempDir {
    /// Its path.
    pub fn path(&self) -> &std::path::Path {
        &self.0
    }
}

impl std::ops::Deref for TempDir {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kept {} for the failing test", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A fresh [`TempDir`] named after `tag`.
pub fn temp_dir(tag: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!(
        "flightdeck-test-{tag}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    TempDir(dir)
}

/// Default settings, but spills go to memory (no files from tests) and the
/// CUDA driver is used only where the GPU checks ask for it.
pub fn test_config() -> ServerConfig {
    ServerConfig {
        spill_url: Some("memory://".to_string()),
        use_cuda: std::env::var_os("FLIGHTDECK_GPU_TESTS").is_some(),
        ..ServerConfig::default()
    }
}

/// A server running in this process on `127.0.0.1:<free port>`.
pub struct TestServer {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    handle: JoinHandle<Result<(), ServeError>>,
}

impl TestServer {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A server with a 1 GiB memory limit, an in-memory spill store, and
    /// otherwise default settings.
    pub async fn start() -> Self {
        Self::start_with(ServerConfig {
            memory_limit: 1 << 30,
            ..test_config()
        })
        .await
    }

    /// A server with `config` (its `listen` is ignored: port 0 on loopback).
    pub async fn start_with(config: ServerConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let (tx, rx) = oneshot::channel::<()>();
        let handle = tokio::spawn(flightdeck_server::serve(listener, config, async {
            let _ = rx.await;
        }));
        Self {
            addr,
            shutdown: Some(tx),
            handle,
        }
    }

    /// `http://127.0.0.1:<port>`.
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A new client on its own connection.
    pub async fn client(&self) -> Client {
        timed("connect", Client::connect(self.uri()))
            .await
            .expect("connect to the test server")
    }

    /// Stops the server and waits for it to finish cleanly.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        let handle = &mut self.handle;
        timed("server shutdown", handle)
            .await
            .expect("server task")
            .expect("server stops cleanly");
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A loopback TCP proxy in front of a server whose connections can be cut at
/// once, as when an executor dies or the network drops mid-stream.
pub struct CutProxy {
    addr: SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl CutProxy {
    /// Proxies `127.0.0.1:<free port>` to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut_rx.wait_for(|&c| c) => {}
                    }
                    // Dropping both sockets closes them mid-stream.
                });
            }
        });
        Self { addr, cut, task }
    }

    /// `http://127.0.0.1:<proxy port>`.
    pub fn uri(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Closes every proxied connection now and stops accepting.
    pub fn cut(self) {
        let _ = self.cut.send(true);
        self.task.abort();
    }
}

/// The schema of the synthetic dataset: many types, nulls, lists.
pub fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("attempt", DataType::UInt32, false),
        Field::new("x", DataType::Float32, false),
        Field::new("name", DataType::Utf8, true),
        Field::new("flag", DataType::Boolean, false),
        Field::new(
            "ts",
            DataType::Timestamp(TimeUnit::Microsecond, Some("UTC".into())),
            false,
        ),
        Field::new(
            "vec",
            DataType::FixedSizeList(Arc::new(Field::new("item", DataType::Float32, false)), 4),
            false,
        ),
        Field::new(
            "tags",
            DataType::List(Arc::new(Field::new("item", DataType::Int32, true))),
            true,
        ),
    ]))
}

fn name_of(id: i64, attempt: u32) -> Option<String> {
    (id % 7 != 0).then(|| format!("row-{id}-a{attempt}"))
}

fn x_of(id: i64, attempt: u32) -> f32 {
    id as f32 * 0.5 + attempt as f32
}

fn vec_of(id: i64, attempt: u32) -> [f32; 4] {
    std::array::from_fn(|i| (id + i as i64) as f32 + attempt as f32)
}

fn tags_of(id: i64) -> Option<Vec<Option<i32>>> {
    (id % 11 != 5).then(|| {
        (0..(id % 4) as i32)
            .map(|i| (i != 2).then_some(id as i32 % 100 + i))
            .collect()
    })
}

/// One batch of rows `ids` written by attempt `attempt`.
pub fn batch(ids: std::ops::Range<i64>, attempt: u32) -> RecordBatch {
    let ids: Vec<i64> = ids.collect();
    let n = ids.len();
    let vec_values = Float32Array::from_iter_values(ids.iter().flat_map(|&id| vec_of(id, attempt)));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(Int64Array::from(ids.clone())),
        Arc::new(UInt32Array::from(vec![attempt; n])),
        Arc::new(Float32Array::from_iter_values(
            ids.iter().map(|&id| x_of(id, attempt)),
        )),
        Arc::new(StringArray::from_iter(
            ids.iter().map(|&id| name_of(id, attempt)),
        )),
        Arc::new(BooleanArray::from_iter(
            ids.iter().map(|&id| Some(id % 3 == 0)),
        )),
        Arc::new(
            TimestampMicrosecondArray::from_iter_values(
                ids.iter().map(|&id| 1_700_000_000_000_000 + id),
            )
            .with_timezone("UTC"),
        ),
        Arc::new(FixedSizeListArray::new(
            Arc::new(Field::new("item", DataType::Float32, false)),
            4,
            Arc::new(vec_values),
            None,
        )),
        Arc::new(ListArray::from_iter_primitive::<Int32Type, _, _>(
            ids.iter().map(|&id| tags_of(id)),
        )),
    ];
    RecordBatch::try_new(schema(), columns).expect("valid synthetic batch")
}

/// The batches of a partition holding rows `ids`, `chunk` rows per batch.
pub fn partition_batches(ids: std::ops::Range<i64>, attempt: u32, chunk: i64) -> Vec<RecordBatch> {
    let mut out = Vec::new();
    let mut start = ids.start;
    while start < ids.end {
        let end = (start + chunk).min(ids.end);
        out.push(batch(start..end, attempt));
        start = end;
    }
    out
}

/// Writes rows `ids` of the synthetic dataset ([`batch`]) as attempt
/// `attempt` of partition `p` of `ds`, in batches of `chunk` rows; the
/// server's acknowledgement.
pub async fn put_ids(
    c: &mut Client,
    ds: &str,
    p: u32,
    attempt: u32,
    ids: std::ops::Range<i64>,
    chunk: i64,
) -> Result<flightdeck_client::PutAck, flightdeck_client::ClientError> {
    let batches = partition_batches(ids, attempt, chunk);
    timed(
        "put",
        c.put_partition(
            ds,
            p,
            attempt,
            schema(),
            futures::stream::iter(batches.into_iter().map(Ok)),
        ),
    )
    .await
}

/// Checks every value of every row of `batch` (any projection of [`schema`]
/// that includes `id`) against the values attempt `attempt_of(id)` wrote.
/// Returns the ids in order.
pub fn check_batch(batch: &RecordBatch, attempt_of: &dyn Fn(i64) -> u32) -> Vec<i64> {
    let ids = batch
        .column_by_name("id")
        .expect("id column")
        .as_primitive::<Int64Type>();
    let ids: Vec<i64> = ids.values().to_vec();
    for (field, col) in batch.schema().fields().iter().zip(batch.columns()) {
        for (row, &id) in ids.iter().enumerate() {
            let a = attempt_of(id);
            let ctx = || format!("column {} row {row} id {id} attempt {a}", field.name());
            match field.name().as_str() {
                "id" => {}
                "attempt" => {
                    assert_eq!(col.as_primitive::<UInt32Type>().value(row), a, "{}", ctx())
                }
                "x" => assert_eq!(
                    col.as_primitive::<Float32Type>().value(row),
                    x_of(id, a),
                    "{}",
                    ctx()
                ),
                "name" => {
                    let s = col.as_string::<i32>();
                    let got = s.is_valid(row).then(|| s.value(row).to_string());
                    assert_eq!(got, name_of(id, a), "{}", ctx());
                }
                "flag" => assert_eq!(col.as_boolean().value(row), id % 3 == 0, "{}", ctx()),
                "ts" => assert_eq!(
                    col.as_primitive::<TimestampMicrosecondType>().value(row),
                    1_700_000_000_000_000 + id,
                    "{}",
                    ctx()
                ),
                "vec" => {
                    let l = col.as_fixed_size_list();
                    let v = l.value(row);
                    let got: Vec<f32> = v.as_primitive::<Float32Type>().values().to_vec();
                    assert_eq!(got, vec_of(id, a).to_vec(), "{}", ctx());
                }
                "tags" => {
                    let l = col.as_list::<i32>();
                    let got = l.is_valid(row).then(|| {
                        let v = l.value(row);
                        let v = v.as_primitive::<Int32Type>();
                        (0..v.len())
                            .map(|i| v.is_valid(i).then(|| v.value(i)))
                            .collect::<Vec<_>>()
                    });
                    assert_eq!(got, tags_of(id), "{}", ctx());
                }
                other => panic!("unexpected column {other}"),
            }
        }
    }
    ids
}

/// Winner attempt per row id, from partition layouts and winners.
pub fn attempts_by_id(
    layout: &[std::ops::Range<i64>],
    winners: &HashMap<u32, u32>,
) -> HashMap<i64, u32> {
    let mut out = HashMap::new();
    for (p, ids) in layout.iter().enumerate() {
        let a = winners.get(&(p as u32)).copied().unwrap_or(0);
        for id in ids.clone() {
            out.insert(id, a);
        }
    }
    out
}

/// Partition `p` of `sizes` holds the ids `layout[p]`, ids consecutive across
/// partitions from 0.
pub fn layout(sizes: &[i64]) -> Vec<std::ops::Range<i64>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|&n| {
            let r = start..start + n;
            start += n;
            r
        })
        .collect()
}

/// The `flightdeck` binary the process-based tests start:
/// `FLIGHTDECK_BIN`, else `target/debug/flightdeck` of this workspace.
pub fn server_binary() -> std::path::PathBuf {
    let path = std::env::var_os("FLIGHTDECK_BIN")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/debug/flightdeck")
        });
    assert!(
        path.exists(),
        "server binary {} not found: run `cargo build --bin flightdeck` first (scripts/test.sh \
         does)",
        path.display()
    );
    path
}

/// Starts the server binary with `args` and `--no-cuda`, its stderr into
/// the file `log`; the lines of its stdout as they come, for
/// [`STEP_TIMEOUT`] (scaled) at most, since a server that never says it
/// listens must not hold a test up.
pub fn spawn_server(
    args: &[String],
    log: &std::path::Path,
) -> (std::process::Child, impl Iterator<Item = String> + use<>) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(server_binary())
        .args(args)
        .arg("--no-cuda")
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(log).expect("log file"))
        .spawn()
        .expect("start flightdeck");
    let stdout = child.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let deadline = std::time::Instant::now() + scaled(STEP_TIMEOUT);
    let lines = std::iter::from_fn(move || {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        rx.recv_timeout(left).ok()
    });
    (child, lines)
}

/// A `flightdeck serve` child process: one member of a cluster. Its log
/// is kept in a file; it is killed when dropped, so a failing assertion
/// never leaves servers behind.
pub struct MemberProcess {
    child: std::process::Child,
    addr: SocketAddr,
    /// Its stderr.
    pub log: std::path::PathBuf,
    args: Vec<String>,
    /// Holds the log; removed after the process is killed.
    _dir: TempDir,
}

impl MemberProcess {
    /// Starts a member on `listen` (e.g. `127.0.0.1:0`) with extra flags.
    pub fn start(listen: &str, extra: &[&str]) -> Self {
        let dir = temp_dir("member");
        let log = dir.join("stderr.log");
        let mut args = vec!["serve".to_string(), "--listen".into(), listen.into()];
        args.extend(extra.iter().map(|s| s.to_string()));
        if !extra.contains(&"--spill-url") {
            args.extend(["--spill-url".into(), "memory://".into()]);
        }
        if !extra.contains(&"--memory-limit") {
            args.extend(["--memory-limit".into(), "1GiB".into()]);
        }
        let (mut child, mut lines) = spawn_server(&args, &log);
        let addr = lines.find_map(|line| {
            line.strip_prefix("flightdeck listening on ")
                .map(|a| a.trim().to_string())
        });
        let addr = match addr.ok_or(()) {
            Ok(a) => a.parse().expect("address"),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "member did not start: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
        };
        Self {
            child,
            addr,
            log,
            args,
            _dir: dir,
        }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its location, as it advertises itself (`grpc://127.0.0.1:<port>`).
    pub fn location(&self) -> String {
        format!("grpc://{}", self.addr)
    }

    /// A client on a new connection.
    pub async fn client(&self) -> Client {
        timed("connect", Client::connect(self.location()))
            .await
            .expect("connect to a member")
    }

    /// Kills it at once (SIGKILL), as a node failure would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its resident memory now, in bytes (`VmRSS`).
    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the member's /proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("VmRSS")
            * 1024
    }

    /// Starts it again on the same address with the same flags.
    pub fn restart(&mut self) {
        self.kill();
        let listen = self.addr.to_string();
        let extra: Vec<&str> = self.args[3..].iter().map(String::as_str).collect();
        // The port may linger briefly after the kill.
        let deadline = std::time::Instant::now() + scaled(STEP_TIMEOUT);
        loop {
            if std::net::TcpListener::bind(self.addr).is_ok() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "port {listen} stays taken"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        *self = Self::start(&listen, &extra);
    }
}

impl Drop for MemberProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("log of member {}: {}", self.addr, self.log.display());
        }
    }
}

/// A test certificate authority and a server certificate it signed, for
/// `127.0.0.1` and `localhost`, made with the `openssl` command in `dir`.
pub struct TestCerts {
    /// The authority's certificate (PEM): what clients trust.
    pub ca: std::path::PathBuf,
    /// The server's certificate (PEM).
    pub cert: std::path::PathBuf,
    /// The server's private key (PEM).
    pub key: std::path::PathBuf,
}

impl TestCerts {
    /// Makes them; fails the test if `openssl` cannot.
    pub fn make(dir: &std::path::Path) -> Self {
        let run = |args: &[&str]| {
            let out = std::process::Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .expect("run openssl (needed for the TLS tests)");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        run(&[
            &["req", "-x509"][..],
            &ec,
            &[
                "-days",
                "2",
                "-subj",
                "/CN=flightdeck test CA",
                "-keyout",
                "ca.key",
                "-out",
                "ca.pem",
            ],
        ]
        .concat());
        run(&[
            &["req"][..],
            &ec,
            &[
                "-subj",
                "/CN=localhost",
                "-keyout",
                "key.pem",
                "-out",
                "server.csr",
            ],
        ]
        .concat());
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
             keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n",
        )
        .expect("extensions");
        run(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "server.ext",
            "-out",
            "cert.pem",
        ]);
        Self {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }
    }
}
