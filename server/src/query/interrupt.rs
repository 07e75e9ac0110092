//! Queries that stop when their client goes.
//!
//! A query stops when the task driving it is dropped, but only at a point
//! where it gives control back to the runtime. DataFusion's own rule
//! (`EnsureCooperative`) makes the scans spend the runtime's budget, which
//! is enough wherever each output batch comes from polling an input; it is
//! not where one input batch yields output without end: a cross join of
//! four 1 000-row tables produces 10^12 rows from the four tables' first
//! batches, and its count never yields. [`Interruptible`] makes every
//! operator that may produce more rows than it reads (joins, unnest,
//! operators DataFusion knows nothing about) spend the budget too, so a
//! query yields at least once per 128 batches these operators and the
//! scans produce between them.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::config::ConfigOptions;
use datafusion::common::tree_node::{Transformed, TreeNode};
use datafusion::physical_optimizer::PhysicalOptimizerRule;
use datafusion::physical_plan::ExecutionPlan;
use datafusion::physical_plan::coop::CooperativeExec;
use datafusion::physical_plan::execution_plan::{CardinalityEffect, SchedulingType};

/// The physical optimizer rule that puts a [`CooperativeExec`] above every
/// operator with inputs that may produce more rows than it reads, unless
/// it already spends the runtime's budget. Added after DataFusion's own
/// rules.
#[derive(Debug, Default)]
pub struct Interruptible;

/// Whether `plan`'s output may go on without it polling its inputs.
fn may_run_on(plan: &Arc<dyn ExecutionPlan>) -> bool {
    !plan.children().is_empty()
        && plan.properties().scheduling_type != SchedulingType::Cooperative
        && !matches!(
            plan.cardinality_effect(),
            CardinalityEffect::Equal | CardinalityEffect::LowerEqual
        )
}

impl PhysicalOptimizerRule for Interruptible {
    fn optimize(
        &self,
        plan: Arc<dyn ExecutionPlan>,
        _config: &ConfigOptions,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        plan.transform_up(|plan| {
            Ok(if may_run_on(&plan) {
                Transformed::yes(Arc::new(CooperativeExec::new(plan)) as Arc<dyn ExecutionPlan>)
            } else {
                Transformed::no(plan)
            })
        })
        .map(|t| t.data)
    }

    fn name(&self) -> &str {
        "Interruptible"
    }

    fn schema_check(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use arrow::array::{Int64Array, RecordBatch};
    use arrow::datatypes::{DataType, Field, Schema, SchemaRef};
    use datafusion::catalog::streaming::StreamingTable;
    use datafusion::execution::{SendableRecordBatchStream, SessionStateBuilder, TaskContext};
    use datafusion::physical_plan::displayable;
    use datafusion::physical_plan::stream::RecordBatchStreamAdapter;
    use datafusion::physical_plan::streaming::PartitionStream;
    use datafusion::prelude::{SessionConfig, SessionContext};
    use futures::StreamExt;

    use super::*;

    /// One batch, streamed without statistics (as the server's tables are:
    /// DataFusion cannot answer a count from them without reading).
    #[derive(Debug)]
    struct OneBatch(RecordBatch);

    impl PartitionStream for OneBatch {
        fn schema(&self) -> &SchemaRef {
            self.0.schema_ref()
        }

        fn execute(&self, _ctx: Arc<TaskContext>) -> SendableRecordBatchStream {
            let batch = self.0.clone();
            Box::pin(RecordBatchStreamAdapter::new(
                batch.schema(),
                futures::stream::iter([Ok(batch)]),
            ))
        }
    }

    /// A session with table `one` (1 000 rows in one batch), planned with
    /// [`Interruptible`] when `interruptible`.
    fn session(interruptible: bool) -> SessionContext {
        let mut state = SessionStateBuilder::new()
            .with_config(SessionConfig::new().with_target_partitions(1))
            .with_default_features();
        if interruptible {
            state = state.with_physical_optimizer_rule(Arc::new(Interruptible));
        }
        let ctx = SessionContext::new_with_state(state.build());
        let schema = Arc::new(Schema::new(vec![Field::new("id", DataType::Int64, false)]));
        let ids = Arc::new(Int64Array::from_iter_values(0..1000));
        let batch = RecordBatch::try_new(schema.clone(), vec![ids]).expect("a batch");
        let table =
            StreamingTable::try_new(schema, vec![Arc::new(OneBatch(batch))]).expect("a table");
        ctx.register_table("one", Arc::new(table))
            .expect("registered");
        ctx
    }

    /// The physical plan of `sql`, one operator a line.
    async fn plan(ctx: &SessionContext, sql: &str) -> String {
        let frame = ctx.sql(sql).await.expect("planned");
        let plan = frame.create_physical_plan().await.expect("a physical plan");
        displayable(plan.as_ref()).indent(false).to_string()
    }

    /// Operators of `plan` whose line starts with `op` and that run
    /// directly under a `CooperativeExec`.
    fn under_cooperative(plan: &str, op: &str) -> usize {
        plan.lines()
            .zip(plan.lines().skip(1))
            .filter(|(above, line)| {
                above.trim_start().starts_with("CooperativeExec")
                    && line.trim_start().starts_with(op)
            })
            .count()
    }

    #[tokio::test]
    async fn joins_spend_the_budget_and_filters_are_left_alone() {
        let join = "SELECT count(*) FROM one a, one b";
        let ours = plan(&session(true), join).await;
        assert_eq!(under_cooperative(&ours, "CrossJoinExec"), 1, "{ours}");
        // DataFusion's own rules leave it as it is.
        let bare = plan(&session(false), join).await;
        assert_eq!(under_cooperative(&bare, "CrossJoinExec"), 0, "{bare}");
        let filter = plan(&session(true), "SELECT id FROM one WHERE id > 5").await;
        // The scan spends the budget itself; a filter reads for every batch.
        assert_eq!(under_cooperative(&filter, ""), 0, "{filter}");
    }

    #[test]
    fn an_endless_query_stops_once_given_up() {
        // Without the rule this count runs until it is done (checked when
        // the rule was written: the task had not ended after 10 s).
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a runtime");
        let ctx = session(true);
        let (give_up, gave_up) = tokio::sync::oneshot::channel::<()>();
        let (done, ended) = std::sync::mpsc::channel::<()>();
        runtime.spawn(async move {
            let sql = "SELECT count(*) FROM one a, one b, one c, one d";
            let frame = ctx.sql(sql).await.expect("planned");
            let mut stream = frame.execute_stream().await.expect("started");
            tokio::select! {
                _ = gave_up => {}
                _ = stream.next() => panic!("10^12 rows counted"),
            }
            drop(stream);
            let _ = done.send(());
        });
        std::thread::sleep(Duration::from_millis(200));
        let _ = give_up.send(());
        let stopped = ended.recv_timeout(Duration::from_secs(10));
        // A query that did not stop holds its thread for good.
        runtime.shutdown_background();
        assert!(
            stopped.is_ok(),
            "the count still ran 10 s after it was given up"
        );
    }
}
