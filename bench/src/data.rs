//! The synthetic dataset: `rows` rows of float32 features (as separate
//! columns, one `fixed_size_list<float32>[D]` column, or one `list<float32>`
//! column of D values a row, as Spark writes `array<float>`) and an int64
//! label, cut into partitions of record batches. Values come from a seeded
//! xorshift generator, so a run is repeatable.

use std::sync::Arc;

use arrow::array::{
    ArrayRef, FixedSizeListArray, Float32Array, Int64Array, ListArray, RecordBatch,
};
use arrow::buffer::OffsetBuffer;
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

/// Shape of the generated data.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Total rows.
    pub rows: u64,
    /// Float32 features per row.
    pub features: usize,
    /// Features as one fixed-size-list column instead of separate columns.
    pub vector: bool,
    /// Features as one list column of `features` values a row (Spark's
    /// `array<float>`) instead of separate columns.
    pub list: bool,
    /// Partitions (one `DoPut` each).
    pub partitions: usize,
    /// Rows per record batch within a partition.
    pub batch_rows: usize,
    /// Seed of the values.
    pub seed: u64,
}

impl Shape {
    /// Payload bytes per row: 4 per feature plus the 8-byte label.
    pub fn row_bytes(&self) -> u64 {
        4 * self.features as u64 + 8
    }

    /// Payload bytes of the whole dataset.
    pub fn payload_bytes(&self) -> u64 {
        self.rows * self.row_bytes()
    }

    /// The schema of every batch.
    pub fn schema(&self) -> SchemaRef {
        let mut fields = vec![Field::new("label", DataType::Int64, false)];
        if self.list {
            fields.push(Field::new(
                "features",
                DataType::List(Arc::new(Field::new("element", DataType::Float32, true))),
                true,
            ));
        } else if self.vector {
            fields.push(Field::new(
                "features",
                DataType::FixedSizeList(
                    Arc::new(Field::new("item", DataType::Float32, false)),
                    self.features as i32,
                ),
                false,
            ));
        } else {
            fields.extend(
                (0..self.features).map(|i| Field::new(format!("f{i}"), DataType::Float32, false)),
            );
        }
        Arc::new(Schema::new(fields))
    }

    /// Rows of partition `p` as `start..end` of the global row range.
    pub fn partition_rows(&self, p: usize) -> std::ops::Range<u64> {
        let per = self.rows / self.partitions as u64;
        let extra = self.rows % self.partitions as u64;
        let p64 = p as u64;
        let start = p64 * per + p64.min(extra);
        start..start + per + u64::from(p64 < extra)
    }

    /// The record batches of partition `p`.
    pub fn partition(&self, p: usize) -> Vec<RecordBatch> {
        let range = self.partition_rows(p);
        let mut out = Vec::new();
        let mut start = range.start;
        while start < range.end {
            let end = (start + self.batch_rows as u64).min(range.end);
            out.push(self.batch(start..end));
            start = end;
        }
        out
    }

    fn batch(&self, rows: std::ops::Range<u64>) -> RecordBatch {
        let n = (rows.end - rows.start) as usize;
        let mut state = self.seed ^ rows.start.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        };
        let labels: ArrayRef =
            Arc::new(Int64Array::from_iter_values(rows.map(|r| (r % 10) as i64)));
        let mut columns = vec![labels];
        if self.list {
            let values = Float32Array::from_iter_values((0..n * self.features).map(|_| next()));
            columns.push(Arc::new(ListArray::new(
                Arc::new(Field::new("element", DataType::Float32, true)),
                OffsetBuffer::from_lengths(std::iter::repeat_n(self.features, n)),
                Arc::new(values),
                None,
            )));
        } else if self.vector {
            let values = Float32Array::from_iter_values((0..n * self.features).map(|_| next()));
            columns.push(Arc::new(FixedSizeListArray::new(
                Arc::new(Field::new("item", DataType::Float32, false)),
                self.features as i32,
                Arc::new(values),
                None,
            )));
        } else {
            for _ in 0..self.features {
                columns.push(Arc::new(Float32Array::from_iter_values(
                    (0..n).map(|_| next()),
                )));
            }
        }
        RecordBatch::try_new(self.schema(), columns).expect("generated batch matches its schema")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_cover_all_rows() {
        let shape = Shape {
            rows: 1003,
            features: 3,
            vector: false,
            list: false,
            partitions: 7,
            batch_rows: 50,
            seed: 1,
        };
        let total: usize = (0..7)
            .flat_map(|p| shape.partition(p))
            .map(|b| b.num_rows())
            .sum();
        assert_eq!(total, 1003);
        assert_eq!(shape.partition_rows(6).end, 1003);
        let v = Shape {
            vector: true,
            ..shape
        };
        assert_eq!(v.partition(0)[0].num_columns(), 2);
        let l = Shape {
            list: true,
            ..shape
        };
        let batch = &l.partition(0)[0];
        assert_eq!(batch.schema(), l.schema());
        // The same values a row as the fixed-size list's.
        let (fixed, list) = (v.partition(0)[0].column(1).clone(), batch.column(1).clone());
        let flat = |a: &ArrayRef| {
            arrow::compute::cast(
                a,
                &DataType::List(Arc::new(Field::new("element", DataType::Float32, true))),
            )
            .expect("cast")
        };
        assert_eq!(&flat(&fixed), &list);
    }
}
