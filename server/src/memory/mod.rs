//! Memory accounting: the budget every cached byte is charged to.
//!
//! The budget is reserved *before* data is kept, so concurrent ingest can never
//! overshoot `--memory-limit`; a refused reservation is a `ResourceExhausted`
//! error for that one request, never a dead server. This module owns counting
//! only: it does not know about datasets or the Flight protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// A hard limit on the bytes the cache may hold, shared by all requests.
#[derive(Debug)]
pub struct Budget {
    limit: u64,
    used: AtomicU64,
}

impl Budget {
    /// A budget of `limit` bytes, none used.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicU64::new(0),
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

    /// Takes `bytes` from the budget, or fails without taking anything.
    fn try_take(&self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
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
                Ok(_) => return Ok(()),
                Err(actual) => used = actual,
            }
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

/// Bytes held for one in-flight request; returned to the budget on drop
/// unless [`Reservation::keep`] hands them over to the catalog.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: u64,
}

impl Reservation {
    /// An empty reservation against `budget`.
    pub fn new(budget: Arc<Budget>) -> Self {
        Self { budget, bytes: 0 }
    }

    /// Grows the reservation by `bytes`, or fails leaving it as it was.
    /// `what` describes the request for the error message.
    pub fn grow(&mut self, bytes: u64, what: impl Fn() -> String) -> Result<()> {
        self.budget.try_take(bytes, &what)?;
        self.bytes += bytes;
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Keeps the bytes charged: from now on whoever holds the data releases
    /// them with [`Budget::release`].
    pub fn keep(mut self) -> u64 {
        std::mem::take(&mut self.bytes)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.release(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_never_overshoot_and_return_on_drop() {
        let budget = Budget::new(100);
        let mut a = Reservation::new(budget.clone());
        a.grow(60, || "a".into()).expect("fits");
        let mut b = Reservation::new(budget.clone());
        let err = b
            .grow(50, || "partition 3 of 'd'".into())
            .expect_err("over the limit");
        assert!(err.to_string().contains("partition 3 of 'd'"), "{err}");
        assert_eq!(budget.used(), 60);
        b.grow(40, || "b".into()).expect("fits exactly");
        assert_eq!(budget.used(), 100);
        drop(b);
        assert_eq!(budget.used(), 60);
        let kept = a.keep();
        assert_eq!((kept, budget.used()), (60, 60));
        budget.release(kept);
        assert_eq!(budget.used(), 0);
    }

    #[test]
    fn concurrent_reservations_respect_the_limit() {
        let budget = Budget::new(1_000);
        let held: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let budget = budget.clone();
                    s.spawn(move || {
                        let mut r = Reservation::new(budget);
                        for _ in 0..100 {
                            if r.grow(7, String::new).is_err() {
                                break;
                            }
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("no panic"))
                .collect()
        });
        let total: u64 = held.iter().map(Reservation::bytes).sum();
        assert!(total <= 1_000);
        assert_eq!(total, budget.used());
        // Free space only shrinks, and some thread failed: less than one grow is left.
        assert!(1_000 - total < 7);
    }
}
