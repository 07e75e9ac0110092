//! Memory tiers: the budget, the host arena, the device tier and the spill
//! store.
//!
//! - [`Budget`]: `--memory-limit`. Memory is taken from it *before* data is
//!   copied, so concurrent ingest can never overshoot the limit; a refusal is
//!   a `ResourceExhausted` error for that one request, never a dead server.
//! - [`arena`]: the slabs every cached byte lives in (page-locked with a CUDA
//!   driver), charged to the budget slab by slab.
//! - [`device`]: the CUDA driver when present; columns placed on GPUs.
//! - [`spill`]: sealed datasets as Parquet in an object store, for spill and
//!   for persistence across restarts.
//!
//! None of these know about the Flight protocol; the server's state ties
//! them to the catalog.

pub mod arena;
pub mod device;
pub mod spill;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// A hard limit on the bytes the cache may hold, shared by all requests.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
    /// The most `used` has been since start.
    peak: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes currently reserved.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    /// The most bytes reserved at once since start.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Takes `bytes` from the budget, or fails without taking anything.
    pub(crate) fn try_take(&self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let next = used.saturating_add(bytes);
            if next > self.limit {
                return Err(Error::ResourceExhausted(format!(
                    "{} needs {bytes} more bytes but the memory budget has {} of {} bytes free; \
                     drop datasets that are no longer needed or start the server with a larger \
                     --memory-limit",
                    what(),
                    self.limit - used.min(self.limit),
                    self.limit
                )));
            }
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::AcqRel);
                    return Ok(());
                }
                Err(actual) => used = actual,
            }
        }
    }

    /// Sets `bytes` aside for one writer (a [`Reservation`]), or fails
    /// without taking anything.
    pub fn try_reserve(
        self: &Arc<Self>,
        bytes: u64,
        what: &dyn Fn() -> String,
    ) -> Result<Reservation> {
        self.try_take(bytes, what)?;
        Ok(Reservation {
            budget: self.clone(),
            left: bytes,
        })
    }

    /// Takes `bytes`, first from what `reservation` still holds, the rest
    /// from the budget; fails without taking anything.
    pub(crate) fn take_reserved(
        &self,
        bytes: u64,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let Some(r) = reservation else {
            return self.try_take(bytes, what);
        };
        let covered = r.left.min(bytes);
        if covered < bytes {
            self.try_take(bytes - covered, what)?;
        }
        r.left -= covered;
        Ok(())
    }

    /// Returns `bytes` to the budget (memory of dropped data).
    pub fn release(&self, bytes: u64) {
        let prev = self.used.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(
            prev >= bytes,
            "released {bytes} bytes with only {prev} used"
        );
    }
}

/// Budget set aside for one writer that said up front how much it will
/// send: its allocations draw on it first ([`Budget::take_reserved`]), and
/// what is left returns to the budget when it is dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    left: u64,
}

impl Reservation {
    /// Bytes still set aside.
    pub fn left(&self) -> u64 {
        self.left
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.left > 0 {
            self.budget.release(self.left);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_never_overshoot_and_name_the_request() {
        let budget = Budget::new(100);
        budget.try_take(60, &|| "a".into()).expect("fits");
        let err = budget
            .try_take(50, &|| "partition 3 of 'd'".into())
            .expect_err("over the limit");
        assert!(err.to_string().contains("partition 3 of 'd'"), "{err}");
        assert_eq!(budget.used(), 60);
        budget.try_take(40, &|| "b".into()).expect("fits exactly");
        assert_eq!(budget.used(), 100);
        budget.release(100);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.peak(), 100);
    }

    #[test]
    fn a_reservation_is_drawn_on_first_and_returns_what_is_left() {
        let budget = Budget::new(100);
        let mut r = budget.try_reserve(60, &|| "a".into()).expect("fits");
        assert!(budget.try_reserve(50, &|| "b".into()).is_err());
        budget
            .take_reserved(40, Some(&mut r), &|| "a".into())
            .expect("covered");
        assert_eq!((budget.used(), r.left()), (60, 20));
        // Past the reservation: the rest comes from the budget.
        budget
            .take_reserved(30, Some(&mut r), &|| "a".into())
            .expect("fits");
        assert_eq!((budget.used(), r.left()), (70, 0));
        let mut r2 = budget.try_reserve(30, &|| "b".into()).expect("fits");
        drop(r2);
        assert_eq!(budget.used(), 70);
        r2 = budget.try_reserve(10, &|| "c".into()).expect("fits");
        // Not enough left anywhere: nothing is taken.
        assert!(
            budget
                .take_reserved(40, Some(&mut r2), &|| "c".into())
                .is_err()
        );
        assert_eq!((budget.used(), r2.left()), (80, 10));
        drop(r2);
        drop(r);
        assert_eq!(budget.used(), 70);
    }

    #[test]
    fn concurrent_takes_respect_the_limit() {
        let budget = Budget::new(1_000);
        let taken: u64 = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let budget = budget.clone();
                    s.spawn(move || {
                        let mut mine = 0u64;
                        for _ in 0..100 {
                            if budget.try_take(7, &String::new).is_err() {
                                break;
                            }
                            mine += 7;
                        }
                        mine
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .sum()
        });
        assert!(taken <= 1_000);
        assert_eq!(taken, budget.used());
        // Free space only shrinks, and some thread failed: less than one take is left.
        assert!(1_000 - taken < 7);
    }
}
