//! Where a sealed dataset's rows are: the first row of each stored batch,
//! and a table of equal row buckets naming the batches each spans, so that
//! finding a row's batch is a lookup and a compare or two rather than a
//! binary search over every batch (one per row of a shuffled read, its
//! branches unpredictable).

/// The batch of every global row of a dataset.
#[derive(Debug, Clone)]
pub struct RowIndex {
    /// `starts[i]` is the first row of batch `i`; one extra entry = rows.
    starts: Vec<u64>,
    /// `buckets[k]`: the batch holding row `k << shift` (the last batch's
    /// for rows past the end); one extra entry past the last bucket.
    buckets: Vec<u32>,
    /// Log2 of a bucket's rows: at most half a batch's average.
    shift: u32,
}

impl RowIndex {
    /// The index of batches of `sizes` rows each, in row order (none 0).
    pub fn new(sizes: impl IntoIterator<Item = u64>) -> Self {
        let mut starts = vec![0u64];
        for rows in sizes {
            starts.push(starts[starts.len() - 1] + rows);
        }
        let batches = starts.len() - 1;
        let rows = starts[batches];
        // About two buckets a batch: the table stays small whatever the
        // rows, and most buckets fall in one batch.
        let per_bucket = (rows / (2 * batches.max(1) as u64)).max(1);
        let shift = per_bucket.ilog2();
        let mut buckets = Vec::with_capacity((rows >> shift) as usize + 2);
        let mut b = 0usize;
        for k in 0..(rows >> shift) + 2 {
            let first = (k << shift).min(rows.saturating_sub(1));
            while b + 1 < batches && starts[b + 1] <= first {
                b += 1;
            }
            // A batch index fits u32: a dataset's batches are Flight
            // messages, far fewer than 2^32.
            buckets.push(b as u32);
        }
        Self {
            starts,
            buckets,
            shift,
        }
    }

    /// Total rows.
    pub fn rows(&self) -> u64 {
        self.starts[self.starts.len() - 1]
    }

    /// `(batch index, row within batch)` of global row `row` (below
    /// [`Self::rows`]).
    #[inline]
    pub fn locate(&self, row: u64) -> (usize, usize) {
        debug_assert!(row < self.rows());
        // The batches of the bucket's first row and of the next bucket's:
        // `row`'s is one of them or between (a row past the end, a
        // caller's bug, lands in the last batch).
        let k = ((row >> self.shift) as usize).min(self.buckets.len() - 2);
        let (lo, hi) = (self.buckets[k] as usize, self.buckets[k + 1] as usize);
        let batch = if hi <= lo + 1 {
            // The bucket lies in one batch or spans two (all do when the
            // batches are about equal): one compare and no branch, where a
            // search of zero or one boundaries would mispredict about every
            // other row of a shuffled read.
            let next = self.starts.get(lo + 1).is_some_and(|&s| s <= row);
            (lo + usize::from(next)).min(self.starts.len().saturating_sub(2))
        } else {
            lo + self.starts[lo + 1..=hi].partition_point(|&s| s <= row)
        };
        (batch, (row - self.starts[batch]) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn every_row_is_found_in_its_batch(
            sizes in proptest::collection::vec(
                prop_oneof![1u64..4, 1u64..100, Just(16_384u64), 1u64..50_000],
                0..40,
            ),
        ) {
            let index = RowIndex::new(sizes.iter().copied());
            prop_assert_eq!(index.rows(), sizes.iter().sum::<u64>());
            let mut row = 0u64;
            for (b, &size) in sizes.iter().enumerate() {
                // Every row of small batches, the edges and a few inside of
                // large ones.
                let within: Vec<u64> = if size <= 300 {
                    (0..size).collect()
                } else {
                    vec![0, 1, size / 3, size / 2, size - 2, size - 1]
                };
                for r in within {
                    prop_assert_eq!(index.locate(row + r), (b, r as usize));
                }
                row += size;
            }
        }
    }

    #[test]
    fn the_table_stays_about_two_buckets_a_batch() {
        let index = RowIndex::new([1, 1_000_000, 3, 16_384, 7]);
        assert!(
            index.buckets.len() <= 2 * 5 * 2 + 2,
            "{}",
            index.buckets.len()
        );
        assert_eq!(index.locate(1_000_001), (2, 0));
        assert_eq!(index.locate(1_016_390), (4, 2));
        let none = RowIndex::new([]);
        assert_eq!(none.rows(), 0);
    }
}
