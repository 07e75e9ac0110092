//! Reading a shard: the rows a [`ShardOrder`] names, gathered from a sealed
//! dataset into record batches of the plan's size, with only the projected
//! columns.
//!
//! Synchronous and CPU-bound: the Flight edge runs it off the async reactor and
//! feeds a small bounded channel, so memory waits for the socket.

use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::compute::interleave_record_batch;
use arrow::datatypes::{Schema, SchemaRef};

use crate::catalog::{SealedData, describe_fields};
use crate::error::{Error, Result};
use crate::order::{ReadPlan, ShardOrder};

/// Indices of `columns` in `schema` and the projected schema; empty = all.
pub fn project(
    schema: &Schema,
    columns: &[String],
    dataset: &str,
) -> Result<(Vec<usize>, SchemaRef)> {
    if columns.is_empty() {
        return Ok((
            (0..schema.fields().len()).collect(),
            Arc::new(schema.clone()),
        ));
    }
    let indices = columns
        .iter()
        .map(|c| {
            schema.index_of(c).map_err(|_| {
                Error::invalid(format!(
                    "dataset '{dataset}' has no column '{c}'; its columns are {}",
                    describe_fields(schema)
                ))
            })
        })
        .collect::<Result<Vec<usize>>>()?;
    let projected = schema
        .project(&indices)
        .map_err(|e| Error::Internal(format!("projection of valid indices failed: {e}")))?;
    Ok((indices, Arc::new(projected)))
}

/// One rank's shard of one epoch, ready to stream.
#[derive(Debug)]
pub struct Shard {
    data: Arc<SealedData>,
    /// The dataset's batches with only the projected columns.
    projected: Vec<RecordBatch>,
    schema: SchemaRef,
    order: ShardOrder,
    plan: ReadPlan,
}

impl Shard {
    /// Rank `rank`'s shard of `plan` over `data`; checks columns and start.
    pub fn new(data: Arc<SealedData>, plan: &ReadPlan, rank: u32) -> Result<Self> {
        let (indices, schema) = project(data.schema(), &plan.columns, &plan.dataset)?;
        let projected = data
            .batches()
            .iter()
            .map(|b| {
                b.project(&indices)
                    .map_err(|e| Error::Internal(format!("projection of a stored batch: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let n = data.rows();
        let order = ShardOrder::new(plan.epoch_order(n), plan.shares(n)?, rank)?;
        Ok(Self {
            data,
            projected,
            schema,
            order,
            plan: plan.clone(),
        })
    }

    /// The projected schema every batch has.
    pub fn schema(&self) -> SchemaRef {
        self.schema.clone()
    }

    /// Rows of the rank's whole share (before any split).
    pub fn rank_rows(&self) -> u64 {
        self.order.len()
    }

    /// The stream's record batches, in order; the last may be shorter.
    pub fn batches(&self) -> impl Iterator<Item = Result<RecordBatch>> + '_ {
        self.plan
            .stream_batches(self.rank_rows())
            .map(move |samples| self.gather(samples))
    }

    fn gather(&self, samples: std::ops::Range<u64>) -> Result<RecordBatch> {
        let indices: Vec<(usize, usize)> = self
            .order
            .rows(samples)
            .map(|row| self.data.locate(row))
            .collect();
        if self.schema.fields().is_empty() {
            let options =
                arrow::array::RecordBatchOptions::new().with_row_count(Some(indices.len()));
            return RecordBatch::try_new_with_options(self.schema.clone(), vec![], &options)
                .map_err(|e| Error::Internal(format!("empty projection: {e}")));
        }
        let sources: Vec<&RecordBatch> = self.projected.iter().collect();
        interleave_record_batch(&sources, &indices)
            .map_err(|e| Error::Internal(format!("gathering rows: {e}")))
    }
}
