//! GPU checks of the memory tiers: arena slabs are page-locked, and `place`
//! puts exactly the arena's bytes on every listed device (a list column of
//! one length as its values).
//!
//! The checks that need a CUDA driver and a device are ignored by default,
//! so that `ok` always means checked: `scripts/gpu-check.sh run` runs them
//! (`--include-ignored`) on a GPU machine, where a missing GPU fails them.

use std::sync::Arc;

use arrow::array::{
    Array, AsArray, FixedSizeListArray, Float32Array, Int64Array, ListArray, RecordBatch,
};
use arrow::buffer::{Buffer, NullBuffer, OffsetBuffer};
use arrow::datatypes::{DataType, Field, Float32Type, Schema};
use flightdeck_server::catalog::{AttemptKey, SealedData};
use flightdeck_server::memory::Budget;
use flightdeck_server::memory::arena::{Arena, HostMemory};
use flightdeck_server::memory::device::{CudaHost, column_segments};

/// The CUDA driver; a test that needs one fails without it.
fn gpu() -> CudaHost {
    CudaHost::probe().expect("no CUDA driver with a device: run this test on a GPU machine")
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

/// `count` batches of `rows` rows each (see `batch`), copied into `arena`
/// and sealed.
fn sealed_in(arena: &Arena, count: i64, rows: i64) -> SealedData {
    let batches: Vec<RecordBatch> = (0..count)
        .map(|i| {
            arena
                .copy_batch(&batch(i * rows, rows), &|| "gpu test".into())
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

/// `data` with its `fixed_size_list` column `name` as a list column
/// (Spark's `array<float>`): row `r` of stored batch `b` holds the first
/// `lengths(b, r)` of its values (repeated past its width), or is null
/// where that is `None`.
fn as_list(
    data: &SealedData,
    name: &str,
    lengths: impl Fn(usize, usize) -> Option<usize>,
) -> SealedData {
    let idx = data.schema().index_of(name).expect("column");
    let item = Arc::new(Field::new("item", DataType::Float32, true));
    let mut fields: Vec<Field> = data
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields[idx] = Field::new(name, DataType::List(item.clone()), true);
    let schema = Arc::new(Schema::new(fields));
    let batches: Vec<RecordBatch> = data
        .batches()
        .iter()
        .enumerate()
        .map(|(b, batch)| {
            let fixed = batch.column(idx).as_fixed_size_list();
            let width = fixed.value_length() as usize;
            let values = fixed.values().as_primitive::<Float32Type>();
            let (mut offsets, mut kept, mut valid) = (vec![0i32], Vec::new(), Vec::new());
            for r in 0..batch.num_rows() {
                let n = lengths(b, r);
                let own = (r + fixed.offset()) * width;
                kept.extend((0..n.unwrap_or(0)).map(|i| values.value(own + i % width)));
                offsets.push(kept.len() as i32);
                valid.push(n.is_some());
            }
            let list = ListArray::new(
                item.clone(),
                OffsetBuffer::new(offsets.into()),
                Arc::new(Float32Array::from(kept)),
                Some(NullBuffer::from(valid)).filter(|n| n.null_count() > 0),
            );
            let mut columns = batch.columns().to_vec();
            columns[idx] = Arc::new(list);
            RecordBatch::try_new(schema.clone(), columns).expect("batch")
        })
        .collect();
    SealedData::from_batches(schema, data.winners().to_vec(), batches)
}

/// The bytes of all `segments`, in order.
fn joined(segments: &[Buffer]) -> Vec<u8> {
    segments
        .iter()
        .flat_map(|s| s.as_slice().to_vec())
        .collect()
}

#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh run"]
fn arena_slabs_are_page_locked() {
    let host = gpu();
    let arena = Arena::new(
        Budget::new(1 << 30),
        8 << 20,
        HostMemory::Pinned(host.clone()),
    );
    assert!(arena.stats().pinned);
    let data = sealed_in(&arena, 5, 10_000);
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
#[ignore = "needs a GPU: scripts/gpu-check.sh run"]
fn place_round_trips_values_exactly() {
    let host = gpu();
    let arena = Arena::new(
        Budget::new(1 << 30),
        8 << 20,
        HostMemory::Pinned(host.clone()),
    );
    let data = sealed_in(&arena, 5, 10_000);
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

/// Evicting gives a placement's device memory back, also when the last
/// reference goes on a thread where no CUDA context is current (in the
/// server: a tokio worker running `evict`, a replacement or a dropped
/// dataset). Prints `cuMemGetInfo`'s free bytes before placing, while a
/// placement is held, and after five place-and-drop rounds.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh run"]
fn evicted_placements_give_their_device_memory_back() {
    use cudarc::driver::CudaContext;

    let host = gpu();
    let arena = Arena::new(
        Budget::new(2 << 30),
        64 << 20,
        HostMemory::Pinned(host.clone()),
    );
    // 16 batches of 1 M rows × 20 bytes: 320 MB on the device a placement.
    let data = sealed_in(&arena, 16, 1_000_000);
    let columns = vec!["id".to_string(), "vec".to_string()];
    let ctx = CudaContext::new(0).expect("device 0");
    // Frees are stream-ordered: the pool hands memory back at a sync.
    let free = || {
        ctx.synchronize().expect("synchronize");
        ctx.mem_get_info().expect("cuMemGetInfo").0
    };
    let before = free();
    let mut held = 0;
    let rounds = 5;
    for _ in 0..rounds {
        let placed = host.place(&data, &columns, 0).expect("place");
        assert_eq!(placed.bytes, 16_000_000 * 20);
        held = before.saturating_sub(free());
        assert!(
            held as u64 >= placed.bytes,
            "a held placement of {} B shows as {held} B in use",
            placed.bytes
        );
        std::thread::spawn(move || drop(placed))
            .join()
            .expect("drop on a thread of its own");
    }
    let after = free();
    let lost = before.saturating_sub(after);
    println!(
        "cuMemGetInfo free on device 0: {before} B before placing, {held} B fewer while a \
         placement is held, {after} B after {rounds} evictions ({lost} B not given back)"
    );
    assert!(
        lost < 64 << 20,
        "{lost} B of device memory not given back after {rounds} evictions"
    );
}

#[test]
fn column_segments_are_the_column() {
    // Pure: runs everywhere.
    let arena = Arena::new(Budget::new(1 << 30), 8 << 20, HostMemory::Heap);
    let data = sealed_in(&arena, 5, 10_000);
    let ids = column_segments(&data, "id").expect("numeric");
    let expected: Vec<u8> = (0..50_000i64).flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(joined(&ids.segments), expected);
    let vec = column_segments(&data, "vec").expect("fixed-size list");
    assert_eq!(
        (vec.width, vec.rows, vec.element.clone()),
        (3, 50_000, DataType::Float32)
    );
    let expected: Vec<u8> = (0..150_000)
        .flat_map(|v| (v as f32 * 0.5).to_le_bytes())
        .collect();
    assert_eq!(joined(&vec.segments), expected);
    // A sliced batch still gives exactly its rows.
    let sliced = SealedData::from_batches(
        data.schema().clone(),
        vec![],
        vec![data.batches()[1].slice(10, 5)],
    );
    let seg = column_segments(&sliced, "vec").expect("segments");
    let want: Vec<u8> = (30_030..30_045)
        .flat_map(|v| (v as f32 * 0.5).to_le_bytes())
        .collect();
    assert_eq!(joined(&seg.segments), want);
    let err = column_segments(&data, "nope").expect_err("unknown");
    assert!(err.to_string().contains("no column 'nope'"), "{err}");
}

/// A list column whose rows all hold one number of values (Spark's
/// `array<float>`) is placed as the `fixed_size_list` it is: the same
/// values, width and rows, also from a sliced batch. Lists of differing
/// lengths — within a batch or from one batch to the next — null rows and
/// empty lists are refused, naming the rows.
#[test]
fn a_list_column_of_one_length_is_placed_as_its_values() {
    // Pure: runs everywhere.
    let arena = Arena::new(Budget::new(1 << 30), 8 << 20, HostMemory::Heap);
    let data = sealed_in(&arena, 5, 10_000);
    let fixed = column_segments(&data, "vec").expect("fixed-size list");
    let listed = as_list(&data, "vec", |_, _| Some(3));
    let list = column_segments(&listed, "vec").expect("a list of one length");
    assert_eq!(
        (&list.element, list.width, list.rows),
        (&fixed.element, fixed.width, fixed.rows)
    );
    assert_eq!(joined(&list.segments), joined(&fixed.segments));
    let sliced = SealedData::from_batches(
        listed.schema().clone(),
        vec![],
        vec![listed.batches()[1].slice(10, 5)],
    );
    let want: Vec<u8> = (30_030..30_045)
        .flat_map(|v| (v as f32 * 0.5).to_le_bytes())
        .collect();
    let seg = column_segments(&sliced, "vec").expect("segments");
    assert_eq!((seg.width, seg.rows), (3, 5));
    assert_eq!(joined(&seg.segments), want);

    let refused = |lengths: &dyn Fn(usize, usize) -> Option<usize>| {
        column_segments(&as_list(&data, "vec", lengths), "vec")
            .expect_err("refused")
            .to_string()
    };
    let uneven = "column 'vec' is a list whose rows hold different numbers of values";
    let ragged = refused(&|b, r| Some(if b == 2 && r == 7 { 2 } else { 3 }));
    assert!(
        ragged.contains(&format!("{uneven} (row 20000 holds 3, row 20007 holds 2)")),
        "{ragged}"
    );
    let shifting = refused(&|b, _| Some(if b < 3 { 3 } else { 2 }));
    assert!(
        shifting.contains(&format!(
            "{uneven} (rows before row 30000 hold 3, row 30000 holds 2)"
        )),
        "{shifting}"
    );
    let null = refused(&|b, r| ((b, r) != (1, 4)).then_some(3));
    assert!(null.contains("column 'vec' has nulls"), "{null}");
    let all_null = refused(&|b, _| (b != 4).then_some(3));
    assert!(
        all_null.contains("column 'vec' has nulls (rows 40000 to 49999)"),
        "{all_null}"
    );
    let empty = refused(&|_, _| Some(0));
    assert!(
        empty.contains("column 'vec' holds empty lists (row 0)"),
        "{empty}"
    );
}

/// The CUDA backend trains like the CPU backend: after 100 steps of an MLP
/// with AdamW the parameters agree within 1e-3 (relative), with features
/// uploaded from host memory and taken from the device tier (placed from a
/// `fixed_size_list` column and from a list column of one length); prints
/// the throughput and the share of step time spent gathering.
#[test]
#[ignore = "needs a GPU: scripts/gpu-check.sh run"]
fn cuda_training_equals_cpu_training() {
    use flightdeck_server::order::Shuffle;
    use flightdeck_server::train::model::Optimizer;
    use flightdeck_server::train::{Devices, Hooks, Job, JobSpec, Progress, TaskSpec};
    use std::sync::Mutex;
    use std::sync::atomic::AtomicBool;

    let host = gpu();
    let arena = Arena::new(Budget::new(1 << 30), 8 << 20, HostMemory::Heap);
    // 50 000 rows: "vec" (3 floats in [-1, 1]) as features, the id's class
    // mod 4 as label. Features of the size of `batch`'s (up to 75 000) would
    // make f32 GEMMs differ from the CPU backend's f64 sums by rounding
    // alone; normalised ones leave the backends' own difference.
    let batches: Vec<RecordBatch> = (0..5)
        .map(|i| {
            let rows = i * 10_000..(i + 1) * 10_000;
            let values = Float32Array::from_iter_values(
                (rows.start * 3..rows.end * 3).map(|v| (v * 7919 % 2001) as f32 / 1000.0 - 1.0),
            );
            let features = FixedSizeListArray::new(
                Arc::new(Field::new("item", DataType::Float32, false)),
                3,
                Arc::new(values),
                None,
            );
            let label = Int64Array::from_iter_values(rows.map(|v| v * 7 % 4));
            let schema = Schema::new(vec![
                Field::new("vec", features.data_type().clone(), false),
                Field::new("label", DataType::Int64, false),
            ]);
            let b =
                RecordBatch::try_new(Arc::new(schema), vec![Arc::new(features), Arc::new(label)])
                    .expect("batch");
            arena.copy_batch(&b, &|| "gpu test".into()).expect("fits").0
        })
        .collect();
    let data = SealedData::from_batches(
        batches[0].schema(),
        vec![AttemptKey {
            partition: 0,
            attempt: 0,
        }],
        batches,
    );
    let spec = |devices: Devices| JobSpec {
        dataset: "gpu".into(),
        features: vec!["vec".into()],
        label: "label".into(),
        task: TaskSpec::Classification(4),
        hidden: vec![64, 64],
        optimizer: Optimizer::AdamW,
        lr: 1e-3,
        weight_decay: 0.01,
        global_batch: 512,
        epochs: 2,
        seed: 9,
        shuffle: Shuffle::Global,
        devices,
        checkpoint_url: None,
        checkpoint_every: 0,
        resume_from: None,
        max_steps: 100,
        keep_checkpoints: flightdeck_server::train::DEFAULT_KEEP_CHECKPOINTS,
        filter: String::new(),
    };
    // The same features as a list column (Spark's `array<float>`).
    let listed = as_list(&data, "vec", |_, _| Some(3));
    // With `placed`, the feature column comes from the device tier: placed
    // as the job sees it (f32, its width, every row), which is what a GPU
    // rank takes from there instead of host memory.
    let run = |data: &SealedData, devices: Devices, placed: bool| {
        let mut job = Job::prepare(spec(devices.clone()), data, None).expect("valid job");
        if let (true, Devices::Gpu(ordinals)) = (placed, &devices) {
            job.placed = ordinals
                .iter()
                .map(|&d| Arc::new(host.place(data, &["vec".to_string()], d).expect("place")))
                .collect();
            for p in &job.placed {
                let c = &p.columns[0];
                assert_eq!(
                    (c.name.as_str(), &c.element, c.width, c.rows),
                    (
                        "vec",
                        &DataType::Float32,
                        job.data.columns[0].1,
                        job.data.rows()
                    )
                );
            }
        }
        let last = Mutex::new(Vec::<Progress>::new());
        let progress = |p: &Progress| last.lock().expect("lock").push(p.clone());
        let cancel = AtomicBool::new(false);
        let hooks = Hooks {
            progress: &progress,
            cancel: &cancel,
            checkpoint: None,
        };
        let out = job.run(None, &hooks).expect("job runs");
        (out, last.into_inner().expect("lock"))
    };
    let (cpu, _) = run(&data, Devices::Cpu(1), false);
    let mut gpus = vec![vec![0u32]];
    if host.device_count() >= 2 {
        gpus.push(vec![0, 1]);
    }
    let runs = gpus.into_iter().flat_map(|o| {
        [
            (o.clone(), false, &data, "from host"),
            (o.clone(), true, &data, "placed"),
            (o, true, &listed, "placed from a list column"),
        ]
    });
    for (ordinals, placed, data, features) in runs {
        let (gpu_out, reports) = run(data, Devices::Gpu(ordinals.clone()), placed);
        let diff = cpu
            .params
            .iter()
            .flatten()
            .zip(gpu_out.params.iter().flatten())
            .map(|(&a, &b)| {
                (f64::from(a) - f64::from(b)).abs() / f64::from(a.abs().max(b.abs())).max(1e-2)
            })
            .fold(0.0, f64::max);
        let steady: Vec<&Progress> = reports.iter().filter(|p| !p.done).skip(1).collect();
        let sps =
            steady.iter().map(|p| p.samples_per_second).sum::<f64>() / steady.len().max(1) as f64;
        let stall =
            steady.iter().map(|p| p.data_stall_fraction).sum::<f64>() / steady.len().max(1) as f64;
        println!(
            "GPUs {ordinals:?} (features {features}): max relative difference to CPU \
             {diff:.2e}, {sps:.0} samples/s, {:.1}% of step time gathering",
            stall * 100.0
        );
        assert!(
            diff <= 1e-3,
            "CUDA differs from CPU by {diff} on {ordinals:?} (features {features})"
        );
    }
}
