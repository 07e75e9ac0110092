//! What read streams hold between the gather and the socket: each stream's
//! Outbox ([`outbox`]) of batches read ahead, and the server-wide [`ReadAhead`]
//! allowance those batches are charged to.
//!
//! Every gathered batch is charged to the allowance before it is gathered
//! (by an estimate, settled to its encoded size after) and its charge is
//! released only when the last of its bytes is dropped — by the HTTP/2
//! layer after writing them, or by a purge. So the server's memory for read
//! streams is bounded by the allowance however many readers there are and
//! however slowly they read, rather than by a number of batches per stream.
//! A stream that already holds batches may only take the allowance up to
//! three quarters: the last quarter is kept for streams that hold nothing
//! (a reader starting, or one keeping up), so others' read-ahead cannot
//! shut them out. A batch larger than the whole allowance still goes when
//! nothing else is charged.
//!
//! A reader that takes nothing for `--stream-idle-timeout` has its outbox
//! purged — the batches queued for it and the rest of the message it was
//! being sent are dropped, their charges with them — and its stream ends
//! with `ABORTED`. Unlike a channel, the outbox can be emptied from the
//! sending side, so a stalled reader cannot pin memory (or the allowance)
//! past its timeout.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use tokio::sync::Notify;

use super::ipc::IpcMessage;
use crate::error::{Error, Result};

/// The server-wide allowance for batches gathered ahead of the socket.
#[derive(Debug)]
pub struct ReadAhead {
    limit: u64,
    used: Mutex<u64>,
    freed: Notify,
}

impl ReadAhead {
    /// An allowance of `limit` bytes.
    pub fn new(limit: u64) -> Arc<Self> {
        Arc::new(Self {
            limit: limit.max(1),
            used: Mutex::new(0),
            freed: Notify::new(),
        })
    }

    /// The allowance, in bytes.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes charged now.
    pub fn used(&self) -> u64 {
        *self.lock()
    }

    fn lock(&self) -> MutexGuard<'_, u64> {
        self.used.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Charges `bytes` for a stream holding `held` bytes already, if the
    /// allowance has room for them (see the module's rules).
    fn try_take(self: &Arc<Self>, bytes: u64, held: u64) -> bool {
        let mut used = self.lock();
        let cap = if held == 0 {
            self.limit
        } else {
            self.limit / 4 * 3
        };
        let fits = used.saturating_add(bytes) <= cap || (held == 0 && *used == 0);
        if fits {
            *used += bytes;
        }
        fits
    }

    /// Charges `bytes` whether or not they fit: a settled estimate.
    fn force(&self, bytes: u64) {
        *self.lock() += bytes;
    }

    fn give(&self, bytes: u64) {
        if bytes == 0 {
            return;
        }
        {
            let mut used = self.lock();
            *used = used.saturating_sub(bytes);
        }
        self.freed.notify_waiters();
    }
}

/// One stream's share of the allowance: what it holds now, and the charges
/// it takes.
#[derive(Debug, Clone)]
pub struct Account {
    pool: Arc<ReadAhead>,
    held: Arc<AtomicU64>,
}

impl Account {
    /// A new stream's account with `pool`.
    pub fn new(pool: Arc<ReadAhead>) -> Self {
        Self {
            pool,
            held: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Bytes this stream holds.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }

    /// A charge of `bytes` if the allowance has room now.
    pub fn try_charge(&self, bytes: u64) -> Option<Charge> {
        self.pool
            .try_take(bytes, self.held())
            .then(|| self.charged(bytes))
    }

    /// A charge of `bytes`, waiting (on no thread) until the allowance has
    /// room.
    pub async fn charge(&self, bytes: u64) -> Charge {
        loop {
            let freed = self.pool.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if let Some(c) = self.try_charge(bytes) {
                return c;
            }
            freed.await;
        }
    }

    fn charged(&self, bytes: u64) -> Charge {
        self.held.fetch_add(bytes, Ordering::AcqRel);
        Charge {
            account: self.clone(),
            bytes,
        }
    }
}

/// Bytes charged to the allowance; released when dropped.
#[derive(Debug)]
pub struct Charge {
    account: Account,
    bytes: u64,
}

impl Charge {
    /// Settles an estimate to `bytes`: takes the difference (even past the
    /// allowance: the batch exists) or gives it back.
    fn settle(&mut self, bytes: u64) {
        let a = &self.account;
        if bytes > self.bytes {
            a.pool.force(bytes - self.bytes);
            a.held.fetch_add(bytes - self.bytes, Ordering::AcqRel);
        } else {
            a.pool.give(self.bytes - bytes);
            a.held.fetch_sub(self.bytes - bytes, Ordering::AcqRel);
        }
        self.bytes = bytes;
    }

    /// Splits off a charge of `bytes` (at most what this one holds).
    fn split(&mut self, bytes: u64) -> Charge {
        let bytes = bytes.min(self.bytes);
        self.bytes -= bytes;
        Charge {
            account: self.account.clone(),
            bytes,
        }
    }

    /// Makes each body piece of `messages` carry its share of this charge
    /// (settled to their total first), so that each share is released when
    /// the last copy of its piece is dropped.
    pub fn attach(mut self, messages: &mut [IpcMessage]) {
        let total = messages.iter().map(|m| m.body_len as u64).sum();
        self.settle(total);
        for m in messages {
            for piece in &mut m.body {
                let charge = self.split(piece.len() as u64);
                *piece = Bytes::from_owner(Charged {
                    bytes: std::mem::take(piece),
                    _charge: charge,
                });
            }
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.account.held.fetch_sub(self.bytes, Ordering::AcqRel);
        self.account.pool.give(self.bytes);
    }
}

/// Bytes that release their charge when dropped.
struct Charged {
    bytes: Bytes,
    _charge: Charge,
}

impl AsRef<[u8]> for Charged {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

/// One item of a stream: a batch's messages, or the error that ends it.
pub type Item = Result<Vec<IpcMessage>>;

/// A read stream's queue from its gather to its response body, which the
/// sending side can purge.
#[derive(Debug)]
struct Shared {
    inner: Mutex<Inner>,
    /// Room was made, or the receiver left.
    room: Notify,
}

#[derive(Debug)]
struct Inner {
    /// Batches (and at most one error) not yet taken.
    queue: VecDeque<Item>,
    /// Batches the queue holds at most (the error has a place of its own).
    capacity: usize,
    /// Messages taken from the queue, not yet framed: the edge's framing
    /// may have to wait (a full shared-memory ring).
    unframed: VecDeque<IpcMessage>,
    /// The framed pieces of the message being sent (the edge's).
    current: VecDeque<Bytes>,
    /// No more items will come.
    closed: bool,
    /// The receiver was dropped.
    gone: bool,
    /// The sender purged the outbox: a batch taken just before is dropped
    /// rather than sent.
    purged: bool,
    /// Since when the receiver has been owed something without taking any
    /// of it: when it last took a batch or a piece, or when it was next
    /// given one after taking everything.
    taken: std::time::Instant,
    waker: Option<Waker>,
}

/// What [`Inner::take_all`] takes out.
type Taken = (VecDeque<Item>, VecDeque<IpcMessage>, VecDeque<Bytes>);

impl Inner {
    fn batches(&self) -> usize {
        self.queue.iter().filter(|i| i.is_ok()).count()
    }

    /// Whether something taken from the queue is still to be sent.
    fn sending(&self) -> bool {
        !self.unframed.is_empty() || !self.current.is_empty()
    }

    /// What is queued or being sent, taken out to be dropped outside the
    /// lock (their charges released).
    fn take_all(&mut self) -> Taken {
        (
            std::mem::take(&mut self.queue),
            std::mem::take(&mut self.unframed),
            std::mem::take(&mut self.current),
        )
    }

    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

/// A stream's outbox of at most `capacity` batches: its sending and
/// receiving ends.
pub fn outbox(capacity: usize) -> (Sender, Receiver) {
    let shared = Arc::new(Shared {
        inner: Mutex::new(Inner {
            queue: VecDeque::new(),
            capacity: capacity.max(1),
            unframed: VecDeque::new(),
            current: VecDeque::new(),
            closed: false,
            gone: false,
            purged: false,
            taken: std::time::Instant::now(),
            waker: None,
        }),
        room: Notify::new(),
    });
    (Sender(shared.clone()), Receiver(shared))
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The gather's end of an outbox. Dropping it ends the stream after what
/// it queued.
#[derive(Debug)]
pub struct Sender(Arc<Shared>);

impl Sender {
    /// Whether the receiver left (the client hung up).
    pub fn is_gone(&self) -> bool {
        self.0.lock().gone
    }

    /// Whether another batch fits now; `None` when the receiver left.
    pub fn has_room(&self) -> Option<bool> {
        let inner = self.0.lock();
        (!inner.gone).then(|| inner.batches() < inner.capacity)
    }

    /// Waits until another batch fits; `false` when the receiver left.
    pub async fn room(&self) -> bool {
        self.until(|| {
            self.has_room()
                .map_or(Some(false), |room| room.then_some(true))
        })
        .await
    }

    /// Waits until the receiver leaves (the client hung up).
    pub async fn gone(&self) {
        self.until(|| self.is_gone().then_some(())).await
    }

    /// Waits until `ready` says something, asking it again whenever the
    /// receiver takes an item or leaves.
    async fn until<T>(&self, ready: impl Fn() -> Option<T>) -> T {
        loop {
            let notified = self.0.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = ready() {
                return v;
            }
            notified.await;
        }
    }

    /// Waits until the receiver has had something to take for `idle` and
    /// took nothing: a reader that stopped reading, seen while the stream
    /// waits for room in its outbox or in the allowance.
    pub async fn stalled(&self, idle: std::time::Duration) {
        loop {
            let wait = {
                let inner = self.0.lock();
                let owed = inner.batches() > 0 || inner.sending();
                let since = inner.taken.elapsed();
                match owed {
                    true if since >= idle => return,
                    true => idle - since,
                    false => idle,
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// Queues `item` (a batch, or the error that ends the stream).
    pub fn push(&self, item: Item) {
        let mut inner = self.0.lock();
        if inner.closed || inner.gone {
            return;
        }
        if inner.queue.is_empty() && !inner.sending() {
            inner.taken = std::time::Instant::now();
        }
        inner.closed = item.is_err();
        inner.queue.push_back(item);
        inner.wake();
    }

    /// Ends the stream with `error` now: drops what was queued and the rest
    /// of the message being sent (a reader that stalled inside a message
    /// then sees the stream break there), then queues the error.
    pub fn purge(&self, error: Error) {
        let purged = {
            let mut inner = self.0.lock();
            let purged = inner.take_all();
            inner.purged = true;
            if !inner.closed && !inner.gone {
                inner.queue.push_back(Err(error));
                inner.closed = true;
            }
            inner.wake();
            purged
        };
        // Freed (and their charges released) outside the lock.
        drop(purged);
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        let mut inner = self.0.lock();
        inner.closed = true;
        inner.wake();
    }
}

/// The response body's end of an outbox. Dropping it (the client hung up)
/// tells the gather to stop.
#[derive(Debug)]
pub struct Receiver(Arc<Shared>);

impl Receiver {
    /// The next item; `None` after the last.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let mut inner = self.0.lock();
        if let Some(item) = inner.queue.pop_front() {
            inner.taken = std::time::Instant::now();
            drop(inner);
            self.0.room.notify_waiters();
            return Poll::Ready(Some(item));
        }
        if inner.closed {
            return Poll::Ready(None);
        }
        inner.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// The next item, waiting for it.
    pub async fn recv(&mut self) -> Option<Item> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The next piece of the message being sent, framing the next message
    /// with `frame` when the last one is done. Framing may wait
    /// (`Pending`, having arranged to be woken): the message stays first in
    /// line, unless a purge drops it meanwhile. An error item (or a failed
    /// framing) is returned as is, and `None` is the stream's end.
    pub fn poll_piece(
        &mut self,
        cx: &mut Context<'_>,
        mut frame: impl FnMut(&IpcMessage, &mut Context<'_>) -> Poll<Result<Vec<Bytes>>>,
    ) -> Poll<Option<Result<Bytes>>> {
        loop {
            let next = {
                let mut inner = self.0.lock();
                if let Some(piece) = inner.current.pop_front() {
                    inner.taken = std::time::Instant::now();
                    return Poll::Ready(Some(Ok(piece)));
                }
                inner.unframed.pop_front()
            };
            let Some(m) = next else {
                match self.poll_recv(cx) {
                    Poll::Ready(Some(Ok(messages))) => {
                        let mut inner = self.0.lock();
                        if !inner.purged {
                            inner.unframed.extend(messages);
                        }
                        continue;
                    }
                    Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                    Poll::Ready(None) => return Poll::Ready(None),
                    Poll::Pending => return Poll::Pending,
                }
            };
            // Framed outside the lock: it may copy the message.
            let framed = frame(&m, cx);
            let mut inner = self.0.lock();
            if inner.purged {
                // The purge's error is next; the message and its pieces are
                // dropped after the lock (they were declared before it).
                continue;
            }
            match framed {
                Poll::Ready(Ok(pieces)) => inner.current.extend(pieces),
                Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Pending => {
                    inner.unframed.push_front(m);
                    return Poll::Pending;
                }
            }
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let taken = {
            let mut inner = self.0.lock();
            inner.gone = true;
            inner.take_all()
        };
        drop(taken);
        self.0.room.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: usize) -> IpcMessage {
        IpcMessage {
            header: Bytes::from_static(b"h"),
            body: vec![
                Bytes::from(vec![7u8; len / 2]),
                Bytes::from(vec![8u8; len - len / 2]),
            ],
            body_len: len,
            app_metadata: Bytes::new(),
        }
    }

    #[test]
    fn charges_follow_the_bytes_until_the_last_copy_is_dropped() {
        let pool = ReadAhead::new(1000);
        let a = Account::new(pool.clone());
        let charge = a.try_charge(300).expect("fits");
        let mut batch = vec![message(500)];
        charge.attach(&mut batch);
        assert_eq!(pool.used(), 500, "settled to the encoded size");
        assert_eq!(a.held(), 500);
        let piece = batch[0].body[0].clone();
        drop(batch);
        assert_eq!(pool.used(), 250, "the piece still held keeps its share");
        drop(piece);
        assert_eq!((pool.used(), a.held()), (0, 0));
    }

    #[test]
    fn the_last_quarter_is_kept_for_streams_holding_nothing() {
        let pool = ReadAhead::new(1000);
        let busy = Account::new(pool.clone());
        let _first = busy.try_charge(600).expect("an empty stream may fill it");
        assert!(
            busy.try_charge(200).is_none(),
            "past 3/4 for a stream holding some"
        );
        let fresh = Account::new(pool.clone());
        let _second = fresh.try_charge(300).expect("a stream holding nothing");
        assert!(fresh.try_charge(1).is_none());
        drop(_first);
        let big = Account::new(pool.clone());
        assert!(
            big.try_charge(5000).is_none(),
            "too big while others hold some"
        );
        drop(_second);
        let _all = big.try_charge(5000).expect("too big, but alone");
        assert_eq!(pool.used(), 5000);
    }

    #[tokio::test]
    async fn a_waiting_charge_goes_when_room_is_made() {
        let pool = ReadAhead::new(100);
        let a = Account::new(pool.clone());
        let held = a.try_charge(100).expect("fits");
        let b = Account::new(pool.clone());
        let waiting = tokio::spawn(async move { b.charge(50).await.bytes });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        drop(held);
        assert_eq!(waiting.await.expect("joins"), 50);
    }

    #[tokio::test]
    async fn a_purge_frees_what_was_queued_and_ends_with_the_error() {
        let pool = ReadAhead::new(10_000);
        let a = Account::new(pool.clone());
        let (tx, mut rx) = outbox(4);
        for _ in 0..3 {
            let mut batch = vec![message(1000)];
            a.try_charge(1000).expect("fits").attach(&mut batch);
            tx.push(Ok(batch));
        }
        assert_eq!(tx.has_room(), Some(true));
        // The body takes the first piece of the first message, then stalls.
        let first =
            std::future::poll_fn(|cx| rx.poll_piece(cx, |m, _| Poll::Ready(Ok(m.body.clone()))))
                .await
                .expect("a piece")
                .expect("ok");
        assert_eq!(pool.used(), 3000);
        tx.purge(Error::Aborted("stalled".into()));
        assert_eq!(pool.used(), 500, "only the piece already taken is held");
        drop(first);
        assert_eq!(pool.used(), 0);
        match rx.recv().await {
            Some(Err(Error::Aborted(m))) => assert_eq!(m, "stalled"),
            other => panic!("expected the error, got {other:?}"),
        }
        assert!(rx.recv().await.is_none());
    }

    #[tokio::test]
    async fn a_framing_that_waits_keeps_its_message_first_until_a_purge_drops_it() {
        let pool = ReadAhead::new(10_000);
        let a = Account::new(pool.clone());
        let (tx, mut rx) = outbox(4);
        for len in [1000, 2000] {
            let mut batch = vec![message(len)];
            a.try_charge(len as u64).expect("fits").attach(&mut batch);
            tx.push(Ok(batch));
        }
        let room = std::cell::Cell::new(false);
        let mut frame = |m: &IpcMessage, _: &mut Context<'_>| match room.get() {
            true => Poll::Ready(Ok(vec![Bytes::from(m.body_len.to_string())])),
            false => Poll::Pending,
        };
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..3 {
            assert!(rx.poll_piece(&mut cx, &mut frame).is_pending());
        }
        room.set(true);
        let first = rx.poll_piece(&mut cx, &mut frame);
        assert!(
            matches!(&first, Poll::Ready(Some(Ok(p))) if p == "1000"),
            "the waiting message goes first: {first:?}"
        );
        room.set(false);
        assert!(rx.poll_piece(&mut cx, &mut frame).is_pending());
        assert_eq!(pool.used(), 2000, "the waiting message keeps its charge");
        tx.purge(Error::Aborted("stalled".into()));
        assert_eq!(pool.used(), 0, "a purge drops the waiting message too");
        match rx.poll_piece(&mut cx, &mut frame) {
            Poll::Ready(Some(Err(Error::Aborted(m)))) => assert_eq!(m, "stalled"),
            other => panic!("expected the error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn room_is_bounded_and_a_gone_receiver_is_seen() {
        let (tx, rx) = outbox(1);
        tx.push(Ok(Vec::new()));
        assert_eq!(tx.has_room(), Some(false));
        drop(rx);
        assert!(!tx.room().await, "the receiver left");
        assert!(tx.is_gone());
    }
}
