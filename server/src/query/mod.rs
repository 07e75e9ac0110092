//! Queries over cached datasets, on DataFusion: a read plan's `filter` and
//! `select`, and the `hash_bucket` function that makes a deterministic
//! hold-out split expressible.
//!
//! A filter is evaluated once per (dataset generation, filter) over the
//! stored batches and kept as the ascending ids of the selected rows
//! ([`Selection`], in arena memory, so counted in the budget and freed with
//! the dataset). Reads then number the selected rows `0..N'` in storage
//! order and every part of the sample-order contract applies to them as to
//! an `N'`-row dataset. A `select` list is evaluated on each gathered batch.
//!
//! Expressions are SQL in DataFusion's dialect over the dataset's columns.
//! Bad SQL, unknown columns, a filter that is not boolean and type errors
//! are [`Error::InvalidArgument`] carrying DataFusion's message and the
//! expression; so is an expression DataFusion panics on (some extreme
//! literals overflow inside its type coercion): the engine runs under
//! [`guarded`], and the caller gets an answer rather than a reset stream.

mod hash_bucket;
mod interrupt;

use std::sync::{Arc, Mutex};

use arrow::array::{Array, BooleanArray, RecordBatch, RecordBatchOptions};
use arrow::buffer::ScalarBuffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
use datafusion::common::DFSchema;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::logical_expr::simplify::SimplifyContext;
use datafusion::logical_expr::{Expr, ExprSchemable};
use datafusion::optimizer::simplify_expressions::ExprSimplifier;
use datafusion::physical_expr::PhysicalExpr;
use datafusion::prelude::{SessionConfig, SessionContext};

use crate::catalog::{SealedData, describe_fields};
use crate::error::{Error, Result, panic_message};
use crate::memory::Reservation;
use crate::memory::arena::Arena;

pub use hash_bucket::{HashBucket, bucket_of_bytes, bucket_of_int};
pub use interrupt::Interruptible;

/// Filters kept per dataset generation; the oldest is dropped past this.
const KEPT_SELECTIONS: usize = 8;

/// DataFusion's settings for every expression and query a client writes.
///
/// SQL's string types (`VARCHAR`, `TEXT`, …) are Arrow's `Utf8`, not
/// DataFusion's default `Utf8View`: every client reads `Utf8`, while Spark
/// and Arrow Java's Flight SQL JDBC driver refuse a `Utf8View` column (a
/// `CAST(x AS VARCHAR)` result) or parameter outright.
pub fn config() -> SessionConfig {
    let mut config = SessionConfig::new();
    config.options_mut().sql_parser.map_string_types_to_utf8view = false;
    config
}

/// The DataFusion session every read-plan expression is planned in:
/// default functions plus `hash_bucket`; made once (registering every
/// function is not free) and shared, as planning an expression only reads it.
pub fn session() -> &'static SessionContext {
    static SESSION: std::sync::OnceLock<SessionContext> = std::sync::OnceLock::new();
    SESSION.get_or_init(|| {
        let ctx = SessionContext::new_with_config(config());
        ctx.register_udf(HashBucket::udf());
        ctx
    })
}

/// `INVALID_ARGUMENT` for an expression DataFusion refused.
fn refused(what: &str, sql: &str, dataset: &str, e: impl std::fmt::Display) -> Error {
    Error::invalid(format!(
        "the {what} `{sql}` cannot be evaluated over dataset '{dataset}': {e}"
    ))
}

/// Runs `f`, DataFusion's work on the {what} `sql` a client wrote; a panic
/// inside it becomes `INVALID_ARGUMENT` naming the expression.
pub fn guarded<T>(
    what: &str,
    sql: &str,
    dataset: &str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(refused(
            what,
            sql,
            dataset,
            format!(
                "the query engine failed on it ({}); write it another way",
                panic_message(&*panic)
            ),
        ))
    })
}

/// `expr` as DataFusion runs it over `schema`: types coerced, then
/// simplified as a query's plan is. `create_physical_expr` alone does not
/// simplify, and some functions exist only as the simplifier's rewrites
/// (`coalesce` and `nvl2` become CASE, `arrow_cast` CAST): without it they
/// fail as "should have been simplified". Constant parts are evaluated here,
/// once, and `now()` is the time the expression is compiled.
fn physical(
    ctx: &SessionContext,
    expr: Expr,
    schema: &DFSchema,
) -> datafusion::error::Result<Arc<dyn PhysicalExpr>> {
    let info = SimplifyContext::builder()
        .with_schema(Arc::new(schema.clone()))
        .with_current_time()
        .build();
    let simplifier = ExprSimplifier::new(info);
    let expr = simplifier.simplify(simplifier.coerce(expr, schema)?)?;
    ctx.create_physical_expr(expr, schema)
}

/// What in `expr` needs more than its own row (DataFusion would refuse it
/// as "not implemented"), named for the person who wrote it.
fn not_row_by_row(expr: &Expr) -> Option<&'static str> {
    let mut found = None;
    // The closure never fails.
    let _ = expr.apply(|e| {
        found = match e {
            Expr::AggregateFunction(_) | Expr::GroupingSet(_) => Some("an aggregate"),
            Expr::WindowFunction(_) => Some("a window function"),
            Expr::ScalarSubquery(_)
            | Expr::Exists(_)
            | Expr::InSubquery(_)
            | Expr::SetComparison(_) => Some("a subquery"),
            Expr::Unnest(_) => Some("unnest"),
            _ => None,
        };
        Ok(if found.is_some() {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    });
    found
}

/// A parsed expression over `schema`, and its type (type errors surface
/// when the expression is typed, not when it is parsed).
fn parse(
    ctx: &SessionContext,
    schema: &DFSchema,
    what: &str,
    sql: &str,
    dataset: &str,
) -> Result<(Expr, DataType)> {
    let expr = ctx
        .parse_sql_expr(sql, schema)
        .map_err(|e| refused(what, sql, dataset, e))?;
    if let Some(kind) = not_row_by_row(&expr) {
        return Err(Error::invalid(format!(
            "the {what} `{sql}` over dataset '{dataset}' has {kind}; a read plan's expressions are \
             evaluated row by row: run such a query with SQL over the cache (Flight SQL), or \
             derive a dataset from it"
        )));
    }
    let ty = expr
        .get_type(schema)
        .map_err(|e| refused(what, sql, dataset, e))?;
    Ok((expr, ty))
}

/// A compiled read-plan filter over one dataset schema.
#[derive(Debug, Clone)]
pub struct Filter {
    sql: String,
    expr: Arc<dyn PhysicalExpr>,
}

impl Filter {
    /// Compiles `sql`, a boolean SQL expression over `schema`'s columns.
    pub fn compile(schema: &Schema, sql: &str, dataset: &str) -> Result<Self> {
        guarded("filter", sql, dataset, || {
            Self::compile_unguarded(schema, sql, dataset)
        })
    }

    fn compile_unguarded(schema: &Schema, sql: &str, dataset: &str) -> Result<Self> {
        let ctx = session();
        let df = DFSchema::try_from(schema.clone())
            .map_err(|e| Error::Internal(format!("schema of '{dataset}' is not usable: {e}")))?;
        let (expr, ty) = parse(ctx, &df, "filter", sql, dataset)?;
        if ty != DataType::Boolean && ty != DataType::Null {
            return Err(Error::invalid(format!(
                "the filter `{sql}` over dataset '{dataset}' is of type {ty}, not boolean; write a \
                 condition such as `label >= 0`"
            )));
        }
        let expr = physical(ctx, expr, &df).map_err(|e| refused("filter", sql, dataset, e))?;
        Ok(Self {
            sql: sql.to_string(),
            expr,
        })
    }

    /// The expression as written.
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// The rows of `batch` the filter keeps (true; false and null are left
    /// out), as offsets into the batch.
    pub fn matches(&self, batch: &RecordBatch, dataset: &str) -> Result<Vec<u32>> {
        let value = guarded("filter", &self.sql, dataset, || {
            self.expr
                .evaluate(batch)
                .and_then(|v| v.into_array(batch.num_rows()))
                .map_err(|e| refused("filter", &self.sql, dataset, e))
        })?;
        let keep: Vec<u32> = match value.as_any().downcast_ref::<BooleanArray>() {
            Some(b) => (0..b.len())
                .filter(|&i| b.is_valid(i) && b.value(i))
                .map(|i| i as u32)
                .collect(),
            // A null literal keeps nothing.
            None if value.data_type() == &DataType::Null => Vec::new(),
            None => {
                return Err(Error::invalid(format!(
                    "the filter `{}` over dataset '{dataset}' gave {} values, not booleans",
                    self.sql,
                    value.data_type()
                )));
            }
        };
        Ok(keep)
    }
}

/// The ascending ids of the rows a filter selected from one sealed
/// dataset, held in arena memory.
#[derive(Debug)]
pub struct Selection {
    rows: ScalarBuffer<u64>,
}

impl Selection {
    /// The ascending stored rows `filter` selects from `data`, outside the
    /// arena (the CPU work of a selection; [`crate::state::State::selection`]
    /// keeps them).
    pub fn select(data: &SealedData, filter: &Filter, dataset: &str) -> Result<Vec<u64>> {
        let mut rows: Vec<u64> = Vec::new();
        let mut start = 0u64;
        for batch in data.batches() {
            rows.extend(
                filter
                    .matches(batch, dataset)?
                    .into_iter()
                    .map(|i| start + u64::from(i)),
            );
            start += batch.num_rows() as u64;
        }
        Ok(rows)
    }

    /// Keeps selected `rows` in `arena`, drawing on `reservation` first:
    /// the ids count against the budget like any cached bytes.
    pub fn keep(
        rows: Vec<u64>,
        arena: &Arena,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<Self> {
        let len = rows.len();
        let staged = ScalarBuffer::<u64>::from(rows);
        let buffer = if len == 0 {
            staged.into_inner()
        } else {
            arena.copy_bytes(staged.inner().as_slice(), reservation, what)?
        };
        Ok(Self {
            rows: ScalarBuffer::new(buffer, 0, len),
        })
    }

    /// What the memory for a selection is taken for, in errors.
    pub fn what(filter: &str, dataset: &str) -> String {
        format!("the rows filter `{filter}` selects from dataset '{dataset}'")
    }

    /// A selection of the given ascending rows, outside the arena (tests).
    pub fn of(rows: Vec<u64>) -> Self {
        Self {
            rows: ScalarBuffer::from(rows),
        }
    }

    /// Rows selected.
    pub fn len(&self) -> u64 {
        self.rows.len() as u64
    }

    /// Whether no row is selected.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The stored row of selected row `i` (below `len()`).
    pub fn row(&self, i: u64) -> u64 {
        self.rows[i as usize]
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        (self.rows.len() * 8) as u64
    }

    /// Selected rows in each run of consecutive stored rows of the given
    /// lengths (a member's partitions, in order).
    pub fn counts(&self, lengths: &[u64]) -> Vec<u64> {
        let mut counts = Vec::with_capacity(lengths.len());
        let mut end = 0u64;
        let mut before = 0usize;
        for &len in lengths {
            end += len;
            let upto = self.rows.partition_point(|&r| r < end);
            counts.push((upto - before) as u64);
            before = upto;
        }
        counts
    }
}

/// The selections made over one sealed dataset, by filter text.
#[derive(Debug, Default)]
pub struct SelectionCache(Mutex<Vec<(String, Arc<Selection>)>>);

impl SelectionCache {
    /// The kept selection of filter `sql`, if any (now the most recent).
    pub fn get(&self, sql: &str) -> Option<Arc<Selection>> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let i = kept.iter().position(|(s, _)| s == sql)?;
        let hit = kept.remove(i);
        let selection = hit.1.clone();
        kept.push(hit);
        Some(selection)
    }

    /// Keeps `selection` of filter `sql` (the oldest kept one goes beyond
    /// `KEPT_SELECTIONS`); one made meanwhile by another reader is kept
    /// instead and returned.
    pub fn keep(&self, sql: &str, dataset: &str, selection: Selection) -> Arc<Selection> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, made)) = kept.iter().find(|(s, _)| s == sql) {
            return made.clone();
        }
        tracing::debug!(
            dataset,
            filter = sql,
            rows = selection.len(),
            bytes = selection.bytes(),
            "selected rows"
        );
        let selection = Arc::new(selection);
        if kept.len() >= KEPT_SELECTIONS {
            kept.remove(0);
        }
        kept.push((sql.to_string(), selection.clone()));
        selection
    }

    /// Drops every kept selection; the bytes they held.
    pub fn give_up(&self) -> u64 {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = kept.iter().map(|(_, s)| s.bytes()).sum();
        kept.clear();
        bytes
    }
}

/// A compiled `select` list: expressions over a dataset's columns, each
/// named by its alias (or DataFusion's name for it).
#[derive(Debug, Clone)]
pub struct Derive {
    /// The dataset columns the expressions read, in schema order.
    inputs: Vec<String>,
    exprs: Vec<Arc<dyn PhysicalExpr>>,
    schema: SchemaRef,
}

impl Derive {
    /// Compiles `select` over `schema`; fails on an empty list entry, bad
    /// SQL, unknown columns, type errors and duplicate output names.
    pub fn compile(schema: &Schema, select: &[String], dataset: &str) -> Result<Self> {
        guarded("select list", &select.join(", "), dataset, || {
            Self::compile_unguarded(schema, select, dataset)
        })
    }

    fn compile_unguarded(schema: &Schema, select: &[String], dataset: &str) -> Result<Self> {
        let ctx = session();
        let full = DFSchema::try_from(schema.clone())
            .map_err(|e| Error::Internal(format!("schema of '{dataset}' is not usable: {e}")))?;
        let mut parsed = Vec::with_capacity(select.len());
        let mut used = std::collections::BTreeSet::new();
        for sql in select {
            if sql.trim().is_empty() {
                return Err(Error::invalid(format!(
                    "an empty expression in the select list of dataset '{dataset}'"
                )));
            }
            let (expr, _) = parse(ctx, &full, "select expression", sql, dataset)?;
            for c in expr.column_refs() {
                used.insert(schema.index_of(&c.name).map_err(|_| {
                    Error::invalid(format!(
                        "dataset '{dataset}' has no column '{}'; its columns are {}",
                        c.name,
                        describe_fields(schema)
                    ))
                })?);
            }
            parsed.push((sql, expr));
        }
        // Expressions are evaluated over the gathered input columns only.
        let indices: Vec<usize> = if used.is_empty() {
            (0..schema.fields().len()).collect()
        } else {
            used.into_iter().collect()
        };
        let input = schema
            .project(&indices)
            .map_err(|e| Error::Internal(format!("projection of valid indices failed: {e}")))?;
        let df = DFSchema::try_from(input.clone())
            .map_err(|e| Error::Internal(format!("schema of '{dataset}' is not usable: {e}")))?;
        let mut fields = Vec::with_capacity(parsed.len());
        let mut exprs = Vec::with_capacity(parsed.len());
        let mut names = std::collections::HashSet::new();
        for (sql, expr) in parsed {
            let field = expr
                .to_field(&df)
                .map_err(|e| refused("select expression", sql, dataset, e))?
                .1;
            if !names.insert(field.name().clone()) {
                return Err(Error::invalid(format!(
                    "the select list of dataset '{dataset}' names the column '{}' twice; give \
                     each expression its own alias with AS",
                    field.name()
                )));
            }
            fields.push(Field::new(
                field.name(),
                field.data_type().clone(),
                field.is_nullable(),
            ));
            exprs.push(
                physical(ctx, expr, &df)
                    .map_err(|e| refused("select expression", sql, dataset, e))?,
            );
        }
        Ok(Self {
            inputs: input.fields().iter().map(|f| f.name().clone()).collect(),
            exprs,
            schema: Arc::new(Schema::new(fields)),
        })
    }

    /// The dataset columns to gather for the expressions, in schema order.
    pub fn inputs(&self) -> &[String] {
        &self.inputs
    }

    /// The schema of the derived batches.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// The derived batch of a batch of the input columns.
    pub fn apply(&self, input: &RecordBatch, dataset: &str) -> Result<RecordBatch> {
        let n = input.num_rows();
        let columns = self
            .exprs
            .iter()
            .zip(self.schema.fields())
            .map(|(e, f)| {
                guarded("select expression for", f.name(), dataset, || {
                    e.evaluate(input).and_then(|v| v.into_array(n)).map_err(|e| {
                        Error::invalid(format!(
                            "the select expression for '{}' failed over dataset '{dataset}': {e}",
                            f.name()
                        ))
                    })
                })
            })
            .collect::<Result<Vec<_>>>()?;
        RecordBatch::try_new_with_options(
            self.schema.clone(),
            columns,
            &RecordBatchOptions::new().with_row_count(Some(n)),
        )
        .map_err(|e| Error::Internal(format!("derived batch does not match its schema: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Int32Array, Int64Array, StringArray};
    use proptest::prelude::*;

    fn batch() -> RecordBatch {
        let schema = Arc::new(Schema::new(vec![
            Field::new("label", DataType::Int32, true),
            Field::new("country", DataType::Utf8, true),
        ]));
        RecordBatch::try_new(
            schema,
            vec![
                Arc::new(Int32Array::from(vec![Some(1), None, Some(-1), Some(3)])),
                Arc::new(StringArray::from(vec![
                    Some("DE"),
                    Some("DE"),
                    None,
                    Some("FR"),
                ])),
            ],
        )
        .expect("batch")
    }

    #[test]
    fn a_filter_keeps_the_rows_where_it_is_true() {
        let b = batch();
        let f = Filter::compile(&b.schema(), "label >= 0 OR country = 'FR'", "d").expect("filter");
        // Row 1: NULL >= 0 is null, 'DE' = 'FR' false: left out.
        assert_eq!(f.matches(&b, "d").expect("matches"), vec![0, 3]);
        let none = Filter::compile(&b.schema(), "NULL", "d").expect("null filter");
        assert!(none.matches(&b, "d").expect("matches").is_empty());
    }

    #[test]
    fn bad_expressions_are_invalid_argument_naming_them() {
        let schema = batch().schema();
        for (sql, words) in [
            ("label >", "label >"),
            ("nope = 1", "nope"),
            ("label + 1", "not boolean"),
            ("country * 2 > 1", "country * 2"),
            ("sum(label) > 1", "has an aggregate"),
            ("row_number() OVER () > 1", "has a window function"),
            ("label IN (SELECT 1)", "has a subquery"),
            ("label > (SELECT 1)", "has a subquery"),
            ("EXISTS (SELECT 1)", "has a subquery"),
            ("unnest(make_array(label)) > 1", "has unnest"),
        ] {
            match Filter::compile(&schema, sql, "d") {
                Err(Error::InvalidArgument(m)) => assert!(m.contains(words), "{sql}: {m}"),
                other => panic!("{sql}: {other:?}"),
            }
        }
        let sums = vec!["sum(label) AS s"];
        for select in [vec!["label", "label"], vec!["nope AS x"], vec![""], sums] {
            let select: Vec<String> = select.into_iter().map(String::from).collect();
            assert!(matches!(
                Derive::compile(&schema, &select, "d"),
                Err(Error::InvalidArgument(_))
            ));
        }
    }

    #[test]
    fn a_panic_in_the_engine_is_invalid_argument_naming_the_expression() {
        let r: Result<()> = guarded("filter", "x > 1", "d", || panic!("overflowed"));
        match r {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains("`x > 1`") && m.contains("overflowed"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        // What does not panic passes through as it is.
        assert_eq!(guarded("filter", "x", "d", || Ok(7)).expect("ok"), 7);
    }

    #[test]
    fn derived_columns_are_computed_from_the_inputs_they_name() {
        let b = batch();
        let select = ["label * 2 AS twice", "upper(country) AS c"].map(String::from);
        let d = Derive::compile(&b.schema(), &select, "d").expect("derive");
        assert_eq!(d.inputs(), ["label", "country"]);
        let out = d.apply(&b, "d").expect("apply");
        assert_eq!(out.schema().field(0).name(), "twice");
        let twice = out
            .column(0)
            .as_any()
            .downcast_ref::<arrow::array::Int64Array>();
        let twice: Vec<Option<i64>> = twice.expect("int64").iter().collect();
        assert_eq!(twice, vec![Some(2), None, Some(-2), Some(6)]);
        // Only `country` read: gathered alone, the expressions still apply.
        let one = Derive::compile(&b.schema(), &["lower(country) AS c".into()], "d").expect("one");
        assert_eq!(one.inputs(), ["country"]);
    }

    /// Functions DataFusion only runs once its simplifier has rewritten them
    /// (`coalesce` and `nvl2` into CASE, `arrow_cast` into CAST) work in
    /// filters and select lists, as in SQL over the cache.
    #[test]
    fn functions_that_exist_as_rewrites_work() {
        let b = batch();
        let f = Filter::compile(&b.schema(), "coalesce(label, 0) >= 0", "d").expect("coalesce");
        assert_eq!(f.matches(&b, "d").expect("matches"), vec![0, 1, 3]);
        let f = Filter::compile(&b.schema(), "nvl2(country, 1, 0) = 0", "d").expect("nvl2");
        assert_eq!(f.matches(&b, "d").expect("matches"), vec![2]);
        let f = Filter::compile(&b.schema(), "arrow_cast(label, 'Float64') > 0.5", "d")
            .expect("arrow_cast");
        assert_eq!(f.matches(&b, "d").expect("matches"), vec![0, 3]);
        let select = [
            "coalesce(label, -9) AS label",
            "arrow_cast(label, 'Float32') AS f",
            "coalesce(country, 'none') AS c",
        ]
        .map(String::from);
        let d = Derive::compile(&b.schema(), &select, "d").expect("derive");
        let out = d.apply(&b, "d").expect("apply");
        assert_eq!(out.schema().field(1).data_type(), &DataType::Float32);
        // The literal is an Int64, so is the result (coerced as in SQL).
        let label = out.column(0).as_any().downcast_ref::<Int64Array>();
        let label: Vec<Option<i64>> = label.expect("int64").iter().collect();
        assert_eq!(label, vec![Some(1), Some(-9), Some(-1), Some(3)]);
        let c = out.column(2).as_any().downcast_ref::<StringArray>();
        let c: Vec<Option<&str>> = c.expect("utf8").iter().collect();
        assert_eq!(c, vec![Some("DE"), Some("DE"), Some("none"), Some("FR")]);
    }

    proptest! {
        #[test]
        fn counts_split_a_selection_by_partition(
            keep in prop::collection::vec(any::<bool>(), 0..200),
            cuts in prop::collection::vec(0usize..200, 0..6),
        ) {
            let rows: Vec<u64> = (0..keep.len() as u64).filter(|&r| keep[r as usize]).collect();
            let s = Selection::of(rows.clone());
            let mut bounds: Vec<usize> = cuts.into_iter().map(|c| c.min(keep.len())).collect();
            bounds.push(0);
            bounds.push(keep.len());
            bounds.sort_unstable();
            let lengths: Vec<u64> = bounds.windows(2).map(|w| (w[1] - w[0]) as u64).collect();
            let counts = s.counts(&lengths);
            for (i, w) in bounds.windows(2).enumerate() {
                let want = rows.iter().filter(|&&r| (w[0] as u64..w[1] as u64).contains(&r)).count();
                prop_assert_eq!(counts[i], want as u64);
            }
            prop_assert_eq!(counts.iter().sum::<u64>(), s.len());
        }
    }
}
