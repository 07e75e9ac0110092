//! Unit and property tests of the commit protocol.

use super::*;
use arrow::array::{Array, Int64Array};
use arrow::datatypes::{DataType, Field};
use proptest::prelude::*;
use std::collections::BTreeMap;

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![Field::new("v", DataType::Int64, false)]))
}

/// An attempt whose values say where they came from: p * 1e6 + a * 1e3 + row.
fn attempt(key: AttemptKey, rows: u64) -> AttemptData {
    let base = i64::from(key.partition) * 1_000_000 + i64::from(key.attempt) * 1_000;
    let values = Int64Array::from_iter_values((0..rows as i64).map(|r| base + r));
    let batch = RecordBatch::try_new(schema(), vec![Arc::new(values)]).expect("valid batch");
    AttemptData {
        batches: vec![batch],
        rows,
        bytes: rows * 8,
    }
}

fn key(partition: u32, attempt: u32) -> AttemptKey {
    AttemptKey { partition, attempt }
}

fn all_values(data: &SealedData) -> Vec<i64> {
    (0..data.rows())
        .map(|row| {
            let (b, r) = data.locate(row);
            let col = data.batches()[b].column(0);
            col.as_any()
                .downcast_ref::<Int64Array>()
                .expect("int64")
                .value(r)
        })
        .collect()
}

#[test]
fn duplicate_attempt_is_refused() {
    let mut c = Catalog::new();
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("first");
    let err = c
        .commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect_err("duplicate");
    assert!(matches!(err, Error::AttemptExists { .. }), "{err}");
}

#[test]
fn schema_mismatch_is_refused_and_names_both() {
    let mut c = Catalog::new();
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("first");
    let other = Arc::new(Schema::new(vec![Field::new("v", DataType::Float32, false)]));
    let err = c.check_put("d", key(1, 0), &other).expect_err("mismatch");
    let msg = err.to_string();
    assert!(
        msg.contains("v: Int64") && msg.contains("v: Float32"),
        "{msg}"
    );
}

#[test]
fn sealed_dataset_refuses_puts_and_second_seal() {
    let mut c = Catalog::new();
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("commit");
    let req = SealRequest {
        dataset: "d".into(),
        ..Default::default()
    };
    c.seal(&req).expect("seal");
    assert!(matches!(
        c.commit("d", key(1, 0), schema(), attempt(key(1, 0), 1)),
        Err(Error::DatasetSealed { .. })
    ));
    assert!(matches!(c.seal(&req), Err(Error::FailedPrecondition(_))));
}

#[test]
fn missing_partitions_are_listed_and_nothing_changes() {
    let mut c = Catalog::new();
    for p in [0, 2, 5] {
        c.commit("d", key(p, 0), schema(), attempt(key(p, 0), 2))
            .expect("commit");
    }
    let err = c
        .seal(&SealRequest {
            dataset: "d".into(),
            partitions: 6,
            winners: vec![],
            members: vec![],
            replace_write: String::new(),
        })
        .expect_err("missing");
    match err {
        Error::MissingPartitions { missing, .. } => assert_eq!(missing, vec![1, 3, 4]),
        other => panic!("unexpected {other}"),
    }
    // A count the client made up is counted, not listed.
    let err = c
        .seal(&SealRequest {
            dataset: "d".into(),
            partitions: u32::MAX,
            winners: vec![],
            members: vec![],
            replace_write: String::new(),
        })
        .expect_err("missing");
    match err {
        Error::MissingPartitions { missing, count, .. } => {
            assert_eq!(count, u64::from(u32::MAX) - 3);
            assert_eq!(missing.len(), crate::error::MISSING_SHOWN);
            assert_eq!(&missing[..4], &[1, 3, 4, 6]);
        }
        other => panic!("unexpected {other}"),
    }
    assert_eq!(
        c.describe("d").expect("still there").state,
        DatasetState::Open
    );
    c.commit("d", key(1, 0), schema(), attempt(key(1, 0), 2))
        .expect("commit");
    let err = c
        .seal(&SealRequest {
            dataset: "d".into(),
            partitions: 3,
            winners: vec![],
            members: vec![],
            replace_write: String::new(),
        })
        .expect_err("extra partition 5");
    assert!(err.to_string().contains("[5]"), "{err}");
}

#[test]
fn unknown_dataset_is_not_found() {
    let mut c = Catalog::new();
    assert!(matches!(
        c.describe("x"),
        Err(Error::DatasetNotFound { .. })
    ));
    assert!(matches!(
        c.drop_dataset("x"),
        Err(Error::DatasetNotFound { .. })
    ));
    assert!(matches!(c.sealed("x"), Err(Error::DatasetNotFound { .. })));
}

#[test]
fn drop_then_write_gets_a_new_generation() {
    let mut c = Catalog::new();
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("commit");
    let g0 = c.describe("d").expect("exists").generation;
    assert_ne!(g0, 0, "0 is no generation: a plan's sealed_as 0 means any");
    let (_, freed) = c.drop_dataset("d").expect("drop");
    assert_eq!(freed, 24);
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("commit again");
    assert_ne!(c.describe("d").expect("exists").generation, g0);
}

/// One step of a random ingest history.
#[derive(Debug, Clone)]
enum Op {
    Commit {
        partition: u32,
        attempt: u32,
        rows: u64,
    },
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        (0u32..6, 0u32..3, 0u64..20).prop_map(|(partition, attempt, rows)| Op::Commit {
            partition,
            attempt,
            rows,
        }),
        0..40,
    )
}

proptest! {
    /// Whatever the history of commits and whatever winners are named, a
    /// successful seal keeps exactly one attempt per partition — the named
    /// one, else the first committed — in partition order, and frees every
    /// other byte.
    #[test]
    fn seal_keeps_exactly_the_winners(
        history in ops(),
        named in prop::collection::vec((0u32..6, 0u32..3), 0..4),
        expected in 0u32..7,
    ) {
        let mut c = Catalog::new();
        let mut committed: BTreeMap<AttemptKey, u64> = BTreeMap::new();
        let mut first: BTreeMap<u32, AttemptKey> = BTreeMap::new();
        for Op::Commit { partition, attempt: a, rows } in history {
            let k = key(partition, a);
            let res = c.commit("d", k, schema(), attempt(k, rows));
            match committed.entry(k) {
                std::collections::btree_map::Entry::Occupied(_) => {
                    prop_assert!(matches!(res, Err(Error::AttemptExists { .. })), "duplicate accepted");
                }
                std::collections::btree_map::Entry::Vacant(slot) => {
                    prop_assert!(res.is_ok());
                    slot.insert(rows);
                    first.entry(partition).or_insert(k);
                }
            }
        }
        let winners: Vec<AttemptKey> = named.iter().map(|&(p, a)| key(p, a)).collect();
        let req = SealRequest {
            dataset: "d".into(),
            partitions: expected,
            winners: winners.clone(),
            members: vec![],
            replace_write: String::new(),
        };
        let total_bytes: u64 = committed.values().map(|r| r * 8).sum();

        let mut chosen = first.clone();
        let mut dup = false;
        let mut seen = std::collections::HashSet::new();
        for w in &winners {
            dup |= !seen.insert(w.partition);
            chosen.insert(w.partition, *w);
        }
        let named_ok = winners.iter().all(|w| committed.contains_key(w));
        let complete = expected == 0
            || ((0..expected).all(|p| chosen.contains_key(&p)) && chosen.keys().all(|&p| p < expected));

        match c.seal(&req) {
            Ok((summary, freed)) => {
                prop_assert!(!dup && named_ok && complete && !committed.is_empty());
                let kept: u64 = chosen.values().map(|k| committed[k] * 8).sum();
                prop_assert_eq!(freed + kept, total_bytes);
                prop_assert_eq!(summary.bytes, kept);
                let (_, data) = c.sealed("d").expect("sealed");
                let got_winners: Vec<AttemptKey> = chosen.values().copied().collect();
                prop_assert_eq!(data.winners(), &got_winners[..]);
                let expected_values: Vec<i64> = chosen
                    .values()
                    .flat_map(|k| {
                        let base = i64::from(k.partition) * 1_000_000 + i64::from(k.attempt) * 1_000;
                        (0..committed[k] as i64).map(move |r| base + r)
                    })
                    .collect();
                prop_assert_eq!(all_values(&data), expected_values);
            }
            Err(e) => {
                prop_assert!(committed.is_empty() || dup || !named_ok || !complete, "{}", e);
                if !committed.is_empty() {
                    let d = c.describe("d").expect("still there");
                    prop_assert_eq!(d.state, DatasetState::Open);
                    prop_assert_eq!(d.bytes, total_bytes);
                }
            }
        }
    }
}

fn sealed_with(c: &mut Catalog, name: &str, rows: u64) {
    c.commit(name, key(0, 0), schema(), attempt(key(0, 0), rows))
        .expect("commit");
    c.seal(&SealRequest {
        dataset: name.into(),
        ..Default::default()
    })
    .expect("seal");
}

fn stored(name: &str) -> Stored {
    Stored {
        dir: object_store::path::Path::from(name),
        persisted: false,
    }
}

#[test]
fn least_recently_read_spills_first_and_comes_back() {
    let mut c = Catalog::new();
    sealed_with(&mut c, "a", 3);
    sealed_with(&mut c, "b", 4);
    // Open datasets are never candidates.
    c.commit("open", key(0, 0), schema(), attempt(key(0, 0), 1))
        .expect("commit");
    let first = c.spill_candidate(None, &[]).expect("candidate");
    assert_eq!(first.name, "a", "sealed first, read never");
    c.touch("a");
    assert_eq!(c.spill_candidate(None, &[]).expect("candidate").name, "b");
    assert_eq!(
        c.spill_candidate(Some("b"), &[]).expect("candidate").name,
        "a"
    );

    // Without a store copy the host copy cannot go.
    let gen_b = c.describe("b").expect("b").generation;
    assert!(c.release_host("b", gen_b).is_none());
    assert!(c.set_stored("b", gen_b, stored("b")));
    let data = c.release_host("b", gen_b).expect("released");
    let s = c.describe("b").expect("b");
    assert!(!s.resident && s.bytes == 0 && s.rows == 4 && s.stored.is_some());
    assert_eq!(c.totals().spilled, 1);
    assert!(matches!(c.lookup("b"), Ok(SealedView::Stored { .. })));
    assert!(c.sealed("b").is_err());
    // Only "a" is left to spill.
    assert_eq!(c.spill_candidate(None, &[]).expect("candidate").name, "a");

    // A stale generation changes nothing.
    assert!(!c.set_stored("b", gen_b + 100, stored("x")));
    assert!(
        c.restore(
            "b",
            gen_b + 100,
            SealedData::from_batches(schema(), vec![], vec![])
        )
        .is_none()
    );
    let back = c
        .restore(
            "b",
            gen_b,
            SealedData::from_batches(schema(), vec![key(0, 0)], data.batches().to_vec()),
        )
        .expect("restored");
    assert_eq!(all_values(&back), all_values(&data));
    assert!(c.describe("b").expect("b").resident);
    assert!(matches!(c.lookup("b"), Ok(SealedView::Resident { .. })));
}

#[test]
fn persisted_datasets_come_back_sealed_with_newer_generations_after_them() {
    let mut c = Catalog::new();
    let parts = vec![PartitionSummary {
        key: key(0, 1),
        rows: 5,
        bytes: 40,
        committed_attempts: 2,
    }];
    c.insert_persisted(PersistedDataset {
        name: "p".into(),
        generation: 41,
        schema: schema(),
        partitions: parts.clone(),
        stored: Stored {
            dir: object_store::path::Path::from("p"),
            persisted: true,
        },
        cluster: None,
    })
    .expect("insert");
    let s = c.describe("p").expect("p");
    assert_eq!(
        (s.state, s.rows, s.generation, s.resident),
        (DatasetState::Sealed, 5, 41, false)
    );
    assert_eq!(s.partitions, parts);
    assert!(c.check_put("p", key(1, 0), &schema()).is_err(), "sealed");
    c.commit("q", key(0, 0), schema(), attempt(key(0, 0), 1))
        .expect("commit");
    assert!(c.describe("q").expect("q").generation > 41);
}

#[test]
fn a_member_seals_exactly_its_winners_and_adopts_only_its_layout() {
    use crate::cluster::{Layout, Member};
    let mut c = Catalog::new();
    for (p, a) in [(0, 0), (0, 1), (1, 0), (2, 0)] {
        c.commit("d", key(p, a), schema(), attempt(key(p, a), 4))
            .expect("commit");
    }
    let winners = [key(0, 1), key(1, 0)];
    let err = c
        .prepare_member("d", &[key(0, 1), key(7, 0)])
        .expect_err("partition 7 is elsewhere");
    assert!(err.to_string().contains("7 (attempt 0)"), "{err}");
    let (s, freed) = c.prepare_member("d", &winners).expect("prepare");
    assert!(
        freed > 0,
        "attempt 0 of partition 0 and partition 2 are losers here"
    );
    assert_eq!(
        s.partitions.iter().map(|p| p.key).collect::<Vec<_>>(),
        winners.to_vec()
    );
    assert!(matches!(s.cluster, Some(ClusterState::Pending)));
    let (_, again) = c.prepare_member("d", &winners).expect("idempotent");
    assert_eq!(again, 0);
    assert!(
        c.prepare_member("d", &[key(0, 0)]).is_err(),
        "other winners"
    );

    let member = |generation| Member {
        location: "grpc://a:1".into(),
        generation,
        partitions: s.partitions.clone(),
    };
    let stale = Layout::new(vec![member(s.generation + 1)], vec![]).expect("layout");
    assert!(
        c.commit_layout("d", Arc::new(stale), 0).is_err(),
        "another generation"
    );
    let layout = Arc::new(Layout::new(vec![member(s.generation)], vec![]).expect("layout"));
    let s = c.commit_layout("d", layout.clone(), 0).expect("commit");
    assert!(matches!(
        s.cluster,
        Some(ClusterState::Member { index: 0, .. })
    ));
    c.commit_layout("d", layout, 0).expect("idempotent");
    let other = Member {
        location: "grpc://b:1".into(),
        generation: 99,
        partitions: vec![PartitionSummary {
            key: key(5, 0),
            rows: 1,
            bytes: 1,
            committed_attempts: 1,
        }],
    };
    let bigger = Layout::new(vec![member(s.generation), other], vec![]).expect("layout");
    assert!(
        c.commit_layout("d", Arc::new(bigger), 0).is_err(),
        "another layout"
    );
}

#[test]
fn attempts_of_an_aborted_write_are_refused_and_bring_nothing_back() {
    let mut c = Catalog::new();
    c.commit_write("d", key(0, 0), "job-1", schema(), attempt(key(0, 0), 3))
        .expect("before the abort");
    // The job fails: its driver drops what it wrote and names the write.
    c.abort_write("job-1");
    c.drop_dataset("d").expect("drop");
    // A task still running commits afterwards: refused, nothing recreated.
    let err = c
        .commit_write("d", key(1, 0), "job-1", schema(), attempt(key(1, 0), 3))
        .expect_err("aborted");
    assert!(matches!(err, Error::Aborted(_)), "{err}");
    assert!(err.to_string().contains("write 'job-1'"), "{err}");
    assert!(c.check_write("d", "job-1").is_err());
    assert!(c.describe("d").is_err(), "the dataset stays dropped");
    // Other writes, and writes without an id, are not affected.
    c.commit_write("d", key(0, 0), "job-2", schema(), attempt(key(0, 0), 3))
        .expect("another job");
    c.commit("d", key(1, 0), schema(), attempt(key(1, 0), 3))
        .expect("no id");
    c.abort_write("");
    c.commit_write("d", key(2, 0), "", schema(), attempt(key(2, 0), 3))
        .expect("an empty id is never aborted");
}

#[test]
fn an_open_dataset_takes_the_attempts_of_one_write_only() {
    let mut c = Catalog::new();
    c.commit_write("d", key(0, 0), "job-1", schema(), attempt(key(0, 0), 3))
        .expect("the first write creates it");
    // A second job writing the same dataset meanwhile is refused before it
    // stores anything, so no seal can take partitions of both.
    let err = c
        .commit_write("d", key(1, 0), "job-2", schema(), attempt(key(1, 0), 3))
        .expect_err("another write");
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("being written by another write ('job-1'"),
        "{text}"
    );
    assert!(text.contains("flightdeck drop d"), "{text}");
    assert!(c.check_writer("d", "job-2").is_err());
    // Also for an attempt the first job committed already: the other write
    // is what the second job needs to hear of, not the attempt number.
    let same = c
        .commit_write("d", key(0, 0), "job-2", schema(), attempt(key(0, 0), 3))
        .expect_err("another write");
    assert!(matches!(same, Error::FailedPrecondition(_)), "{same}");
    // The first job goes on; attempts without a write id are not checked.
    c.commit_write("d", key(1, 0), "job-1", schema(), attempt(key(1, 0), 3))
        .expect("the same write");
    c.commit("d", key(2, 0), schema(), attempt(key(2, 0), 3))
        .expect("no id");
    // The refused job fails and drops "what it wrote": the other job's
    // dataset is left, and is not the refused job's to drop.
    assert!(c.held_by_others("d", "job-2"));
    assert!(!c.held_by_others("d", "job-1"));
    assert!(!c.held_by_others("d", ""));
    assert!(!c.held_by_others("missing", "job-2"));
    c.seal(&SealRequest {
        dataset: "d".into(),
        partitions: 3,
        ..Default::default()
    })
    .expect("seal");
    assert_eq!(c.describe("d").expect("sealed").rows, 9);
    // Once the dataset is dropped, another job may write it.
    c.drop_dataset("d").expect("drop");
    c.commit_write("d", key(0, 0), "job-2", schema(), attempt(key(0, 0), 3))
        .expect("a new dataset");
}

#[test]
fn aborted_writes_are_remembered_up_to_a_bound() {
    let mut c = Catalog::new();
    for i in 0..=AbortedWrites::LIMIT {
        c.abort_write(&format!("job-{i}"));
    }
    // The oldest is forgotten, the newest kept.
    assert!(c.check_write("d", "job-0").is_ok());
    assert!(c.check_write("d", "job-1").is_err());
    assert!(
        c.check_write("d", &format!("job-{}", AbortedWrites::LIMIT))
            .is_err()
    );
    c.abort_write("job-5");
    assert_eq!(c.aborted.order.len(), AbortedWrites::LIMIT);
}

#[test]
fn unsealed_holders_are_the_open_datasets_largest_first() {
    let mut c = Catalog::new();
    c.commit("small", key(0, 0), schema(), attempt(key(0, 0), 2))
        .expect("commit");
    for (p, a) in [(0, 0), (0, 1), (1, 0)] {
        c.commit("big", key(p, a), schema(), attempt(key(p, a), 10))
            .expect("commit");
    }
    c.commit("sealed", key(0, 0), schema(), attempt(key(0, 0), 100))
        .expect("commit");
    c.seal(&SealRequest {
        dataset: "sealed".into(),
        ..Default::default()
    })
    .expect("seal");
    let held: Vec<(String, u64)> = c
        .unsealed_holders()
        .into_iter()
        .map(|(name, bytes, idle)| {
            assert!(idle < Duration::from_secs(60), "{idle:?}");
            (name, bytes)
        })
        .collect();
    // Every attempt counts, losers to be included: none is freed before seal.
    assert_eq!(held, [("big".to_string(), 240), ("small".to_string(), 16)]);
}

#[test]
fn a_replacing_write_is_staged_beside_the_dataset_and_swapped_in_at_once() {
    let mut c = Catalog::new();
    c.commit("d", key(0, 0), schema(), attempt(key(0, 0), 3))
        .expect("old");
    seal_named(&mut c, "d");
    let (old_generation, old) = c.sealed("d").expect("old sealed");
    // The replacement is written and sealed beside the dataset: readers
    // keep the old rows, listings do not show what is staged.
    let staged = staged_key("d", "w1");
    c.commit(&staged, key(0, 1), schema(), attempt(key(0, 1), 5))
        .expect("staged");
    c.commit(&staged, key(1, 0), schema(), attempt(key(1, 0), 2))
        .expect("staged");
    assert_eq!(c.sealed("d").expect("old still").1.rows(), 3);
    let names: Vec<String> = c.list().into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["d"]);
    assert_eq!(c.totals().datasets, 1);
    assert_eq!(c.totals().bytes, (3 + 5 + 2) * 8);
    let err = c.swap_in("d", "w1").expect_err("not sealed");
    assert!(matches!(err, Error::Internal(_)), "{err}");
    seal_named(&mut c, &staged);
    let (new, replaced) = c.swap_in("d", "w1").expect("swap");
    assert_eq!((new.name.as_str(), new.rows), ("d", 7));
    let replaced = replaced.expect("the old dataset");
    assert_eq!((replaced.generation, replaced.rows), (old_generation, 3));
    let (generation, data) = c.sealed("d").expect("new");
    assert!(
        generation > old_generation,
        "a new generation refuses old tickets"
    );
    assert_eq!(
        all_values(&data),
        [1_000, 1_001, 1_002, 1_003, 1_004, 1_000_000, 1_000_001]
    );
    // A reader that held the old rows still has them.
    assert_eq!(all_values(&old), [0, 1, 2]);
    assert!(!c.holds(&staged));
    // Sent again, the swap says nothing is staged.
    let err = c.swap_in("d", "w1").expect_err("swapped already");
    assert!(err.to_string().contains("staged nothing"), "{err}");
    // A late attempt of that write (a speculative task ending after the
    // seal) is refused, at its start and at its commit, and stages nothing.
    let err = c.check_write("d", "w1").expect_err("late");
    assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
    assert!(
        err.to_string()
            .contains("write 'w1' replaced dataset 'd' already"),
        "{err}"
    );
    c.commit_write(&staged, key(0, 2), "w1", schema(), attempt(key(0, 2), 1))
        .expect_err("late commit");
    assert!(!c.holds(&staged));
    c.check_write("d", "w3").expect("another write");
    // A replacement of a dataset that does not exist yet creates it.
    let staged = staged_key("e", "w2");
    c.commit(&staged, key(0, 0), schema(), attempt(key(0, 0), 1))
        .expect("staged");
    seal_named(&mut c, &staged);
    let (_, replaced) = c.swap_in("e", "w2").expect("swap");
    assert!(replaced.is_none());
    assert_eq!(c.describe("e").expect("e").rows, 1);
}

#[test]
fn staged_keys_read_as_their_dataset_and_write() {
    let k = staged_key("d", "w");
    assert_eq!(public_name(&k), "d");
    assert_eq!(public_name("d"), "d");
    let err = Error::DatasetNotFound { dataset: k };
    assert_eq!(
        readable(&err.to_string()),
        "dataset 'd', as replaced by write 'w' does not exist; write it with DoPut, or list \
         datasets with ListFlights"
    );
}

fn seal_named(c: &mut Catalog, name: &str) {
    c.seal(&SealRequest {
        dataset: name.into(),
        ..Default::default()
    })
    .expect("seal");
}

proptest! {
    /// Whatever an overwrite stages and however it ends, the dataset reads
    /// exactly its old rows until the swap, and exactly the replacement's
    /// winners after it; a replacement dropped instead leaves the dataset
    /// as it was and frees every staged byte. Listings never show what is
    /// staged.
    #[test]
    fn an_overwrite_leaves_the_old_rows_or_puts_exactly_the_new_ones(
        old in ops(),
        staged in ops(),
        swap in any::<bool>(),
    ) {
        let mut c = Catalog::new();
        for Op::Commit { partition, attempt: a, rows } in &old {
            let _ = c.commit("d", key(*partition, *a), schema(), attempt(key(*partition, *a), *rows));
        }
        let old_values = (!old.is_empty()).then(|| {
            seal_named(&mut c, "d");
            all_values(&c.sealed("d").expect("old").1)
        });
        let entry = staged_key("d", "w");
        let mut fresh = Catalog::new();
        for Op::Commit { partition, attempt: a, rows } in &staged {
            let (k, rows) = (key(*partition, *a), *rows);
            let here = c.commit(&entry, k, schema(), attempt(k, rows));
            let alone = fresh.commit("d", k, schema(), attempt(k, rows));
            prop_assert_eq!(here.is_ok(), alone.is_ok());
            let shown: Vec<String> = c.list().into_iter().map(|s| s.name).collect();
            prop_assert_eq!(shown, old_values.iter().map(|_| "d".to_string()).collect::<Vec<_>>());
            prop_assert_eq!(
                old_values.clone(),
                c.sealed("d").ok().map(|(_, data)| all_values(&data))
            );
        }
        if staged.is_empty() {
            prop_assert!(c.swap_in("d", "w").is_err());
            return Ok(());
        }
        if swap {
            seal_named(&mut c, &entry);
            seal_named(&mut fresh, "d");
            let (summary, replaced) = c.swap_in("d", "w").expect("swap");
            prop_assert_eq!(replaced.is_some(), old_values.is_some());
            let want = all_values(&fresh.sealed("d").expect("alone").1);
            prop_assert_eq!(all_values(&c.sealed("d").expect("new").1), want);
            prop_assert_eq!(summary.bytes, c.totals().bytes);
        } else {
            let (_, freed) = c.drop_dataset(&entry).expect("drop staged");
            prop_assert_eq!(freed, fresh.totals().bytes);
            prop_assert_eq!(
                old_values.clone(),
                c.sealed("d").ok().map(|(_, data)| all_values(&data))
            );
            prop_assert_eq!(c.totals().datasets, u32::from(old_values.is_some()));
        }
        prop_assert!(c.staged(None).is_empty());
    }
}

#[test]
fn a_schema_naming_a_column_twice_is_refused_before_anything_is_kept() {
    let c = Catalog::new();
    let twice = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("v", DataType::Int64, false),
        Field::new("id", DataType::Utf8, true),
    ]);
    let err = c.check_put("d", key(0, 0), &twice).expect_err("refused");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string()
            .contains("names column 'id' twice (fields 0 and 2)"),
        "{err}"
    );
    // Names differing only in case are two columns (quoted SQL tells them apart).
    let cased = Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("ID", DataType::Int64, false),
    ]);
    c.check_put("d", key(0, 0), &cased).expect("distinct");
}

/// A one-row batch whose only column is a run-end encoded one, which the
/// store cannot hold.
fn runs() -> AttemptData {
    let runs = arrow::array::RunArray::<arrow::datatypes::Int32Type>::try_new(
        &arrow::array::Int32Array::from(vec![1]),
        &Int64Array::from(vec![7]),
    )
    .expect("runs");
    let batch = RecordBatch::try_from_iter([("r", Arc::new(runs) as arrow::array::ArrayRef)])
        .expect("batch");
    AttemptData {
        batches: vec![batch],
        rows: 1,
        bytes: 16,
    }
}

#[test]
fn a_dataset_the_store_cannot_hold_never_spills_and_is_refused_where_all_persist() {
    let mut c = Catalog::new();
    let data = runs();
    let schema = data.batches[0].schema();
    c.commit("runs", key(0, 0), schema.clone(), data)
        .expect("kept in memory");
    c.seal(&SealRequest {
        dataset: "runs".into(),
        ..Default::default()
    })
    .expect("seal");
    sealed_with(&mut c, "plain", 3);
    c.touch("plain");
    // Read less recently, but it cannot be written: the other one goes.
    assert_eq!(
        c.spill_candidate(None, &[]).expect("candidate").name,
        "plain"
    );
    assert!(c.spill_candidate(Some("plain"), &[]).is_none());
    let held = c.unspillable_holders();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, "runs");
    assert_eq!(held[0].2, "column 'r' is a run-end encoded array");
    // Once stored (persisted by an earlier server) it is only released.
    let generation = c.describe("runs").expect("runs").generation;
    assert!(c.set_stored("runs", generation, stored("runs")));
    assert_eq!(
        c.spill_candidate(Some("plain"), &[])
            .expect("candidate")
            .name,
        "runs"
    );
    assert!(c.unspillable_holders().is_empty());

    let persisting = Catalog::persisting();
    let err = persisting
        .check_put("p", key(0, 0), &schema)
        .expect_err("refused");
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    assert!(
        err.to_string().contains(
            "dataset 'p' cannot be persisted: column 'r' is a run-end encoded array, which the \
             store (Parquet) cannot hold"
        ),
        "{err}"
    );
    let mut persisting = persisting;
    assert!(persisting.commit("p", key(0, 0), schema, runs()).is_err());
    assert!(persisting.describe("p").is_err(), "nothing kept");
}

#[test]
fn what_a_dead_write_left_unsealed_is_dropped_and_its_later_attempts_refused() {
    let mut c = Catalog::new();
    // A job that died after two tasks (write "dead"), one that replaces a
    // sealed dataset and died too ("gone"), and a sealed dataset.
    for p in 0..2 {
        c.commit_write("left", key(p, 0), "dead", schema(), attempt(key(p, 0), 3))
            .expect("commit");
    }
    c.commit("kept", key(0, 0), schema(), attempt(key(0, 0), 4))
        .expect("commit");
    c.seal(&SealRequest {
        dataset: "kept".into(),
        partitions: 1,
        ..Default::default()
    })
    .expect("seal");
    let staged = staged_key("kept", "gone");
    c.commit_write(&staged, key(0, 0), "gone", schema(), attempt(key(0, 0), 5))
        .expect("stage");

    // Nothing is abandoned until the idle time has passed; sealed datasets never are.
    assert!(c.abandoned(Duration::from_secs(3600)).is_empty());
    let mut idle = c.abandoned(Duration::ZERO);
    idle.sort();
    assert_eq!(idle, vec![staged.clone(), "left".to_string()]);
    assert!(c.drop_abandoned("kept", Duration::ZERO).is_none(), "sealed");
    assert!(
        c.drop_abandoned("left", Duration::from_secs(3600))
            .is_none(),
        "written since"
    );

    let (summary, freed, writes) = c.drop_abandoned("left", Duration::ZERO).expect("dropped");
    assert_eq!(
        (summary.rows, freed, writes),
        (6, 48, vec!["dead".to_string()])
    );
    let (_, _, writes) = c.drop_abandoned(&staged, Duration::ZERO).expect("dropped");
    assert_eq!(writes, vec!["gone".to_string()]);
    assert!(!c.holds("left") && !c.holds(&staged) && c.holds("kept"));

    // Their tasks still running are refused, saying why; other writes are not.
    for (dataset, write) in [("left", "dead"), (staged.as_str(), "gone")] {
        let err = c
            .commit_write(dataset, key(5, 0), write, schema(), attempt(key(5, 0), 1))
            .expect_err("refused");
        let msg = err.to_string();
        assert!(matches!(err, Error::Aborted(_)), "{msg}");
        assert!(
            msg.contains("was never sealed, so the server dropped what it wrote"),
            "{msg}"
        );
    }
    c.commit_write("left", key(0, 0), "rerun", schema(), attempt(key(0, 0), 2))
        .expect("a new job writes the dataset again");
    c.abort_write("failed");
    let err = c
        .commit_write("x", key(0, 0), "failed", schema(), attempt(key(0, 0), 1))
        .expect_err("aborted");
    assert!(
        err.to_string()
            .contains("its job failed and dropped what it wrote"),
        "{err}"
    );
}
