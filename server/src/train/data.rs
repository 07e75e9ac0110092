//! A job's view of a sealed dataset: the feature columns as `f32` and the
//! label column, checked once, and the gather of a batch's rows into a
//! row-major feature matrix. A job with a filter sees only the rows it
//! selects, numbered `0..rows()` in storage order.

use std::sync::Arc;

use arrow::array::{ArrayRef, AsArray, Float32Array};
use arrow::buffer::NullBuffer;
use arrow::compute::cast;
use arrow::datatypes::{DataType, Float32Type};

use crate::catalog::{SealedData, describe_fields};
use crate::error::{Error, Result};
use crate::memory::device::{numeric_values_with_nulls, one_length, uneven};
use crate::query::Selection;

/// What the label column holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LabelKind {
    /// Class indices `0..classes` (an integer column).
    Classes(usize),
    /// Regression targets (a numeric or fixed_size_list column).
    Values,
}

/// Feature and label columns of every stored batch, as `f32`.
#[derive(Debug)]
pub struct TrainData {
    /// Per stored batch, per feature column: its values and width.
    features: Vec<Vec<(Float32Array, usize)>>,
    /// Per stored batch: the labels (`f32`; class indices are exact).
    labels: Vec<(Float32Array, usize)>,
    /// Row offsets of the stored batches (one extra = rows).
    starts: Vec<u64>,
    /// The stored rows the job trains on, when a filter chose them.
    selection: Option<Arc<Selection>>,
    /// The feature columns, in order, with their values per row.
    pub columns: Vec<(String, usize)>,
    /// Features per row.
    pub dim: usize,
    /// Label values per row (1 for classes).
    pub label_width: usize,
}

/// The column as `f32` values (those of null rows unspecified) and its
/// width, or why it cannot be; its null rows in stored batch `batch`, if
/// any, go to `nulls`.
fn as_f32(
    col: &ArrayRef,
    name: &str,
    what: &str,
    (batch, first_row): (usize, u64),
    nulls: &mut Vec<NullRows>,
) -> Result<(Float32Array, usize)> {
    let column = format!("{what} column '{name}'");
    let col = one_length(col, &column, first_row)?;
    let (values, width, null_rows) = numeric_values_with_nulls(&col, &column)?;
    let f =
        cast(&values, &DataType::Float32).map_err(|e| Error::invalid(format!("{column}: {e}")))?;
    if let Some(rows) = null_rows {
        nulls.push(NullRows {
            column,
            name: name.to_string(),
            batch,
            nulls: rows,
        });
    }
    Ok((f.as_primitive::<Float32Type>().clone(), width))
}

/// The null rows of one feature or label column in one stored batch.
#[derive(Debug)]
struct NullRows {
    /// "feature column 'x'" or "label column 'y'".
    column: String,
    name: String,
    batch: usize,
    nulls: NullBuffer,
}

impl TrainData {
    /// Checks `features` and `label` against `data` and prepares them: every
    /// column exists and is numeric (or a fixed_size_list of numbers); in
    /// the rows trained on (`selection`'s, else every row) no column is
    /// null — so a filter such as `"x" IS NOT NULL` trains on the rows that
    /// have values — and class labels are integers in `0..classes`.
    pub fn new(
        data: &SealedData,
        features: &[String],
        label: &str,
        kind: LabelKind,
        selection: Option<Arc<Selection>>,
    ) -> Result<Self> {
        let schema = data.schema();
        let index = |name: &str, what: &str| {
            schema.index_of(name).map_err(|_| {
                Error::invalid(format!(
                    "{what} column '{name}' is not in the dataset; its columns are {}",
                    describe_fields(schema)
                ))
            })
        };
        if features.is_empty() {
            return Err(Error::invalid("the job names no feature columns"));
        }
        if features.iter().any(|f| f == label) {
            return Err(Error::invalid(format!(
                "column '{label}' is both a feature and the label"
            )));
        }
        if let Some((first, i)) = crate::convert::first_repeat(features) {
            return Err(Error::invalid(format!(
                "feature column '{}' is named twice (positions {first} and {i}); name each \
                 feature once",
                features[i]
            )));
        }
        let feature_idx = features
            .iter()
            .map(|f| index(f, "feature"))
            .collect::<Result<Vec<_>>>()?;
        let label_idx = index(label, "label")?;
        if let LabelKind::Classes(_) = kind
            && !schema.field(label_idx).data_type().is_integer()
        {
            return Err(Error::invalid(format!(
                "label column '{label}' has type {}; classification needs integer class indices",
                schema.field(label_idx).data_type()
            )));
        }
        let mut out = Self {
            features: Vec::new(),
            labels: Vec::new(),
            columns: Vec::new(),
            starts: vec![0],
            selection: None,
            dim: 0,
            label_width: 1,
        };
        let mut rows = 0u64;
        let mut nulls = Vec::new();
        for (b, batch) in data.batches().iter().enumerate() {
            let at = (b, rows);
            let cols = feature_idx
                .iter()
                .zip(features)
                .map(|(&i, name)| as_f32(batch.column(i), name, "feature", at, &mut nulls))
                .collect::<Result<Vec<_>>>()?;
            let columns: Vec<(String, usize)> = features
                .iter()
                .zip(&cols)
                .map(|(name, (_, w))| (name.clone(), *w))
                .collect();
            let (labels, width) = as_f32(batch.column(label_idx), label, "label", at, &mut nulls)?;
            // A list column's length is its rows', which every batch must share.
            if b > 0 {
                let before = out.columns.iter().map(|(_, w)| *w).chain([out.label_width]);
                let now = columns.iter().map(|(_, w)| *w).chain([width]);
                let names = features.iter().map(|f| ("feature", f.as_str()));
                let differs = names
                    .chain([("label", label)])
                    .zip(before.zip(now))
                    .find(|(_, (w0, w))| w0 != w);
                if let Some(((what, name), (w0, w))) = differs {
                    return Err(uneven(
                        &format!("{what} column '{name}'"),
                        format!("rows before row {rows} hold {w0}, row {rows} holds {w}"),
                    ));
                }
            }
            out.dim = columns.iter().map(|(_, w)| w).sum();
            out.columns = columns;
            out.label_width = width;
            out.features.push(cols);
            out.labels.push((labels, width));
            rows += batch.num_rows() as u64;
            out.starts.push(rows);
        }
        if rows == 0 {
            return Err(Error::invalid("the dataset has no rows to train on"));
        }
        out.selection = selection;
        if out.rows() == 0 {
            return Err(Error::invalid(
                "the job's filter selects none of the dataset's rows; there is nothing to train on",
            ));
        }
        out.check_nulls(&nulls)?;
        out.check_finite(features, label, kind)?;
        if let LabelKind::Classes(classes) = kind
            && let Some((row, v)) = out.label_outside(classes)
        {
            return Err(Error::invalid(format!(
                "label column '{label}' holds {v} at row {row}, outside the {classes} classes \
                 (0 ≤ label < {classes}){}; give --classes/classes as one more than the largest \
                 label",
                if out.selection.is_some() {
                    ", a row the job's filter selects"
                } else {
                    ""
                }
            )));
        }
        Ok(out)
    }

    /// Rows the job trains on: the dataset's, or those its filter selects.
    pub fn rows(&self) -> u64 {
        match &self.selection {
            Some(s) => s.len(),
            None => self.stored_rows(),
        }
    }

    /// Whether the job trains on every stored row, in storage order.
    pub fn every_row(&self) -> bool {
        self.rows() == self.stored_rows()
    }

    fn stored_rows(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The stored row of the job's row `i`.
    fn stored(&self, i: u64) -> u64 {
        match &self.selection {
            Some(s) => s.row(i),
            None => i,
        }
    }

    /// Refuses a null in a row the job trains on, naming the column and, for
    /// a job with a filter, the row.
    fn check_nulls(&self, nulls: &[NullRows]) -> Result<()> {
        let Some(first) = nulls.first() else {
            return Ok(());
        };
        let Some(selection) = &self.selection else {
            return Err(Error::invalid(format!(
                "{} has nulls; fill or drop them before training, or train on the rows that \
                 have values with a filter such as `\"{}\" IS NOT NULL`",
                first.column, first.name
            )));
        };
        let mut by_batch: Vec<Vec<&NullRows>> = vec![Vec::new(); self.labels.len()];
        for n in nulls {
            by_batch[n.batch].push(n);
        }
        for i in 0..selection.len() {
            let row = selection.row(i);
            let (b, r) = self.locate(row);
            if let Some(n) = by_batch[b].iter().find(|n| n.nulls.is_null(r)) {
                return Err(Error::invalid(format!(
                    "{} is null at row {row}, a row the job's filter selects; add \
                     `AND \"{}\" IS NOT NULL` to the filter, or fill the column",
                    n.column, n.name
                )));
            }
        }
        Ok(())
    }

    /// Refuses a NaN or an infinite value in a feature (or regression
    /// label) of a row the job trains on, naming the column and the row:
    /// one such value makes every weight it reaches NaN, and the ReLU of a
    /// NaN is 0, so the loss could stay a number while the model is lost.
    fn check_finite(&self, features: &[String], label: &str, kind: LabelKind) -> Result<()> {
        /// Per stored batch, a column's values and width.
        type PerBatch<'a> = Vec<&'a (Float32Array, usize)>;
        // (feature or label, name, values)
        let mut columns: Vec<(&str, &str, PerBatch<'_>)> = features
            .iter()
            .enumerate()
            .map(|(c, name)| {
                let per_batch = self.features.iter().map(|cols| &cols[c]).collect();
                ("feature", name.as_str(), per_batch)
            })
            .collect();
        if kind == LabelKind::Values {
            columns.push(("label", label, self.labels.iter().collect()));
        }
        for (what, column, per_batch) in &columns {
            // The first stored row (of those trained on) holding a value
            // that is not finite, and the value.
            let bad = |b: usize, r: usize| {
                let (values, width) = per_batch[b];
                values.values()[r * width..(r + 1) * width]
                    .iter()
                    .copied()
                    .find(|v| !v.is_finite())
            };
            let found = match &self.selection {
                Some(s) => (0..s.len()).map(|i| s.row(i)).find_map(|row| {
                    let (b, r) = self.locate(row);
                    bad(b, r).map(|v| (row, v))
                }),
                None => per_batch
                    .iter()
                    .zip(&self.starts)
                    .find_map(|(&(values, width), start)| {
                        let i = values.values().iter().position(|v| !v.is_finite())?;
                        Some((start + (i / width) as u64, values.values()[i]))
                    }),
            };
            if let Some((row, v)) = found {
                let leave_out = if v.is_nan() {
                    format!("`isnan(\"{column}\") = false`")
                } else {
                    format!("`abs(\"{column}\") < 'Infinity'`")
                };
                return Err(Error::invalid(format!(
                    "{what} column '{column}' holds {v} at row {row}{}; a value that is not \
                     finite makes every weight it reaches NaN: fix or drop those rows, or leave \
                     them out with a filter such as {leave_out} (for a scalar column)",
                    if self.selection.is_some() {
                        ", a row the job's filter selects"
                    } else {
                        ""
                    }
                )));
            }
        }
        Ok(())
    }

    /// The first of the job's rows whose class label is not in
    /// `0..classes`: its stored row and its label.
    fn label_outside(&self, classes: usize) -> Option<(u64, f32)> {
        let outside = |v: &f32| !(0.0..classes as f32).contains(v);
        match &self.selection {
            Some(s) => (0..s.len()).map(|i| s.row(i)).find_map(|row| {
                let (b, r) = self.locate(row);
                let v = self.labels[b].0.values()[r];
                outside(&v).then_some((row, v))
            }),
            None => self
                .labels
                .iter()
                .zip(&self.starts)
                .find_map(|((labels, _), start)| {
                    let (r, v) = labels
                        .values()
                        .iter()
                        .enumerate()
                        .find(|(_, v)| outside(v))?;
                    Some((start + r as u64, *v))
                }),
        }
    }

    /// Features (`rows × dim`, row-major) and labels (`rows × label_width`)
    /// of the given rows (the job's numbering), in that order.
    pub fn gather(&self, rows: impl Iterator<Item = u64>) -> (Vec<f32>, Vec<f32>) {
        let mut x = Vec::new();
        let mut y = Vec::new();
        for row in rows {
            let (b, r) = self.locate_job_row(row);
            for (col, w) in &self.features[b] {
                x.extend_from_slice(&col.values()[r * w..(r + 1) * w]);
            }
            self.push_labels(&mut y, b, r);
        }
        (x, y)
    }

    /// Labels only (`rows × label_width`) of the given rows (the job's
    /// numbering).
    pub fn gather_labels(&self, rows: impl Iterator<Item = u64>) -> Vec<f32> {
        let mut y = Vec::new();
        for row in rows {
            let (b, r) = self.locate_job_row(row);
            self.push_labels(&mut y, b, r);
        }
        y
    }

    /// The stored batch holding the job's row `row`, and the row within it.
    fn locate_job_row(&self, row: u64) -> (usize, usize) {
        self.locate(self.stored(row))
    }

    /// The stored batch holding stored row `row`, and the row within it.
    fn locate(&self, row: u64) -> (usize, usize) {
        let b = self.starts.partition_point(|&s| s <= row) - 1;
        (b, (row - self.starts[b]) as usize)
    }

    fn push_labels(&self, y: &mut Vec<f32>, b: usize, r: usize) {
        let (labels, w) = &self.labels[b];
        y.extend_from_slice(&labels.values()[r * w..(r + 1) * w]);
    }
}
