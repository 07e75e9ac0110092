//! Many nodes, one dataset: the layout of a dataset sealed across several
//! servers ("members"), its one row space, which member serves which rank,
//! and the `NODE` assignment.
//!
//! This module is pure — no I/O, no locks, no async — like `order`. The
//! network half (sealing members, fetching a rank's rows from peers) lives
//! in [`peer`].
//!
//! - [`Layout`]: every member's location, generation and winning partitions.
//!   Rows are numbered partitions-in-partition-order across members, exactly
//!   as on one server holding every partition, so each order, `start_sample`
//!   and `drop_last` means the same on a cluster; [`Layout::locate`] maps a
//!   row to its member and the row's place in that member's own rows.
//! - [`Nodes`]: torchrun's rank → node convention and each node's member.
//! - [`NodeOrder`]: `LOCALITY_NODE` — each node keeps as many of its own
//!   member's rows as its ranks take, surplus rows (a keyed arithmetic
//!   progression over the member's rows, new every epoch) go to nodes short
//!   of rows, and each node's rows are shuffled per epoch (one keyed
//!   permutation per sample).
//! - [`RankRows`]: a rank's samples as `(member, member row)`, for either
//!   locality.
//!
//! A single server's dataset is the one-member layout, so the same read path
//! serves both.

pub mod peer;

use std::sync::Arc;

use arrow::datatypes::{DataType, Schema};

use crate::catalog::PartitionSummary;
use crate::error::{Error, Result};
pub use crate::order::Locality;
use crate::order::{KeyedPermutation, ReadPlan, ShardOrder, Walk, derive_key, mix64};

/// Domain tags of the `NODE` orders.
const TAG_MEMBER_ROWS: u64 = 0x6D65_6D62_6572; // "member"
const TAG_NODE_ROWS: u64 = 0x6E6F_6465; // "node"

/// A keyed affine bijection `i -> (a·i + c) mod n` over a member's rows:
/// which of them its node keeps (the images of `0..kept`) and which move.
/// The node's own shuffle ([`KeyedPermutation`]) gives the order; this only
/// picks, so one multiply does where a second keyed permutation would cost
/// as much as the shuffle itself. The moved rows are an arithmetic
/// progression mod `n` with a keyed step, spread over the member's
/// partitions, different every epoch.
#[derive(Debug, Clone)]
struct MemberPick {
    n: u64,
    a: u64,
    c: u64,
}

impl MemberPick {
    fn new(n: u64, key: u64) -> Self {
        if n <= 1 {
            return Self { n, a: 1, c: 0 };
        }
        let k = mix64(key);
        // A step coprime with n (so the map is a bijection), away from the
        // degenerate 1 and n - 1 where n allows.
        let mut a = if n > 3 { 2 + k % (n - 3) } else { 1 };
        while gcd(a, n) != 1 {
            a = if a + 1 >= n { 1 } else { a + 1 };
        }
        Self {
            n,
            a,
            c: mix64(k) % n,
        }
    }

    /// The member row of pick index `i < n`.
    fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n, "pick {i} of {}", self.n);
        if self.n <= 1 << 32 {
            // a, i, c < n: the sum fits 64 bits.
            return (self.a * i + self.c) % self.n;
        }
        ((u128::from(self.a) * u128::from(i) + u128::from(self.c)) % u128::from(self.n)) as u64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// One member of a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Where peers and ranks reach it.
    pub location: String,
    /// The dataset's generation on that member.
    pub generation: u64,
    /// Its winning partitions, in partition order.
    pub partitions: Vec<PartitionSummary>,
}

impl Member {
    /// Rows the member holds.
    pub fn rows(&self) -> u64 {
        self.partitions
            .iter()
            .fold(0u64, |t, p| t.saturating_add(p.rows))
    }
}

/// Where one partition's rows are.
#[derive(Debug, Clone, Copy)]
struct Part {
    /// First row of the partition in the global row space.
    start: u64,
    rows: u64,
    member: usize,
    /// First row of the partition among its member's rows.
    local_start: u64,
}

/// A dataset's partitions over its members, and its row space.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Identifies this layout: a hash of every member's location, generation
    /// and partitions, so a dataset written again has a new id.
    pub id: u64,
    /// Members ordered by location.
    pub members: Vec<Member>,
    /// Per column: fixed-width values without nulls on every member, or a
    /// list whose rows hold one number of values, the same on every member
    /// (such columns are gathered as bytes and packed, the same choice a
    /// single server makes; see [`byte_columns`]).
    pub fixed: Vec<bool>,
    /// Partitions in partition order.
    parts: Vec<Part>,
}

/// Which columns of a dataset sealed across members are gathered as bytes
/// (a layout's `fixed`), from what each member says of its part: per
/// column, whether its values are fixed-width without nulls there (lists
/// aside), and for a list whose rows there all hold one number of values,
/// that number (0 otherwise). `lists` says per column whether it is a
/// list ([`list_columns`]). A column is gathered as bytes where every
/// member says fixed; a list where every member's rows hold the same
/// number of values — a
/// rank's batch joins rows of several members, and lists of two lengths,
/// or a member that names no number (ragged, null rows, or a build from
/// before lists were packed on members), are merged by `interleave`.
pub fn byte_columns(members: &[(&[bool], &[u32])], lists: &[bool]) -> Vec<bool> {
    let fixed = |(fixed, _): &(&[bool], &[u32]), i: usize| fixed.get(i).copied().unwrap_or(false);
    let width = |(_, widths): &(&[bool], &[u32]), i: usize| widths.get(i).copied().unwrap_or(0);
    lists
        .iter()
        .enumerate()
        .map(|(i, &list)| match members.first() {
            None => false,
            Some(first) if list => {
                let w = width(first, i);
                w > 0 && members.iter().all(|m| width(m, i) == w)
            }
            Some(_) => members.iter().all(|m| fixed(m, i)),
        })
        .collect()
}

/// Per column of `schema`: whether it is a list (Spark's `array<…>`), the
/// columns [`byte_columns`] takes a number of values a row for.
pub fn list_columns(schema: &Schema) -> Vec<bool> {
    schema
        .fields()
        .iter()
        .map(|f| matches!(f.data_type(), DataType::List(_) | DataType::LargeList(_)))
        .collect()
}

/// FNV-1a continued from `h`, a stable hash (the same on every build):
/// layout ids, and `hash_bucket` from the offset basis.
pub(crate) fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Layout {
    /// Every member but the `index`-th (the other members, as member
    /// `index` sees them).
    pub fn others(&self, index: usize) -> impl Iterator<Item = &Member> {
        self.members
            .iter()
            .enumerate()
            .filter(move |(i, _)| *i != index)
            .map(|(_, m)| m)
    }

    /// A layout of `members` (any order; empty members are left out);
    /// fails when a partition is held twice.
    pub fn new(mut members: Vec<Member>, fixed: Vec<bool>) -> Result<Self> {
        members.retain(|m| !m.partitions.is_empty());
        members.sort_by(|a, b| a.location.cmp(&b.location));
        for w in members.windows(2) {
            if w[0].location == w[1].location {
                return Err(Error::invalid(format!(
                    "member {} appears twice in the layout",
                    w[0].location
                )));
            }
        }
        let mut all: Vec<(u32, usize, u64)> = Vec::new();
        for (m, member) in members.iter_mut().enumerate() {
            member.partitions.sort_by_key(|p| p.key.partition);
            for p in &member.partitions {
                all.push((p.key.partition, m, p.rows));
            }
        }
        all.sort_unstable();
        if let Some(w) = all.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::invalid(format!(
                "partition {} is held by two members ({} and {}); name one winner",
                w[0].0, members[w[0].1].location, members[w[1].1].location
            )));
        }
        let mut local = vec![0u64; members.len()];
        let mut start = 0u64;
        let mut parts = Vec::with_capacity(all.len());
        for (_, member, rows) in all {
            parts.push(Part {
                start,
                rows,
                member,
                local_start: local[member],
            });
            start = crate::catalog::add_rows(start, rows, || "the layout".to_string())?;
            local[member] += rows;
        }
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for m in &members {
            h = fnv1a(m.location.as_bytes(), h);
            h = fnv1a(&m.generation.to_le_bytes(), h);
            for p in &m.partitions {
                h = fnv1a(&p.key.partition.to_le_bytes(), h);
                h = fnv1a(&p.key.attempt.to_le_bytes(), h);
                h = fnv1a(&p.rows.to_le_bytes(), h);
            }
        }
        h = fnv1a(&fixed.iter().map(|&f| u8::from(f)).collect::<Vec<_>>(), h);
        Ok(Self {
            id: h.max(1),
            members,
            fixed,
            parts,
        })
    }

    /// The one-member layout of a dataset held whole by one server.
    pub fn single(location: &str, generation: u64, partitions: Vec<PartitionSummary>) -> Self {
        let member = Member {
            location: location.to_string(),
            generation,
            partitions,
        };
        // One member cannot hold a partition twice.
        Self::new(vec![member.clone()], Vec::new()).unwrap_or_else(|_| Self {
            id: 1,
            members: vec![member],
            fixed: Vec::new(),
            parts: Vec::new(),
        })
    }

    /// Partitions per member, in member order: the shape of a selection's
    /// counts.
    pub fn partition_counts(&self) -> Vec<usize> {
        self.members.iter().map(|m| m.partitions.len()).collect()
    }

    /// Rows of each member's partitions in order (members in order).
    pub fn partition_rows(&self, member: usize) -> Vec<u64> {
        self.members[member]
            .partitions
            .iter()
            .map(|p| p.rows)
            .collect()
    }

    /// The row space of the rows a filter selected: the same members and
    /// partitions, partition `j` of the flattened list (members in order,
    /// each one's partitions in order) holding `selected[j]` rows. Member
    /// indices are those of `self`.
    pub fn selected(&self, selected: &[u64]) -> Result<Self> {
        let total: usize = self.partition_counts().iter().sum();
        if selected.len() != total {
            return Err(Error::invalid(format!(
                "the selection names {} partitions; the layout has {total}",
                selected.len()
            )));
        }
        let mut counts = selected.iter();
        let mut members = self.members.clone();
        for m in &mut members {
            for p in &mut m.partitions {
                let n = counts.next().copied().unwrap_or(0);
                if n > p.rows {
                    return Err(Error::invalid(format!(
                        "the selection takes {n} rows of partition {}, which holds {}",
                        p.key.partition, p.rows
                    )));
                }
                p.rows = n;
            }
        }
        Self::new(members, self.fixed.clone())
    }

    /// Rows of each partition, in partition order.
    pub fn part_rows(&self) -> Vec<u64> {
        self.parts.iter().map(|p| p.rows).collect()
    }

    /// Rows of the whole dataset.
    pub fn rows(&self) -> u64 {
        self.parts.last().map_or(0, |p| p.start + p.rows)
    }

    /// Rows of each member.
    pub fn member_rows(&self) -> Vec<u64> {
        self.members.iter().map(Member::rows).collect()
    }

    /// The member index of `location`.
    pub fn member_at(&self, location: &str) -> Option<usize> {
        self.members.iter().position(|m| m.location == location)
    }

    /// `(member, row among the member's rows)` of global row `row`.
    pub fn locate(&self, row: u64) -> (usize, u64) {
        debug_assert!(row < self.rows());
        let i = self.parts.partition_point(|p| p.start <= row) - 1;
        let p = self.parts[i];
        (p.member, p.local_start + (row - p.start))
    }
}

/// Ranks on nodes (torchrun: rank = node × ranks_per_node + local rank) and
/// each node's member.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nodes {
    world_size: u64,
    ranks_per_node: u64,
    /// Member of each node, if its server holds rows.
    members: Vec<Option<usize>>,
    member_count: usize,
}

impl Nodes {
    /// The node map of a plan over a layout of `member_count` members:
    /// `ranks_per_node` 0 = `ceil(world_size / members)`; `nodes` empty =
    /// node `i` is member `i`, else one entry per node (`None`: no member).
    pub fn new(
        world_size: u32,
        ranks_per_node: u32,
        nodes: Vec<Option<usize>>,
        member_count: usize,
    ) -> Result<Self> {
        let w = u64::from(world_size.max(1));
        let m = member_count.max(1) as u64;
        let per = match ranks_per_node {
            0 => w.div_ceil(m),
            n => u64::from(n),
        };
        let count = w.div_ceil(per) as usize;
        let members = if nodes.is_empty() {
            (0..count)
                .map(|g| (g < member_count).then_some(g))
                .collect()
        } else {
            if nodes.len() != count {
                return Err(Error::invalid(format!(
                    "the plan names {} nodes, but world_size {w} at {per} ranks per node makes \
                     {count}; name one location per node, in node order",
                    nodes.len()
                )));
            }
            let mut seen = vec![false; member_count];
            for m in nodes.iter().flatten() {
                if std::mem::replace(&mut seen[*m], true) {
                    return Err(Error::invalid(
                        "the plan names one member for two nodes; each node has its own server",
                    ));
                }
            }
            nodes
        };
        Ok(Self {
            world_size: w,
            ranks_per_node: per,
            members,
            member_count,
        })
    }

    /// Ranks on each node (the last may have fewer).
    pub fn ranks_per_node(&self) -> u64 {
        self.ranks_per_node
    }

    /// Number of nodes.
    pub fn count(&self) -> usize {
        self.members.len()
    }

    /// The node rank `rank` runs on.
    pub fn node_of(&self, rank: u64) -> usize {
        (rank / self.ranks_per_node) as usize
    }

    /// Ranks of node `node`.
    pub fn ranks_of(&self, node: usize) -> std::ops::Range<u64> {
        let first = node as u64 * self.ranks_per_node;
        first..(first + self.ranks_per_node).min(self.world_size)
    }

    /// The member of node `node`, if any.
    pub fn member_of(&self, node: usize) -> Option<usize> {
        self.members.get(node).copied().flatten()
    }

    /// The member that serves rank `rank`: its node's, or for a node
    /// without one, member `node mod members`.
    pub fn serving_member(&self, rank: u64) -> usize {
        let node = self.node_of(rank);
        self.member_of(node)
            .unwrap_or(node % self.member_count.max(1))
    }
}

/// Most node indices [`NodeOrder::samples_held`] inverts (its answer holds
/// at most that many 16-byte entries: 32 MiB).
pub const HELD_MAX: u64 = 1 << 21;

/// The `NODE` assignment of one epoch: which `(member, member row)` each
/// node's ranks read, each row once (padding aside).
#[derive(Debug, Clone)]
pub struct NodeOrder {
    member_rows: Vec<u64>,
    /// Per member: which of its rows its node keeps and which move.
    member_pick: Vec<MemberPick>,
    /// Per member: rows its own node keeps (the first of `member_pick`).
    kept: Vec<u64>,
    /// Start of each member's surplus in the pool; one extra entry = pool size.
    pool_start: Vec<u64>,
    nodes: Nodes,
    node: Vec<NodePart>,
    per_rank: u64,
}

#[derive(Debug, Clone)]
struct NodePart {
    member: Option<usize>,
    kept: u64,
    /// Pool rows this node receives: `pool[from..from + received]`.
    from: u64,
    received: u64,
    /// Samples the node's ranks take: ranks × per_rank.
    capacity: u64,
    perm: KeyedPermutation,
}

impl NodeOrder {
    /// The assignment for members holding `member_rows`, nodes `nodes`,
    /// `per_rank` samples per rank over the whole epoch.
    pub fn new(member_rows: &[u64], nodes: Nodes, per_rank: u64, seed: u64, epoch: u64) -> Self {
        let member_pick: Vec<MemberPick> = member_rows
            .iter()
            .enumerate()
            .map(|(m, &n)| {
                MemberPick::new(n, derive_key(&[TAG_MEMBER_ROWS, seed, epoch, m as u64]))
            })
            .collect();
        let mut kept = vec![0u64; member_rows.len()];
        let mut node = Vec::with_capacity(nodes.count());
        for g in 0..nodes.count() {
            let ranks = nodes.ranks_of(g);
            let capacity = (ranks.end - ranks.start) * per_rank;
            let member = nodes.member_of(g);
            let k = member.map_or(0, |m| member_rows[m].min(capacity));
            if let Some(m) = member {
                kept[m] = k;
            }
            node.push(NodePart {
                member,
                kept: k,
                from: 0,
                received: 0,
                capacity,
                perm: KeyedPermutation::new(
                    capacity,
                    derive_key(&[TAG_NODE_ROWS, seed, epoch, g as u64]),
                ),
            });
        }
        let mut pool_start = Vec::with_capacity(member_rows.len() + 1);
        let mut pool = 0u64;
        for (m, &n) in member_rows.iter().enumerate() {
            pool_start.push(pool);
            pool += n - kept[m];
        }
        pool_start.push(pool);
        let mut next = 0u64;
        for part in &mut node {
            let want = part.capacity - part.kept;
            part.from = next;
            part.received = want.min(pool - next);
            next += part.received;
        }
        Self {
            member_rows: member_rows.to_vec(),
            member_pick,
            kept,
            pool_start,
            nodes,
            node,
            per_rank,
        }
    }

    /// Samples every rank takes over the epoch.
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// The node map.
    pub fn nodes(&self) -> &Nodes {
        &self.nodes
    }

    /// Pool row `j` as `(member, pick index into the member's rows)`.
    fn pool_row(&self, j: u64) -> (usize, u64) {
        // The last member whose surplus starts at or before `j`: members
        // without surplus share their start with the next one.
        let m = self.pool_start.partition_point(|&s| s <= j) - 1;
        (m, self.kept[m] + (j - self.pool_start[m]))
    }

    /// The `i`-th of node `g`'s assigned rows (before the node's shuffle)
    /// as `(member, pick index into the member's rows)`: the member's
    /// row is `member_pick[member].apply(index)`, computed only by whoever
    /// needs it.
    fn assigned(&self, g: usize, i: u64) -> (usize, u64) {
        let part = &self.node[g];
        if i < part.kept {
            return (part.member.unwrap_or(0), i);
        }
        if i < part.kept + part.received {
            return self.pool_row(part.from + (i - part.kept));
        }
        // Padding (no drop_last): the node's own rows again — no transfer —
        // else rows it received, else (a node given nothing) the first
        // member's.
        let pad = i - (part.kept + part.received);
        if part.kept > 0 {
            return self.assigned(g, pad % part.kept);
        }
        if part.received > 0 {
            return self.pool_row(part.from + pad % part.received);
        }
        let m = self.member_rows.iter().position(|&n| n > 0).unwrap_or(0);
        let n = self.member_rows.get(m).copied().unwrap_or(0).max(1);
        (m, pad % n)
    }

    /// Rank `rank`'s `k`-th sample as `(member, pick index into the
    /// member's rows)`.
    fn assigned_sample(&self, rank: u64, k: u64) -> (usize, u64) {
        let g = self.nodes.node_of(rank);
        let ranks = self.nodes.ranks_of(g);
        let local = rank - ranks.start;
        let p = local + k * (ranks.end - ranks.start);
        self.assigned(g, self.node[g].perm.apply(p))
    }

    /// Rank `rank`'s `k`-th sample of the epoch (`k < per_rank()`).
    pub fn sample(&self, rank: u64, k: u64) -> (usize, u64) {
        let (m, i) = self.assigned_sample(rank, k);
        (m, self.member_pick[m].apply(i))
    }

    /// Rank `rank`'s samples `range` ([`Self::sample`] of each), the
    /// node's shuffle computed a pass at a time
    /// ([`KeyedPermutation::apply_all`]).
    pub fn samples(&self, rank: u64, range: std::ops::Range<u64>) -> Vec<(usize, u64)> {
        self.samples_where(rank, range, |_| true)
    }

    /// Member `member`'s rows of rank `rank`'s samples `range`, in sample
    /// order: [`Self::samples`] of that member, with the member pick
    /// computed only for its own samples.
    pub fn samples_from(&self, rank: u64, range: std::ops::Range<u64>, member: usize) -> Vec<u64> {
        self.samples_where(rank, range, |m| m == member)
            .into_iter()
            .map(|(_, row)| row)
            .collect()
    }

    /// [`Self::samples`] of the members `keep` accepts.
    fn samples_where(
        &self,
        rank: u64,
        range: std::ops::Range<u64>,
        keep: impl Fn(usize) -> bool,
    ) -> Vec<(usize, u64)> {
        let g = self.nodes.node_of(rank);
        let ranks = self.nodes.ranks_of(g);
        let (local, width) = (rank - ranks.start, ranks.end - ranks.start);
        let mut at: Vec<u64> = range.map(|k| local + k * width).collect();
        self.node[g].perm.apply_all(&mut at, &mut Walk::default());
        at.into_iter()
            .map(|i| self.assigned(g, i))
            .filter(|&(m, _)| keep(m))
            .map(|(m, i)| (m, self.member_pick[m].apply(i)))
            .collect()
    }

    /// Rank `rank`'s samples from its `first` on that member `member`
    /// holds, as `(k, member row)` in ascending `k`: what
    /// [`Self::samples_from`] finds walking every sample, found instead by
    /// inverting the node's shuffle over the indices the member supplies,
    /// so it costs the member's part of the node rather than the rank's
    /// samples. `None` when that part is not smaller than the samples left
    /// or than [`HELD_MAX`] (walk the samples then).
    pub fn samples_held(&self, rank: u64, first: u64, member: usize) -> Option<Vec<(u64, u64)>> {
        let g = self.nodes.node_of(rank);
        let part = self.node.get(g)?;
        let ranks = self.nodes.ranks_of(g);
        let width = ranks.end - ranks.start;
        let local = rank - ranks.start;
        // Indices of the node's assigned rows that may be the member's:
        // its kept rows, its slice of the pool, and the padding.
        let mut candidates: Vec<std::ops::Range<u64>> = Vec::new();
        if part.member == Some(member) {
            candidates.push(0..part.kept);
        }
        if let (Some(&start), Some(&end)) =
            (self.pool_start.get(member), self.pool_start.get(member + 1))
        {
            let (lo, hi) = (start.max(part.from), end.min(part.from + part.received));
            if lo < hi {
                candidates.push(part.kept + (lo - part.from)..part.kept + (hi - part.from));
            }
        }
        candidates.push(part.kept + part.received..part.capacity);
        let count: u64 = candidates.iter().map(|r| r.end - r.start).sum();
        if count >= self.per_rank.saturating_sub(first).min(HELD_MAX) {
            return None;
        }
        // Inverted a chunk at a time: the samples held are about one in
        // `width` of the candidates.
        let mut indices = candidates.into_iter().flatten();
        let (mut held, mut at, mut pending) = (Vec::new(), Vec::new(), Walk::default());
        loop {
            let chunk: Vec<u64> = indices.by_ref().take(1 << 14).collect();
            if chunk.is_empty() {
                break;
            }
            at.clone_from(&chunk);
            part.perm.invert_all(&mut at, &mut pending);
            held.extend(chunk.into_iter().zip(&at).filter_map(|(i, &p)| {
                let k = p / width;
                if p % width != local || k < first {
                    return None;
                }
                let (m, row) = self.assigned(g, i);
                (m == member).then(|| (k, self.member_pick[m].apply(row)))
            }));
        }
        held.sort_unstable();
        Some(held)
    }

    /// Members whose rows node `g` reads (a superset, cheap to compute).
    pub fn sources(&self, g: usize) -> Vec<usize> {
        let part = &self.node[g];
        let mut out: Vec<usize> = part.member.filter(|_| part.kept > 0).into_iter().collect();
        if part.received > 0 {
            let (first, _) = self.pool_row(part.from);
            let (last, _) = self.pool_row(part.from + part.received - 1);
            out.extend(first..=last);
        }
        if part.kept + part.received == 0 && part.capacity > 0 {
            out.extend(self.member_rows.iter().position(|&n| n > 0));
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Rows node `g` receives from other members: what it is short, or
    /// everything it reads when its member holds none of it.
    pub fn transferred(&self, g: usize) -> u64 {
        let part = &self.node[g];
        if part.kept == 0 {
            part.capacity
        } else {
            part.received
        }
    }
}

/// A rank's samples as `(member, member row)`, from sample `first` on.
#[derive(Debug, Clone)]
pub enum RankRows {
    /// `LOCALITY_GLOBAL`: the single-server order over the layout's row space.
    Global {
        /// The rank's order over global rows.
        order: ShardOrder,
        /// The row space.
        layout: Arc<Layout>,
    },
    /// `LOCALITY_NODE`.
    Node {
        /// The epoch's assignment.
        order: Arc<NodeOrder>,
        /// The rank.
        rank: u64,
        /// Samples already consumed (resume).
        first: u64,
    },
}

impl RankRows {
    /// Rank `rank`'s samples of `plan` over `layout`.
    pub fn new(plan: &ReadPlan, layout: Arc<Layout>, nodes: &Nodes, rank: u32) -> Result<Self> {
        let n = layout.rows();
        match plan.locality {
            Locality::Global => Ok(Self::Global {
                order: ShardOrder::new(plan.epoch_order(n), plan.shares(n)?, rank)?,
                layout,
            }),
            Locality::Node => {
                let order = node_order(plan, &layout, nodes.clone())?;
                let first = if plan.start_sample >= n {
                    order.per_rank()
                } else {
                    plan.start_sample / u64::from(plan.world_size)
                };
                Ok(Self::Node {
                    order: Arc::new(order),
                    rank: u64::from(rank),
                    first,
                })
            }
        }
    }

    /// Samples the rank receives.
    pub fn len(&self) -> u64 {
        match self {
            Self::Global { order, .. } => order.len(),
            Self::Node { order, first, .. } => order.per_rank() - first,
        }
    }

    /// Whether the rank receives nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `(member, member row)` of the rank's `k`-th sample.
    pub fn sample(&self, k: u64) -> (usize, u64) {
        match self {
            Self::Global { order, layout } => layout.locate(order.row(k)),
            Self::Node { order, rank, first } => order.sample(*rank, first + k),
        }
    }

    /// `(member, member row)` of the rank's samples `range`, in order
    /// ([`Self::sample`] of each, computed a pass at a time).
    pub fn samples(&self, range: std::ops::Range<u64>) -> Vec<(usize, u64)> {
        match self {
            Self::Global { order, layout } => order
                .rows(range)
                .into_iter()
                .map(|row| layout.locate(row))
                .collect(),
            Self::Node { order, rank, first } => {
                order.samples(*rank, first + range.start..first + range.end)
            }
        }
    }

    /// Member `member`'s rows of the rank's samples `range`, in order
    /// ([`Self::samples`] of that member).
    pub fn samples_from(&self, range: std::ops::Range<u64>, member: usize) -> Vec<u64> {
        match self {
            Self::Global { .. } => self
                .samples(range)
                .into_iter()
                .filter(|&(m, _)| m == member)
                .map(|(_, row)| row)
                .collect(),
            Self::Node { order, rank, first } => {
                order.samples_from(*rank, first + range.start..first + range.end, member)
            }
        }
    }

    /// Member `member`'s samples of this rank as `(k, member row)`, `k`
    /// counted as [`Self::sample`] counts, ascending; `None` where walking
    /// the samples with [`Self::samples_from`] is the cheaper way
    /// ([`NodeOrder::samples_held`]).
    pub fn held_by(&self, member: usize) -> Option<Vec<(u64, u64)>> {
        match self {
            Self::Global { .. } => None,
            Self::Node { order, rank, first } => {
                let mut held = order.samples_held(*rank, *first, member)?;
                for (k, _) in &mut held {
                    *k -= first;
                }
                Some(held)
            }
        }
    }

    /// Members that may hold this rank's rows.
    pub fn sources(&self) -> Vec<usize> {
        match self {
            Self::Global { layout, .. } => layout
                .members
                .iter()
                .enumerate()
                .filter(|(_, m)| m.rows() > 0)
                .map(|(i, _)| i)
                .collect(),
            Self::Node { order, rank, .. } => order.sources(order.nodes().node_of(*rank)),
        }
    }
}

/// The `NODE` assignment of `plan` over `layout`; refuses a resume it
/// cannot make exact.
pub fn node_order(plan: &ReadPlan, layout: &Layout, nodes: Nodes) -> Result<NodeOrder> {
    let n = layout.rows();
    let w = u64::from(plan.world_size);
    let resumed_at = match plan.resume_world_size {
        0 => plan.world_size,
        r => r,
    };
    if plan.start_sample > 0 && resumed_at != plan.world_size {
        return Err(Error::FailedPrecondition(format!(
            "dataset '{}': a LOCALITY_NODE epoch resumes only at the world size it started with \
             ({resumed_at}), not at {}; finish the epoch at {resumed_at} ranks, start the next \
             epoch, or read with LOCALITY_GLOBAL, which resumes at any world size",
            plan.dataset, plan.world_size
        )));
    }
    if !plan.start_sample.is_multiple_of(w) && plan.start_sample < n {
        return Err(Error::FailedPrecondition(format!(
            "dataset '{}': a LOCALITY_NODE epoch resumes at a whole step (start_sample a \
             multiple of world_size {w}), not at {}",
            plan.dataset, plan.start_sample
        )));
    }
    let full = crate::order::Shares::new(n, plan.world_size, 0, plan.drop_last)?;
    // Validates start_sample against the row count.
    plan.shares(n)?;
    Ok(NodeOrder::new(
        &layout.member_rows(),
        nodes,
        full.per_rank(),
        plan.seed,
        plan.epoch,
    ))
}

#[cfg(test)]
mod tests;
