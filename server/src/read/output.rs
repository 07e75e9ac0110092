//! Where a gather writes a column's values: a buffer of its own
//! (`MutableBuffer`), or a [`Region`] of one buffer that holds all the
//! fixed-width columns of a batch (packed or gathered column by column)
//! back to back, laid out as the batch's Arrow IPC body lays them out
//! ([`Columns`]).
//!
//! One buffer for the batch's columns is what lets the `DoGet` edge send
//! them as one piece (`service::ipc`): a 65-column batch of separate
//! buffers leaves as 65 HTTP/2 DATA frames, each a write of its own.

#![allow(unsafe_code)]

use std::marker::PhantomData;

use arrow::buffer::{Buffer, MutableBuffer};
use arrow::datatypes::ArrowNativeType;

use crate::error::{Error, Result};

/// Where the IPC body starts each buffer (Arrow's default alignment).
pub const ALIGNMENT: usize = 64;

/// A column's values being appended, by the untile kernels and the
/// gathers around them.
pub trait Output: Send + Sized {
    /// Bytes written so far.
    fn len(&self) -> usize;
    /// Makes room for `additional` bytes after the end.
    fn reserve(&mut self, additional: usize);
    /// The start of the output (bytes written so far, then the room).
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Counts the first `len` bytes as written.
    ///
    /// # Safety
    ///
    /// The first `len` bytes were written, and are within the room made.
    unsafe fn set_len(&mut self, len: usize);
    /// The bytes written so far.
    fn as_slice_mut(&mut self) -> &mut [u8];
    /// Appends `additional` zero bytes.
    fn extend_zeros(&mut self, additional: usize);
    /// Appends `bytes`.
    fn extend_from_slice(&mut self, bytes: &[u8]);
    /// Appends `values`, each as its native bytes.
    fn extend_values<T: ArrowNativeType>(&mut self, values: impl Iterator<Item = T>);
    /// An output for what follows the next `keep` bytes, which this one
    /// keeps, the first `next` of them for the new output itself (a part
    /// of a gather split over threads, `read::in_parts`; split again for
    /// the part after it), appended back with [`Output::join`].
    fn split_rest(&mut self, keep: usize, next: usize) -> Self;
    /// Appends a part [`Output::split_rest`] gave.
    fn join(&mut self, part: Self);
}

impl Output for MutableBuffer {
    fn len(&self) -> usize {
        MutableBuffer::len(self)
    }
    fn reserve(&mut self, additional: usize) {
        MutableBuffer::reserve(self, additional);
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        MutableBuffer::as_mut_ptr(self)
    }
    unsafe fn set_len(&mut self, len: usize) {
        // SAFETY: as the caller promises.
        unsafe { MutableBuffer::set_len(self, len) }
    }
    fn as_slice_mut(&mut self) -> &mut [u8] {
        MutableBuffer::as_slice_mut(self)
    }
    fn extend_zeros(&mut self, additional: usize) {
        MutableBuffer::extend_zeros(self, additional);
    }
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        MutableBuffer::extend_from_slice(self, bytes);
    }
    fn extend_values<T: ArrowNativeType>(&mut self, values: impl Iterator<Item = T>) {
        self.extend(values);
    }
    fn split_rest(&mut self, keep: usize, next: usize) -> Self {
        MutableBuffer::reserve(self, keep);
        MutableBuffer::with_capacity(next)
    }
    fn join(&mut self, part: Self) {
        MutableBuffer::extend_from_slice(self, part.as_slice());
    }
}

/// One column's bytes in a batch's [`Columns`]: `cap` bytes at `ptr`,
/// the first `len` written.
#[derive(Debug)]
pub struct Region<'a> {
    ptr: *mut u8,
    len: usize,
    cap: usize,
    _columns: PhantomData<&'a mut [u8]>,
}

// SAFETY: a region is the only way to its bytes (regions never overlap),
// and the buffer it lies in stays borrowed while it lives.
unsafe impl Send for Region<'_> {}

impl Region<'_> {
    /// Whether every byte of the region was written.
    pub fn is_full(&self) -> bool {
        self.len == self.cap
    }

    fn room(&self, additional: usize) {
        assert!(
            additional <= self.cap - self.len,
            "a column region of {} bytes overflowed ({} written, {additional} more)",
            self.cap,
            self.len
        );
    }
}

impl Output for Region<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn reserve(&mut self, additional: usize) {
        self.room(additional);
    }
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    unsafe fn set_len(&mut self, len: usize) {
        debug_assert!(len <= self.cap);
        self.len = len;
    }
    fn as_slice_mut(&mut self) -> &mut [u8] {
        // SAFETY: the first `len` bytes are in the region and written.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn extend_zeros(&mut self, additional: usize) {
        self.room(additional);
        // SAFETY: within the region's room (checked above).
        unsafe { self.ptr.add(self.len).write_bytes(0, additional) };
        self.len += additional;
    }
    fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.room(bytes.len());
        // SAFETY: within the region's room (checked above); `bytes` cannot
        // overlap it (the region is borrowed mutably).
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(self.len), bytes.len())
        };
        self.len += bytes.len();
    }
    fn extend_values<T: ArrowNativeType>(&mut self, values: impl Iterator<Item = T>) {
        for value in values {
            self.room(size_of::<T>());
            // SAFETY: within the region's room (checked above).
            unsafe { self.ptr.add(self.len).cast::<T>().write_unaligned(value) };
            self.len += size_of::<T>();
        }
    }
    fn split_rest(&mut self, keep: usize, next: usize) -> Self {
        let at = self.len + keep;
        assert!(
            at + next <= self.cap,
            "a column region of {} bytes split past its end",
            self.cap
        );
        let part = Self {
            // SAFETY: `at <= cap`: inside the region or one past its end.
            ptr: unsafe { self.ptr.add(at) },
            len: 0,
            cap: self.cap - at,
            _columns: PhantomData,
        };
        self.cap = at;
        part
    }
    fn join(&mut self, part: Self) {
        assert!(
            self.is_full() && std::ptr::eq(self.ptr.wrapping_add(self.cap), part.ptr),
            "a part of a column region joined out of order"
        );
        self.cap += part.cap;
        self.len += part.len;
    }
}

/// One buffer for `widths.len()` columns of `rows` rows each, column `k`
/// of `rows * widths[k]` bytes starting at an [`ALIGNMENT`] multiple after
/// the one before — the layout of those columns' data in an Arrow IPC body
/// when no other buffers come between them.
#[derive(Debug)]
pub struct Columns {
    buffer: MutableBuffer,
    /// `(start, bytes)` of each column.
    spans: Vec<(usize, usize)>,
}

impl Columns {
    /// Room for columns of `widths` bytes a row, `rows` rows each, the
    /// padding between them zeroed.
    pub fn new(rows: usize, widths: &[usize]) -> Self {
        let mut spans = Vec::with_capacity(widths.len());
        let mut end = 0;
        for &width in widths {
            let bytes = rows * width;
            spans.push((end, bytes));
            end = (end + bytes).next_multiple_of(ALIGNMENT);
        }
        let total = spans.last().map_or(0, |&(start, bytes)| start + bytes);
        let mut buffer = MutableBuffer::with_capacity(total);
        let base = buffer.as_mut_ptr();
        for pair in spans.windows(2) {
            let ((start, bytes), (next, _)) = (pair[0], pair[1]);
            // SAFETY: the padding between two columns, inside the capacity.
            unsafe { base.add(start + bytes).write_bytes(0, next - start - bytes) };
        }
        Self { buffer, spans }
    }

    /// Each column's values, written by `write` into the columns' regions
    /// (one each, in order, to be filled from their starts), sharing the
    /// one buffer; an internal error where a region is left short.
    pub fn fill(
        mut self,
        write: impl FnOnce(&mut [Region<'_>]) -> Result<()>,
    ) -> Result<Vec<Buffer>> {
        let base = self.buffer.as_mut_ptr();
        let mut regions: Vec<Region<'_>> = self
            .spans
            .iter()
            .map(|&(start, bytes)| Region {
                // SAFETY: every span lies inside the capacity.
                ptr: unsafe { base.add(start) },
                len: 0,
                cap: bytes,
                _columns: PhantomData,
            })
            .collect();
        write(&mut regions)?;
        if !regions.iter().all(Region::is_full) {
            return Err(Error::Internal(
                "a gather left a column short of its rows".into(),
            ));
        }
        drop(regions);
        let total = self.spans.last().map_or(0, |&(start, bytes)| start + bytes);
        // SAFETY: every column was written whole (checked above) and the
        // padding between them zeroed (`new`).
        unsafe { self.buffer.set_len(total) };
        let buffer: Buffer = self.buffer.into();
        Ok(self
            .spans
            .iter()
            .map(|&(start, bytes)| buffer.slice_with_length(start, bytes))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_lie_back_to_back_at_aligned_starts_and_parts_join_in_place() {
        let widths = [8, 4, 3, 4];
        let rows = 37;
        let buffers = Columns::new(rows, &widths)
            .fill(|regions| {
                for (k, (region, &width)) in regions.iter_mut().zip(&widths).enumerate() {
                    // The first ten rows here, the rest as a part of their own.
                    let mut rest = region.split_rest(10 * width, (rows - 10) * width);
                    region.extend_values((0..10 * width).map(|i| (k * 1000 + i) as u8));
                    rest.extend_values((10 * width..rows * width).map(|i| (k * 1000 + i) as u8));
                    region.join(rest);
                    assert!(region.is_full());
                }
                Ok(())
            })
            .expect("filled");
        let base = buffers[0].as_ptr() as usize;
        assert_eq!(base % ALIGNMENT, 0);
        for (k, (buffer, &width)) in buffers.iter().zip(&widths).enumerate() {
            assert_eq!(buffer.len(), rows * width);
            assert_eq!((buffer.as_ptr() as usize - base) % ALIGNMENT, 0);
            assert_eq!(buffer.data_ptr(), buffers[0].data_ptr(), "one allocation");
            let expected: Vec<u8> = (0..rows * width).map(|i| (k * 1000 + i) as u8).collect();
            assert_eq!(buffer.as_slice(), expected);
        }
    }

    #[test]
    #[should_panic(expected = "overflowed")]
    fn a_region_refuses_bytes_past_its_end() {
        let _ = Columns::new(4, &[4]).fill(|regions| {
            regions[0].extend_from_slice(&[0; 17]);
            Ok(())
        });
    }

    #[test]
    fn a_column_left_short_is_an_error() {
        let err = Columns::new(4, &[4, 8])
            .fill(|regions| {
                regions[0].extend_from_slice(&[0; 16]);
                regions[1].extend_from_slice(&[0; 8]);
                Ok(())
            })
            .expect_err("short");
        assert!(err.to_string().contains("short of its rows"), "{err}");
    }
}
