//! What a SQL query holds of its own (hash tables, a join's build side, sort
//! buffers), charged to the server's [`Budget`] as it grows.
//!
//! DataFusion asks its memory pool before it grows an operator's memory.
//! [`QueryPool`] answers with two limits: the query's own cap (a share of
//! the budget, so one query cannot take it all) and what the budget has
//! free, so queries and the cache together never hold more than
//! `--memory-limit`. What a query held goes back to the budget as its
//! operators shrink and when it ends.

use std::fmt;
use std::num::NonZeroUsize;
use std::sync::Arc;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::memory_pool::{
    GreedyMemoryPool, MemoryConsumer, MemoryLimit, MemoryPool, MemoryReservation,
    TrackConsumersPool,
};

use super::Budget;
use crate::error::Error;

/// The start of the message of a query refused because the server's
/// budget is full (rather than because the query reached its own cap).
pub const BUDGET_FULL: &str = "the server's memory budget is full";

/// A query's memory pool: its own cap, charged to the server's budget.
#[derive(Debug)]
pub struct QueryPool {
    /// The query's cap (a greedy pool, naming its largest consumers when
    /// it refuses).
    cap: TrackConsumersPool<GreedyMemoryPool>,
    budget: Arc<Budget>,
}

impl QueryPool {
    /// A pool of at most `cap` bytes, each of them taken from `budget`.
    pub fn new(cap: usize, budget: Arc<Budget>) -> Self {
        Self {
            cap: TrackConsumersPool::new(
                GreedyMemoryPool::new(cap),
                NonZeroUsize::new(5).unwrap_or(NonZeroUsize::MIN),
            ),
            budget,
        }
    }
}

impl fmt::Display for QueryPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "query pool ({}) within the server's budget", self.cap)
    }
}

impl MemoryPool for QueryPool {
    fn name(&self) -> &str {
        "flightdeck-query"
    }

    fn register(&self, consumer: &MemoryConsumer) {
        self.cap.register(consumer);
    }

    fn unregister(&self, consumer: &MemoryConsumer) {
        self.cap.unregister(consumer);
    }

    /// Growth DataFusion does not let fail (small bookkeeping): counted in
    /// the budget even past its limit, and returned on shrink.
    fn grow(&self, reservation: &MemoryReservation, additional: usize) {
        self.cap.grow(reservation, additional);
        self.budget.take(additional as u64);
    }

    fn shrink(&self, reservation: &MemoryReservation, shrink: usize) {
        self.cap.shrink(reservation, shrink);
        self.budget.release(shrink as u64);
    }

    fn try_grow(&self, reservation: &MemoryReservation, additional: usize) -> Result<()> {
        let what = || format!("the query's {}", reservation.consumer().name());
        match self.budget.try_take(additional as u64, &what) {
            Ok(()) => {}
            Err(Error::ResourceExhausted(m)) => {
                return Err(DataFusionError::ResourcesExhausted(format!(
                    "{BUDGET_FULL}: {m}"
                )));
            }
            Err(e) => return Err(DataFusionError::External(Box::new(e))),
        }
        self.cap.try_grow(reservation, additional).inspect_err(|_| {
            self.budget.release(additional as u64);
        })
    }

    fn reserved(&self) -> usize {
        self.cap.reserved()
    }

    fn memory_limit(&self) -> MemoryLimit {
        self.cap.memory_limit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reservation(pool: &Arc<QueryPool>, name: &str) -> MemoryReservation {
        let pool: Arc<dyn MemoryPool> = pool.clone();
        MemoryConsumer::new(name).register(&pool)
    }

    #[test]
    fn a_query_is_charged_to_the_budget_and_gives_it_back() {
        let budget = Budget::new(1000);
        let pool = Arc::new(QueryPool::new(600, budget.clone()));
        let r = reservation(&pool, "hash join");
        r.try_grow(400).expect("within cap and budget");
        assert_eq!(budget.used(), 400);
        assert_eq!(pool.reserved(), 400);
        r.shrink(100);
        assert_eq!(budget.used(), 300);
        // Infallible growth is counted too.
        r.grow(50);
        assert_eq!(budget.used(), 350);
        drop(r);
        assert_eq!(budget.used(), 0);
        assert_eq!(pool.reserved(), 0);
    }

    #[test]
    fn the_query_cap_refuses_and_takes_nothing() {
        let budget = Budget::new(1000);
        let pool = Arc::new(QueryPool::new(600, budget.clone()));
        let r = reservation(&pool, "sort");
        r.try_grow(500).expect("fits");
        let err = r.try_grow(200).expect_err("past the query's cap");
        assert!(
            matches!(err.find_root(), DataFusionError::ResourcesExhausted(m) if !m.starts_with(BUDGET_FULL)),
            "{err}"
        );
        assert_eq!(budget.used(), 500);
    }

    #[test]
    fn a_full_budget_refuses_a_query_that_fits_its_cap() {
        let budget = Budget::new(1000);
        budget
            .try_take(700, &|| "cached data".into())
            .expect("fits");
        let pool = Arc::new(QueryPool::new(600, budget.clone()));
        let r = reservation(&pool, "hash join");
        r.try_grow(200).expect("fits both");
        let err = r.try_grow(200).expect_err("the budget has 100 left");
        match err.find_root() {
            DataFusionError::ResourcesExhausted(m) => {
                assert!(m.starts_with(BUDGET_FULL), "{m}");
                assert!(m.contains("hash join"), "{m}");
            }
            other => panic!("{other}"),
        }
        assert_eq!(budget.used(), 900);
        assert_eq!(pool.reserved(), 200);
    }
}
