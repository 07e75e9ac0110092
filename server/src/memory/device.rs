//! The CUDA driver, when there is one: page-locked slabs for the arena and
//! the device tier (`place` / `evict`).
//!
//! cudarc loads `libcuda` at run time, and panics when a call finds no
//! library, so every entry point goes through [`CudaHost::probe`], which
//! checks `is_culib_present()` first. A server without a driver has no
//! `CudaHost`: its arena uses heap memory and `place` answers
//! `FailedPrecondition`.
//!
//! Which bytes go to the device is decided by [`column_segments`], which is
//! pure and tested without a GPU; this module only copies them. A list
//! column whose rows all hold one number of values (Spark's `array<float>`)
//! is placed, like a `fixed_size_list`, as its values ([`one_length`]).
#![allow(unsafe_code)]

use std::sync::{Arc, OnceLock};

use arrow::array::{Array, ArrayData, ArrayRef, AsArray, GenericListArray, OffsetSizeTrait};
use arrow::buffer::{Buffer, NullBuffer, OffsetBuffer};
use arrow::datatypes::{DataType, FieldRef};
use cudarc::driver::{CudaContext, CudaSlice, sys};

use crate::catalog::SealedData;
use crate::error::{Error, Result};

/// A handle on the CUDA driver, bound to device 0's primary context for host
/// allocations (which are portable: usable from every device).
#[derive(Clone)]
pub struct CudaHost {
    ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for CudaHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaHost")
            .field("devices", &self.device_count())
            .finish()
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names.
    unsafe { sys::is_culib_present() }
}

impl CudaHost {
    /// The driver with at least one device, or `None` (no library, no device,
    /// or a driver that fails to initialise).
    pub fn probe() -> Option<Self> {
        if !driver_present() {
            return None;
        }
        let count = CudaContext::device_count().ok()?;
        if count < 1 {
            return None;
        }
        let ctx = CudaContext::new(0).ok()?;
        Some(Self { ctx })
    }

    /// Number of devices the driver sees.
    pub fn device_count(&self) -> u32 {
        CudaContext::device_count()
            .ok()
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0)
    }

    /// `cap` bytes of page-locked, portable host memory.
    pub(crate) fn alloc_pinned(&self, cap: usize) -> Result<*mut u8> {
        self.ctx.bind_to_thread().map_err(cuda_error)?;
        // SAFETY: a plain allocation; its bytes are written before they are read.
        let ptr =
            unsafe { cudarc::driver::result::malloc_host(cap, sys::CU_MEMHOSTALLOC_PORTABLE) }
                .map_err(cuda_error)?;
        Ok(ptr.cast())
    }

    /// Frees memory from [`CudaHost::alloc_pinned`].
    pub(crate) fn free_pinned(&self, ptr: *mut u8) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `alloc_pinned` and is freed once.
            let _ = unsafe { cudarc::driver::result::free_host(ptr.cast()) };
        }
    }

    /// Whether `ptr` lies in page-locked memory the driver knows
    /// (`cuMemHostGetFlags` succeeds only for such memory).
    pub fn is_pinned(&self, ptr: *const u8) -> bool {
        if self.ctx.bind_to_thread().is_err() {
            return false;
        }
        let mut flags = 0u32;
        // SAFETY: the driver only reads the pointer value.
        let r = unsafe { sys::cuMemHostGetFlags(&mut flags, ptr.cast_mut().cast()) };
        r == sys::CUresult::CUDA_SUCCESS
    }

    /// Copies the named columns of `data` to `device`, one device buffer per
    /// column, from the arena (page-locked) on one stream.
    pub fn place(
        &self,
        data: &SealedData,
        columns: &[String],
        device: u32,
    ) -> Result<DevicePlacement> {
        let count = self.device_count();
        if device >= count {
            return Err(Error::invalid(format!(
                "device {device} does not exist: this server sees {count} CUDA devices \
                 (0..{count})"
            )));
        }
        let ctx = CudaContext::new(device as usize).map_err(cuda_error)?;
        let stream = ctx.default_stream();
        let mut placed = Vec::with_capacity(columns.len());
        let mut bytes = 0u64;
        for name in columns {
            let col = column_segments(data, name)?;
            let total: usize = col.segments.iter().map(|s| s.len()).sum();
            // SAFETY: every byte is written by the copies below before use.
            let mut buf = unsafe { stream.alloc::<u8>(total.max(1)) }.map_err(cuda_error)?;
            let mut at = 0usize;
            for seg in &col.segments {
                let mut dst = buf.slice_mut(at..at + seg.len());
                stream
                    .memcpy_htod(seg.as_slice(), &mut dst)
                    .map_err(cuda_error)?;
                at += seg.len();
            }
            bytes += total as u64;
            placed.push(DeviceColumn {
                name: name.clone(),
                element: col.element.clone(),
                width: col.width,
                rows: col.rows,
                buffer: buf,
            });
        }
        stream.synchronize().map_err(cuda_error)?;
        Ok(DevicePlacement {
            device,
            columns: placed,
            bytes,
        })
    }
}

fn cuda_error(e: cudarc::driver::DriverError) -> Error {
    Error::Internal(format!("CUDA driver call failed: {e}"))
}

/// One column on one device: `rows × width` values of `element`, row-major.
pub struct DeviceColumn {
    /// Column name.
    pub name: String,
    /// Element type.
    pub element: DataType,
    /// Values per row (1 for primitive columns).
    pub width: usize,
    /// Rows.
    pub rows: u64,
    /// The values.
    pub buffer: CudaSlice<u8>,
}

/// The columns of one dataset placed on one device.
pub struct DevicePlacement {
    /// Device ordinal.
    pub device: u32,
    /// Placed columns, in request order.
    pub columns: Vec<DeviceColumn>,
    /// Device bytes held.
    pub bytes: u64,
}

impl Drop for DevicePlacement {
    /// Binds the device's context before the buffers are freed: cudarc
    /// frees a buffer without binding its context, and a placement is
    /// dropped on whatever thread lets go of it last (`evict`, a
    /// replacement, a dropped dataset), where no context may be current
    /// and the free would fail silently and leak.
    fn drop(&mut self) {
        if let Some(c) = self.columns.first()
            && let Err(e) = c.buffer.context().bind_to_thread()
        {
            tracing::warn!(device = self.device, error = ?e, "cannot bind the device's context to free a placement");
        }
    }
}

impl std::fmt::Debug for DevicePlacement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DevicePlacement")
            .field("device", &self.device)
            .field(
                "columns",
                &self.columns.iter().map(|c| &c.name).collect::<Vec<_>>(),
            )
            .field("bytes", &self.bytes)
            .finish()
    }
}

/// A numeric column of a sealed dataset as contiguous byte runs: the values
/// of each stored batch, in row order, without nulls.
#[derive(Debug)]
pub struct ColumnSegments {
    /// Element type (a primitive numeric type).
    pub element: DataType,
    /// Values per row.
    pub width: usize,
    /// Rows over all segments.
    pub rows: u64,
    /// The values, batch by batch; concatenated they are the column.
    pub segments: Vec<Buffer>,
}

/// The element type and values per row of a column type that can be placed
/// or trained on: a primitive number (width 1) or a `fixed_size_list` of
/// numbers.
pub fn numeric_shape(dt: &DataType) -> Option<(DataType, usize)> {
    let number = |t: &DataType| t.is_numeric() && t.is_primitive();
    match dt {
        DataType::FixedSizeList(item, n) if number(item.data_type()) => {
            Some((item.data_type().clone(), usize::try_from(*n).ok()?))
        }
        t if number(t) => Some((t.clone(), 1)),
        _ => None,
    }
}

/// The refusal of `column` (e.g. "feature column 'x'") of a type that is
/// neither a number nor a fixed_size_list of numbers.
fn not_numeric(column: &str, data_type: &DataType) -> Error {
    Error::invalid(format!(
        "{column} has type {data_type}; only numeric columns and fixed_size_list columns of \
         numbers can be placed on a device or trained on (training also takes a list of numbers \
         whose rows all hold one number of values, such as Spark's array<float>, and so does a \
         GPU copy)"
    ))
}

/// The values of a numeric column as one flat array holding exactly its
/// rows, and the values per row; refuses other types and nulls. `column`
/// names it in errors (e.g. "feature column 'x'").
pub fn numeric_values(col: &ArrayRef, column: &str) -> Result<(ArrayRef, usize)> {
    let (values, width, nulls) = numeric_values_with_nulls(col, column)?;
    match nulls {
        None => Ok((values, width)),
        Some(_) if col.null_count() > 0 => Err(Error::invalid(format!(
            "{column} has nulls; fill or drop them before placing or training"
        ))),
        Some(_) => Err(Error::invalid(format!(
            "{column} has null list items; fill them before placing or training"
        ))),
    }
}

/// [`numeric_values`] of a column that may hold nulls: the values (those
/// of a null row are unspecified), the values per row, and which rows are
/// null — null themselves or, for a list, holding a null item — or `None`
/// when no row is. Refuses other types.
pub fn numeric_values_with_nulls(
    col: &ArrayRef,
    column: &str,
) -> Result<(ArrayRef, usize, Option<NullBuffer>)> {
    let Some((_, width)) = numeric_shape(col.data_type()) else {
        return Err(not_numeric(column, col.data_type()));
    };
    if !matches!(col.data_type(), DataType::FixedSizeList(..)) {
        let nulls = col.logical_nulls().filter(|n| n.null_count() > 0);
        return Ok((col.clone(), 1, nulls));
    }
    let list = col.as_fixed_size_list();
    // The rows of this (possibly sliced) list array.
    let child = list
        .values()
        .slice(list.offset() * width, list.len() * width);
    let items = child
        .logical_nulls()
        .filter(|n| n.null_count() > 0)
        .map(|items| {
            // A row is valid when every one of its items is.
            NullBuffer::from_iter(
                (0..list.len()).map(|r| (r * width..(r + 1) * width).all(|i| items.is_valid(i))),
            )
        });
    let nulls = NullBuffer::union(list.logical_nulls().as_ref(), items.as_ref())
        .filter(|n| n.null_count() > 0);
    Ok((child, width, nulls))
}

/// The bytes of column `name` of `data`, as a GPU holds it: a primitive
/// numeric column, a `fixed_size_list` of one, or a list of one whose rows
/// all hold one number of values (every stored batch the same number), with
/// no nulls. Anything else is refused with a message naming the column and
/// its type, or the rows that differ.
pub fn column_segments(data: &SealedData, name: &str) -> Result<Arc<ColumnSegments>> {
    let schema = data.schema();
    let idx = schema.index_of(name).map_err(|_| {
        Error::invalid(format!(
            "no column '{name}'; columns are {}",
            crate::catalog::describe_fields(schema)
        ))
    })?;
    segments_at(data, idx)
}

/// A list column (Spark's `array<float>`) of numbers as the
/// `fixed_size_list` it is when every row holds the same number of values;
/// a row holding another number is refused, naming it (rows are numbered
/// from `first_row`), as are empty lists. Null rows stay null; a column of
/// another type is returned as it is.
pub fn one_length(col: &ArrayRef, column: &str, first_row: u64) -> Result<ArrayRef> {
    match col.data_type() {
        DataType::List(item) if item.data_type().is_numeric() => {
            list_one_length(col.as_list::<i32>(), item, column, first_row)
        }
        DataType::LargeList(item) if item.data_type().is_numeric() => {
            list_one_length(col.as_list::<i64>(), item, column, first_row)
        }
        _ => Ok(col.clone()),
    }
}

fn list_one_length<O: OffsetSizeTrait>(
    list: &GenericListArray<O>,
    item: &FieldRef,
    column: &str,
    first_row: u64,
) -> Result<ArrayRef> {
    let mut lengths = list
        .offsets()
        .windows(2)
        .enumerate()
        .filter(|(i, _)| list.is_valid(*i))
        .map(|(i, w)| (first_row + i as u64, (w[1] - w[0]).as_usize()));
    let Some((first, width)) = lengths.next() else {
        return Ok(Arc::new(list.clone())); // every row null: refused as nulls
    };
    if let Some((row, other)) = lengths.find(|&(_, n)| n != width) {
        return Err(uneven(
            column,
            format!("row {first} holds {width}, row {row} holds {other}"),
        ));
    }
    if width == 0 {
        return Err(Error::invalid(format!(
            "{column} holds empty lists (row {first}); there is nothing to train on in it (or to \
             place)"
        )));
    }
    let size = i32::try_from(width)
        .map_err(|_| Error::invalid(format!("{column} holds lists of {width} values")))?;
    // arrow's cast takes a list whose rows all hold `size` values to start
    // at its values' first, which a slice's (offsets not from 0) does not:
    // the rows are given to it as a list of their own values, offsets from 0.
    let offsets = list.offsets();
    let rows = if offsets[0].as_usize() == 0 {
        list.clone()
    } else {
        let (start, end) = (offsets[0].as_usize(), offsets[offsets.len() - 1].as_usize());
        let from_zero = OffsetBuffer::new(offsets.iter().map(|&o| o - offsets[0]).collect());
        GenericListArray::<O>::try_new(
            item.clone(),
            from_zero,
            list.values().slice(start, end - start),
            list.nulls().cloned(),
        )
        .map_err(|e| Error::invalid(format!("{column}: {e}")))?
    };
    let options = arrow::compute::CastOptions {
        safe: false,
        ..Default::default()
    };
    arrow::compute::cast_with_options(
        &rows,
        &DataType::FixedSizeList(item.clone(), size),
        &options,
    )
    .map_err(|e| Error::invalid(format!("{column}: {e}")))
}

/// The refusal of list `column` (e.g. "feature column 'x'") whose rows
/// hold different numbers of values, as `rows` says.
pub fn uneven(column: &str, rows: String) -> Error {
    Error::invalid(format!(
        "{column} is a list whose rows hold different numbers of values ({rows}); training \
         takes lists of one length, as does a GPU copy (pad or cut them to one length first)"
    ))
}

/// The bytes of a numeric column's values (all of its rows, none else; a
/// list's when its rows all hold one number of values); refuses other
/// types and nulls. `column` names it in errors.
pub fn value_bytes(col: &ArrayRef, column: &str) -> Result<Buffer> {
    let (values, _) = numeric_values(&one_length(col, column, 0)?, column)?;
    let values: ArrayData = values.to_data();
    let elem_bytes = values.data_type().primitive_width().unwrap_or(1);
    let start = values.offset() * elem_bytes;
    Ok(values.buffers()[0].slice_with_length(start, values.len() * elem_bytes))
}

/// [`column_segments`] of the column at `idx` of the schema, worked out at
/// the first call for the column and kept with the data
/// ([`SegmentsCache`]): every read stream, placement and packed copy of a
/// dataset asks again, and the answer lasts as long as the data.
pub fn segments_at(data: &SealedData, idx: usize) -> Result<Arc<ColumnSegments>> {
    data.segments().get(data, idx)
}

/// Each column's [`ColumnSegments`] (or the reason it has none) of one
/// sealed dataset, each worked out once. Working them out walks every
/// stored batch of the column (and, for a list column, every row's
/// length), which a read stream would otherwise pay for every column at
/// its start.
#[derive(Debug)]
pub struct SegmentsCache(Box<[OnceLock<Result<Arc<ColumnSegments>>>]>);

impl SegmentsCache {
    /// Room for the columns of a schema of `columns` fields, none worked
    /// out yet.
    pub fn new(columns: usize) -> Self {
        Self((0..columns).map(|_| OnceLock::new()).collect())
    }

    /// Column `idx` of `data` (the data this cache belongs to, so `idx`
    /// is a column of its schema, as `work_out_segments` needs too).
    fn get(&self, data: &SealedData, idx: usize) -> Result<Arc<ColumnSegments>> {
        self.0[idx]
            .get_or_init(|| work_out_segments(data, idx).map(Arc::new))
            .clone()
    }
}

/// [`segments_at`], not kept.
fn work_out_segments(data: &SealedData, idx: usize) -> Result<ColumnSegments> {
    let schema = data.schema();
    let column = format!("column '{}'", schema.field(idx).name());
    let data_type = schema.field(idx).data_type();
    let (element, mut width) = match data_type {
        DataType::List(item) | DataType::LargeList(item)
            if item.data_type().is_numeric() && item.data_type().is_primitive() =>
        {
            (item.data_type().clone(), None)
        }
        t => {
            let (element, width) = numeric_shape(t).ok_or_else(|| not_numeric(&column, t))?;
            (element, Some(width))
        }
    };
    let is_list = width.is_none();
    let mut segments = Vec::with_capacity(data.batches().len());
    let mut rows = 0u64;
    for batch in data.batches() {
        if is_list && batch.num_rows() == 0 {
            segments.push(Buffer::from_vec(Vec::<u8>::new()));
            continue;
        }
        if is_list {
            let fixed = one_length(batch.column(idx), &column, rows)?;
            // Still a list: every row of the batch is null.
            let DataType::FixedSizeList(_, n) = fixed.data_type() else {
                return Err(Error::invalid(format!(
                    "{column} has nulls (rows {rows} to {}); fill or drop them before placing or \
                     training",
                    rows + batch.num_rows() as u64 - 1
                )));
            };
            let n = *n as usize;
            if let Some(w) = width.filter(|&w| w != n) {
                return Err(uneven(
                    &column,
                    format!("rows before row {rows} hold {w}, row {rows} holds {n}"),
                ));
            }
            width = Some(n);
            segments.push(value_bytes(&fixed, &column)?);
        } else {
            segments.push(value_bytes(batch.column(idx), &column)?);
        }
        rows += batch.num_rows() as u64;
    }
    let Some(width) = width else {
        return Err(Error::invalid(format!(
            "{column} has no rows to take the length of its lists from"
        )));
    };
    Ok(ColumnSegments {
        element,
        width,
        rows,
        segments,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow::array::{Float32Array, Int64Array, ListArray, RecordBatch, StringArray};
    use arrow::datatypes::{Field, Schema};

    /// Two batches of a number, a string and a list of two floats a row.
    fn data() -> SealedData {
        let item = Arc::new(Field::new("item", DataType::Float32, false));
        let schema = Arc::new(Schema::new(vec![
            Field::new("id", DataType::Int64, false),
            Field::new("name", DataType::Utf8, false),
            Field::new("features", DataType::List(item.clone()), false),
        ]));
        let batch = |start: i64| {
            let values = Float32Array::from_iter_values((0..6).map(|v| (start * 2 + v) as f32));
            let lists = ListArray::new(
                item.clone(),
                OffsetBuffer::from_lengths([2, 2, 2]),
                Arc::new(values),
                None,
            );
            let columns: Vec<ArrayRef> = vec![
                Arc::new(Int64Array::from_iter_values(start..start + 3)),
                Arc::new(StringArray::from_iter_values(["a", "b", "c"])),
                Arc::new(lists),
            ];
            RecordBatch::try_new(schema.clone(), columns).expect("batch")
        };
        SealedData::from_batches(schema.clone(), vec![], [batch(0), batch(3)])
    }

    #[test]
    fn a_column_s_segments_are_worked_out_once_and_kept_with_the_data() {
        let data = data();
        for idx in [0, 2] {
            let first = segments_at(&data, idx).expect("a column of numbers");
            let again = segments_at(&data, idx).expect("a column of numbers");
            assert!(Arc::ptr_eq(&first, &again), "column {idx} worked out twice");
            let fresh = work_out_segments(&data, idx).expect("a column of numbers");
            assert_eq!(
                (&first.element, first.width, first.rows, &first.segments),
                (&fresh.element, fresh.width, fresh.rows, &fresh.segments)
            );
        }
        let by_name = column_segments(&data, "features").expect("by its name");
        assert!(Arc::ptr_eq(&by_name, &segments_at(&data, 2).expect("kept")));
        assert_eq!(by_name.width, 2);
        assert_eq!(by_name.rows, 6);
        // A column without segments says why, the same each time.
        let refused = |idx| segments_at(&data, idx).expect_err("strings").to_string();
        assert_eq!(refused(1), refused(1));
        assert_eq!(
            refused(1),
            work_out_segments(&data, 1)
                .expect_err("strings")
                .to_string()
        );
        assert!(refused(1).contains("column 'name'"), "{}", refused(1));
    }
}
