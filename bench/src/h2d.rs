//! The `h2d` phase (GPU only): host-to-device bandwidth of the same bytes
//! from the server's arena (page-locked slabs), from a plain pinned buffer
//! (`cuMemHostAlloc`, the figure `cudaMemcpy` reaches) and from pageable
//! heap memory.

use std::sync::Arc;
use std::time::Instant;

use arrow::array::{Float32Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use cudarc::driver::{CudaSlice, CudaStream, HostSlice, sys};
use flightdeck_server::memory::Budget;
use flightdeck_server::memory::arena::{Arena, HostMemory};
use flightdeck_server::memory::device::CudaHost;

use crate::phases::BoxError;
use crate::report::Sample;

/// One repetition's three figures.
pub struct H2d {
    /// From an arena slab.
    pub arena: Sample,
    /// From a `cuMemHostAlloc` buffer.
    pub pinned: Sample,
    /// From heap memory.
    pub pageable: Sample,
}

fn err(e: impl std::fmt::Display) -> BoxError {
    format!("CUDA: {e}").into()
}

/// Copies `bytes` to device 0 from each source `reps` times.
pub fn run(bytes: usize, reps: usize) -> Result<Vec<H2d>, BoxError> {
    let host = CudaHost::probe().ok_or(
        "h2d needs a CUDA driver and a device; none was found on this machine \
         (the other phases run without one)",
    )?;
    let ctx = cudarc::driver::CudaContext::new(0).map_err(err)?;
    let stream = ctx.default_stream();
    let floats = bytes / 4;
    let bytes = floats * 4;

    // The arena's copy of one float column, as ingest would make it.
    let arena = Arena::new(
        Budget::new((2 * bytes) as u64 + (64 << 20)),
        64 << 20,
        HostMemory::Pinned(host.clone()),
    );
    let schema = Arc::new(Schema::new(vec![Field::new("x", DataType::Float32, false)]));
    let column = Float32Array::from_iter_values((0..floats).map(|i| i as f32));
    let batch = RecordBatch::try_new(schema, vec![Arc::new(column)])?;
    let (in_arena, _) = arena.copy_batch(&batch, &|| "h2d".to_string())?;
    drop(batch);
    let arena_bytes = in_arena.column(0).to_data().buffers()[0].clone();
    if !host.is_pinned(arena_bytes.as_ptr()) {
        return Err("the arena's slab is not page-locked".into());
    }
    let mut pinned = pinned_buffer(&ctx, bytes)?;
    pinned
        .as_mut_slice()
        .map_err(err)?
        .copy_from_slice(arena_bytes.as_slice());
    let pageable = arena_bytes.as_slice().to_vec();
    let mut dst = stream.alloc_zeros::<u8>(bytes).map_err(err)?;

    // Warm up the path once.
    timed(&stream, arena_bytes.as_slice(), &mut dst)?;
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        out.push(H2d {
            arena: timed(&stream, arena_bytes.as_slice(), &mut dst)?,
            pinned: timed(&stream, &pinned, &mut dst)?,
            pageable: timed(&stream, &pageable, &mut dst)?,
        });
    }
    // The device copy is the arena's bytes.
    let back = stream.clone_dtoh(&dst).map_err(err)?;
    if back != pageable {
        return Err("the device copy differs from the host bytes".into());
    }
    Ok(out)
}

/// One synchronous copy of `src` into `dst`.
fn timed<S: HostSlice<u8> + ?Sized>(
    stream: &Arc<CudaStream>,
    src: &S,
    dst: &mut CudaSlice<u8>,
) -> Result<Sample, BoxError> {
    let start = Instant::now();
    stream.memcpy_htod(src, dst).map_err(err)?;
    stream.synchronize().map_err(err)?;
    Ok(Sample {
        elapsed: start.elapsed(),
        latencies: vec![],
    })
}

/// A page-locked, portable buffer straight from the driver, as
/// `cudaMallocHost` gives.
#[allow(unsafe_code)]
fn pinned_buffer(
    ctx: &Arc<cudarc::driver::CudaContext>,
    bytes: usize,
) -> Result<cudarc::driver::PinnedHostSlice<u8>, BoxError> {
    // SAFETY: the caller fills every byte before the buffer is read.
    unsafe { ctx.alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(err)
}
