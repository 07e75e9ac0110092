use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::catalog::AttemptKey;
use crate::order::Shuffle;

/// A layout with partition sizes `sizes`, partition `p` on member `owner[p]`.
fn layout(sizes: &[u64], owner: &[usize], members: usize) -> Layout {
    let mut ms: Vec<Member> = (0..members)
        .map(|m| Member {
            location: format!("grpc://10.0.0.{m}:50051"),
            generation: m as u64 + 7,
            partitions: Vec::new(),
        })
        .collect();
    for (p, (&rows, &m)) in sizes.iter().zip(owner).enumerate() {
        ms[m].partitions.push(PartitionSummary {
            key: AttemptKey {
                partition: p as u32,
                attempt: 0,
            },
            rows,
            bytes: rows * 8,
            committed_attempts: 1,
        });
    }
    Layout::new(ms, vec![true]).expect("valid layout")
}

#[test]
fn a_partition_on_two_members_is_refused() {
    let part = PartitionSummary {
        key: AttemptKey {
            partition: 3,
            attempt: 0,
        },
        rows: 5,
        bytes: 40,
        committed_attempts: 1,
    };
    let m = |loc: &str| Member {
        location: loc.into(),
        generation: 1,
        partitions: vec![part.clone()],
    };
    let err = Layout::new(vec![m("a"), m("b")], vec![]).expect_err("held twice");
    assert!(err.to_string().contains("partition 3"), "{err}");
}

#[test]
fn ids_follow_content_not_member_order() {
    let a = layout(&[5, 6, 7], &[0, 1, 0], 2);
    let mut members = a.members.clone();
    members.reverse();
    let b = Layout::new(members, vec![true]).expect("valid");
    assert_eq!(a.id, b.id);
    let mut changed = a.members.clone();
    changed[0].generation += 1;
    assert_ne!(Layout::new(changed, vec![true]).expect("valid").id, a.id);
}

#[test]
fn lists_are_gathered_as_bytes_only_where_every_member_holds_one_length() {
    // Columns: an int64, a nullable one, a list of 64 floats everywhere, a
    // list of 64 on two members and 32 on the third, a list ragged on one
    // member (no number), a list of 8 that one member (an older build)
    // does not report. Members say lists are not fixed (older
    // coordinators then read them column by column).
    let lists = [false, false, true, true, true, true];
    let fixed = [true, false, false, false, false, false];
    let a: (&[bool], &[u32]) = (&fixed, &[0, 0, 64, 64, 4, 8]);
    let b: (&[bool], &[u32]) = (&fixed, &[0, 0, 64, 64, 4, 8]);
    let c: (&[bool], &[u32]) = (&[true, true, false, false], &[0, 0, 64, 32, 0]);
    assert_eq!(
        byte_columns(&[a, b, c], &lists),
        [true, false, true, false, false, false]
    );
    // One member decides alone; a list it names no number for stays out.
    assert_eq!(
        byte_columns(&[a], &lists),
        [true, false, true, true, true, true]
    );
    let no_width: (&[bool], &[u32]) = (&fixed, &[]);
    assert_eq!(
        byte_columns(&[no_width], &lists),
        [true, false, false, false, false, false]
    );
    assert_eq!(byte_columns(&[], &lists), [false; 6]);
}

#[test]
fn nodes_follow_torchrun() {
    let nodes = Nodes::new(6, 2, vec![], 3).expect("valid");
    assert_eq!(nodes.count(), 3);
    assert_eq!(
        (0..6).map(|r| nodes.node_of(r)).collect::<Vec<_>>(),
        [0, 0, 1, 1, 2, 2]
    );
    assert_eq!(nodes.serving_member(5), 2);
    // Default: ranks spread over the members.
    let nodes = Nodes::new(4, 0, vec![], 3).expect("valid");
    assert_eq!(
        (0..4).map(|r| nodes.serving_member(r)).collect::<Vec<_>>(),
        [0, 0, 1, 1]
    );
    assert!(
        Nodes::new(6, 2, vec![Some(0), Some(1)], 3).is_err(),
        "3 nodes, 2 named"
    );
    assert!(
        Nodes::new(4, 2, vec![Some(1), Some(1)], 3).is_err(),
        "one member twice"
    );
    let nodes = Nodes::new(4, 2, vec![None, Some(0)], 3).expect("valid");
    assert_eq!(
        nodes.serving_member(0),
        0,
        "a node without a member falls back"
    );
    assert_eq!(nodes.serving_member(2), 0);
}

/// Every sample of every rank of a NODE epoch.
fn node_epoch(order: &NodeOrder, world: u64) -> Vec<Vec<(usize, u64)>> {
    (0..world)
        .map(|r| (0..order.per_rank()).map(|k| order.sample(r, k)).collect())
        .collect()
}

/// The `NODE` order of members holding `member_rows`, one node per member
/// plus `extra_nodes` without one, `ranks_per_node` ranks each: the world
/// size, the nodes, the shares and the order.
fn node_order_of(
    member_rows: &[u64],
    ranks_per_node: u32,
    extra_nodes: usize,
    drop_last: bool,
    seed: u64,
    epoch: u64,
) -> (u32, Nodes, crate::order::Shares, NodeOrder) {
    let m = member_rows.len();
    let world = ranks_per_node * (m + extra_nodes) as u32;
    let n: u64 = member_rows.iter().sum();
    let nodes = Nodes::new(world, ranks_per_node, vec![], m).expect("nodes");
    let full = crate::order::Shares::new(n, world, 0, drop_last).expect("shares");
    let order = NodeOrder::new(member_rows, nodes.clone(), full.per_rank(), seed, epoch);
    (world, nodes, full, order)
}

/// A range within `0..len` drawn from two arbitrary numbers.
fn sub_range(len: u64, a: u64, b: u64) -> std::ops::Range<u64> {
    let (a, b) = (a % (len + 1), b % (len + 1));
    a.min(b)..a.max(b)
}

/// Rank `rank`'s `k`-th sample as `(k, member row)` when member
/// `member` holds it: the one-at-a-time reference for a member's samples.
fn walked_from(order: &NodeOrder, rank: u64, k: u64, member: usize) -> Option<(u64, u64)> {
    let (m, row) = order.sample(rank, k);
    (m == member).then_some((k, row))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// The row space is the single server's: partitions in partition order,
    /// each row mapped to its partition's member and its place there.
    #[test]
    fn rows_map_to_their_partitions_member(
        parts in proptest::collection::vec((0u64..50, 0usize..3), 1..12),
    ) {
        let sizes: Vec<u64> = parts.iter().map(|p| p.0).collect();
        let owner: Vec<usize> = parts.iter().map(|p| p.1).collect();
        let l = layout(&sizes, &owner, 3);
        prop_assert_eq!(l.rows(), sizes.iter().sum::<u64>());
        let mut row = 0u64;
        let mut local: HashMap<String, u64> = HashMap::new();
        for (p, &n) in sizes.iter().enumerate() {
            let loc = format!("grpc://10.0.0.{}:50051", owner[p]);
            for i in 0..n {
                let (m, r) = l.locate(row);
                prop_assert_eq!(&l.members[m].location, &loc);
                prop_assert_eq!(r, local.get(&loc).copied().unwrap_or(0) + i);
                row += 1;
            }
            *local.entry(loc).or_default() += n;
        }
    }

    /// NODE: equal counts; every row once per epoch (drop_last: at most
    /// once, exactly W·per_rank rows); transfers only where a node is short.
    #[test]
    fn node_assignment_is_equal_exact_and_local(
        member_rows in proptest::collection::vec(0u64..400, 1..4),
        ranks_per_node in 1u32..4,
        extra_nodes in 0usize..2,
        drop_last: bool,
        seed: u64,
        epoch in 0u64..50,
    ) {
        let m = member_rows.len();
        let count = m + extra_nodes;
        let n: u64 = member_rows.iter().sum();
        let (world, nodes, full, order) =
            node_order_of(&member_rows, ranks_per_node, extra_nodes, drop_last, seed, epoch);
        let epoch_rows = node_epoch(&order, u64::from(world));
        let mut seen: HashMap<(usize, u64), u64> = HashMap::new();
        let mut transfers = vec![0u64; count];
        for (r, rows) in epoch_rows.iter().enumerate() {
            prop_assert_eq!(rows.len() as u64, full.per_rank());
            let g = nodes.node_of(r as u64);
            for &(mm, row) in rows {
                prop_assert!(row < member_rows[mm], "row {} of member {}", row, mm);
                *seen.entry((mm, row)).or_default() += 1;
                if nodes.member_of(g) != Some(mm) {
                    transfers[g] += 1;
                }
                let sources = order.sources(g);
                prop_assert!(sources.contains(&mm), "member {} not among {:?}", mm, sources);
            }
            // A peer's view of the same samples: its rows, nothing else.
            for peer in 0..m {
                let from = order.samples_from(r as u64, 0..full.per_rank(), peer);
                let theirs: Vec<u64> =
                    rows.iter().filter(|&&(mm, _)| mm == peer).map(|&(_, row)| row).collect();
                prop_assert_eq!(from, theirs);
            }
        }
        let total = full.per_rank() * u64::from(world);
        if drop_last {
            prop_assert!(seen.values().all(|&c| c == 1));
            prop_assert_eq!(seen.len() as u64, total);
        } else {
            prop_assert_eq!(seen.len() as u64, n, "every row read");
            prop_assert_eq!(seen.values().map(|&c| c - 1).sum::<u64>(), total - n);
        }
        for (g, &t) in transfers.iter().enumerate() {
            let capacity = u64::from(ranks_per_node) * full.per_rank();
            let own = nodes.member_of(g).map_or(0, |mm| member_rows[mm]);
            // Padding repeats a node's own rows; only a short node receives.
            let short = capacity.saturating_sub(own);
            prop_assert!(t <= short, "node {} received {} but was short {}", g, t, short);
            prop_assert!(t <= order.transferred(g));
        }
    }

    /// A member's samples found by inverting the node's shuffle are the
    /// ones walking every sample finds, in the same order.
    #[test]
    fn held_samples_are_the_walked_ones(
        member_rows in proptest::collection::vec(0u64..400, 1..4),
        ranks_per_node in 1u32..4,
        extra_nodes in 0usize..2,
        drop_last: bool,
        seed: u64,
        first_frac in 0u64..4,
    ) {
        let m = member_rows.len();
        let (world, _, full, order) =
            node_order_of(&member_rows, ranks_per_node, extra_nodes, drop_last, seed, 3);
        let first = full.per_rank() * first_frac / 4;
        for r in 0..u64::from(world) {
            for peer in 0..m {
                let Some(held) = order.samples_held(r, first, peer) else { continue };
                let walked: Vec<(u64, u64)> = (first..order.per_rank())
                    .filter_map(|k| walked_from(&order, r, k, peer))
                    .collect();
                prop_assert_eq!(held, walked, "rank {} member {}", r, peer);
            }
        }
    }

    /// A range of a rank's samples computed at once is each sample's
    /// `(member, row)`, over `NODE` and `GLOBAL` alike.
    #[test]
    fn samples_of_a_range_are_each_samples(
        member_rows in proptest::collection::vec(0u64..400, 1..4),
        ranks_per_node in 1u32..4,
        extra_nodes in 0usize..2,
        drop_last: bool,
        seed: u64,
        a: u64,
        b: u64,
    ) {
        let (world, nodes, full, order) =
            node_order_of(&member_rows, ranks_per_node, extra_nodes, drop_last, seed, 5);
        let range = sub_range(full.per_rank(), a, b);
        for r in 0..u64::from(world) {
            let one_by_one: Vec<(usize, u64)> = range.clone().map(|k| order.sample(r, k)).collect();
            prop_assert_eq!(order.samples(r, range.clone()), one_by_one, "rank {}", r);
        }
        let sizes: Vec<u64> = member_rows.clone();
        let owners: Vec<usize> = (0..sizes.len()).collect();
        let layout = Arc::new(layout(&sizes, &owners, sizes.len()));
        for locality in [Locality::Global, Locality::Node] {
            let plan = ReadPlan {
                dataset: "d".into(),
                world_size: world,
                epoch: 5,
                seed,
                shuffle: Shuffle::Global,
                batch_rows: 4,
                drop_last,
                columns: vec![],
                start_sample: 0,
                split: crate::order::Split::WHOLE,
                locality,
                ranks_per_node,
                nodes: vec![],
                resume_world_size: 0,
                filter: String::new(),
                select: Vec::new(),
                max_rows: 0,
            };
            for r in 0..world {
                let Ok(rows) = RankRows::new(&plan, layout.clone(), &nodes, r) else { continue };
                let range = sub_range(rows.len(), a, b);
                let one_by_one: Vec<(usize, u64)> = range.clone().map(|k| rows.sample(k)).collect();
                for member in 0..sizes.len() {
                    let theirs: Vec<u64> = one_by_one
                        .iter()
                        .filter(|&&(m, _)| m == member)
                        .map(|&(_, row)| row)
                        .collect();
                    prop_assert_eq!(rows.samples_from(range.clone(), member), theirs);
                }
                prop_assert_eq!(rows.samples(range), one_by_one, "{:?} rank {}", locality, r);
            }
        }
    }

    /// Balanced members transfer nothing; epochs give different orders.
    #[test]
    fn balanced_nodes_transfer_nothing(
        per_rank in 1u64..60, members in 1usize..4, ranks_per_node in 1u32..4, seed: u64,
    ) {
        let rows = vec![per_rank * u64::from(ranks_per_node); members];
        let world = ranks_per_node * members as u32;
        let nodes = Nodes::new(world, ranks_per_node, vec![], members).expect("nodes");
        let a = NodeOrder::new(&rows, nodes.clone(), per_rank, seed, 0);
        for r in 0..u64::from(world) {
            let g = nodes.node_of(r);
            for k in 0..per_rank {
                prop_assert_eq!(a.sample(r, k).0, g);
            }
            prop_assert_eq!(a.transferred(g), 0);
        }
        // Two epochs of a node's n rows coincide by chance about once in
        // n! seeds: only a node of more than 20 rows must differ.
        if per_rank * u64::from(ranks_per_node) > 20 {
            let b = NodeOrder::new(&rows, nodes, per_rank, seed, 1);
            prop_assert_ne!(node_epoch(&a, u64::from(world)), node_epoch(&b, u64::from(world)));
        }
    }
}

proptest! {
    /// A member's pick is a bijection of its rows, and which rows move
    /// changes with the epoch's key.
    #[test]
    fn member_picks_are_bijections(n in 0u64..3000, key: u64) {
        let pick = MemberPick::new(n, key);
        let mut seen = vec![false; n as usize];
        for i in 0..n {
            let r = pick.apply(i) as usize;
            prop_assert!(r < n as usize && !seen[r], "row {} picked twice or outside {}", r, n);
            seen[r] = true;
        }
        if n > 200 {
            let other = MemberPick::new(n, key ^ 1);
            let moved = |p: &MemberPick| (n / 2..n).map(|i| p.apply(i)).collect::<Vec<_>>();
            prop_assert_ne!(moved(&pick), moved(&other));
        }
    }
}

#[test]
fn a_short_node_finds_its_few_transferred_rows_without_walking() {
    // Member 0 holds 600 rows, members 1 and 2 hold 300: nodes 1 and 2
    // each receive 100 of member 0's rows.
    let nodes = Nodes::new(6, 2, vec![], 3).expect("nodes");
    let order = NodeOrder::new(&[600, 300, 300], nodes, 200, 9, 0);
    for r in 2..6 {
        let held = order.samples_held(r, 0, 0).expect("cheaper than walking");
        let walked: Vec<(u64, u64)> = (0..200)
            .filter_map(|k| walked_from(&order, r, k, 0))
            .collect();
        assert_eq!(held, walked);
        assert!(!held.is_empty() && held.len() < 100, "{}", held.len());
    }
    // A node's own member holds most of its rows: walking is cheaper.
    assert!(order.samples_held(2, 0, 1).is_none());
}

#[test]
fn node_resume_needs_the_same_world_size_and_whole_steps() {
    let l = layout(&[10, 10, 10], &[0, 1, 2], 3);
    let mut plan = crate::order::ReadPlan {
        dataset: "d".into(),
        world_size: 6,
        epoch: 0,
        seed: 1,
        shuffle: crate::order::Shuffle::Global,
        batch_rows: 4,
        drop_last: false,
        columns: vec![],
        start_sample: 12,
        split: crate::order::Split::WHOLE,
        locality: Locality::Node,
        ranks_per_node: 2,
        nodes: vec![],
        resume_world_size: 0,
        filter: String::new(),
        select: Vec::new(),
        max_rows: 0,
    };
    let nodes = || Nodes::new(6, 2, vec![], 3).expect("nodes");
    let rows = RankRows::new(&plan, Arc::new(l.clone()), &nodes(), 0).expect("same W");
    assert_eq!(rows.len(), 5 - 2);
    plan.resume_world_size = 3;
    let err = RankRows::new(&plan, Arc::new(l.clone()), &nodes(), 0).expect_err("other W");
    assert!(err.to_string().contains("resumes only"), "{err}");
    plan.resume_world_size = 0;
    plan.start_sample = 13;
    assert!(RankRows::new(&plan, Arc::new(l), &nodes(), 0).is_err());
}

proptest! {
    /// The row space of a filter's selection: selected row `i` of the
    /// selected layout is, through its member's selection, the `i`-th
    /// selected row of the dataset in storage (partition) order — so every
    /// order over it is the order over a dataset of just those rows.
    #[test]
    fn a_selection_numbers_the_selected_rows_in_storage_order(
        parts in prop::collection::vec((0u64..40, 0usize..3), 1..8),
        keep in prop::collection::vec(any::<bool>(), 97),
    ) {
        let sizes: Vec<u64> = parts.iter().map(|p| p.0).collect();
        let owner: Vec<usize> = parts.iter().map(|p| p.1).collect();
        let l = layout(&sizes, &owner, 3);
        let mut local: Vec<Vec<u64>> = vec![Vec::new(); l.members.len()];
        let mut want = Vec::new();
        for g in 0..l.rows() {
            if keep[(g % 97) as usize] {
                let (m, r) = l.locate(g);
                local[m].push(r);
                want.push(g);
            }
        }
        let selections: Vec<crate::query::Selection> =
            local.into_iter().map(crate::query::Selection::of).collect();
        let counts: Vec<u64> = (0..l.members.len())
            .flat_map(|m| selections[m].counts(&l.partition_rows(m)))
            .collect();
        let s = l.selected(&counts).expect("selected layout");
        prop_assert_eq!(s.rows(), want.len() as u64);
        prop_assert_eq!(s.members.len(), l.members.len());
        for (i, &g) in want.iter().enumerate() {
            let (m, j) = s.locate(i as u64);
            prop_assert_eq!((m, selections[m].row(j)), l.locate(g));
        }
        // Per partition, in partition order: the rows kept of its span.
        prop_assert_eq!(l.part_rows(), sizes.clone());
        let mut start = 0;
        let kept: Vec<u64> = sizes
            .iter()
            .map(|&n| {
                let span = start..start + n;
                start += n;
                want.iter().filter(|g| span.contains(g)).count() as u64
            })
            .collect();
        prop_assert_eq!(s.part_rows(), kept);
        // Counts that do not fit the layout are refused.
        prop_assert!(l.selected(&counts[1..]).is_err());
    }
}
