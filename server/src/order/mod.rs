//! Sample order: which row each rank reads at each step of an epoch.
//!
//! This module owns the core contract of DESIGN.md ("Sample order") and is pure:
//! no I/O, no locks, no async. Three pieces compose:
//!
//! 1. [`EpochOrder`] maps an epoch position `0..n` to a row index `0..n`
//!    (`none`, `global`, `block`), a function of `(n, seed, epoch)` only — never
//!    of the world size.
//! 2. [`Shares`] gives every rank the same number of samples from
//!    `start_sample` on (`drop_last` truncates, otherwise the tail wraps to the
//!    start of the epoch's order).
//! 3. Strided assignment: rank `r`'s `k`-th sample is epoch position
//!    `start_sample + r + k·W`, so a job stopped after `k` steps of `W` ranks
//!    resumes at `start_sample = k·W` with any other world size.
//!
//! [`ShardOrder`] puts the three together for one rank.

mod permutation;

pub use permutation::{KeyedPermutation, Walk};
pub(crate) use permutation::{derive_key, mix64};

use crate::error::{Error, Result};

/// Domain-separation tags so the permutations used for different purposes
/// are independent even for the same seed and epoch.
const TAG_GLOBAL: u64 = 0x676C_6F62_616C; // "global"
const TAG_BLOCKS: u64 = 0x626C_6F63_6B73; // "blocks"
const TAG_ROWS: u64 = 0x726F_7773; // "rows"

/// How an epoch's global order is formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shuffle {
    /// Partition order, then row order.
    None,
    /// A seeded permutation of all rows.
    Global,
    /// Blocks of `block_rows` consecutive rows in a seeded order, rows within
    /// each block permuted too.
    Block {
        /// Rows per block, at least 1.
        block_rows: u64,
    },
}

/// Position → row mapping of one epoch.
#[derive(Debug, Clone)]
pub struct EpochOrder {
    n: u64,
    seed: u64,
    epoch: u64,
    kind: OrderKind,
}

#[derive(Debug, Clone)]
enum OrderKind {
    Identity,
    Global(KeyedPermutation),
    Block(BlockOrder),
}

/// Blocks of `k` rows (the last one `last_len` long) visited in the order of
/// `blocks`: slot `j` of the epoch holds block `blocks.apply(j)`.
#[derive(Debug, Clone)]
struct BlockOrder {
    k: u64,
    last_len: u64,
    blocks: KeyedPermutation,
    /// The slot that holds the (possibly short) last block.
    short_slot: u64,
}

impl EpochOrder {
    /// The order of epoch `epoch` over `n` rows.
    pub fn new(n: u64, shuffle: Shuffle, seed: u64, epoch: u64) -> Self {
        let kind = match shuffle {
            _ if n == 0 => OrderKind::Identity,
            Shuffle::None => OrderKind::Identity,
            Shuffle::Global => OrderKind::Global(KeyedPermutation::new(
                n,
                derive_key(&[TAG_GLOBAL, seed, epoch]),
            )),
            Shuffle::Block { block_rows } => {
                let k = block_rows.clamp(1, n);
                let nb = n.div_ceil(k);
                let blocks = KeyedPermutation::new(nb, derive_key(&[TAG_BLOCKS, seed, epoch]));
                let short_slot = blocks.invert(nb - 1);
                OrderKind::Block(BlockOrder {
                    k,
                    last_len: n - (nb - 1) * k,
                    blocks,
                    short_slot,
                })
            }
        };
        Self {
            n,
            seed,
            epoch,
            kind,
        }
    }

    /// Number of rows (and positions).
    pub fn len(&self) -> u64 {
        self.n
    }

    /// Whether the epoch has no rows.
    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// The row at epoch position `position` (below `len()`).
    pub fn row_at(&self, position: u64) -> u64 {
        debug_assert!(position < self.n);
        match &self.kind {
            OrderKind::Identity => position,
            OrderKind::Global(p) => p.apply(position),
            OrderKind::Block(b) => {
                let short_start = b.short_slot * b.k;
                let (slot, offset) = if position < short_start {
                    (position / b.k, position % b.k)
                } else if position < short_start + b.last_len {
                    (b.short_slot, position - short_start)
                } else {
                    let q = position - short_start - b.last_len;
                    (b.short_slot + 1 + q / b.k, q % b.k)
                };
                let block = b.blocks.apply(slot);
                let len = if block == b.blocks.len() - 1 {
                    b.last_len
                } else {
                    b.k
                };
                let within = KeyedPermutation::new(
                    len,
                    derive_key(&[TAG_ROWS, self.seed, self.epoch, block]),
                );
                block * b.k + within.apply(offset)
            }
        }
    }
}

impl EpochOrder {
    /// Replaces every position of `positions` (each below `len()`) by its
    /// row: [`Self::row_at`] of each, a global order's computed a pass at a
    /// time ([`KeyedPermutation::apply_all`]).
    pub fn rows_at(&self, positions: &mut [u64], scratch: &mut Walk) {
        match &self.kind {
            OrderKind::Identity => {}
            OrderKind::Global(p) => p.apply_all(positions, scratch),
            OrderKind::Block(_) => {
                for p in positions {
                    *p = self.row_at(*p);
                }
            }
        }
    }
}

/// Equal shares of the remaining samples of an epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    n: u64,
    world_size: u64,
    start_sample: u64,
    per_rank: u64,
}

impl Shares {
    /// Shares of `n` rows among `world_size` ranks from `start_sample` on.
    ///
    /// Fails when `world_size` is 0 or `start_sample` is past the end.
    pub fn new(n: u64, world_size: u32, start_sample: u64, drop_last: bool) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::invalid("world_size must be at least 1"));
        }
        if start_sample > n {
            return Err(Error::invalid(format!(
                "start_sample {start_sample} is past the end of the epoch ({n} rows); \
                 it must be between 0 and {n}"
            )));
        }
        let w = u64::from(world_size);
        let remaining = n - start_sample;
        let per_rank = if drop_last {
            remaining / w
        } else {
            remaining.div_ceil(w)
        };
        Ok(Self {
            n,
            world_size: w,
            start_sample,
            per_rank,
        })
    }

    /// Samples every rank receives.
    pub fn per_rank(&self) -> u64 {
        self.per_rank
    }

    /// These shares cut to at most `max` samples a rank (0: as they are):
    /// the same positions, fewer of them.
    pub fn at_most(mut self, max: u64) -> Self {
        if max > 0 {
            self.per_rank = self.per_rank.min(max);
        }
        self
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u64 {
        self.world_size
    }

    /// Epoch position of rank `rank`'s `k`-th sample (`k < per_rank()`),
    /// wrapped to the start of the epoch's order past its end.
    pub fn position(&self, rank: u64, k: u64) -> u64 {
        debug_assert!(rank < self.world_size && k < self.per_rank);
        let q = self.start_sample + rank + k * self.world_size;
        if q < self.n { q } else { q % self.n }
    }
}

/// The rows of one rank in one epoch, in the order it receives them.
#[derive(Debug, Clone)]
pub struct ShardOrder {
    order: EpochOrder,
    shares: Shares,
    rank: u64,
}

impl ShardOrder {
    /// Rank `rank`'s shard; fails if `rank` is not below the world size.
    pub fn new(order: EpochOrder, shares: Shares, rank: u32) -> Result<Self> {
        let rank = u64::from(rank);
        if rank >= shares.world_size {
            return Err(Error::invalid(format!(
                "rank {rank} is not below world_size {}",
                shares.world_size
            )));
        }
        Ok(Self {
            order,
            shares,
            rank,
        })
    }

    /// Rows this rank receives.
    pub fn len(&self) -> u64 {
        self.shares.per_rank
    }

    /// Whether this rank receives no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The row of this rank's `k`-th sample.
    pub fn row(&self, k: u64) -> u64 {
        self.order.row_at(self.shares.position(self.rank, k))
    }

    /// The rows of samples `range`, in order.
    pub fn rows(&self, range: std::ops::Range<u64>) -> Vec<u64> {
        let rank = self.rank;
        let mut rows: Vec<u64> = range.map(|k| self.shares.position(rank, k)).collect();
        self.order.rows_at(&mut rows, &mut Walk::default());
        rows
    }
}

/// A read plan in domain terms: how `world_size` ranks read one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadPlan {
    /// Dataset to read.
    pub dataset: String,
    /// Number of ranks, at least 1.
    pub world_size: u32,
    /// Epoch number; different epochs give different shuffled orders.
    pub epoch: u64,
    /// Seed of the shuffled orders.
    pub seed: u64,
    /// Global order of the epoch.
    pub shuffle: Shuffle,
    /// Rows per streamed record batch, at least 1.
    pub batch_rows: u32,
    /// Truncate to equal shares instead of padding by wrap-around.
    pub drop_last: bool,
    /// Projected columns in order; empty = all.
    pub columns: Vec<String>,
    /// Samples of this epoch already consumed.
    pub start_sample: u64,
    /// Which of a rank's batches this plan's streams carry.
    pub split: Split,
    /// Where each rank's rows come from (cluster datasets).
    pub locality: Locality,
    /// Ranks per node; 0 = spread evenly over the members.
    pub ranks_per_node: u32,
    /// Member location of each node ("" = none); empty = node i is member i.
    pub nodes: Vec<String>,
    /// World size `start_sample` was consumed at; 0 = `world_size`.
    pub resume_world_size: u32,
    /// SQL condition rows must meet to be read; empty = every row. The
    /// selected rows, in storage order, are the rows the order numbers.
    pub filter: String,
    /// SQL expressions (with `AS` aliases) to read instead of `columns`;
    /// empty = the columns as stored.
    pub select: Vec<String>,
    /// Each rank's stream ends after at most this many samples (0 = its
    /// whole share); the order and every position stay the plan's without
    /// it, only the end moves.
    pub max_rows: u64,
}

/// Where a rank's rows come from on a dataset spread over several members.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Locality {
    /// The order of one server holding every partition.
    #[default]
    Global,
    /// Each node's own rows, shuffled within the node, plus the least
    /// transfer that makes the counts equal.
    Node,
}

/// A share of a rank's stream: batches `b` with `b % count == index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    /// Readers sharing one rank's stream, at least 1.
    pub count: u32,
    /// This reader, below `count`.
    pub index: u32,
}

impl Split {
    /// The whole stream.
    pub const WHOLE: Split = Split { count: 1, index: 0 };
}

impl ReadPlan {
    /// `world_size` ranks reading every column of `dataset` in `shuffle`
    /// order, `batch_rows` a batch: epoch 0, seed 0, from the start, each
    /// rank's whole share, nothing filtered or derived.
    pub fn new(dataset: &str, world_size: u32, shuffle: Shuffle, batch_rows: u32) -> Self {
        Self {
            dataset: dataset.to_string(),
            world_size,
            epoch: 0,
            seed: 0,
            shuffle,
            batch_rows,
            drop_last: false,
            columns: Vec::new(),
            start_sample: 0,
            split: Split::WHOLE,
            locality: Locality::Global,
            ranks_per_node: 0,
            nodes: Vec::new(),
            resume_world_size: 0,
            filter: String::new(),
            select: Vec::new(),
            max_rows: 0,
        }
    }

    /// The order of this plan's epoch over `n` rows.
    pub fn epoch_order(&self, n: u64) -> EpochOrder {
        EpochOrder::new(n, self.shuffle, self.seed, self.epoch)
    }

    /// The equal shares of this plan over `n` rows.
    pub fn shares(&self, n: u64) -> Result<Shares> {
        Ok(
            Shares::new(n, self.world_size, self.start_sample, self.drop_last)?
                .at_most(self.max_rows),
        )
    }

    /// The sample ranges (of a rank's `rows` samples) of the batches this
    /// plan's stream carries, in order.
    pub fn stream_batches(&self, rows: u64) -> impl Iterator<Item = std::ops::Range<u64>> {
        (0..).map_while(move |j| self.stream_batch(rows, j))
    }

    /// The sample range of the `j`-th batch of this plan's stream (of a
    /// rank's `rows` samples); `None` past the last.
    pub fn stream_batch(&self, rows: u64, j: u64) -> Option<std::ops::Range<u64>> {
        let batch = u64::from(self.batch_rows.max(1));
        let count = u64::from(self.split.count.max(1));
        let b = j
            .checked_mul(count)?
            .checked_add(u64::from(self.split.index))?;
        let start = b.checked_mul(batch)?;
        (start < rows).then(|| start..start.saturating_add(batch).min(rows))
    }

    /// Rows and batches of the stream of a rank with `rows` samples.
    ///
    /// Computed, not counted: a dataset of null columns can claim 2^62 rows
    /// at no cost to its writer.
    pub fn stream_size(&self, rows: u64) -> (u64, u64) {
        let batch = u64::from(self.batch_rows.max(1));
        let count = u64::from(self.split.count.max(1));
        let index = u64::from(self.split.index);
        let all = rows.div_ceil(batch);
        if index >= all {
            return (0, 0);
        }
        let batches = (all - 1 - index) / count + 1;
        let last = index + (batches - 1) * count;
        let last_len = (rows - last * batch).min(batch);
        ((batches - 1) * batch + last_len, batches)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn shuffle_strategy() -> impl Strategy<Value = Shuffle> {
        prop_oneof![
            Just(Shuffle::None),
            Just(Shuffle::Global),
            (1u64..5_000).prop_map(|block_rows| Shuffle::Block { block_rows }),
        ]
    }

    /// All rows of every rank, by rank.
    fn read_all(n: u64, shuffle: Shuffle, seed: u64, epoch: u64, shares: Shares) -> Vec<Vec<u64>> {
        let order = EpochOrder::new(n, shuffle, seed, epoch);
        (0..shares.world_size())
            .map(|r| {
                let shard = ShardOrder::new(order.clone(), shares, r as u32).expect("rank < W");
                shard.rows(0..shard.len())
            })
            .collect()
    }

    #[test]
    fn none_is_partition_then_row_order() {
        let shares = Shares::new(10, 3, 0, false).expect("valid");
        let got = read_all(10, Shuffle::None, 1, 2, shares);
        assert_eq!(
            got,
            vec![vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
        );
    }

    #[test]
    fn drop_last_truncates() {
        let shares = Shares::new(10, 3, 0, true).expect("valid");
        assert_eq!(shares.per_rank(), 3);
        let got = read_all(10, Shuffle::None, 0, 0, shares);
        assert_eq!(got, vec![vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
    }

    #[test]
    fn more_ranks_than_rows_wraps() {
        let shares = Shares::new(2, 5, 0, false).expect("valid");
        let got = read_all(2, Shuffle::None, 0, 0, shares);
        assert_eq!(got, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
        let shares = Shares::new(2, 5, 0, true).expect("valid");
        assert_eq!(shares.per_rank(), 0);
    }

    #[test]
    fn empty_dataset_gives_empty_shards() {
        for shuffle in [
            Shuffle::None,
            Shuffle::Global,
            Shuffle::Block { block_rows: 4 },
        ] {
            for drop_last in [false, true] {
                let shares = Shares::new(0, 4, 0, drop_last).expect("valid");
                assert_eq!(shares.per_rank(), 0);
                assert!(read_all(0, shuffle, 0, 0, shares).iter().all(Vec::is_empty));
            }
        }
    }

    #[test]
    fn bad_shares_are_rejected() {
        assert!(Shares::new(10, 0, 0, false).is_err());
        assert!(Shares::new(10, 2, 11, false).is_err());
        assert!(Shares::new(10, 2, 10, false).is_ok());
        let shares = Shares::new(10, 2, 0, false).expect("valid");
        assert!(ShardOrder::new(EpochOrder::new(10, Shuffle::None, 0, 0), shares, 2).is_err());
    }

    /// A one-rank, unshuffled plan of `batch_rows` batches, split by `split`.
    fn split_plan(batch_rows: u32, split: Split) -> ReadPlan {
        ReadPlan {
            dataset: "d".into(),
            world_size: 1,
            epoch: 0,
            seed: 0,
            shuffle: Shuffle::None,
            batch_rows,
            drop_last: false,
            columns: vec![],
            start_sample: 0,
            split,
            locality: Locality::Global,
            ranks_per_node: 0,
            nodes: vec![],
            resume_world_size: 0,
            filter: String::new(),
            select: Vec::new(),
            max_rows: 0,
        }
    }

    #[test]
    fn splits_partition_a_ranks_batches() {
        for split_count in 1..5u32 {
            let mut seen = Vec::new();
            let mut total = 0;
            for index in 0..split_count {
                let plan = split_plan(
                    10,
                    Split {
                        count: split_count,
                        index,
                    },
                );
                let (rows, _) = plan.stream_size(95);
                total += rows;
                seen.extend(plan.stream_batches(95).flatten());
            }
            seen.sort_unstable();
            assert_eq!(seen, (0..95).collect::<Vec<_>>());
            assert_eq!(total, 95);
        }
    }

    #[test]
    fn block_mode_keeps_blocks_together() {
        let n = 1_000;
        let k = 10;
        let order = EpochOrder::new(n, Shuffle::Block { block_rows: k }, 3, 1);
        for slot in 0..n / k {
            let first_block = order.row_at(slot * k) / k;
            for off in 0..k {
                assert_eq!(order.row_at(slot * k + off) / k, first_block);
            }
        }
    }

    #[test]
    fn fixed_orders_never_change() {
        // Determinism across builds and days is part of the contract.
        let g = EpochOrder::new(100, Shuffle::Global, 42, 3);
        let b = EpochOrder::new(100, Shuffle::Block { block_rows: 8 }, 42, 3);
        let g8: Vec<u64> = (0..8).map(|p| g.row_at(p)).collect();
        let b8: Vec<u64> = (0..8).map(|p| b.row_at(p)).collect();
        assert_eq!((g8, b8), (PINNED_GLOBAL.to_vec(), PINNED_BLOCK.to_vec()));
    }

    const PINNED_GLOBAL: [u64; 8] = [85, 56, 25, 74, 21, 91, 99, 31];
    const PINNED_BLOCK: [u64; 8] = [70, 65, 68, 67, 64, 66, 69, 71];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]

        /// `max_rows` ends every rank's stream early and moves nothing else:
        /// the same positions, at most that many of them.
        #[test]
        fn max_rows_moves_only_the_end(
            n in 0u64..2_000, w in 1u32..9, start in 0u64..2_000, drop_last: bool,
            max in 0u64..400,
        ) {
            let start = start.min(n);
            let whole = Shares::new(n, w, start, drop_last).expect("shares");
            let cut = whole.at_most(max);
            let expected = if max == 0 { whole.per_rank() } else { whole.per_rank().min(max) };
            prop_assert_eq!(cut.per_rank(), expected);
            for rank in 0..u64::from(w) {
                for k in 0..cut.per_rank() {
                    prop_assert_eq!(cut.position(rank, k), whole.position(rank, k));
                }
            }
        }

        /// The computed stream size is the size of the batches streamed.
        #[test]
        fn stream_size_counts_the_streamed_batches(
            rows in 0u64..5_000, batch_rows in 0u32..300, count in 0u32..9, index in 0u32..10,
        ) {
            let plan = split_plan(batch_rows, Split { count, index });
            let counted = plan
                .stream_batches(rows)
                .fold((0, 0), |(r, b), range| (r + range.end - range.start, b + 1));
            prop_assert_eq!(plan.stream_size(rows), counted);
        }

        /// Every epoch order is a permutation of the rows.
        #[test]
        fn epoch_order_is_a_permutation(
            n in 0u64..20_000, shuffle in shuffle_strategy(), seed: u64, epoch in 0u64..1_000,
        ) {
            let order = EpochOrder::new(n, shuffle, seed, epoch);
            let mut seen = vec![false; n as usize];
            for p in 0..n {
                let row = order.row_at(p);
                prop_assert!(row < n);
                prop_assert!(!seen[row as usize], "row {} twice", row);
                seen[row as usize] = true;
            }
        }

        /// Equal counts; disjoint, complete coverage; the exact wrap-around.
        #[test]
        fn shares_are_equal_disjoint_and_complete(
            n in 0u64..100_000, w in 1u32..=64, shuffle in shuffle_strategy(),
            seed: u64, epoch in 0u64..1_000, drop_last: bool, start_frac in 0.0f64..=1.0,
        ) {
            let start = ((n as f64) * start_frac) as u64;
            let shares = Shares::new(n, w, start, drop_last).expect("valid plan");
            let order = EpochOrder::new(n, shuffle, seed, epoch);
            let per_rank = read_all(n, shuffle, seed, epoch, shares);
            let remaining = n - start;
            let w64 = u64::from(w);
            let expected = if drop_last { remaining / w64 } else { remaining.div_ceil(w64) };
            for rows in &per_rank {
                prop_assert_eq!(rows.len() as u64, expected);
            }
            // The first `remaining` samples (in global step order) are exactly
            // positions start..n, each once; the rest wrap to the epoch's start.
            let mut seen = HashSet::new();
            let mut wrapped = Vec::new();
            for k in 0..expected {
                for r in 0..w64 {
                    let global = k * w64 + r;
                    let row = per_rank[r as usize][k as usize];
                    if global < remaining {
                        prop_assert!(seen.insert(row), "row {} read twice", row);
                    } else {
                        wrapped.push(row);
                    }
                }
            }
            let expected_rows: HashSet<u64> = (start..n.min(start + expected * w64))
                .map(|p| order.row_at(p))
                .collect();
            prop_assert_eq!(seen.len() as u64, remaining.min(expected * w64));
            prop_assert_eq!(&seen, &expected_rows);
            if drop_last {
                prop_assert!(wrapped.is_empty());
                prop_assert!(remaining - expected * w64 < w64);
            } else {
                prop_assert!((wrapped.len() as u64) < w64);
                for (i, row) in wrapped.iter().enumerate() {
                    prop_assert_eq!(*row, order.row_at((n + i as u64) % n));
                }
            }
        }

        /// Shuffled orders depend on (seed, epoch) and nothing else. (At
        /// least 29 blocks: two orders coincide by chance only about once
        /// in 29! seeds.)
        #[test]
        fn shuffled_orders_are_keyed_by_seed_and_epoch(
            n in 200u64..5_000, seed: u64, epoch in 0u64..1_000,
            block in prop_oneof![Just(None), (1u64..8).prop_map(Some)],
        ) {
            let shuffle = match block {
                None => Shuffle::Global,
                Some(block_rows) => Shuffle::Block { block_rows },
            };
            let rows = |s, e| -> Vec<u64> {
                let o = EpochOrder::new(n, shuffle, s, e);
                (0..n).map(|p| o.row_at(p)).collect()
            };
            let a = rows(seed, epoch);
            prop_assert_eq!(&a, &rows(seed, epoch));
            prop_assert_ne!(&a, &rows(seed, epoch + 1));
            prop_assert_ne!(&a, &rows(seed.wrapping_add(1), epoch));
        }

        /// Stop after k steps of W ranks, resume at k·W with W': every
        /// remaining sample exactly once, none seen before.
        #[test]
        fn rows_of_a_range_are_each_samples_row(
            n in 1u64..50_000, w in 1u32..=16, shuffle in shuffle_strategy(), seed: u64,
            epoch in 0u64..100, start_frac in 0.0f64..=1.0, drop_last: bool, a: u64, b: u64,
        ) {
            let order = EpochOrder::new(n, shuffle, seed, epoch);
            let start = ((n as f64) * start_frac) as u64;
            let shares = Shares::new(n, w, start, drop_last).expect("valid");
            let shard = ShardOrder::new(order, shares, (a % u64::from(w)) as u32).expect("rank");
            let len = shard.len();
            let (lo, hi) = if len == 0 { (0, 0) } else { (a % len, b % (len + 1)) };
            let range = lo.min(hi)..lo.max(hi);
            let one_by_one: Vec<u64> = range.clone().map(|k| shard.row(k)).collect();
            prop_assert_eq!(shard.rows(range), one_by_one);
        }

        #[test]
        fn resume_with_another_world_size_sees_exactly_the_rest(
            n in 1u64..50_000, w in 1u32..=64, w2 in 1u32..=64,
            shuffle in shuffle_strategy(), seed: u64, epoch in 0u64..100, step_frac in 0.0f64..=1.0,
        ) {
            let w2 = if w2 == w { w % 64 + 1 } else { w2 };
            let order = EpochOrder::new(n, shuffle, seed, epoch);
            let first = Shares::new(n, w, 0, true).expect("valid");
            let k = ((first.per_rank() as f64) * step_frac) as u64;
            let mut seen = HashSet::new();
            for r in 0..u64::from(w) {
                let shard = ShardOrder::new(order.clone(), first, r as u32).expect("rank");
                for row in shard.rows(0..k) {
                    prop_assert!(seen.insert(row));
                }
            }
            let start = k * u64::from(w);
            let resumed = Shares::new(n, w2, start, false).expect("valid resume");
            let remaining = n - start;
            let mut rest = HashSet::new();
            for kk in 0..resumed.per_rank() {
                for r in 0..u64::from(w2) {
                    if kk * u64::from(w2) + r >= remaining {
                        continue; // wrap-around padding
                    }
                    let shard = ShardOrder::new(order.clone(), resumed, r as u32).expect("rank");
                    let row = shard.row(kk);
                    prop_assert!(!seen.contains(&row), "row {} seen before the stop", row);
                    prop_assert!(rest.insert(row), "row {} twice after resume", row);
                }
            }
            prop_assert_eq!(seen.len() as u64 + rest.len() as u64, n);
        }
    }
}
