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
//! - [`heartbeat`]: which servers use the spill store, so that a stopped
//!   server's files are removed and a running one's never taken.
//! - [`query_pool`]: what a SQL query holds of its own, charged to the
//!   budget as it grows.
//!
//! None of these know about the Flight protocol; the server's state ties
//! them to the catalog.

pub mod arena;
pub mod device;
pub mod heartbeat;
pub mod query_pool;
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

    /// Bytes not reserved.
    pub fn free(&self) -> u64 {
        self.limit.saturating_sub(self.used())
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

    /// Takes `bytes` even past the limit: for growth its caller cannot
    /// refuse (a query's small bookkeeping), returned with
    /// [`Self::release`].
    pub(crate) fn take(&self, bytes: u64) {
        let next = self.used.fetch_add(bytes, Ordering::AcqRel) + bytes;
        self.peak.fetch_max(next, Ordering::AcqRel);
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

    /// Takes `bytes` of new memory, of which the caller's own data is
    /// `share`: that share is drawn from what `reservation` still holds, the
    /// rest (the part of a new slab other writers will fill) from the
    /// budget; fails without taking anything.
    pub(crate) fn take_reserved(
        &self,
        bytes: u64,
        share: u64,
        reservation: Option<&mut Reservation>,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let Some(r) = reservation else {
            return self.try_take(bytes, what);
        };
        let covered = r.left.min(share).min(bytes);
        if covered < bytes {
            self.try_take(bytes - covered, what)?;
        }
        r.left -= covered;
        Ok(())
    }

    /// A reserved writer's `share` bytes landed in memory the budget already
    /// counts (a slab another allocation paid for): that much of its
    /// reservation is no longer needed and goes back.
    ///
    /// So a reservation follows its writer's own data exactly, whoever paid
    /// for the slabs: a writer that opened a slab others fill is never short
    /// while their reservations hold what it paid (measured before: the
    /// third of three admitted 64 MiB writers refused mid-stream).
    pub(crate) fn settle(&self, share: u64, reservation: Option<&mut Reservation>) {
        if let Some(r) = reservation {
            let covered = r.left.min(share);
            r.left -= covered;
            self.release(covered);
        }
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
/// send. It follows the writer's own data: each allocation draws its size
/// from it, whether it opens a new slab (the rest of which the budget pays)
/// or lands in one already paid for (and that much goes back to the
/// budget). What is left returns to the budget when it is dropped.
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
            .take_reserved(40, 40, Some(&mut r), &|| "a".into())
            .expect("covered");
        assert_eq!((budget.used(), r.left()), (60, 20));
        // Past the reservation: the rest comes from the budget.
        budget
            .take_reserved(30, 30, Some(&mut r), &|| "a".into())
            .expect("fits");
        assert_eq!((budget.used(), r.left()), (70, 0));
        let mut r2 = budget.try_reserve(30, &|| "b".into()).expect("fits");
        drop(r2);
        assert_eq!(budget.used(), 70);
        r2 = budget.try_reserve(10, &|| "c".into()).expect("fits");
        // Not enough left anywhere: nothing is taken.
        assert!(
            budget
                .take_reserved(40, 40, Some(&mut r2), &|| "c".into())
                .is_err()
        );
        assert_eq!((budget.used(), r2.left()), (80, 10));
        drop(r2);
        drop(r);
        assert_eq!(budget.used(), 70);
    }

    #[test]
    fn a_reservation_pays_for_its_own_data_not_for_the_slabs_others_fill() {
        let budget = Budget::new(100);
        let mut a = budget.try_reserve(30, &|| "a".into()).expect("fits");
        let mut b = budget.try_reserve(30, &|| "b".into()).expect("fits");
        // `a` opens a 40-byte slab for 10 bytes of its own: 10 from its
        // reservation, 30 from the budget.
        budget
            .take_reserved(40, 10, Some(&mut a), &|| "a".into())
            .expect("fits");
        assert_eq!((budget.used(), a.left()), (90, 20));
        // `b` fills 25 bytes of that slab: paid already, so 25 of its
        // reservation goes back.
        budget.settle(25, Some(&mut b));
        assert_eq!((budget.used(), b.left()), (65, 5));
        // `a` still holds what its remaining 20 bytes need, and opens the next
        // slab with them.
        budget
            .take_reserved(40, 20, Some(&mut a), &|| "a".into())
            .expect("fits");
        assert_eq!((budget.used(), a.left()), (85, 0));
        // A settle never returns more than is left.
        budget.settle(50, Some(&mut b));
        assert_eq!((budget.used(), b.left()), (80, 0));
        budget.settle(50, None);
        assert_eq!(budget.used(), 80);
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
