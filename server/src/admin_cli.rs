//! `flightdeck datasets | describe | drop | place | evict | stats | health | jobs |
//! sql | derive`: what a running server holds and does, and queries over
//! what it holds, for the person operating it, without a Python client or
//! a Flight SQL driver at hand.
//!
//! Each command is one call or a few (a listing describes every dataset it
//! lists) through the Rust client, so it follows the same names, tokens
//! (`FLIGHTDECK_TOKEN`) and TLS roots (`FLIGHTDECK_TLS_ROOT_CERTS`) as every
//! client. The text is made by pure functions of the server's replies,
//! tested apart from any server; with `--json` they print the replies as
//! JSON instead (one document, the message's fields by their .proto names,
//! a dataset's state as a word and its schema as fields; `sql`'s rows as
//! JSON lines, one object a row, printed as they arrive), for scripts. The
//! pieces every client command shares (`flightdeck train` too) are here:
//! `--server` ([`ServerArg`]) and the server's advice in command-line words
//! ([`CLI_TERMS`]).

use std::fmt::Write as _;

use arrow::ipc::convert::try_schema_from_ipc_buffer;
use arrow::util::display::{ArrayFormatter, FormatOptions};
use flightdeck_client::{
    Client, ClientError, ClusterLayout, DatasetInfo, DatasetState, JobStatus, ServerStats,
    StagedWrite,
};
use flightdeck_server::config::{show_age, show_size};
use futures::TryStreamExt;

/// The server's advice (in Flight's words, left) as a person at the command
/// line acts on it: the command line writes and reads no rows itself.
pub const CLI_TERMS: &[(&str, &str)] = &[
    (
        "write it with DoPut, or list datasets with ListFlights",
        "write it first (Spark's flightdeck data source, or a client's put_partition); \
         `flightdeck datasets` lists what the server holds",
    ),
    (
        "read it with DoGet (FlightDeckIterableDataset)",
        "read it with the Python client's FlightDeckIterableDataset",
    ),
    (
        "use action 'derive' to keep a result as a dataset",
        "use `flightdeck derive` to keep a result as a dataset",
    ),
    (
        "dropped with action 'drop'",
        "dropped with `flightdeck drop NAME`",
    ),
    (
        "read the dataset with DoGet instead",
        "read the dataset with the Python client's FlightDeckIterableDataset instead",
    ),
];

/// The server a command talks to.
#[derive(Debug, clap::Args)]
pub struct ServerArg {
    /// Server: `local` (this node's: FLIGHTDECK_URI, else 127.0.0.1),
    /// `host`, `host:port`, `grpc://…`, `grpc+tls://…` or
    /// `grpc+unix:///PATH` (a server's --unix-socket); port 50051 when none
    /// is given.
    #[arg(long, alias = "uri", default_value = "local")]
    server: String,
}

impl ServerArg {
    /// A client of the server, or why it cannot be reached (every cause:
    /// "connection refused", not only "transport error").
    pub async fn connect(&self) -> Result<Client, String> {
        Client::connect(&self.server).await.map_err(|e| {
            let hint = match e {
                ClientError::Transport(_) => {
                    "; is a server running there? Start one with `flightdeck serve`, or name \
                     another with --server"
                }
                _ => "",
            };
            format!(
                "cannot reach {}: {}{hint}",
                named_server(&self.server),
                with_causes(&e)
            )
        })
    }

    /// `e`, an error of a call to this server, in command-line words; one
    /// of the transport (the server stopped answering: hung, gone, cut
    /// off) says which server did not answer.
    pub fn said(&self, e: &ClientError) -> String {
        let text = e.text_in(CLI_TERMS);
        if !e.is_transport() {
            return text;
        }
        format!(
            "{} did not answer: {text}; is a flightdeck server running there? Name another with \
             --server",
            named_server(&self.server)
        )
    }
}

/// `name` as given and, where it stands for another location (`local`, a
/// host without a scheme or port), that location: `local
/// (grpc://127.0.0.1:50051)`.
fn named_server(name: &str) -> String {
    match flightdeck_client::server_location(name) {
        Ok(location) if location != name => format!("{name} ({location})"),
        _ => name.to_string(),
    }
}

/// `e` and each of its causes that it does not already say, `: ` apart.
fn with_causes(e: &dyn std::error::Error) -> String {
    flightdeck_client::with_causes(e.to_string(), e.source())
}

/// How a command prints the server's reply.
#[derive(Debug, clap::Args)]
pub struct Output {
    /// Print the reply as one JSON document (fields named as in
    /// flightdeck.proto) instead of text, for scripts.
    #[arg(long)]
    json: bool,
}

impl Output {
    /// Prints `text(reply)`, or with `--json` `json(reply)`.
    fn print<T: ?Sized>(
        &self,
        reply: &T,
        text: impl Fn(&T) -> String,
        json: impl Fn(&T) -> serde_json::Value,
    ) {
        if self.json {
            println!("{:#}", json(reply));
        } else {
            print!("{}", text(reply));
        }
    }
}

/// Flags of `flightdeck datasets`.
#[derive(Debug, clap::Args)]
pub struct DatasetsArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// List only the datasets whose names start with this.
    #[arg(default_value = "")]
    prefix: String,
}

/// Flags of `flightdeck describe` and `flightdeck drop`.
#[derive(Debug, clap::Args)]
pub struct DatasetArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// The dataset's name.
    dataset: String,
}

/// Flags of `flightdeck drop`.
#[derive(Debug, clap::Args)]
pub struct DropArgs {
    #[command(flatten)]
    dataset: DatasetArgs,
    /// Drop only what this write (an overwrite whose job is gone) staged to
    /// replace the dataset, which stays as it is; the write's attempts are
    /// refused from then on.
    #[arg(long, value_name = "WRITE")]
    staged_by: Option<String>,
}

/// Flags of `flightdeck place`.
#[derive(Debug, clap::Args)]
pub struct PlaceArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// The sealed dataset.
    dataset: String,
    /// Columns to copy (numeric, fixed_size_list of numbers, or a list of
    /// numbers whose rows all hold one number of values — Spark's
    /// `array<float>` — no nulls), comma-separated; every such column when
    /// not given.
    #[arg(long, value_delimiter = ',')]
    columns: Vec<String>,
    /// GPUs to copy them to (ordinals or cuda:N), comma-separated; device
    /// 0 when not given.
    #[arg(long, value_delimiter = ',', value_parser = crate::config::parse_gpu)]
    devices: Vec<u32>,
}

/// Flags of `flightdeck evict`.
#[derive(Debug, clap::Args)]
pub struct EvictArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// The dataset.
    dataset: String,
    /// GPUs to free (ordinals or cuda:N), comma-separated; every device
    /// when not given.
    #[arg(long, value_delimiter = ',', value_parser = crate::config::parse_gpu)]
    devices: Vec<u32>,
}

/// Flags of `flightdeck stats`.
#[derive(Debug, clap::Args)]
pub struct StatsArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
}

/// Flags of `flightdeck health`.
#[derive(Debug, clap::Args)]
pub struct HealthArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Give up after this long (e.g. 5s, 500ms): a probe's own timeout.
    #[arg(long, value_parser = flightdeck_server::config::parse_duration, default_value = "5s")]
    timeout: std::time::Duration,
}

/// Flags of `flightdeck jobs`.
#[derive(Debug, clap::Args)]
pub struct JobsArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// One job's id; every job since the server started when not given.
    job: Option<u64>,
}

/// Flags of `flightdeck sql`.
#[derive(Debug, clap::Args)]
pub struct SqlArgs {
    #[command(flatten)]
    server: ServerArg,
    /// Print the rows as JSON lines (one object a row, keyed by column
    /// name, every key on every line: nulls, NaN and infinities as null)
    /// instead of a table, for scripts.
    #[arg(long)]
    json: bool,
    /// Rows to print at most (0: all); by default 100 as a table and every
    /// row with --json. The rows past it are counted, not printed (with
    /// --json the count goes to stderr).
    #[arg(long)]
    max_rows: Option<usize>,
    /// A read-only SQL query; each sealed dataset is a table by its name
    /// (double-quote names that are not plain identifiers: "clicks-v2").
    query: String,
}

/// Rows `flightdeck sql` prints as a table when `--max-rows` is not given.
pub const SQL_ROWS_SHOWN: usize = 100;

/// Flags of `flightdeck derive`.
#[derive(Debug, clap::Args)]
pub struct DeriveArgs {
    #[command(flatten)]
    server: ServerArg,
    #[command(flatten)]
    output: Output,
    /// The new dataset (refused if it exists).
    target: String,
    /// The read-only SQL query whose result it keeps; each sealed dataset
    /// is a table by its name, and --source's also `source`.
    query: String,
    /// A dataset the query may also read as the table `source`.
    #[arg(long, default_value = "")]
    source: String,
}

/// `call` on a client of `server`, its error said in command-line words.
async fn on_server<T>(
    server: &ServerArg,
    call: impl AsyncFnOnce(&mut Client) -> flightdeck_client::Result<T>,
) -> Result<T, String> {
    let mut client = server.connect().await?;
    call(&mut client).await.map_err(|e| server.said(&e))
}

/// Runs `flightdeck datasets`: one line a dataset.
pub async fn datasets(args: DatasetsArgs) -> Result<(), String> {
    let (infos, staged) = on_server(&args.server, async |c| {
        let mut infos = Vec::new();
        for name in c.list_datasets_starting_with(&args.prefix).await? {
            match c.describe(&name).await {
                Ok(info) => infos.push(info),
                // Dropped since it was listed.
                Err(e) if e.code() == flightdeck_client::Code::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let mut staged = c.stats().await?.staged;
        staged.retain(|w| w.dataset.starts_with(&args.prefix));
        Ok((infos, staged))
    })
    .await?;
    args.output.print(
        &infos[..],
        |i| datasets_text(i) + &staged_text(&staged),
        |i| i.iter().map(dataset_json).collect(),
    );
    Ok(())
}

/// Runs `flightdeck describe`.
pub async fn describe(args: DatasetArgs) -> Result<(), String> {
    let info = on_server(&args.server, async |c| c.describe(&args.dataset).await).await?;
    args.output.print(&info, describe_text, dataset_json);
    Ok(())
}

/// Runs `flightdeck drop`.
pub async fn drop(args: DropArgs) -> Result<(), String> {
    let DropArgs {
        dataset: args,
        staged_by,
    } = args;
    let info = on_server(&args.server, async |c| match &staged_by {
        Some(write) => c.drop_replacement(&args.dataset, write).await,
        None => c.drop_dataset(&args.dataset).await,
    })
    .await?;
    let text = |i: &DatasetInfo| match &staged_by {
        Some(write) => format!(
            "dropped what write '{write}' staged to replace '{}': {} rows, {} of memory freed; \
             the dataset stays as it was\n",
            i.dataset,
            i.rows,
            show_size(i.bytes)
        ),
        None => format!("{}\n", dropped_text(i)),
    };
    args.output.print(&info, text, dataset_json);
    Ok(())
}

/// Runs `flightdeck place`: prints where the dataset's columns are then.
pub async fn place(args: PlaceArgs) -> Result<(), String> {
    let columns: Vec<&str> = args.columns.iter().map(String::as_str).collect();
    let info = on_server(&args.server, async |c| {
        c.place(&args.dataset, &columns, &args.devices).await
    })
    .await?;
    args.output.print(&info, placements_text, dataset_json);
    Ok(())
}

/// Runs `flightdeck evict`: prints where the dataset's columns are left.
pub async fn evict(args: EvictArgs) -> Result<(), String> {
    let info = on_server(&args.server, async |c| {
        c.evict(&args.dataset, &args.devices).await
    })
    .await?;
    args.output.print(&info, placements_text, dataset_json);
    Ok(())
}

/// Runs `flightdeck stats`.
pub async fn stats(args: StatsArgs) -> Result<(), String> {
    let stats = on_server(&args.server, async |c| c.stats().await).await?;
    args.output.print(&stats, stats_text, to_json);
    Ok(())
}

/// Runs `flightdeck health`: asks the server's gRPC health service (which
/// needs no token) whether it serves, and prints its answer. `SERVING`
/// succeeds; `NOT_SERVING` (a server draining after SIGTERM), no answer
/// within `--timeout`, or no server fail, saying which — an exec probe for
/// where an orchestrator's own gRPC probe cannot reach (TLS, with
/// `FLIGHTDECK_TLS_ROOT_CERTS`; a Unix socket).
pub async fn health(args: HealthArgs) -> Result<(), String> {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let server = named_server(&args.server.server);
    let ask = async {
        let client = args.server.connect().await?;
        let reply = HealthClient::new(client.channel())
            .check(HealthCheckRequest::default())
            .await
            .map_err(|s| format!("{server} did not answer its health check: {}", s.message()))?;
        Ok::<_, String>(reply.into_inner().status())
    };
    let status = tokio::time::timeout(args.timeout, ask)
        .await
        .map_err(|_| {
            format!(
                "{server} did not answer its health check within {:?}",
                args.timeout
            )
        })??;
    println!("{}", status.as_str_name());
    if status == ServingStatus::Serving {
        return Ok(());
    }
    Err(format!(
        "{server} is not serving ({}): it is shutting down, or not yet up",
        status.as_str_name()
    ))
}

/// Runs `flightdeck jobs`.
pub async fn jobs(args: JobsArgs) -> Result<(), String> {
    let list = on_server(&args.server, async |c| c.jobs(args.job.unwrap_or(0)).await).await?;
    args.output
        .print(&list.jobs[..], jobs_text, |j| to_json(&j));
    Ok(())
}

/// Runs `flightdeck sql`: the query's rows as a table (the first
/// `--max-rows`, then how many there were) or as JSON lines, printed as
/// they arrive.
pub async fn sql(args: SqlArgs) -> Result<(), String> {
    let mut client = args.server.connect().await?;
    let said = |e: flightdeck_client::ClientError| args.server.said(&e);
    let result = client.sql(&args.query).await.map_err(said)?;
    if args.json {
        json_keys(&result.schema)?;
    }
    let limit = match args.max_rows {
        Some(0) => usize::MAX,
        Some(n) => n,
        None if args.json => usize::MAX,
        None => SQL_ROWS_SHOWN,
    };
    // A null is written as `null`, not left out: every line has every key.
    let mut lines = args.json.then(|| {
        arrow::json::WriterBuilder::new()
            .with_explicit_nulls(true)
            .build::<_, arrow::json::writer::LineDelimited>(std::io::stdout().lock())
    });
    let mut batches = result.batches;
    let (mut kept, mut shown, mut rows) = (Vec::new(), 0usize, 0u64);
    while let Some(batch) = batches.try_next().await.map_err(said)? {
        rows += batch.num_rows() as u64;
        let take = batch.num_rows().min(limit - shown);
        if take == 0 {
            continue;
        }
        shown += take;
        let batch = batch.slice(0, take);
        match lines.as_mut() {
            Some(w) => w
                .write(&batch)
                .map_err(|e| format!("cannot print the rows as JSON: {e}"))?,
            None => kept.push(batch),
        }
    }
    match lines.as_mut() {
        Some(w) => {
            w.finish()
                .map_err(|e| format!("cannot print the rows as JSON: {e}"))?;
            // Stdout stays JSON lines; what --max-rows left out is said apart.
            if rows > shown as u64 {
                eprintln!("({rows} rows, the first {shown} printed; --max-rows 0 prints all)");
            }
        }
        None => print!("{}", sql_text(&result.schema, &kept, rows)?),
    }
    Ok(())
}

/// Checks that the columns of `schema` can key JSON objects: no name
/// twice (a join's `SELECT *` of two tables with an `id` each).
pub fn json_keys(schema: &arrow::datatypes::Schema) -> Result<(), String> {
    let mut seen = std::collections::HashSet::new();
    match schema.fields().iter().find(|f| !seen.insert(f.name())) {
        Some(f) => Err(format!(
            "the result has two columns named '{}', which JSON objects cannot key apart: \
             name them apart in the query (`AS`), or print a table without --json",
            f.name()
        )),
        None => Ok(()),
    }
}

/// Characters of a value `flightdeck sql` prints as a table; a longer one
/// (a feature vector, a long string) ends in `…` there (`--json` prints it
/// whole).
pub const SQL_CELL_CHARS: usize = 40;

/// The text of `flightdeck sql`: `shown` (the result's first rows) as a
/// table under `schema`'s column names (nulls as `NULL`, values past
/// [`SQL_CELL_CHARS`] cut), then how many rows the result had (`rows`)
/// and, where that is more, how to see them all; an `EXPLAIN`'s plans
/// whole instead.
pub fn sql_text(
    schema: &arrow::datatypes::SchemaRef,
    shown: &[arrow::array::RecordBatch],
    rows: u64,
) -> Result<String, String> {
    let options = FormatOptions::new().with_null("NULL");
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    if names == ["plan_type", "plan"] {
        return explain_text(shown, &options);
    }
    let mut lines = Vec::new();
    for batch in shown {
        let columns = formatters(batch, &options)?;
        for row in 0..batch.num_rows() {
            lines.push(
                columns
                    .iter()
                    .map(|c| cut(c.value(row).to_string()))
                    .collect(),
            );
        }
    }
    let plural = if rows == 1 { "" } else { "s" };
    let count = if (lines.len() as u64) < rows {
        format!(
            "({rows} row{plural}, the first {} shown; --max-rows 0 prints all)",
            lines.len()
        )
    } else {
        format!("({rows} row{plural})")
    };
    Ok(format!("{}{count}\n", table(&names, &lines)))
}

/// An `EXPLAIN`'s rows (DataFusion's `plan_type` and `plan` columns) as
/// text: each plan's kind, then the plan whole, indented.
fn explain_text(
    shown: &[arrow::array::RecordBatch],
    options: &FormatOptions,
) -> Result<String, String> {
    let mut out = String::new();
    for batch in shown {
        let columns = formatters(batch, options)?;
        for row in 0..batch.num_rows() {
            let _ = writeln!(out, "{}:", columns[0].value(row));
            indented(&mut out, &columns[1].value(row).to_string());
        }
    }
    Ok(out)
}

/// A formatter of each column of `batch`.
fn formatters<'a>(
    batch: &'a arrow::array::RecordBatch,
    options: &'a FormatOptions,
) -> Result<Vec<ArrayFormatter<'a>>, String> {
    batch
        .columns()
        .iter()
        .map(|c| ArrayFormatter::try_new(c.as_ref(), options))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot print the rows: {e}"))
}

/// `value` cut to [`SQL_CELL_CHARS`] characters, the last one `…`, and
/// on one line.
fn cut(value: String) -> String {
    let value = value.replace(['\n', '\r', '\t'], " ");
    if value.chars().count() <= SQL_CELL_CHARS {
        return value;
    }
    let mut short: String = value.chars().take(SQL_CELL_CHARS - 1).collect();
    short.push('…');
    short
}

/// Runs `flightdeck derive`: prints the new dataset as `describe` does.
pub async fn derive(args: DeriveArgs) -> Result<(), String> {
    let info = on_server(&args.server, async |c| {
        c.derive(&args.target, &args.query, &args.source).await
    })
    .await?;
    args.output.print(&info, describe_text, dataset_json);
    Ok(())
}

/// `rows` as a table: columns padded to their widest cell (the header's
/// included), two spaces apart, the last one not padded.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = header.iter().map(|h| h.to_string()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, w)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                let _ = write!(out, "{cell:<w$}  ");
            }
        }
        out.push('\n');
    }
    out
}

/// Width of the names before the values in `describe` and `stats`.
const NAME_WIDTH: usize = 12;

/// `name` padded to [`NAME_WIDTH`], then `value`, as one line of `out` (a
/// continuation line with `name` empty).
fn field(out: &mut String, name: &str, value: impl std::fmt::Display) {
    let _ = writeln!(out, "{name:<NAME_WIDTH$}{value}");
}

/// Each `(name, value)` of `lines` as a [`field`].
fn fields<'a>(out: &mut String, lines: impl IntoIterator<Item = (&'a str, String)>) {
    for (name, value) in lines {
        field(out, name, value);
    }
}

/// `text` (a [`table`]) into `out`, each line indented two spaces.
fn indented(out: &mut String, text: &str) {
    for line in text.lines() {
        let _ = writeln!(out, "  {line}");
    }
}

/// A dataset's state as a word.
fn state(info: &DatasetInfo) -> &'static str {
    match info.state() {
        DatasetState::Open => "open",
        DatasetState::Sealed => "sealed",
        DatasetState::Sealing => "sealing",
        DatasetState::Unspecified => "unknown",
    }
}

/// Where a dataset's rows are: `memory` or `spilled`, then `persisted`,
/// the GPUs holding placed columns, and the members of a cluster dataset.
fn held(info: &DatasetInfo) -> String {
    let mut at = vec![if info.spilled { "spilled" } else { "memory" }.to_string()];
    if info.persisted {
        at.push("persisted".into());
    }
    if !info.placements.is_empty() {
        let devices: Vec<String> = info
            .placements
            .iter()
            .map(|p| p.device.to_string())
            .collect();
        at.push(format!("gpu {}", devices.join(",")));
    }
    if let Some(layout) = &info.layout {
        at.push(format!("{} members", layout.members.len()));
    }
    at.join(", ")
}

/// Partitions as a list of ranges: `0-5, 9, 11-12`.
fn ranges(mut parts: Vec<u32>) -> String {
    parts.sort_unstable();
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < parts.len() {
        let mut j = i;
        while j + 1 < parts.len() && parts[j + 1] == parts[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            parts[i].to_string()
        } else {
            format!("{}-{}", parts[i], parts[j])
        });
        i = j + 1;
    }
    out.join(", ")
}

/// The text of `flightdeck datasets`.
pub fn datasets_text(infos: &[DatasetInfo]) -> String {
    if infos.is_empty() {
        return "no datasets\n".into();
    }
    let rows: Vec<Vec<String>> = infos
        .iter()
        .map(|i| {
            vec![
                i.dataset.clone(),
                state(i).into(),
                i.rows.to_string(),
                i.partitions.len().to_string(),
                show_size(i.bytes),
                held(i),
            ]
        })
        .collect();
    table(
        &["DATASET", "STATE", "ROWS", "PARTITIONS", "MEMORY", "HELD"],
        &rows,
    )
}

/// What `flightdeck datasets` adds under its table while overwrites are
/// being written: each write staging rows to replace a dataset.
pub fn staged_text(staged: &[StagedWrite]) -> String {
    if staged.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = staged
        .iter()
        .map(|w| {
            vec![
                w.dataset.clone(),
                w.write_id.clone(),
                w.rows.to_string(),
                w.committed_partitions.to_string(),
                show_size(w.bytes),
                format!("{} ago", seconds_ago(w.written_seconds_ago)),
            ]
        })
        .collect();
    let header = [
        "REPLACES",
        "WRITE",
        "ROWS",
        "PARTITIONS",
        "MEMORY",
        "LAST WRITTEN",
    ];
    format!(
        "\nbeing written (each takes its dataset's place when sealed):\n{}",
        table(&header, &rows)
    )
}

/// A reply's `*_seconds_ago` as a person reads it.
fn seconds_ago(seconds: f64) -> String {
    show_age(std::time::Duration::from_secs_f64(seconds.max(0.0)))
}

/// `reply` as JSON: its fields by their .proto names.
pub fn to_json<T: serde::Serialize + ?Sized>(reply: &T) -> serde_json::Value {
    // The messages hold numbers, strings, lists and messages: nothing that
    // fails to serialize.
    serde_json::to_value(reply).unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }))
}

/// A dataset as `--json` prints it: every field of `DatasetInfo`, its
/// `state` as a word, and `schema` as a list of `{name, type, nullable}`
/// (null before the first commit).
pub fn dataset_json(info: &DatasetInfo) -> serde_json::Value {
    let mut json = to_json(info);
    json["state"] = state(info).into();
    json["schema"] = if info.schema.is_empty() {
        serde_json::Value::Null
    } else {
        match try_schema_from_ipc_buffer(&info.schema) {
            Ok(schema) => schema
                .fields()
                .iter()
                .map(|f| {
                    serde_json::json!({
                        "name": f.name(),
                        "type": f.data_type().to_string(),
                        "nullable": f.is_nullable(),
                    })
                })
                .collect(),
            Err(e) => format!("cannot be decoded: {e}").into(),
        }
    };
    json
}

/// The schema's fields, one line each (`name: type`, `nullable` where so).
fn schema_lines(schema: &[u8], out: &mut String) {
    if schema.is_empty() {
        field(out, "schema", "none yet (no attempt committed)");
        return;
    }
    match try_schema_from_ipc_buffer(schema) {
        Ok(schema) => {
            out.push_str("schema\n");
            for f in schema.fields() {
                let nullable = if f.is_nullable() { ", nullable" } else { "" };
                let _ = writeln!(out, "  {}: {}{nullable}", f.name(), f.data_type());
            }
        }
        Err(e) => field(out, "schema", format_args!("cannot be decoded: {e}")),
    }
}

/// The members of a cluster dataset's layout.
fn layout_lines(layout: &ClusterLayout, out: &mut String) {
    field(out, "layout", format_args!("{:#018x}", layout.id));
    let rows: Vec<Vec<String>> = layout
        .members
        .iter()
        .map(|m| {
            vec![
                m.location.clone(),
                m.rows.to_string(),
                m.generation.to_string(),
                ranges(m.partitions.iter().map(|p| p.partition).collect()),
            ]
        })
        .collect();
    indented(
        out,
        &table(&["MEMBER", "ROWS", "GENERATION", "PARTITIONS"], &rows),
    );
}

/// The text of `flightdeck describe`: the dataset, its schema, a cluster
/// dataset's members, and each partition's winning attempt (`WINNER`; while
/// open, the one that would win) beside the attempts committed of it.
pub fn describe_text(info: &DatasetInfo) -> String {
    let mut out = String::new();
    let state = format!("{} (generation {})", state(info), info.generation);
    let partitions = format!(
        "{} ({} with a committed attempt)",
        info.partitions.len(),
        info.committed_partitions
    );
    let mut lines = vec![
        ("dataset", info.dataset.clone()),
        ("state", state),
        ("rows", info.rows.to_string()),
        ("partitions", partitions),
        ("memory", show_size(info.bytes)),
        ("held", held(info)),
    ];
    if info.state == DatasetState::Open as i32 {
        let quiet = seconds_ago(info.written_seconds_ago);
        lines.push(("written", format!("last attempt committed {quiet} ago")));
    }
    if info.state == DatasetState::Sealing as i32 {
        lines.push((
            "sealing",
            "this member's part is sealed, but the seal across members did not finish here \
             (rows and partitions are this member's): send the seal again, or drop the dataset"
                .to_string(),
        ));
    }
    for w in &info.replacements {
        lines.push((
            "replacing",
            format!(
                "write '{}' has staged {} rows in {} partitions ({}), last written {} ago; \
                 sealed, it takes this dataset's place",
                w.write_id,
                w.rows,
                w.committed_partitions,
                show_size(w.bytes),
                seconds_ago(w.written_seconds_ago)
            ),
        ));
    }
    if info.spilled {
        let note = "(in the spill store only: the next read brings it back)";
        lines.push(("", note.into()));
    }
    lines.extend(placement_lines(info).map(|line| ("", line)));
    fields(&mut out, lines);
    schema_lines(&info.schema, &mut out);
    if let Some(layout) = &info.layout {
        layout_lines(layout, &mut out);
    }
    if !info.partitions.is_empty() {
        out.push_str("partitions\n");
        let rows: Vec<Vec<String>> = info
            .partitions
            .iter()
            .map(|p| {
                vec![
                    p.partition.to_string(),
                    p.attempt.to_string(),
                    p.rows.to_string(),
                    show_size(p.bytes),
                    p.committed_attempts.to_string(),
                ]
            })
            .collect();
        let header = ["PARTITION", "WINNER", "ROWS", "BYTES", "ATTEMPTS"];
        indented(&mut out, &table(&header, &rows));
    }
    out
}

/// The text of `flightdeck place` and `evict`: the GPUs holding the
/// dataset's columns, one line each.
pub fn placements_text(info: &DatasetInfo) -> String {
    if info.placements.is_empty() {
        return format!("'{}' has no columns on a GPU\n", info.dataset);
    }
    let mut out = String::new();
    for line in placement_lines(info) {
        let _ = writeln!(out, "'{}' {line}", info.dataset);
    }
    out
}

/// `on gpu N: columns (bytes)` for each device holding the dataset's
/// columns.
fn placement_lines(info: &DatasetInfo) -> impl Iterator<Item = String> + '_ {
    info.placements.iter().map(|p| {
        format!(
            "on gpu {}: {} ({})",
            p.device,
            p.columns.join(", "),
            show_size(p.bytes)
        )
    })
}

/// The line `flightdeck drop` prints.
pub fn dropped_text(info: &DatasetInfo) -> String {
    let everywhere = match &info.layout {
        Some(layout) => format!(" on all {} members", layout.members.len()),
        None => String::new(),
    };
    format!(
        "dropped '{}'{everywhere}: {} rows, {} of memory freed here",
        info.dataset,
        info.rows,
        show_size(info.bytes)
    )
}

/// `yes` or `no`.
fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

/// The text of `flightdeck stats`, now.
pub fn stats_text(s: &ServerStats) -> String {
    stats_text_at(s, std::time::SystemTime::now())
}

/// When a certificate that expires at `expires` (Unix seconds) does, seen
/// at `now`: the moment and how far it is (`none` for 0, no TLS).
fn tls_text(expires: u64, now: std::time::SystemTime) -> String {
    if expires == 0 {
        return "none".into();
    }
    let at = std::time::Duration::from_secs(expires);
    let expiry = flightdeck_server::credentials::Expiry::at(at);
    match expiry.left(now) {
        Some(left) => format!("certificate expires {}, in {}", expiry.text, show_age(left)),
        None => format!(
            "certificate EXPIRED {}, {} ago: install a renewed one",
            expiry.text,
            show_age(
                now.duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .saturating_sub(at)
            )
        ),
    }
}

/// The text of `flightdeck stats` as seen at `now`.
fn stats_text_at(s: &ServerStats, now: std::time::SystemTime) -> String {
    let resident = if s.resident_peak_bytes > 0 {
        format!("; resident peak {}", show_size(s.resident_peak_bytes))
    } else {
        String::new()
    };
    let plural = |n: u64, one: &str| format!("{n} {one}{}", if n == 1 { "" } else { "s" });
    let traffic = |rows: u64, bytes: u64| format!("{rows} rows, {}", show_size(bytes));
    let lines = [
        ("location", s.location.clone()),
        ("tls", tls_text(s.tls_certificate_expires, now)),
        (
            "memory",
            format!(
                "{} of {} in use (peak {}){resident}",
                show_size(s.memory_used),
                show_size(s.memory_limit),
                show_size(s.memory_used_peak)
            ),
        ),
        (
            "host arena",
            format!(
                "{} held, {} live, {} idle; pinned {}",
                show_size(s.host_held_bytes),
                show_size(s.host_live_bytes),
                show_size(s.host_idle_bytes),
                yes(s.host_pinned)
            ),
        ),
        ("packed rows", show_size(s.packed_bytes)),
        (
            "gpus",
            format!(
                "{}, {} placed",
                plural(s.cuda_devices.into(), "device"),
                show_size(s.device_bytes)
            ),
        ),
        (
            "datasets",
            format!(
                "{} ({} sealed, {} spilled): {} rows, {} in memory",
                s.datasets,
                s.sealed_datasets,
                s.spilled_datasets,
                s.rows,
                show_size(s.bytes)
            ),
        ),
        (
            "spill store",
            format!(
                "{}; persist {}; {} and {} since start",
                s.spill_url,
                yes(s.persist),
                plural(s.spills, "spill"),
                plural(s.restores, "restore")
            ),
        ),
        (
            "overwrites",
            match s.staged.len() {
                0 => "none being written".into(),
                n => format!(
                    "{n} being written: {} rows, {} staged",
                    s.staged.iter().map(|w| w.rows).sum::<u64>(),
                    show_size(s.staged.iter().map(|w| w.bytes).sum())
                ),
            },
        ),
        (
            "sql queries",
            format!(
                "{} running; {} done, {} failed, {} given up since start",
                s.queries_running, s.queries_done, s.queries_failed, s.queries_given_up
            ),
        ),
        ("to ranks", traffic(s.rows_served, s.bytes_served)),
        (
            "to peers",
            traffic(s.rows_served_to_peers, s.bytes_served_to_peers),
        ),
        (
            "from peers",
            traffic(s.rows_fetched_from_peers, s.bytes_fetched_from_peers),
        ),
    ];
    let mut out = String::new();
    fields(&mut out, lines);
    out
}

/// The text of `flightdeck jobs`.
pub fn jobs_text(jobs: &[JobStatus]) -> String {
    if jobs.is_empty() {
        return "no jobs\n".into();
    }
    let rows: Vec<Vec<String>> = jobs
        .iter()
        .map(|j| {
            let mut note = j.error.clone();
            if !j.checkpoint.is_empty() {
                if !note.is_empty() {
                    note.push_str("; ");
                }
                let _ = write!(note, "checkpoint {}", j.checkpoint);
            }
            vec![
                j.job.to_string(),
                j.dataset.clone(),
                j.state.clone(),
                format!("{}/{}", j.step, j.total_steps),
                format!("{:.4}", j.loss),
                j.accuracy.map_or("-".into(), |a| format!("{a:.4}")),
                note,
            ]
        })
        .collect();
    table(
        &[
            "JOB", "DATASET", "STATE", "STEP", "LOSS", "ACCURACY", "NOTE",
        ],
        &rows,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::datatypes::{DataType, Field, Schema};
    use arrow::ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteOptions};
    use flightdeck_protos::{ClusterMember, DevicePlacement, PartitionInfo};

    #[test]
    fn gpus_are_ordinals_or_cuda_n_and_uri_names_the_server() {
        use clap::Parser;
        #[derive(Debug, Parser)]
        struct Place {
            #[command(flatten)]
            args: PlaceArgs,
        }
        #[derive(Debug, Parser)]
        struct Evict {
            #[command(flatten)]
            args: EvictArgs,
        }
        let place = |argv: &[&str]| Place::try_parse_from(argv).map(|p| p.args);
        let args = place(&["place", "d", "--devices", "cuda:1,0"]).expect("parses");
        assert_eq!(args.devices, vec![1, 0]);
        let err = place(&["place", "d", "--devices", "gpu1"]).expect_err("not a GPU");
        assert!(
            err.to_string()
                .contains("'gpu1' is not a GPU: give its ordinal (0, 1, …) or cuda:N"),
            "{err}"
        );
        let evict = Evict::try_parse_from(["evict", "d", "--devices", "cuda:3"]).expect("parses");
        assert_eq!(evict.args.devices, vec![3]);
        // `--uri`, as the Spark options and clients call it, is `--server`.
        let args = place(&["place", "d", "--uri", "grpc://h:1"]).expect("parses");
        assert_eq!(args.server.server, "grpc://h:1");
    }

    #[tokio::test]
    async fn a_server_not_there_is_named_with_its_location_and_what_to_do() {
        assert_eq!(named_server("grpc://127.0.0.1:1"), "grpc://127.0.0.1:1");
        assert_eq!(named_server("h"), "h (grpc://h:50051)");
        assert_eq!(named_server("foo://x"), "foo://x");
        let nobody = ServerArg {
            server: "127.0.0.1:1".into(),
        };
        let Err(e) = nobody.connect().await else {
            panic!("nothing listens on port 1")
        };
        assert!(
            e.starts_with("cannot reach 127.0.0.1:1 (grpc://127.0.0.1:1): "),
            "{e}"
        );
        assert!(e.contains("Connection refused"), "{e}");
        assert!(e.ends_with("Start one with `flightdeck serve`, or name another with --server"));
        let bad = ServerArg {
            server: "foo://x".into(),
        };
        let Err(e) = bad.connect().await else {
            panic!("not a server name")
        };
        assert!(
            e.contains("does not name a server") && !e.contains("Start one"),
            "{e}"
        );
    }

    fn schema_bytes(schema: &Schema) -> Vec<u8> {
        let data = IpcDataGenerator::default().schema_to_bytes_with_dictionary_tracker(
            schema,
            &mut DictionaryTracker::new(false),
            &IpcWriteOptions::default(),
        );
        let mut out = Vec::new();
        arrow::ipc::writer::write_message(&mut out, data, &IpcWriteOptions::default())
            .expect("schema message");
        out
    }

    fn assert_has_line(text: &str, line: &str) {
        assert!(
            text.lines().any(|l| l == line),
            "no line {line:?} in\n{text}"
        );
    }

    fn part(partition: u32, attempt: u32, rows: u64) -> PartitionInfo {
        PartitionInfo {
            partition,
            attempt,
            rows,
            bytes: rows * 12,
            committed_attempts: attempt + 1,
        }
    }

    fn staged_write(dataset: &str, write_id: &str, rows: u64) -> StagedWrite {
        StagedWrite {
            dataset: dataset.into(),
            write_id: write_id.into(),
            rows,
            bytes: rows * 12,
            committed_partitions: 2,
            written_seconds_ago: 95.5,
        }
    }

    #[test]
    fn overwrites_under_way_show_under_the_listing_and_in_their_dataset() {
        assert_eq!(staged_text(&[]), "");
        let text = staged_text(&[staged_write("clicks", "job-1", 300)]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert_eq!(
            lines[1],
            "being written (each takes its dataset's place when sealed):"
        );
        let words = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(
            words(lines[3]),
            ["clicks", "job-1", "300", "2", "3.5KiB", "1m35s", "ago"]
        );
        let mut info = sealed("clicks", 1000);
        info.replacements = vec![staged_write("clicks", "job-1", 300)];
        assert_has_line(
            &describe_text(&info),
            "replacing   write 'job-1' has staged 300 rows in 2 partitions (3.5KiB), last written \
             1m35s ago; sealed, it takes this dataset's place",
        );
        assert!(!describe_text(&info).contains("last attempt committed"));
        info.state = DatasetState::Open.into();
        info.written_seconds_ago = 4.2;
        assert_has_line(
            &describe_text(&info),
            "written     last attempt committed 4s ago",
        );
    }

    fn sealed(name: &str, rows: u64) -> DatasetInfo {
        DatasetInfo {
            dataset: name.into(),
            state: DatasetState::Sealed.into(),
            rows,
            bytes: rows * 12,
            committed_partitions: 2,
            partitions: vec![part(0, 0, rows / 2), part(1, 1, rows - rows / 2)],
            generation: 3,
            ..Default::default()
        }
    }

    #[test]
    fn a_table_pads_every_column_but_the_last_to_its_widest_cell() {
        let text = table(
            &["A", "LONGER"],
            &[
                vec!["wide cell".into(), "x".into()],
                vec!["b".into(), "y".into()],
            ],
        );
        assert_eq!(text, "A          LONGER\nwide cell  x\nb          y\n");
    }

    #[test]
    fn an_error_says_each_cause_once() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        #[derive(Debug, thiserror::Error)]
        #[error("transport error")]
        struct Outer(#[source] std::io::Error);
        assert_eq!(with_causes(&Outer(io)), "transport error: refused");
        let io = std::io::Error::other("x");
        #[derive(Debug, thiserror::Error)]
        #[error("said already: {0}")]
        struct Says(#[source] std::io::Error);
        assert_eq!(with_causes(&Says(io)), "said already: x");
    }

    #[test]
    fn partitions_read_as_ranges() {
        assert_eq!(ranges(vec![]), "");
        assert_eq!(ranges(vec![4]), "4");
        assert_eq!(ranges(vec![5, 0, 1, 2, 9, 11, 12]), "0-2, 5, 9, 11-12");
    }

    #[test]
    fn the_listing_says_state_rows_partitions_memory_and_where_each_dataset_is() {
        assert_eq!(datasets_text(&[]), "no datasets\n");
        let mut spilled = sealed("clicks", 1000);
        spilled.spilled = true;
        spilled.persisted = true;
        spilled.bytes = 0;
        let mut open = sealed("events", 2048);
        open.state = DatasetState::Open.into();
        open.placements = vec![DevicePlacement {
            device: 1,
            columns: vec!["x".into()],
            bytes: 64,
        }];
        open.layout = Some(ClusterLayout {
            members: vec![ClusterMember::default(); 3],
            ..Default::default()
        });
        let text = datasets_text(&[spilled, open]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        let words = |l: &str| l.split_whitespace().map(str::to_string).collect::<Vec<_>>();
        assert_eq!(
            words(lines[0]),
            ["DATASET", "STATE", "ROWS", "PARTITIONS", "MEMORY", "HELD"]
        );
        assert_eq!(
            words(lines[1]),
            [
                "clicks",
                "sealed",
                "1000",
                "2",
                "0B",
                "spilled,",
                "persisted"
            ]
        );
        assert_eq!(
            words(lines[2]),
            [
                "events", "open", "2048", "2", "24.0KiB", "memory,", "gpu", "1,", "3", "members"
            ]
        );
    }

    #[test]
    fn json_names_every_field_the_state_as_a_word_and_the_schema_as_fields() {
        let mut info = sealed("events", 100);
        let json = dataset_json(&info);
        assert_eq!(json["dataset"], "events");
        assert_eq!(json["state"], "sealed");
        assert_eq!(json["rows"], 100);
        assert_eq!(json["generation"], 3);
        assert_eq!(json["schema"], serde_json::Value::Null, "none yet");
        assert_eq!(json["layout"], serde_json::Value::Null);
        assert_eq!(json["partitions"][1]["attempt"], 1);
        assert_eq!(json["partitions"][1]["rows"], 50);
        info.schema = schema_bytes(&Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]))
        .into();
        info.state = DatasetState::Open.into();
        let json = dataset_json(&info);
        assert_eq!(json["state"], "open");
        assert_eq!(
            json["schema"],
            serde_json::json!([
                {"name": "id", "type": "Int64", "nullable": false},
                {"name": "name", "type": "Utf8", "nullable": true},
            ])
        );
        info.schema = bytes::Bytes::from_static(b"not a schema");
        let said = dataset_json(&info)["schema"].to_string();
        assert!(said.contains("cannot be decoded"), "{said}");

        let stats = to_json(&ServerStats {
            rows_fetched_from_peers: 7,
            location: "grpc://127.0.0.2:50051".into(),
            ..Default::default()
        });
        assert_eq!(stats["rows_fetched_from_peers"], 7);
        assert_eq!(stats["location"], "grpc://127.0.0.2:50051");
        assert_eq!(stats["memory_used_peak"], 0);
        let jobs = to_json(
            &[JobStatus {
                job: 2,
                state: "failed".into(),
                accuracy: None,
                ..Default::default()
            }][..],
        );
        assert_eq!(jobs[0]["state"], "failed");
        assert_eq!(jobs[0]["accuracy"], serde_json::Value::Null);
    }

    #[test]
    fn a_description_shows_the_schema_partitions_and_layout() {
        let mut info = sealed("events", 100);
        info.schema = schema_bytes(&Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, true),
        ]))
        .into();
        info.layout = Some(ClusterLayout {
            id: 0xabc,
            members: vec![
                ClusterMember {
                    location: "grpc://127.0.0.2:50051".into(),
                    generation: 1,
                    partitions: vec![part(0, 0, 50), part(1, 1, 50), part(3, 0, 0)],
                    rows: 100,
                },
                ClusterMember {
                    location: "grpc://127.0.0.3:50051".into(),
                    generation: 7,
                    partitions: vec![part(2, 0, 0)],
                    rows: 0,
                },
            ],
            ..Default::default()
        });
        let text = describe_text(&info);
        for line in [
            "dataset     events",
            "state       sealed (generation 3)",
            "rows        100",
            "partitions  2 (2 with a committed attempt)",
            "memory      1.2KiB",
            "held        memory, 2 members",
            "schema",
            "  id: Int64",
            "  name: Utf8, nullable",
            "layout      0x0000000000000abc",
            "  MEMBER                  ROWS  GENERATION  PARTITIONS",
            "  grpc://127.0.0.2:50051  100   1           0-1, 3",
            "  grpc://127.0.0.3:50051  0     7           2",
            "  PARTITION  WINNER  ROWS  BYTES  ATTEMPTS",
            "  0          0       50    600B   1",
            "  1          1       50    600B   2",
        ] {
            assert_has_line(&text, line);
        }

        let mut fresh = DatasetInfo {
            dataset: "new".into(),
            state: DatasetState::Open.into(),
            ..Default::default()
        };
        assert!(describe_text(&fresh).contains("schema      none yet"));
        fresh.schema = vec![1, 2, 3].into();
        assert!(describe_text(&fresh).contains("schema      cannot be decoded"));
        fresh.spilled = true;
        assert!(describe_text(&fresh).contains("the next read brings it back"));
    }

    #[test]
    fn placements_name_each_gpu_its_columns_and_bytes() {
        let mut info = sealed("events", 10);
        assert_eq!(placements_text(&info), "'events' has no columns on a GPU\n");
        info.placements = vec![
            DevicePlacement {
                device: 0,
                columns: vec!["x".into(), "y".into()],
                bytes: 2048,
            },
            DevicePlacement {
                device: 3,
                columns: vec!["x".into()],
                bytes: 1024,
            },
        ];
        assert_eq!(
            placements_text(&info),
            "'events' on gpu 0: x, y (2.0KiB)\n'events' on gpu 3: x (1.0KiB)\n"
        );
        let text = describe_text(&info);
        assert!(
            text.contains("held        memory, gpu 0,3\n            on gpu 0: x, y (2.0KiB)\n"),
            "{text}"
        );
    }

    #[test]
    fn a_drop_says_what_it_freed_and_where() {
        assert_eq!(
            dropped_text(&sealed("events", 1024)),
            "dropped 'events': 1024 rows, 12.0KiB of memory freed here"
        );
        let mut cluster = sealed("c", 10);
        cluster.layout = Some(ClusterLayout {
            members: vec![ClusterMember::default(); 3],
            ..Default::default()
        });
        assert!(dropped_text(&cluster).starts_with("dropped 'c' on all 3 members: 10 rows"));
    }

    #[test]
    fn stats_name_every_tier_and_the_traffic() {
        let stats = ServerStats {
            memory_used: 3 << 20,
            memory_limit: 1 << 30,
            memory_used_peak: 5 << 20,
            resident_peak_bytes: 0,
            datasets: 2,
            sealed_datasets: 1,
            rows: 10,
            spills: 1,
            restores: 2,
            spill_url: "memory://".into(),
            location: "grpc://127.0.0.1:1".into(),
            rows_served_to_peers: 7,
            queries_running: 1,
            queries_done: 4,
            queries_given_up: 2,
            ..Default::default()
        };
        let text = stats_text(&stats);
        for line in [
            "location    grpc://127.0.0.1:1",
            "tls         none",
            "memory      3.0MiB of 1.0GiB in use (peak 5.0MiB)",
            "gpus        0 devices, 0B placed",
            "datasets    2 (1 sealed, 0 spilled): 10 rows, 0B in memory",
            "spill store memory://; persist no; 1 spill and 2 restores since start",
            "to peers    7 rows, 0B",
            "overwrites  none being written",
            "sql queries 1 running; 4 done, 0 failed, 2 given up since start",
        ] {
            assert_has_line(&text, line);
        }
        let staged = stats_text(&ServerStats {
            staged: vec![staged_write("a", "w1", 100), staged_write("b", "w2", 20)],
            ..stats.clone()
        });
        assert_has_line(
            &staged,
            "overwrites  2 being written: 120 rows, 1.4KiB staged",
        );
        let with_rss = stats_text(&ServerStats {
            resident_peak_bytes: 2 << 30,
            ..stats
        });
        assert!(with_rss.contains("(peak 5.0MiB); resident peak 2.0GiB"));
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        let with_tls = |hours_left: i64| {
            let expires = 1_800_000_000i64 + hours_left * 3600;
            let s = ServerStats {
                tls_certificate_expires: expires as u64,
                ..ServerStats::default()
            };
            stats_text_at(&s, at)
        };
        assert_has_line(
            &with_tls(41 * 24 + 5),
            "tls         certificate expires 2027-02-25T13:00:00Z, in 41d5h",
        );
        assert_has_line(
            &with_tls(-2),
            "tls         certificate EXPIRED 2027-01-15T06:00:00Z, 2h0m ago: install a renewed one",
        );
    }

    #[test]
    fn jobs_show_progress_loss_and_what_went_wrong() {
        assert_eq!(jobs_text(&[]), "no jobs\n");
        let text = jobs_text(&[
            JobStatus {
                job: 1,
                dataset: "d".into(),
                state: "finished".into(),
                step: 10,
                total_steps: 10,
                loss: 0.5,
                accuracy: Some(0.9),
                checkpoint: "file:///c/step-10".into(),
                ..Default::default()
            },
            JobStatus {
                job: 2,
                dataset: "d".into(),
                state: "failed".into(),
                step: 3,
                total_steps: 10,
                loss: 1.25,
                error: "rank 1 failed".into(),
                ..Default::default()
            },
        ]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(
            lines[1].starts_with("1    d        finished  10/10  0.5000  0.9000    checkpoint")
        );
        assert!(lines[2].ends_with("3/10   1.2500  -         rank 1 failed"));
    }

    /// The server's messages as one text: every `.rs` file under `src`,
    /// with string line continuations (`\` then a newline and indentation)
    /// joined as the compiler joins them.
    fn server_messages() -> String {
        fn walk(dir: &std::path::Path, out: &mut String) {
            for entry in std::fs::read_dir(dir).expect("src is readable") {
                let path = entry.expect("entry").path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).expect("source");
                    let mut lines = text.lines().peekable();
                    while let Some(line) = lines.next() {
                        out.push_str(line.strip_suffix('\\').unwrap_or(line));
                        if line.ends_with('\\') {
                            if let Some(next) = lines.peek_mut() {
                                *next = next.trim_start();
                            }
                        } else {
                            out.push('\n');
                        }
                    }
                }
            }
        }
        let mut out = String::new();
        walk(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
            &mut out,
        );
        out
    }

    /// Each client's table of advice follows the server's wording: a phrase
    /// the server no longer says would leave its advice untranslated.
    #[test]
    fn every_translated_phrase_is_one_the_server_says() {
        let said = server_messages();
        for (table, terms) in [
            ("CLI_TERMS", CLI_TERMS),
            ("RUST_TERMS", flightdeck_client::RUST_TERMS),
        ] {
            for (flight, ours) in terms {
                assert!(
                    said.matches(flight).count() > usize::from(table == "CLI_TERMS"),
                    "{table}: the server never says {flight:?}"
                );
                for word in ["DoPut", "DoGet", "ListFlights", "GetFlightInfo"] {
                    assert!(!ours.contains(word), "{table}: {ours:?} says {word}");
                }
            }
        }
    }

    #[test]
    fn sql_text_is_a_table_then_the_row_count_and_how_to_see_the_rest() {
        use arrow::array::{Int64Array, RecordBatch, StringArray};
        use std::sync::Arc;
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("Name", DataType::Utf8, true),
        ]));
        let long = format!("a\nb{}", "c".repeat(60));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![7, 12, 1000])),
                Arc::new(StringArray::from(vec![
                    Some("a"),
                    None,
                    Some(long.as_str()),
                ])),
            ],
        )
        .expect("batch");
        let all = sql_text(&schema, std::slice::from_ref(&batch), 3).expect("text");
        let cut = format!("a b{}…", "c".repeat(SQL_CELL_CHARS - 4));
        assert_eq!(
            all,
            format!("id    Name\n7     a\n12    NULL\n1000  {cut}\n(3 rows)\n")
        );
        let first = sql_text(&schema, &[batch.slice(0, 1)], 5000).expect("text");
        assert_eq!(
            first,
            "id  Name\n7   a\n(5000 rows, the first 1 shown; --max-rows 0 prints all)\n"
        );
        // No rows: the columns still, and a count that says so.
        let none = sql_text(&schema, &[], 0).expect("text");
        assert_eq!(none, "id  Name\n(0 rows)\n");
        let one = sql_text(&schema, &[batch.slice(1, 1)], 1).expect("text");
        assert_eq!(one, "id  Name\n12  NULL\n(1 row)\n");

        assert!(json_keys(&schema).is_ok());
        let twice = Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("x", DataType::Int64, false),
            Field::new("id", DataType::Int64, false),
        ]);
        let err = json_keys(&twice).expect_err("two columns named id");
        assert!(err.contains("two columns named 'id'"), "{err}");

        // An EXPLAIN's plans are printed whole, one under the other.
        let plans = Arc::new(Schema::new(vec![
            Field::new("plan_type", DataType::Utf8, false),
            Field::new("plan", DataType::Utf8, false),
        ]));
        let long = format!("Projection: {}\n  TableScan: d", "x, ".repeat(20));
        let batch = RecordBatch::try_new(
            plans.clone(),
            vec![
                Arc::new(StringArray::from(vec!["logical_plan", "physical_plan"])),
                Arc::new(StringArray::from(vec![long.as_str(), "DataSourceExec"])),
            ],
        )
        .expect("batch");
        assert_eq!(
            sql_text(&plans, &[batch], 2).expect("text"),
            format!(
                "logical_plan:\n  {}\n    TableScan: d\nphysical_plan:\n  DataSourceExec\n",
                "Projection: ".to_string() + &"x, ".repeat(20)
            )
        );
    }
}
