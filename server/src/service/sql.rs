//! Arrow Flight SQL on the Flight port: every sealed dataset is a table of
//! catalog `flightdeck`, schema `public`, queried with DataFusion over the
//! cached batches (no copy; a spilled dataset is restored first; a cluster
//! dataset's other members stream their rows in). Statements, prepared
//! statements with parameters, `GetSqlInfo` and the catalog, schema, table
//! and table-type listings are answered, so ADBC's and JDBC's Flight SQL
//! drivers work. Queries are read-only: DDL, DML and statements are
//! refused, and so is an update (`ExecuteUpdate`), saying to run a query
//! as one. Action `derive` keeps a query's result as a new sealed dataset;
//! bulk ingestion (`CommandStatementIngest`: ADBC's `adbc_ingest`) writes
//! one, as a write of one partition sealed at its end.
//! Queries run on a runtime of their own (`query_runtime`), so that a
//! query's computing never holds a thread that serves reads, and they
//! stop once their client has gone: every operator that may produce more
//! rows than it reads yields to the runtime ([`crate::query::Interruptible`]).
//!
//! The edge sends a call here when its command, ticket or action is a
//! Flight SQL one ([`is_sql_command`], [`is_sql_action`]); everything else
//! is flightdeck's own protocol.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use arrow::ipc::reader::StreamReader;
use arrow::ipc::writer::{IpcWriteOptions, StreamWriter};
use arrow_flight::decode::{DecodedPayload, FlightDataDecoder};
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::error::FlightError;
use arrow_flight::flight_service_server::FlightService;
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder};
use arrow_flight::sql::server::{FlightSqlService, PeekableFlightDataStream};
use arrow_flight::sql::{
    ActionClosePreparedStatementRequest, ActionCreatePreparedStatementRequest,
    ActionCreatePreparedStatementResult, Any, CommandGetCatalogs, CommandGetCrossReference,
    CommandGetDbSchemas, CommandGetExportedKeys, CommandGetImportedKeys, CommandGetPrimaryKeys,
    CommandGetSqlInfo, CommandGetTableTypes, CommandGetTables, CommandPreparedStatementQuery,
    CommandPreparedStatementUpdate, CommandStatementIngest, CommandStatementQuery,
    CommandStatementUpdate, DoPutPreparedStatementResult, DoPutUpdateResult, ProstMessageExt,
    SqlInfo, TicketStatementQuery,
};
use arrow_flight::{
    Action, FlightDescriptor, FlightEndpoint, FlightInfo, IpcMessage, SchemaAsIpc, Ticket,
};
use bytes::Bytes;
use datafusion::catalog::{Session, TableProvider};
use datafusion::common::DFSchema;
use datafusion::common::{DataFusionError, ParamValues, ScalarValue};
use datafusion::datasource::TableType;
use datafusion::execution::context::SQLOptions;
use datafusion::execution::{SessionState, SessionStateBuilder, TaskContext};
use datafusion::logical_expr::utils::conjunction;
use datafusion::logical_expr::{Expr, LogicalPlan, TableProviderFilterPushDown};
use datafusion::physical_expr::PhysicalExpr;
use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
use datafusion::physical_plan::streaming::{PartitionStream, StreamingTableExec};
use datafusion::physical_plan::{ExecutionPlan, SendableRecordBatchStream};
use datafusion::prelude::{DataFrame, SessionContext};
use datafusion::sql::parser::Statement as DfStatement;
use flightdeck_protos as pb;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt, TryStreamExt};
use prost::Message;
use tonic::{Request, Response, Status};

use crate::catalog::{ClusterState, DatasetState, SealRequest};
use crate::convert::{self, ShardTicket};
use crate::error::{Error, Result, panic_message};
use crate::memory::query_pool::{BUDGET_FULL, QueryPool};
use crate::metrics::{Metrics, QueryOutcome};
use crate::state::State;

/// The catalog every dataset is listed in.
pub const CATALOG: &str = "flightdeck";
/// The schema every dataset is listed in.
pub const SCHEMA: &str = "public";
/// Prefix of the type URL of every Flight SQL command.
const SQL_TYPE_PREFIX: &str = "type.googleapis.com/arrow.flight.protocol.sql.";
/// The Flight SQL actions (the rest are flightdeck's).
const SQL_ACTIONS: [&str; 8] = [
    "CreatePreparedStatement",
    "ClosePreparedStatement",
    "CreatePreparedSubstraitPlan",
    "BeginTransaction",
    "EndTransaction",
    "BeginSavepoint",
    "EndSavepoint",
    "CancelQuery",
];

/// Whether a descriptor command or ticket is a Flight SQL message (an
/// `Any` of a Flight SQL type); flightdeck's own never decode as one.
pub fn is_sql_command(bytes: &[u8]) -> bool {
    Any::decode(bytes).is_ok_and(|any| any.type_url.starts_with(SQL_TYPE_PREFIX))
}

/// What a `DoPut` is, by the command its first message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutKind {
    /// flightdeck's own: an attempt of a partition.
    Partition,
    /// Flight SQL binding a prepared statement's parameters (a read).
    SqlParameters,
    /// A Flight SQL bulk ingestion: writes a dataset.
    SqlIngest,
}

/// The kind of a `DoPut` whose first message's descriptor carries `command`.
pub fn put_kind(command: &[u8]) -> PutKind {
    match Any::decode(command) {
        Ok(any) if any.is::<CommandStatementIngest>() => PutKind::SqlIngest,
        Ok(any) if any.type_url.starts_with(SQL_TYPE_PREFIX) => PutKind::SqlParameters,
        _ => PutKind::Partition,
    }
}

/// A write id for one replacing ingestion, unique on this server and
/// across its restarts (the clock's nanoseconds, and a count within them).
fn ingest_write_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("ingest-{nanos}-{}", COUNT.fetch_add(1, Ordering::Relaxed))
}

/// The dataset a bulk ingestion writes, and whether it replaces one that
/// `exists` (by name): checks what `cmd` asks against what flightdeck
/// does (no temporary tables, transactions, other catalogs or schemas; a
/// sealed dataset is not appended to).
fn ingest_target(
    cmd: &CommandStatementIngest,
    exists: impl FnOnce(&str) -> bool,
) -> Result<(String, bool)> {
    use arrow_flight::sql::{TableExistsOption, TableNotExistOption};
    let dataset = convert::dataset_name(&cmd.table)?;
    if cmd.temporary {
        return Err(Error::invalid(format!(
            "bulk ingestion into '{dataset}' asks for a temporary table; flightdeck keeps \
             datasets until they are dropped: ingest without it, and drop the dataset when \
             done"
        )));
    }
    if cmd.transaction_id.is_some() {
        return Err(Error::invalid(
            "bulk ingestion within a transaction: flightdeck has no transactions (an \
             ingestion is kept whole or not at all); ingest without one",
        ));
    }
    for (what, given, ours) in [
        ("catalog", &cmd.catalog, CATALOG),
        ("schema", &cmd.schema, SCHEMA),
    ] {
        if let Some(given) = given.as_deref().filter(|g| !g.is_empty() && *g != ours) {
            return Err(Error::invalid(format!(
                "bulk ingestion into {what} '{given}': every dataset is in {what} '{ours}'; \
                 leave the {what} out"
            )));
        }
    }
    let options = cmd.table_definition_options.unwrap_or_default();
    let if_missing = TableNotExistOption::try_from(options.if_not_exist)
        .unwrap_or(TableNotExistOption::Unspecified);
    let if_exists =
        TableExistsOption::try_from(options.if_exists).unwrap_or(TableExistsOption::Unspecified);
    let exists = exists(&dataset);
    let replace = match (exists, if_exists, if_missing) {
        (_, TableExistsOption::Unspecified, _) | (_, _, TableNotExistOption::Unspecified) => {
            return Err(Error::invalid(
                "bulk ingestion without what to do where the table exists or does not; \
                 name both (ADBC's modes create, append, replace and create_append do)",
            ));
        }
        (true, TableExistsOption::Fail, _) => {
            return Err(Error::AlreadyExists(format!(
                "dataset '{dataset}' exists; ingest with mode 'replace' to write it again, \
                 or drop it first"
            )));
        }
        (true, TableExistsOption::Append, _) => {
            return Err(Error::FailedPrecondition(format!(
                "dataset '{dataset}' exists, and a dataset is sealed whole: rows cannot be \
                 appended to it; ingest all its rows with mode 'replace', or into a new table"
            )));
        }
        (true, TableExistsOption::Replace, _) => true,
        (false, _, TableNotExistOption::Fail) => {
            return Err(Error::NotFound(format!(
                "dataset '{dataset}' does not exist; ingest with mode 'create' to make it"
            )));
        }
        (false, _, TableNotExistOption::Create) => false,
    };
    Ok((dataset, replace))
}

/// What a bulk ingestion wrote before its seal: dropped (on the runtime)
/// unless the seal takes it.
struct Unsealed {
    state: Arc<State>,
    drop: Option<convert::DropRequest>,
}

impl Unsealed {
    /// The seal took what the ingestion wrote: nothing to drop.
    fn keep(&mut self) {
        self.drop = None;
    }
}

impl Drop for Unsealed {
    fn drop(&mut self) {
        if let Some(request) = self.drop.take() {
            let state = self.state.clone();
            tokio::spawn(async move {
                if let Err(e) = state.drop_dataset(&request).await {
                    tracing::warn!(dataset = %request.dataset, error = %e,
                        "an ingestion that did not finish left rows that could not be dropped");
                }
            });
        }
    }
}

/// Whether an action type is a Flight SQL action.
pub fn is_sql_action(kind: &str) -> bool {
    SQL_ACTIONS.contains(&kind)
}

type DoGetStream =
    Pin<Box<dyn Stream<Item = std::result::Result<arrow_flight::FlightData, Status>> + Send>>;

/// The Flight SQL service over the server's cached datasets.
#[derive(Debug, Clone)]
pub struct SqlService {
    state: Arc<State>,
}

/// What `GetSqlInfo` answers.
fn sql_info() -> std::result::Result<SqlInfoData, Status> {
    let mut builder = SqlInfoDataBuilder::new();
    builder.append(SqlInfo::FlightSqlServerName, "flightdeck");
    builder.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    builder.append(SqlInfo::FlightSqlServerArrowVersion, "1.3");
    // Queries are read-only; bulk ingestion writes datasets.
    builder.append(SqlInfo::FlightSqlServerReadOnly, false);
    builder.append(SqlInfo::FlightSqlServerBulkIngestion, true);
    builder.append(SqlInfo::FlightSqlServerIngestTransactionsSupported, false);
    builder.append(SqlInfo::FlightSqlServerSql, true);
    builder.append(SqlInfo::FlightSqlServerSubstrait, false);
    builder.append(SqlInfo::FlightSqlServerTransaction, 0i32);
    builder.append(SqlInfo::FlightSqlServerCancel, false);
    builder.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    builder
        .build()
        .map_err(|e| Status::internal(format!("cannot build the SQL info: {e}")))
}

impl SqlService {
    /// The service over `state`.
    pub fn new(state: Arc<State>) -> Self {
        Self { state }
    }

    /// A session whose `flightdeck.public` schema lists the sealed
    /// datasets, with `source` (when given) also readable as `source`.
    fn session(&self, source: Option<&str>) -> Result<SessionContext> {
        // What one query may hold beyond the cached data it reads (hash
        // tables, join build sides, sort buffers): a quarter of the budget,
        // and no more than the budget has free.
        let limit = query_memory(self.state.config.memory_limit);
        let config = crate::query::config()
            .with_default_catalog_and_schema(CATALOG, SCHEMA)
            .with_information_schema(true);
        let reserve = sort_merge_reserve(limit, config.target_partitions());
        let config = config.with_sort_spill_reservation_bytes(reserve);
        let pool = QueryPool::new(limit, self.state.arena().budget().clone());
        let runtime = datafusion::execution::runtime_env::RuntimeEnvBuilder::new()
            .with_memory_pool(Arc::new(pool))
            .build_arc()
            .map_err(|e| Error::Internal(format!("cannot make a query runtime: {e}")))?;
        let state = SessionStateBuilder::new()
            .with_config(config)
            .with_runtime_env(runtime)
            .with_default_features()
            .with_physical_optimizer_rule(Arc::new(crate::query::Interruptible))
            .build();
        let ctx = SessionContext::new_with_state(state);
        ctx.register_udf(crate::query::HashBucket::udf());
        let tables = self.tables();
        for (name, schema) in tables {
            let table = Arc::new(CachedTable {
                state: self.state.clone(),
                name: name.clone(),
                schema,
            });
            if source == Some(name.as_str()) && name != "source" {
                ctx.register_table("source", table.clone())
                    .map_err(|e| Error::Internal(format!("cannot register the source: {e}")))?;
            }
            ctx.register_table(datafusion::common::TableReference::bare(name), table)
                .map_err(|e| Error::Internal(format!("cannot register a table: {e}")))?;
        }
        Ok(ctx)
    }

    /// Readable datasets and their schemas, by name.
    fn tables(&self) -> Vec<(String, SchemaRef)> {
        self.state
            .catalog()
            .list()
            .into_iter()
            .filter(|s| {
                s.state == DatasetState::Sealed && !matches!(s.cluster, Some(ClusterState::Pending))
            })
            .map(|s| (s.name, s.schema))
            .collect()
    }

    /// For a query naming a dataset that exists but is not a table yet
    /// (still being written, or its cluster seal unfinished — DataFusion says
    /// "not found"): `FAILED_PRECONDITION` saying so.
    fn unreadable(&self, sql: &str, e: &DataFusionError) -> Option<Error> {
        let DataFusionError::Plan(m) = e.find_root() else {
            return None;
        };
        let summary =
            self.state.catalog().list().into_iter().find(|s| {
                m.contains(&format!("table '{CATALOG}.{SCHEMA}.{}' not found", s.name))
            })?;
        let why = if summary.state == DatasetState::Sealed {
            "its cluster seal is unfinished; seal it again"
        } else {
            "it is still being written; query it once it is sealed"
        };
        Some(Error::FailedPrecondition(format!(
            "the query `{sql}` reads dataset '{}', which is not readable yet: {why}",
            summary.name
        )))
    }

    /// For a query naming a table no dataset is (DataFusion says "not
    /// found"): `INVALID_ARGUMENT` with DataFusion's words, then the tables
    /// there are, or where a
    /// dataset has the name but for case, how to quote it (SQL lowercases
    /// unquoted names).
    fn unknown_table(&self, sql: &str, e: &DataFusionError) -> Option<Error> {
        let DataFusionError::Plan(m) = e.find_root() else {
            return None;
        };
        let prefix = format!("table '{CATALOG}.{SCHEMA}.");
        let name = m.split_once(&prefix)?.1.split_once("' not found")?.0;
        let mut tables: Vec<String> = self.tables().into_iter().map(|(n, _)| n).collect();
        tables.sort();
        let hint = match tables.iter().find(|t| t.eq_ignore_ascii_case(name)) {
            Some(t) => format!(
                "; dataset '{t}' is a table, but SQL lowercases names not in double quotes: \
                 write \"{t}\""
            ),
            None if tables.is_empty() => "; no dataset is sealed here yet".to_string(),
            None => {
                let shown = tables.len().min(crate::error::MISSING_SHOWN);
                let more = match tables.len() - shown {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                format!(
                    "; the tables (the sealed datasets) are: {}{more}",
                    tables[..shown].join(", ")
                )
            }
        };
        Some(Error::invalid(format!(
            "the query `{sql}` cannot run: {e}{hint}"
        )))
    }

    /// The logical plan of `sql`, read-only, with `params` bound.
    async fn plan(
        &self,
        ctx: &SessionContext,
        sql: &str,
        params: Option<ParamValues>,
    ) -> Result<LogicalPlan> {
        unwound(sql, self.plan_unguarded(ctx, sql, params)).await
    }

    async fn plan_unguarded(
        &self,
        ctx: &SessionContext,
        sql: &str,
        params: Option<ParamValues>,
    ) -> Result<LogicalPlan> {
        let refused = |e: DataFusionError| query_error(sql, e);
        let state = ctx.state();
        let planned = match parse(&state, sql) {
            Ok(statement) => state.statement_to_plan(statement).await,
            Err(e) => Err(e),
        };
        let plan = planned.map_err(|e| {
            self.unreadable(sql, &e)
                .or_else(|| self.unknown_table(sql, &e))
                .unwrap_or_else(|| refused(e))
        })?;
        SQLOptions::new()
            .with_allow_ddl(false)
            .with_allow_dml(false)
            .with_allow_statements(false)
            .verify_plan(&plan)
            .map_err(|e| {
                Error::invalid(format!(
                    "the query `{sql}` is refused: {e}; queries over the cache are read-only \
                     (use action 'derive' to keep a result as a dataset); datasets are written \
                     by bulk ingestion (ADBC's adbc_ingest, pandas' to_sql) or the clients, and \
                     dropped with action 'drop'"
                ))
            })?;
        match params {
            Some(p) => {
                let p = in_placeholder_times(&plan, p).map_err(refused)?;
                plan.with_param_values(p).map_err(refused)
            }
            None => Ok(plan),
        }
    }

    /// Runs `sql` and streams its result as Flight data in `schema`.
    async fn run(&self, sql: &str, params: Option<ParamValues>) -> Result<DoGetStream> {
        let ctx = self.session(None)?;
        let plan = self.plan(&ctx, sql, params).await?;
        let schema: SchemaRef = Arc::new(answer_schema(&plan));
        let results = start(sql, DataFrame::new(ctx.state(), plan), &self.state.metrics)?;
        let declared = schema.clone();
        let batches = tokio_stream::wrappers::ReceiverStream::new(results).map(move |item| {
            item.map(|b| conform(&declared, b))
                .map_err(|e| FlightError::Tonic(Box::new(Status::from(e))))
        });
        Ok(FlightDataEncoderBuilder::new()
            .with_schema(schema)
            .build(batches)
            .map_err(Status::from)
            .boxed())
    }

    /// The result schema of `sql`.
    async fn schema_of(&self, sql: &str) -> Result<(Schema, Schema)> {
        let ctx = self.session(None)?;
        let plan = self.plan(&ctx, sql, None).await?;
        let hints = placeholder_hints(&plan);
        let mut params: Vec<(String, arrow::datatypes::FieldRef)> = plan
            .get_parameter_fields()
            .map_err(|e| query_error(sql, e))?
            .into_iter()
            .map(|(name, field)| {
                let field = field.unwrap_or_else(|| {
                    Arc::new(arrow::datatypes::Field::new(
                        &name,
                        untyped_parameter(&hints, &name),
                        true,
                    ))
                });
                (name, field)
            })
            .collect();
        params.sort_by_key(|(name, _)| {
            name.trim_start_matches('$')
                .parse::<u64>()
                .unwrap_or(u64::MAX)
        });
        let params = Schema::new(
            params
                .into_iter()
                .map(|(name, f)| sent_field(&f, Sent::Parameter).with_name(name))
                .collect::<Vec<_>>(),
        );
        Ok((answer_schema(&plan), params))
    }

    /// Why an update of `sql` (`ExecuteUpdate`: JDBC's `executeUpdate`,
    /// ADBC's `executemany` and `execute_update`) is refused: a statement
    /// that changes data gets the read-only refusal every query plan gives
    /// it, and a query is told to run as a query. Nothing is executed.
    async fn refused_update(&self, sql: &str) -> Status {
        match self.schema_of(sql).await {
            Err(e) => e.into(),
            Ok(_) => Status::invalid_argument(format!(
                "the query `{sql}` was sent as an update (JDBC's executeUpdate, ADBC's \
                 executemany), which changes no dataset here: run it as a query (executeQuery, \
                 execute); queries over the cache are read-only"
            )),
        }
    }

    /// Flight SQL bulk ingestion (ADBC's `adbc_ingest`, and pandas'
    /// `to_sql` and Polars' `write_database` through it): the stream becomes
    /// dataset `cmd.table`, one partition, sealed at its end; with the
    /// `replace` option, as a write that replaces the dataset at once (what
    /// Spark's overwrite does), readers keeping the old rows until then.
    /// Datasets are sealed whole, so an append to one that exists is
    /// refused. Nothing is kept of a stream that breaks.
    ///
    /// The partition is committed and sealed as the answer is sent, as
    /// every write's is (`put::Received`): a client that cancels
    /// its call (ADBC's driver does when the data it sends fails) resets
    /// the stream with `NO_ERROR`, which ends the request like a finished
    /// one, but the answer to a reset stream is never taken, so nothing it
    /// sent is kept. Returns what the answer acknowledges, and the answer.
    pub async fn ingest(
        &self,
        mut stream: tonic::Streaming<arrow_flight::FlightData>,
    ) -> Result<(
        pb::PutAck,
        BoxStream<'static, std::result::Result<arrow_flight::PutResult, Status>>,
    )> {
        let first = match stream.next().await {
            Some(Ok(first)) => first,
            Some(Err(status)) => {
                return Err(Error::Aborted(format!(
                    "the bulk ingestion broke before its first message: {}",
                    status.message()
                )));
            }
            None => return Err(Error::invalid("the bulk ingestion sent no message")),
        };
        let cmd = first
            .flight_descriptor
            .as_ref()
            .and_then(|d| Any::decode(d.cmd.as_ref()).ok())
            .and_then(|any| any.unpack::<CommandStatementIngest>().ok().flatten())
            .ok_or_else(|| Error::invalid("the bulk ingestion's first message names no table"))?;
        let (dataset, replace) =
            ingest_target(&cmd, |name| self.state.catalog().describe(name).is_ok())?;
        let write_id = if replace {
            ingest_write_id()
        } else {
            String::new()
        };
        let put = pb::PutPartition {
            dataset: dataset.clone(),
            write_id: write_id.clone(),
            replace,
            ..Default::default()
        };
        // The stream as a DoPut of partition 0: its first message names it.
        let first = arrow_flight::FlightData {
            flight_descriptor: Some(FlightDescriptor::new_cmd(put.encode_to_vec())),
            ..first
        };
        let input = futures::stream::iter([Ok(first)]).chain(stream);
        // (A stream that breaks stores nothing.)
        let received = super::put::receive(&self.state, input).await?;
        let ack = received.ack().clone();
        let dropped = convert::DropRequest {
            dataset: dataset.clone(),
            member_only: false,
            abort_write: write_id.clone(),
            staged: replace,
            keep_write: String::new(),
        };
        let state = self.state.clone();
        let seal = SealRequest {
            dataset,
            partitions: 1,
            winners: Vec::new(),
            members: Vec::new(),
            replace_write: write_id,
        };
        let record_count = i64::try_from(ack.rows).unwrap_or(i64::MAX);
        let answer = futures::stream::once(async move {
            received.commit(&state)?;
            // Committed, what the ingestion wrote goes if the seal fails or
            // the call ends before it.
            let mut unsealed = Unsealed {
                state: state.clone(),
                drop: Some(dropped),
            };
            state.seal(&seal).await?;
            unsealed.keep();
            let result = DoPutUpdateResult { record_count };
            Ok(arrow_flight::PutResult {
                app_metadata: result.encode_to_vec().into(),
            })
        });
        let answer = answer
            .map(|r: Result<arrow_flight::PutResult>| r.map_err(Status::from))
            .boxed();
        Ok((ack, answer))
    }

    /// Action `derive`: runs `sql` (reading `source`, when given, also as
    /// table `source`) and keeps its result as the sealed dataset `target`
    /// in the arena, subject to the budget like any write.
    pub async fn derive(&self, req: &pb::DeriveDataset) -> Result<crate::catalog::DatasetSummary> {
        let target = convert::dataset_name(&req.target)?;
        if self.state.catalog().describe(&target).is_ok() {
            return Err(Error::FailedPrecondition(format!(
                "dataset '{target}' exists; drop it first or derive into another name"
            )));
        }
        let source = (!req.source.is_empty()).then_some(req.source.as_str());
        if let Some(s) = source {
            self.state.readable(s)?;
        }
        let ctx = self.session(source)?;
        let plan = self.plan(&ctx, &req.sql, None).await?;
        let schema: SchemaRef = Arc::new(plan.schema().as_arrow().clone());
        let mut results = start(
            &req.sql,
            DataFrame::new(ctx.state(), plan),
            &self.state.metrics,
        )?;
        let what = || format!("dataset '{target}' derived by `{}`", req.sql);
        let (mut batches, mut rows, mut bytes) = (Vec::new(), 0u64, 0u64);
        while let Some(batch) = results.recv().await {
            let batch = conform(&schema, batch?);
            if batch.num_rows() == 0 {
                continue;
            }
            let (kept, taken) = self.state.admit(&batch, None, None, &what).await?;
            rows += kept.num_rows() as u64;
            bytes += taken;
            batches.push(kept);
        }
        let key = crate::catalog::AttemptKey {
            partition: 0,
            attempt: 0,
        };
        self.state.catalog().commit(
            &target,
            key,
            schema,
            crate::catalog::AttemptData {
                batches,
                rows,
                bytes,
            },
        )?;
        let sealed = self
            .state
            .seal(&SealRequest {
                dataset: target.clone(),
                partitions: 1,
                winners: Vec::new(),
                members: Vec::new(),
                replace_write: String::new(),
            })
            .await;
        if let Err(e) = sealed {
            let _ = self.state.catalog().drop_dataset(&target);
            return Err(e);
        }
        tracing::info!(dataset = %target, rows, bytes, sql = %req.sql, "derived dataset");
        self.state.catalog().describe(&target)
    }
}

/// Bytes one SQL query may hold of its own: a quarter of the memory
/// budget, at least 16 MiB.
pub fn query_memory(budget: u64) -> usize {
    usize::try_from(budget / 4)
        .unwrap_or(usize::MAX)
        .max(16 << 20)
}

/// What each sorting partition of a query sets aside when it starts, for
/// merging what it may spill: DataFusion's 10 MiB, or less where the
/// query's `limit` would not hold that for every one of its `partitions`
/// at once with room to sort (a quarter of the limit between them). With
/// 10 MiB each, a window over a few rows on two cores was refused under a
/// 16 MiB limit, and any sort on a 128-core machine needed 1.3 GB.
fn sort_merge_reserve(limit: usize, partitions: usize) -> usize {
    (limit / 4 / partitions.max(1)).min(10 << 20)
}

/// Threads of the runtime queries run on (see [`query_runtime`]).
fn query_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().max(2))
}

/// The runtime SQL queries (statements and `derive`) run on, apart from the
/// one serving every call: a query computes on these threads, never on the
/// ones that serve reads, writes and health checks. A query yields at least
/// once every 128 batches an operator produces (see
/// [`crate::query::Interruptible`]) and stops there once its client has
/// gone; only work inside one batch (one huge value through a function)
/// holds a thread until it is done.
fn query_runtime() -> Result<&'static tokio::runtime::Runtime> {
    static RUNTIME: std::sync::OnceLock<std::result::Result<tokio::runtime::Runtime, String>> =
        std::sync::OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(query_threads())
                .thread_name("flightdeck-query")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| Error::Internal(format!("cannot start the threads queries run on: {e}")))
}

/// Runs `frame`, the plan of the query `sql`, on the query runtime; its
/// batches (then its error, if any, naming `sql`) arrive on the returned
/// channel, two at most waiting. The query stops at its next yield once
/// the receiver is dropped (its client gone). `metrics` count it.
fn start(
    sql: &str,
    frame: DataFrame,
    metrics: &Arc<Metrics>,
) -> Result<tokio::sync::mpsc::Receiver<Result<RecordBatch>>> {
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let sql = sql.to_string();
    let runtime = query_runtime()?;
    let running = metrics.query_started();
    runtime.spawn(async move {
        let run = async {
            let mut stream = frame
                .execute_stream()
                .await
                .map_err(|e| query_error(&sql, e))?;
            loop {
                let item = tokio::select! {
                    () = tx.closed() => return Ok(QueryOutcome::GivenUp),
                    item = stream.next() => item,
                };
                let Some(item) = item else {
                    return Ok(QueryOutcome::Done);
                };
                let batch = item.map_err(|e| query_error(&sql, e))?;
                if tx.send(Ok(batch)).await.is_err() {
                    return Ok(QueryOutcome::GivenUp);
                }
            }
        };
        let outcome = match unwound(&sql, run).await {
            Ok(outcome) => outcome,
            Err(e) => {
                let _ = tx.send(Err(e)).await;
                QueryOutcome::Failed
            }
        };
        running.end(outcome);
    });
    Ok(rx)
}

/// Runs `work`, DataFusion planning or starting the query `sql` a client
/// sent; a panic inside it (some extreme literals overflow inside the
/// engine's type coercion) becomes `INVALID_ARGUMENT` naming the query.
async fn unwound<T>(sql: &str, work: impl Future<Output = Result<T>>) -> Result<T> {
    AssertUnwindSafe(work)
        .catch_unwind()
        .await
        .unwrap_or_else(|panic| Err(engine_failed(sql, &*panic)))
}

/// `INVALID_ARGUMENT` for a query DataFusion panicked on.
fn engine_failed(sql: &str, panic: &(dyn std::any::Any + Send)) -> Error {
    Error::invalid(format!(
        "the query `{sql}` cannot run: the query engine failed on it ({}); write it another way",
        panic_message(panic)
    ))
}

/// `sql` parsed in the session's dialect, its positional `?` placeholders
/// (JDBC's, and the `qmark` style ADBC's Python driver declares) numbered
/// `$1`, `$2`, … in the order they appear, as DataFusion binds parameters.
/// A query mixing `?` with numbered placeholders is refused.
fn parse(state: &SessionState, sql: &str) -> datafusion::common::Result<DfStatement> {
    use datafusion::sql::sqlparser::ast::{Expr as SqlExpr, Value, visit_expressions_mut};
    use std::ops::ControlFlow;

    let dialect = state.config().options().sql_parser.dialect;
    let mut statement = state.sql_to_statement(sql, &dialect)?;
    let DfStatement::Statement(inner) = &mut statement else {
        return Ok(statement);
    };
    let (mut marks, mut numbered) = (0usize, false);
    let _ = visit_expressions_mut(inner.as_mut(), |expr| {
        if let SqlExpr::Value(v) = expr
            && let Value::Placeholder(name) = &mut v.value
        {
            if name == "?" {
                marks += 1;
                *name = format!("${marks}");
            } else {
                numbered = true;
            }
        }
        ControlFlow::<()>::Continue(())
    });
    if marks > 0 && numbered {
        return Err(DataFusionError::Plan(
            "the query mixes `?` placeholders with numbered ones ($1, $2, …); use one kind".into(),
        ));
    }
    Ok(statement)
}

/// `INVALID_ARGUMENT` with DataFusion's message and the query; a query
/// past its memory is `RESOURCE_EXHAUSTED`; errors of the server itself (a
/// restore that found no room) keep their own code.
fn query_error(sql: &str, e: DataFusionError) -> Error {
    if let DataFusionError::ResourcesExhausted(m) = e.find_root() {
        if m.starts_with(BUDGET_FULL) {
            return Error::ResourceExhausted(format!("the query `{sql}` cannot run now: {m}"));
        }
        return Error::ResourceExhausted(format!(
            "the query `{sql}` needs more memory than a query may hold (a quarter of \
             --memory-limit): {m}; select fewer columns or rows, or aggregate first"
        ));
    }
    match e {
        DataFusionError::External(inner) => match inner.downcast::<Error>() {
            Ok(ours) => *ours,
            Err(other) => Error::invalid(format!("the query `{sql}` failed: {other}")),
        },
        DataFusionError::Context(_, inner) => query_error(sql, *inner),
        DataFusionError::ResourcesExhausted(m) => {
            Error::ResourceExhausted(format!("the query `{sql}` ran out of memory: {m}"))
        }
        other => Error::invalid(format!("the query `{sql}` cannot run: {other}")),
    }
}

/// `batch` with the declared schema's field names and nullability (strict
/// clients compare the stream's schema with the advertised one), its
/// columns cast where the declared type differs (see [`sent_type`]); as it
/// is when the columns do not fit it.
fn conform(schema: &SchemaRef, batch: RecordBatch) -> RecordBatch {
    if batch.schema() == *schema {
        return batch;
    }
    let columns = batch
        .columns()
        .iter()
        .zip(schema.fields())
        .map(|(column, field)| {
            if column.data_type() == field.data_type() {
                Ok(column.clone())
            } else {
                arrow::compute::cast(column, field.data_type())
            }
        })
        .collect::<std::result::Result<Vec<_>, _>>();
    match columns {
        Ok(columns) => RecordBatch::try_new(schema.clone(), columns).unwrap_or(batch),
        Err(_) => batch,
    }
}

/// The schema a query's answer is sent in: its plan's, in [`Sent::Answer`] types.
fn answer_schema(plan: &LogicalPlan) -> Schema {
    sent_schema(plan.schema().as_arrow(), Sent::Answer)
}

/// `schema` as sent in `sent`.
fn sent_schema(schema: &Schema, sent: Sent) -> Schema {
    Schema::new_with_metadata(
        schema
            .fields()
            .iter()
            .map(|f| sent_field(f, sent))
            .collect::<Vec<_>>(),
        schema.metadata().clone(),
    )
}

/// What a type sent to Flight SQL clients is sent as (see [`sent_type`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Sent {
    /// A prepared statement's parameter: what the client binds values as.
    Parameter,
    /// A column of an answer (and of a table's schema in `GetTables`).
    Answer,
}

/// `field` of its [`sent_type`]; a decimal column of an answer says its
/// precision and scale in Flight SQL's column metadata, which is where the
/// JDBC driver's `getPrecision` and `getScale` read them (without, 0 and 0,
/// and Spark's JDBC source reads every decimal as `decimal(38,18)`).
fn sent_field(field: &arrow::datatypes::Field, sent: Sent) -> arrow::datatypes::Field {
    use arrow::datatypes::DataType;
    let data_type = sent_type(field.data_type(), sent);
    let digits = match data_type {
        DataType::Decimal32(p, s)
        | DataType::Decimal64(p, s)
        | DataType::Decimal128(p, s)
        | DataType::Decimal256(p, s)
            if sent == Sent::Answer =>
        {
            Some((p, s))
        }
        _ => None,
    };
    let field = field.clone().with_data_type(data_type);
    match digits {
        Some((precision, scale)) => {
            let mut metadata = field.metadata().clone();
            metadata.insert(COLUMN_PRECISION.into(), precision.to_string());
            metadata.insert(COLUMN_SCALE.into(), scale.to_string());
            field.with_metadata(metadata)
        }
        None => field,
    }
}

/// Flight SQL's column metadata keys for a column's precision (a decimal's
/// digits) and scale (its digits after the point).
const COLUMN_PRECISION: &str = "ARROW:FLIGHT:SQL:PRECISION";
const COLUMN_SCALE: &str = "ARROW:FLIGHT:SQL:SCALE";

/// `data_type` in a type every Flight SQL client reads, at any depth:
/// Arrow's view layouts (`Utf8View`, `BinaryView`) as their plain
/// counterparts, and in answers unsigned integers as the next wider signed
/// type (`UInt64` as `Decimal128(20, 0)`) and half floats as `Float32`,
/// which keep every value. Arrow Java's Flight SQL JDBC driver (and with it
/// Spark's JDBC source and JVM tools) refuses a view or half-float column
/// outright — a listing of the table's columns too — and reads an unsigned
/// value as the signed one of its bits (255 as -1); datasets written from
/// pyarrow, Polars or pandas hold them.
///
/// Parameters of time types are declared in the units that driver writes
/// whatever the type declared (Avatica's: epoch milliseconds, milliseconds
/// of the day, days): a timestamp in milliseconds, a time as `Time32` in
/// milliseconds, a date as `Date32`. Declared in microseconds, as Spark's
/// timestamps are, `setTimestamp` bound a value a thousand times too small
/// (`ts >= ?` matched every row; arrow-java issue 838). Other clients bind
/// values of their own types, which the query casts as it runs.
fn sent_type(data_type: &arrow::datatypes::DataType, sent: Sent) -> arrow::datatypes::DataType {
    use arrow::datatypes::{DataType, TimeUnit};
    let field = |f: &arrow::datatypes::FieldRef| Arc::new(sent_field(f, sent));
    let answer = sent == Sent::Answer;
    match data_type {
        DataType::Utf8View => DataType::Utf8,
        DataType::BinaryView => DataType::Binary,
        DataType::UInt8 if answer => DataType::Int16,
        DataType::UInt16 if answer => DataType::Int32,
        DataType::UInt32 if answer => DataType::Int64,
        DataType::UInt64 if answer => DataType::Decimal128(20, 0),
        DataType::Float16 if answer => DataType::Float32,
        DataType::Timestamp(_, zone) if !answer => {
            DataType::Timestamp(TimeUnit::Millisecond, zone.clone())
        }
        DataType::Time32(_) | DataType::Time64(_) if !answer => {
            DataType::Time32(TimeUnit::Millisecond)
        }
        DataType::Date64 if !answer => DataType::Date32,
        DataType::List(f) => DataType::List(field(f)),
        DataType::LargeList(f) => DataType::LargeList(field(f)),
        DataType::FixedSizeList(f, n) => DataType::FixedSizeList(field(f), *n),
        DataType::Struct(fields) => DataType::Struct(fields.iter().map(field).collect()),
        DataType::Map(f, sorted) => DataType::Map(field(f), *sorted),
        other => other.clone(),
    }
}

/// `params` with each bound time, timestamp or date cast to the type of
/// its placeholder where the two differ: JDBC binds them in the units they
/// are declared in ([`sent_type`]), and DataFusion compares no `Time32`
/// with a `Time64`. Other values are bound as they come (a number keeps
/// its own type, as the query coerces it).
fn in_placeholder_times(
    plan: &LogicalPlan,
    params: ParamValues,
) -> std::result::Result<ParamValues, DataFusionError> {
    use datafusion::common::metadata::ScalarAndMetadata;
    let fields = plan.get_parameter_fields()?;
    let temporal = |t: &arrow::datatypes::DataType| {
        use arrow::datatypes::DataType::*;
        matches!(t, Timestamp(..) | Date32 | Date64 | Time32(_) | Time64(_))
    };
    let cast = |id: String, bound: ScalarAndMetadata| {
        let Some(Some(field)) = fields.get(&id) else {
            return Ok(bound);
        };
        let (from, to) = (bound.value.data_type(), field.data_type());
        if from == *to || !temporal(&from) || !temporal(to) {
            return Ok(bound);
        }
        let value = bound.value.cast_to(to)?;
        Ok(ScalarAndMetadata {
            value,
            metadata: bound.metadata,
        })
    };
    Ok(match params {
        ParamValues::List(values) => ParamValues::List(
            values
                .into_iter()
                .enumerate()
                .map(|(i, v)| cast(format!("${}", i + 1), v))
                .collect::<std::result::Result<_, DataFusionError>>()?,
        ),
        ParamValues::Map(values) => ParamValues::Map(
            values
                .into_iter()
                .map(|(name, v)| Ok((name.clone(), cast(format!("${name}"), v)?)))
                .collect::<std::result::Result<_, DataFusionError>>()?,
        ),
    })
}

/// Types for the placeholders DataFusion leaves untyped, from where they
/// stand: a `LIMIT` or `OFFSET` count (`LIMIT ? OFFSET ?`, how JVM tools
/// page through a result) as `Int64`, a cast's operand (`CAST(? AS
/// BIGINT)`) as the cast's type, as PostgreSQL types `$1::bigint`.
fn placeholder_hints(plan: &LogicalPlan) -> HashMap<String, arrow::datatypes::DataType> {
    use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
    use datafusion::logical_expr::{Cast, TryCast};
    let mut hints = HashMap::new();
    let mut hint = |e: &Expr, data_type: &arrow::datatypes::DataType| {
        if let Expr::Placeholder(p) = e {
            hints.insert(p.id.clone(), data_type.clone());
        }
    };
    // (The closures never fail.)
    let _ = plan.apply_with_subqueries(|node| {
        if let LogicalPlan::Limit(limit) = node {
            for count in [&limit.skip, &limit.fetch].into_iter().flatten() {
                hint(count, &arrow::datatypes::DataType::Int64);
            }
        }
        node.apply_expressions(|e| {
            e.apply(|e| {
                match e {
                    Expr::Cast(Cast { expr, field }) | Expr::TryCast(TryCast { expr, field }) => {
                        hint(expr, field.data_type());
                    }
                    _ => {}
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })
    });
    hints
}

/// The type declared for a parameter the query does not type: its hint
/// ([`placeholder_hints`]), else text, as PostgreSQL types an unknown
/// parameter (`SELECT ? AS tag`). Declared `Null`, as DataFusion leaves
/// them, Arrow Java's JDBC driver binds nothing but NULL to it ("Can't set
/// non-null value on NullVector"). The value bound is used as it comes,
/// whatever its type.
fn untyped_parameter(
    hints: &HashMap<String, arrow::datatypes::DataType>,
    name: &str,
) -> arrow::datatypes::DataType {
    hints
        .get(name)
        .cloned()
        .unwrap_or(arrow::datatypes::DataType::Utf8)
}

/// An IPC schema message.
fn ipc_schema(schema: &Schema) -> std::result::Result<Bytes, Status> {
    let IpcMessage(bytes) = SchemaAsIpc::new(schema, &IpcWriteOptions::default())
        .try_into()
        .map_err(|e: arrow::error::ArrowError| {
            Status::internal(format!("cannot encode a schema: {e}"))
        })?;
    Ok(bytes)
}

/// A prepared statement's handle: its query and bound parameters.
fn encode_handle(query: &str, parameters: Bytes) -> Bytes {
    pb::SqlHandle {
        query: query.to_string(),
        parameters,
    }
    .encode_to_vec()
    .into()
}

fn decode_handle(handle: &[u8]) -> std::result::Result<pb::SqlHandle, Status> {
    pb::SqlHandle::decode(handle).map_err(|_| {
        Status::invalid_argument(
            "the prepared statement handle is not one this server issued; prepare the statement \
             again",
        )
    })
}

/// Bound parameters (an IPC stream of one row) as DataFusion's values:
/// positional (`$1`, `$2`, …) when every column is numbered, else by name.
fn param_values(parameters: &[u8]) -> Result<Option<ParamValues>> {
    if parameters.is_empty() {
        return Ok(None);
    }
    let bad = |e: &dyn std::fmt::Display| Error::invalid(format!("bad statement parameters: {e}"));
    let reader = StreamReader::try_new(parameters, None).map_err(|e| bad(&e))?;
    let batches = reader
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad(&e))?;
    let Some(batch) = batches.iter().find(|b| b.num_rows() > 0) else {
        return Ok(None);
    };
    let mut named = Vec::new();
    for (i, field) in batch.schema().fields().iter().enumerate() {
        let value = ScalarValue::try_from_array(batch.column(i), 0).map_err(|e| bad(&e))?;
        named.push((field.name().trim_start_matches('$').to_string(), value));
    }
    if named.iter().all(|(n, _)| n.parse::<usize>().is_ok()) {
        named.sort_by_key(|(n, _)| n.parse::<usize>().unwrap_or(usize::MAX));
        return Ok(Some(ParamValues::from(
            named.into_iter().map(|(_, v)| v).collect::<Vec<_>>(),
        )));
    }
    Ok(Some(ParamValues::from(named)))
}

/// A FlightInfo of `schema` with one endpoint whose ticket is `ticket`.
fn info_for(
    schema: &Schema,
    ticket: Bytes,
    descriptor: FlightDescriptor,
) -> std::result::Result<Response<FlightInfo>, Status> {
    let info = FlightInfo::new()
        .try_with_schema(schema)
        .map_err(|e| Status::internal(format!("cannot encode a schema: {e}")))?
        .with_endpoint(FlightEndpoint::new().with_ticket(Ticket::new(ticket)))
        .with_descriptor(descriptor);
    Ok(Response::new(info))
}

/// The FlightInfo whose one ticket is `cmd` itself (a metadata command, a
/// statement's ticket, a prepared statement), answered by its `do_get_*`.
fn command_info(
    schema: &Schema,
    cmd: &impl ProstMessageExt,
    request: Request<FlightDescriptor>,
) -> std::result::Result<Response<FlightInfo>, Status> {
    info_for(
        schema,
        cmd.as_any().encode_to_vec().into(),
        request.into_inner(),
    )
}

/// One record batch as a Flight data stream.
fn one_batch(
    schema: SchemaRef,
    batch: std::result::Result<RecordBatch, FlightError>,
) -> DoGetStream {
    FlightDataEncoderBuilder::new()
        .with_schema(schema)
        .build(futures::stream::once(async move { batch }))
        .map_err(Status::from)
        .boxed()
}

#[tonic::async_trait]
impl FlightSqlService for SqlService {
    type FlightService = SqlService;

    async fn get_flight_info_statement(
        &self,
        query: CommandStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let (schema, _) = self.schema_of(&query.query).await?;
        let ticket = TicketStatementQuery {
            statement_handle: query.query.clone().into(),
        };
        command_info(&schema, &ticket, request)
    }

    async fn do_get_statement(
        &self,
        ticket: TicketStatementQuery,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let sql = String::from_utf8(ticket.statement_handle.to_vec())
            .map_err(|_| Status::invalid_argument("the statement ticket is not UTF-8 SQL"))?;
        Ok(Response::new(self.run(&sql, None).await?))
    }

    async fn get_flight_info_prepared_statement(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let handle = decode_handle(&cmd.prepared_statement_handle)?;
        let ctx = self.session(None)?;
        let plan = self
            .plan(&ctx, &handle.query, param_values(&handle.parameters)?)
            .await?;
        command_info(&answer_schema(&plan), &cmd, request)
    }

    async fn do_get_prepared_statement(
        &self,
        cmd: CommandPreparedStatementQuery,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let handle = decode_handle(&cmd.prepared_statement_handle)?;
        let params = param_values(&handle.parameters)?;
        Ok(Response::new(self.run(&handle.query, params).await?))
    }

    async fn do_action_create_prepared_statement(
        &self,
        query: ActionCreatePreparedStatementRequest,
        _request: Request<Action>,
    ) -> std::result::Result<ActionCreatePreparedStatementResult, Status> {
        let (schema, params) = self.schema_of(&query.query).await?;
        Ok(ActionCreatePreparedStatementResult {
            prepared_statement_handle: encode_handle(&query.query, Bytes::new()),
            dataset_schema: ipc_schema(&schema)?,
            parameter_schema: ipc_schema(&params)?,
        })
    }

    async fn do_action_close_prepared_statement(
        &self,
        _query: ActionClosePreparedStatementRequest,
        _request: Request<Action>,
    ) -> std::result::Result<(), Status> {
        // Handles carry their statement: nothing is held to free.
        Ok(())
    }

    async fn do_put_prepared_statement_query(
        &self,
        cmd: CommandPreparedStatementQuery,
        request: Request<PeekableFlightDataStream>,
    ) -> std::result::Result<DoPutPreparedStatementResult, Status> {
        let handle = decode_handle(&cmd.prepared_statement_handle)?;
        let mut decoder = FlightDataDecoder::new(
            request
                .into_inner()
                .map_err(|s| FlightError::Tonic(Box::new(s))),
        );
        let mut parameters = Vec::new();
        let mut writer: Option<StreamWriter<&mut Vec<u8>>> = None;
        let mut rows = 0;
        let bad = |e: &dyn std::fmt::Display| {
            Status::invalid_argument(format!("bad statement parameters: {e}"))
        };
        while let Some(message) = decoder.try_next().await.map_err(|e| bad(&e))? {
            match message.payload {
                DecodedPayload::Schema(schema) => {
                    if writer.is_some() {
                        return Err(bad(&"more than one schema"));
                    }
                    writer =
                        Some(StreamWriter::try_new(&mut parameters, &schema).map_err(|e| bad(&e))?);
                }
                DecodedPayload::RecordBatch(batch) => {
                    rows += batch.num_rows();
                    let w = writer
                        .as_mut()
                        .ok_or_else(|| bad(&"rows before the schema"))?;
                    w.write(&batch).map_err(|e| bad(&e))?;
                }
                DecodedPayload::None => {}
            }
        }
        if rows > 1 {
            return Err(Status::invalid_argument(format!(
                "{rows} rows of parameters were bound; bind one row per execution"
            )));
        }
        if let Some(mut w) = writer {
            w.finish().map_err(|e| bad(&e))?;
        }
        Ok(DoPutPreparedStatementResult {
            prepared_statement_handle: Some(encode_handle(&handle.query, parameters.into())),
        })
    }

    async fn do_put_statement_update(
        &self,
        cmd: CommandStatementUpdate,
        _request: Request<PeekableFlightDataStream>,
    ) -> std::result::Result<i64, Status> {
        Err(self.refused_update(&cmd.query).await)
    }

    async fn do_put_prepared_statement_update(
        &self,
        cmd: CommandPreparedStatementUpdate,
        _request: Request<PeekableFlightDataStream>,
    ) -> std::result::Result<i64, Status> {
        let handle = decode_handle(&cmd.prepared_statement_handle)?;
        Err(self.refused_update(&handle.query).await)
    }

    async fn get_flight_info_catalogs(
        &self,
        query: CommandGetCatalogs,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let schema = query.into_builder().schema();
        command_info(&schema, &query, request)
    }

    async fn do_get_catalogs(
        &self,
        query: CommandGetCatalogs,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let mut builder = query.into_builder();
        builder.append(CATALOG);
        let schema = builder.schema();
        Ok(Response::new(one_batch(schema, builder.build())))
    }

    async fn get_flight_info_schemas(
        &self,
        query: CommandGetDbSchemas,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        command_info(&schema, &query, request)
    }

    async fn do_get_schemas(
        &self,
        query: CommandGetDbSchemas,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let mut builder = query.into_builder();
        builder.append(CATALOG, SCHEMA);
        let schema = builder.schema();
        Ok(Response::new(one_batch(schema, builder.build())))
    }

    async fn get_flight_info_tables(
        &self,
        query: CommandGetTables,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder().schema();
        command_info(&schema, &query, request)
    }

    async fn do_get_tables(
        &self,
        query: CommandGetTables,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let mut builder = query.into_builder();
        for (name, schema) in self.tables() {
            builder
                .append(
                    CATALOG,
                    SCHEMA,
                    name,
                    "TABLE",
                    &sent_schema(&schema, Sent::Answer),
                )
                .map_err(Status::from)?;
        }
        let schema = builder.schema();
        Ok(Response::new(one_batch(schema, builder.build())))
    }

    async fn get_flight_info_table_types(
        &self,
        query: CommandGetTableTypes,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        command_info(&table_types_schema(), &query, request)
    }

    async fn do_get_table_types(
        &self,
        _query: CommandGetTableTypes,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let schema = Arc::new(table_types_schema());
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![Arc::new(arrow::array::StringArray::from(vec!["TABLE"]))],
        )
        .map_err(FlightError::Arrow);
        Ok(Response::new(one_batch(schema, batch)))
    }

    async fn get_flight_info_sql_info(
        &self,
        query: CommandGetSqlInfo,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        let schema = query.clone().into_builder(&sql_info()?).schema();
        command_info(&schema, &query, request)
    }

    async fn do_get_sql_info(
        &self,
        query: CommandGetSqlInfo,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        let info = sql_info()?;
        let builder = query.into_builder(&info);
        let schema = builder.schema();
        Ok(Response::new(one_batch(schema, builder.build())))
    }

    // Datasets have no primary or foreign keys: the key listings answer
    // with no rows, as a database whose tables declare none does (JDBC
    // tools ask for them when they show a table).

    async fn get_flight_info_primary_keys(
        &self,
        query: CommandGetPrimaryKeys,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        command_info(&primary_keys_schema(), &query, request)
    }

    async fn do_get_primary_keys(
        &self,
        _query: CommandGetPrimaryKeys,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        Ok(Response::new(no_rows(primary_keys_schema())))
    }

    async fn get_flight_info_exported_keys(
        &self,
        query: CommandGetExportedKeys,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        command_info(&foreign_keys_schema(), &query, request)
    }

    async fn do_get_exported_keys(
        &self,
        _query: CommandGetExportedKeys,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        Ok(Response::new(no_rows(foreign_keys_schema())))
    }

    async fn get_flight_info_imported_keys(
        &self,
        query: CommandGetImportedKeys,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        command_info(&foreign_keys_schema(), &query, request)
    }

    async fn do_get_imported_keys(
        &self,
        _query: CommandGetImportedKeys,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        Ok(Response::new(no_rows(foreign_keys_schema())))
    }

    async fn get_flight_info_cross_reference(
        &self,
        query: CommandGetCrossReference,
        request: Request<FlightDescriptor>,
    ) -> std::result::Result<Response<FlightInfo>, Status> {
        command_info(&foreign_keys_schema(), &query, request)
    }

    async fn do_get_cross_reference(
        &self,
        _query: CommandGetCrossReference,
        _request: Request<Ticket>,
    ) -> std::result::Result<Response<<Self as FlightService>::DoGetStream>, Status> {
        Ok(Response::new(no_rows(foreign_keys_schema())))
    }

    async fn register_sql_info(&self, _id: i32, _result: &SqlInfo) {}
}

/// The columns of a `CommandGetPrimaryKeys` answer (FlightSql.proto).
fn primary_keys_schema() -> Schema {
    use arrow::datatypes::{DataType, Field};
    Schema::new(vec![
        Field::new("catalog_name", DataType::Utf8, true),
        Field::new("db_schema_name", DataType::Utf8, true),
        Field::new("table_name", DataType::Utf8, false),
        Field::new("column_name", DataType::Utf8, false),
        Field::new("key_name", DataType::Utf8, true),
        Field::new("key_sequence", DataType::Int32, false),
    ])
}

/// The columns of an answer to `CommandGetExportedKeys`,
/// `CommandGetImportedKeys` and `CommandGetCrossReference` (FlightSql.proto).
fn foreign_keys_schema() -> Schema {
    use arrow::datatypes::{DataType, Field};
    Schema::new(vec![
        Field::new("pk_catalog_name", DataType::Utf8, true),
        Field::new("pk_db_schema_name", DataType::Utf8, true),
        Field::new("pk_table_name", DataType::Utf8, false),
        Field::new("pk_column_name", DataType::Utf8, false),
        Field::new("fk_catalog_name", DataType::Utf8, true),
        Field::new("fk_db_schema_name", DataType::Utf8, true),
        Field::new("fk_table_name", DataType::Utf8, false),
        Field::new("fk_column_name", DataType::Utf8, false),
        Field::new("key_sequence", DataType::Int32, false),
        Field::new("fk_key_name", DataType::Utf8, true),
        Field::new("pk_key_name", DataType::Utf8, true),
        Field::new("update_rule", DataType::UInt8, false),
        Field::new("delete_rule", DataType::UInt8, false),
    ])
}

/// An answer of `schema`'s columns and no rows.
fn no_rows(schema: Schema) -> DoGetStream {
    let schema = Arc::new(schema);
    one_batch(schema.clone(), Ok(RecordBatch::new_empty(schema)))
}

fn table_types_schema() -> Schema {
    Schema::new(vec![arrow::datatypes::Field::new(
        "table_type",
        arrow::datatypes::DataType::Utf8,
        false,
    )])
}

/// A sealed dataset as a DataFusion table: its cached batches, and on a
/// cluster dataset the other members' rows streamed from them.
#[derive(Debug)]
struct CachedTable {
    state: Arc<State>,
    name: String,
    schema: SchemaRef,
}

#[tonic::async_trait]
impl TableProvider for CachedTable {
    fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    fn table_type(&self) -> TableType {
        TableType::Base
    }

    /// Every filter is evaluated in the scan with DataFusion's own
    /// expressions, on each batch as it leaves the cache (or arrives from
    /// another member): exactly, so DataFusion does not filter again and
    /// the scan copies only the projected columns of the rows kept.
    fn supports_filters_pushdown(
        &self,
        filters: &[&Expr],
    ) -> datafusion::common::Result<Vec<TableProviderFilterPushDown>> {
        Ok(vec![TableProviderFilterPushDown::Exact; filters.len()])
    }

    async fn scan(
        &self,
        session: &dyn Session,
        projection: Option<&Vec<usize>>,
        filters: &[Expr],
        limit: Option<usize>,
    ) -> datafusion::common::Result<Arc<dyn ExecutionPlan>> {
        let external = |e: Error| DataFusionError::External(Box::new(e));
        let summary = self
            .state
            .catalog()
            .describe(&self.name)
            .map_err(external)?;
        let (_, data) = self.state.resident(&self.name).await.map_err(external)?;
        let schema = match projection {
            Some(p) => Arc::new(self.schema.project(p)?),
            None => self.schema.clone(),
        };
        // The filters read stored batches (every column, no copy); the
        // projection is taken after them.
        let filter = match conjunction(filters.iter().cloned()) {
            Some(expr) => {
                let df = DFSchema::try_from(self.schema.as_ref().clone())?;
                Some(session.create_physical_expr(expr, &df)?)
            }
            None => None,
        };
        let rows = ScanRows {
            schema: schema.clone(),
            projection: projection.cloned(),
            filter,
        };
        let mut partitions: Vec<Arc<dyn PartitionStream>> = vec![Arc::new(LocalRows {
            rows: rows.clone(),
            batches: data.batches().to_vec(),
        })];
        if let Some(ClusterState::Member { layout, index }) = &summary.cluster {
            // Other members send only the projected columns when nothing
            // else is needed: with filters (which read other columns), or
            // when no column is read (count(*); a read names at least one),
            // they send every column and the scan filters and projects.
            let columns: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
            let (columns, remote) = if rows.filter.is_some() || columns.is_empty() {
                (Vec::new(), rows.clone())
            } else {
                let remote = ScanRows {
                    projection: None,
                    ..rows.clone()
                };
                (columns, remote)
            };
            for (m, member) in layout.members.iter().enumerate() {
                if m == *index {
                    continue;
                }
                partitions.push(Arc::new(MemberRows {
                    state: self.state.clone(),
                    rows: remote.clone(),
                    columns: columns.clone(),
                    dataset: self.name.clone(),
                    location: member.location.clone(),
                    layout: layout.id,
                    member: m as u32,
                }));
            }
        }
        Ok(Arc::new(StreamingTableExec::try_new(
            schema,
            partitions,
            None,
            Vec::new(),
            false,
            limit,
        )?))
    }
}

/// What a scan makes of each batch it reads: the rows its filters keep
/// (evaluated on the batch as read), of its projected columns.
#[derive(Debug, Clone)]
struct ScanRows {
    schema: SchemaRef,
    projection: Option<Vec<usize>>,
    filter: Option<Arc<dyn PhysicalExpr>>,
}

impl ScanRows {
    fn apply(&self, batch: &RecordBatch) -> datafusion::common::Result<RecordBatch> {
        let keep = match &self.filter {
            Some(filter) => {
                let keep = filter.evaluate(batch)?.into_array(batch.num_rows())?;
                Some(
                    keep.as_any()
                        .downcast_ref::<arrow::array::BooleanArray>()
                        .cloned()
                        .ok_or_else(|| {
                            DataFusionError::Internal("a pushed filter is not boolean".into())
                        })?,
                )
            }
            None => None,
        };
        let batch = match &self.projection {
            Some(p) => batch.project(p)?,
            None => batch.clone(),
        };
        match keep {
            Some(keep) => Ok(arrow::compute::filter_record_batch(&batch, &keep)?),
            None => Ok(batch),
        }
    }
}

/// This member's cached batches (shared, not copied, until filtered).
#[derive(Debug)]
struct LocalRows {
    rows: ScanRows,
    batches: Vec<RecordBatch>,
}

impl PartitionStream for LocalRows {
    fn schema(&self) -> &SchemaRef {
        &self.rows.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let (rows, batches) = (self.rows.clone(), self.batches.clone());
        Box::pin(RecordBatchStreamAdapter::new(
            self.rows.schema.clone(),
            futures::stream::iter(batches.into_iter().map(move |b| rows.apply(&b))),
        ))
    }
}

/// Another member's rows of a cluster dataset, read from it in storage
/// order as a member reads them for a rank.
#[derive(Debug)]
struct MemberRows {
    state: Arc<State>,
    rows: ScanRows,
    /// Columns to ask for; empty = all.
    columns: Vec<String>,
    dataset: String,
    location: String,
    layout: u64,
    member: u32,
}

impl PartitionStream for MemberRows {
    fn schema(&self) -> &SchemaRef {
        &self.rows.schema
    }

    fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
        let external = |e: Error| DataFusionError::External(Box::new(e));
        let plan = convert::read_plan_from_proto(
            &pb::ReadPlan {
                dataset: self.dataset.clone(),
                world_size: 1,
                columns: self.columns.clone(),
                ..Default::default()
            },
            &self.state.config,
        );
        let (state, location, dataset) = (
            self.state.clone(),
            self.location.clone(),
            self.dataset.clone(),
        );
        let (layout, member) = (self.layout, self.member);
        // A task of its own reads the member's stream (which borrows what it
        // was opened with) and hands the batches over.
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            let opened = match plan {
                Ok(plan) => {
                    let ticket = convert::encode_ticket(&ShardTicket {
                        plan,
                        rank: 0,
                        generation: 0,
                        layout,
                        peer: Some(member),
                        selected: Vec::new(),
                    });
                    state.peers.fetch(&location, &dataset, ticket).await
                }
                Err(e) => Err(e),
            };
            let mut stream = match opened {
                Ok(stream) => Box::pin(stream),
                Err(e) => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
            };
            while let Some(item) = stream.next().await {
                let failed = item.is_err();
                if tx.send(item.map(|(_, batch, _)| batch)).await.is_err() || failed {
                    break;
                }
            }
        });
        let rows = self.rows.clone();
        let batches = tokio_stream::wrappers::ReceiverStream::new(rx)
            .map(move |r| r.map_err(external).and_then(|b| rows.apply(&b)));
        Box::pin(RecordBatchStreamAdapter::new(
            self.rows.schema.clone(),
            batches,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_flight::sql::{TableDefinitionOptions, TableExistsOption, TableNotExistOption};
    use tonic::Code;

    fn ingest(
        if_missing: TableNotExistOption,
        if_exists: TableExistsOption,
    ) -> CommandStatementIngest {
        CommandStatementIngest {
            table: "t".into(),
            table_definition_options: Some(TableDefinitionOptions {
                if_not_exist: if_missing as i32,
                if_exists: if_exists as i32,
            }),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn untyped_parameters_are_typed_by_where_they_stand() {
        use arrow::datatypes::DataType;
        let sql = "SELECT $1 AS tag, CAST($2 AS SMALLINT) AS n, \
                   (SELECT 1 LIMIT $3) AS one LIMIT $4 OFFSET $5";
        let plan = SessionContext::new()
            .state()
            .create_logical_plan(sql)
            .await
            .expect("plans");
        let hints = placeholder_hints(&plan);
        let mut seen: Vec<_> = hints.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        seen.sort();
        assert_eq!(
            seen,
            [
                ("$2", DataType::Int16),
                ("$3", DataType::Int64),
                ("$4", DataType::Int64),
                ("$5", DataType::Int64),
            ]
        );
        assert_eq!(untyped_parameter(&hints, "$1"), DataType::Utf8);
        assert_eq!(untyped_parameter(&hints, "$4"), DataType::Int64);
    }

    #[test]
    fn an_answers_decimal_says_its_precision_and_scale() {
        use arrow::datatypes::{DataType, Field};
        let price = Field::new("price", DataType::Decimal128(12, 2), true);
        let answer = sent_field(&price, Sent::Answer);
        let said = |key: &str| answer.metadata().get(key).map(String::as_str);
        assert_eq!(
            (said(COLUMN_PRECISION), said(COLUMN_SCALE)),
            (Some("12"), Some("2"))
        );
        assert!(sent_field(&price, Sent::Parameter).metadata().is_empty());
        let id = Field::new("id", DataType::Int64, true);
        assert!(sent_field(&id, Sent::Answer).metadata().is_empty());
    }

    #[tokio::test]
    async fn bound_times_take_their_placeholders_types_in_the_units_jdbc_binds() {
        use arrow::array::{ArrayRef, RecordBatch, Time64MicrosecondArray};
        use arrow::array::{TimestampMicrosecondArray, TimestampNanosecondArray};
        use arrow::datatypes::{DataType, TimeUnit};
        let utc = || Some(Arc::from("UTC"));
        let columns: [(&str, ArrayRef); 3] = [
            ("t", Arc::new(Time64MicrosecondArray::from(vec![1]))),
            (
                "ts",
                Arc::new(TimestampMicrosecondArray::from(vec![1]).with_timezone("UTC")),
            ),
            ("ns", Arc::new(TimestampNanosecondArray::from(vec![1]))),
        ];
        let ctx = SessionContext::new();
        ctx.register_batch("x", RecordBatch::try_from_iter(columns).expect("batch"))
            .expect("registered");
        let plan = ctx
            .state()
            .create_logical_plan("SELECT * FROM x WHERE t < $1 AND ts > $2 AND ns = $3 AND t > $4")
            .await
            .expect("plans");
        // Declared in the driver's units...
        for (column, declared) in [
            (
                DataType::Time64(TimeUnit::Microsecond),
                DataType::Time32(TimeUnit::Millisecond),
            ),
            (
                DataType::Timestamp(TimeUnit::Microsecond, utc()),
                DataType::Timestamp(TimeUnit::Millisecond, utc()),
            ),
            (DataType::Date64, DataType::Date32),
        ] {
            assert_eq!(sent_type(&column, Sent::Parameter), declared);
            assert_eq!(sent_type(&column, Sent::Answer), column);
        }
        // ...and bound in the query's; a number bound to a time is left as
        // it came, for the query to refuse or coerce.
        let bound = ParamValues::from(vec![
            ScalarValue::Time32Millisecond(Some(37_800_000)),
            ScalarValue::TimestampMillisecond(Some(5), utc()),
            ScalarValue::TimestampMillisecond(Some(7), None),
            ScalarValue::Int64(Some(3)),
        ]);
        let ParamValues::List(got) = in_placeholder_times(&plan, bound).expect("cast") else {
            panic!("positional values stay positional");
        };
        let got: Vec<_> = got.into_iter().map(|v| v.value).collect();
        assert_eq!(
            got,
            [
                ScalarValue::Time64Microsecond(Some(37_800_000_000)),
                ScalarValue::TimestampMicrosecond(Some(5_000), utc()),
                ScalarValue::TimestampNanosecond(Some(7_000_000), None),
                ScalarValue::Int64(Some(3)),
            ]
        );
    }

    #[test]
    fn each_ingestion_mode_creates_replaces_or_is_refused_by_what_exists() {
        use TableExistsOption as Exists;
        use TableNotExistOption as Missing;
        // ADBC's modes: create, append, replace, create_append.
        let cases = [
            (Missing::Create, Exists::Fail, false, Ok(false)),
            (
                Missing::Create,
                Exists::Fail,
                true,
                Err(Code::AlreadyExists),
            ),
            (Missing::Fail, Exists::Append, false, Err(Code::NotFound)),
            (
                Missing::Fail,
                Exists::Append,
                true,
                Err(Code::FailedPrecondition),
            ),
            (Missing::Create, Exists::Replace, false, Ok(false)),
            (Missing::Create, Exists::Replace, true, Ok(true)),
            (Missing::Create, Exists::Append, false, Ok(false)),
            (
                Missing::Create,
                Exists::Append,
                true,
                Err(Code::FailedPrecondition),
            ),
            (
                Missing::Unspecified,
                Exists::Fail,
                false,
                Err(Code::InvalidArgument),
            ),
            (
                Missing::Create,
                Exists::Unspecified,
                true,
                Err(Code::InvalidArgument),
            ),
        ];
        for (if_missing, if_exists, exists, want) in cases {
            let got = ingest_target(&ingest(if_missing, if_exists), |name| {
                assert_eq!(name, "t");
                exists
            });
            let got = got.map(|(name, replace)| {
                assert_eq!(name, "t");
                replace
            });
            assert_eq!(
                got.map_err(|e| e.code()),
                want,
                "{if_missing:?} {if_exists:?} exists={exists}"
            );
        }
    }

    #[test]
    fn ingestions_flightdeck_has_no_notion_of_are_refused_naming_why() {
        let create = || ingest(TableNotExistOption::Create, TableExistsOption::Fail);
        let cases = [
            (
                CommandStatementIngest {
                    temporary: true,
                    ..create()
                },
                "asks for a temporary table",
            ),
            (
                CommandStatementIngest {
                    transaction_id: Some(Bytes::from_static(b"tx")),
                    ..create()
                },
                "flightdeck has no transactions",
            ),
            (
                CommandStatementIngest {
                    catalog: Some("other".into()),
                    ..create()
                },
                "every dataset is in catalog 'flightdeck'",
            ),
            (
                CommandStatementIngest {
                    schema: Some("other".into()),
                    ..create()
                },
                "every dataset is in schema 'public'",
            ),
            (
                CommandStatementIngest {
                    table: String::new(),
                    ..create()
                },
                "dataset name",
            ),
        ];
        for (cmd, words) in cases {
            match ingest_target(&cmd, |_| false) {
                Err(e) => {
                    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
                    assert!(e.to_string().contains(words), "{e}");
                }
                Ok(got) => panic!("{cmd:?} was taken: {got:?}"),
            }
        }
        // Our own catalog and schema, named, are the default.
        let named = CommandStatementIngest {
            catalog: Some(CATALOG.into()),
            schema: Some(SCHEMA.into()),
            ..create()
        };
        assert_eq!(
            ingest_target(&named, |_| false).ok(),
            Some(("t".into(), false))
        );
    }
}
