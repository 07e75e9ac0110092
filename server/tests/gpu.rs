//! GPU checks of the memory tiers: arena slabs are page-locked, and `place`
//! puts exactly the arena's bytes on every listed device.
//!
//! They need a CUDA driver and a device. Where there is none they pass
//! without checking anything — unless `FLIGHTDECK_GPU_TESTS` is set (as
//! `scripts/gpu-check.sh` does), in which case a missing GPU fails them.

use std::sync::Arc;

use arrow::array::{Array, FixedSizeListArray, Float32Array, Int64Array, RecordBatch};
use arrow::datatypes::{DataType, Field, Schema};
use flightdeck_server::catalog::{AttemptKey, SealedData};
use flightdeck_server::memory::Budget;
use flightdeck_server::memory::arena::{Arena, HostMemory};
use flightdeck_server::memory::device::{CudaHost, column_segments};

fn gpu() -> Option<CudaHost> {
    let host = CudaHost::probe();
    if host.is_none() {
        assert!(
            std::env::var_os("FLIGHTDECK_GPU_TESTS").is_none(),
            "FLIGHTDECK_GPU_TESTS is set but no CUDA driver with a device was found"
        );
        eprintln!("no CUDA driver: GPU check not run here");
    }
    host
}

fn batch(start: i64, rows: i64) -> RecordBatch {
    let values =
        Float32Array::from_iter_values((start * 3..(start + rows) * 3).map(|v| v as f32 * 0.5));
    let vec = FixedSizeListArray::new(
        Arc::new(Field::new("item", DataType::Float32, false)),
        3,
        Arc::new(values),
        None,
    );
    let schema = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("vec", vec.data_type().clone(), false),
    ]);
    RecordBatch::try_new(
        Arc::new(schema),
        vec![
            Arc::new(Int64Array::from_iter_values(start..start + rows)),
            Arc::new(vec),
        ],
    )
    .expect("batch")
}

fn sealed_in(arena: &Arena) -> SealedData {
    let batches: Vec<RecordBatch> = (0..5)
        .map(|i| {
            arena
                .copy_batch(&batch(i * 10_000, 10_000), &|| "gpu test".into())
                .expect("fits")
                .0
        })
        .collect();
    let schema = batches[0].schema();
    SealedData::from_batches(
        schema,
        vec![AttemptKey {
            partition: 0,
            attempt: 0,
        }],
        batches,
    )
}

#[test]
fn arena_slabs_are_page_locked() {
    let Some(host) = gpu() else { return };
    let arena = Arena::new(
        Budget::new(1 << 30),
        8 << 20,
        HostMemory::Pinned(host.clone()),
    );
    assert!(arena.stats().pinned);
    let data = sealed_in(&arena);
    for b in data.batches() {
        for col in b.columns() {
            let d = col.to_data();
            let bufs = d
                .buffers()
                .iter()
                .chain(d.child_data().iter().flat_map(|c| c.buffers()));
            for buf in bufs {
                assert!(
                    host.is_pinned(buf.as_ptr()),
                    "buffer at {:p} is not page-locked",
                    buf.as_ptr()
                );
            }
        }
    }
    // Heap memory is not.
    let heap = vec![0u8; 1 << 20];
    assert!(!host.is_pinned(heap.as_ptr()));
}

#[test]
fn place_round_trips_values_exactly() {
    let Some(host) = gpu() else { return };
    let arena = Arena::new(
        Budget::new(1 << 30),
        8 << 20,
        HostMemory::Pinned(host.clone()),
    );
    let data = sealed_in(&arena);
    let columns = vec!["id".to_string(), "vec".to_string()];
    let devices: Vec<u32> = (0..host.device_count().min(2)).collect();
    for &device in &devices {
        let placed = host.place(&data, &columns, device).expect("place");
        assert_eq!(placed.device, device);
        for col in &placed.columns {
            let expected: Vec<u8> = column_segments(&data, &col.name)
                .expect("segments")
                .segments
                .iter()
                .flat_map(|s| s.as_slice().to_vec())
                .collect();
            let stream = col.buffer.stream().clone();
            let back = stream.clone_dtoh(&col.buffer).expect("copy back");
            assert_eq!(back.len(), expected.len(), "{}", col.name);
            assert!(
                back == expected,
                "column {} differs on device {device}",
                col.name
            );
            assert_eq!(col.rows, 50_000);
        }
        assert_eq!(placed.bytes, 50_000 * (8 + 12));
    }
    let count = host.device_count();
    assert!(
        host.place(&data, &columns, count).is_err(),
        "a device that does not exist"
    );
}

#[test]
fn column_segments_are_the_column() {
    // Pure: runs everywhere.
    let arena = Arena::new(Budget::new(1 << 30), 8 << 20, HostMemory::Heap);
    let data = sealed_in(&arena);
    let ids = column_segments(&data, "id").expect("numeric");
    let bytes: Vec<u8> = ids
        .segments
        .iter()
        .flat_map(|s| s.as_slice().to_vec())
        .collect();
    let expected: Vec<u8> = (0..50_000i64).flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(bytes, expected);
    let vec = column_segments(&data, "vec").expect("fixed-size list");
    assert_eq!(
        (vec.width, vec.rows, vec.element.clone()),
        (3, 50_000, DataType::Float32)
    );
    let floats: Vec<u8> = vec
        .segments
        .iter()
        .flat_map(|s| s.as_slice().to_vec())
        .collect();
    let expected: Vec<u8> = (0..150_000)
        .flat_map(|v| (v as f32 * 0.5).to_le_bytes())
        .collect();
    assert_eq!(floats, expected);
    // A sliced batch still gives exactly its rows.
    let sliced = SealedData::from_batches(
        data.schema().clone(),
        vec![],
        vec![data.batches()[1].slice(10, 5)],
    );
    let seg = column_segments(&sliced, "vec").expect("segments");
    let got: Vec<u8> = seg
        .segments
        .iter()
        .flat_map(|s| s.as_slice().to_vec())
        .collect();
    let want: Vec<u8> = (30_030..30_045)
        .flat_map(|v| (v as f32 * 0.5).to_le_bytes())
        .collect();
    assert_eq!(got, want);
    let err = column_segments(&data, "nope").expect_err("unknown");
    assert!(err.to_string().contains("no column 'nope'"), "{err}");
}
