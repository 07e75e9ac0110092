"""Record batches through the server's shared memory, for a reader on the
server's own machine.

A `DoGet` that carries the `x-flightdeck-shm` header may be answered as
usual except that the server writes each record batch into a ring in a
shared-memory file and the stream carries, in its place, a small message
saying where it lies (the server's `service/shm.rs` describes the
protocol). :class:`RingReader` reads such a stream like a
`pyarrow.flight.FlightStreamReader`: it maps the ring when the server
announces it, copies each batch out (so that the ring can be used again
however long the batch is kept) and tells the server how far it has read.
A stream the server answers without a ring (a server without shared
memory, or none to spare) is read as it comes.

A reader that asks to *lend* (`ShardedDataset`'s loop, which drops each
batch once it trained on it) copies nothing: each batch is handed out as
a view of the ring, and the reader tells the server it is done with a
batch only once nothing refers to it any more (:class:`_Lender`), so the
server never writes over a batch still in use. A loop that keeps its
batches fills the ring; the reader then says it waits for the next
message, and the server sends the rest of the stream over the socket
until room is made — the same batches, in the same order. A lent batch
kept after its stream ended keeps the ring mapped in this process (at
most its 16 MiB) until the batch goes.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import struct
import threading
import weakref
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight

#: The request header that asks for shared memory.
REQUEST_HEADER = b"x-flightdeck-shm"
_ANNOUNCE = b"FDSHM:A1"
_BATCH = b"FDSHM:B1"
_MAGIC = b"FDSHM\x001\x00"
# The header's words (`flightdeck_client::shm` names them): the reader
# writes attached, consumed up to and waiting; the server, its features.
_ATTACHED, _CONSUMED, _WAITING, _FEATURES = 1, 2, 3, 4
# The features word's bit: the server honours `_WAITING`, so a reader may
# hold batches in the ring.
_LENDS = 1


class CannotAttach(Exception):
    """The ring the server announced could not be mapped here (another
    machine's or another user's file): read over the socket instead."""


class Chunk(NamedTuple):
    """A message of the stream, as `FlightStreamReader.read_chunk` gives it."""

    data: pa.RecordBatch | None
    app_metadata: Any


class _Loan:
    """What a lent batch's buffer keeps alive: when the last reference to
    the batch (its arrays, the tensors over them) goes, so does this, and
    its finalizer gives the batch's place in the ring back."""

    __slots__ = ("__weakref__",)


class _Lender:
    """A ring whose batches are handed out in place. The server may write
    over a batch once the reader's consumed position passed its end, so the
    position only moves past batches given back: those whose loans are
    gone, in the order they were lent (a batch kept longer holds back the
    ones after it). Loans are given back on whichever thread drops them."""

    def __init__(self, mapped: mmap.mmap, words: np.ndarray) -> None:
        # Every loan's finalizer refers to this, so the mapping lives as
        # long as a lent batch does, after the stream and its reader.
        self._mapped = mapped
        self._words = words
        self._anchor = ctypes.c_char.from_buffer(mapped)
        self._address = ctypes.addressof(self._anchor)
        self._lock = threading.RLock()
        self._out: collections.deque[list] = collections.deque()
        # A process forked while batches were lent holds copies of their
        # loans: what it drops is not the reader's to give back.
        self._pid = os.getpid()

    def lend(self, offset: int, length: int, end: int) -> pa.Buffer:
        """The ring's bytes `offset..offset + length` as a buffer, given back
        (consumed up to `end`, with those lent before) when it is gone."""
        entry = [end, False]
        with self._lock:
            self._out.append(entry)
        loan = _Loan()
        weakref.finalize(loan, self._given_back, entry).atexit = False
        return pa.foreign_buffer(self._address + offset, length, base=loan)

    def _given_back(self, entry: list) -> None:
        if os.getpid() != self._pid:
            return
        with self._lock:
            entry[1] = True
            consumed = None
            while self._out and self._out[0][1]:
                consumed = self._out.popleft()[0]
            if consumed is not None:
                self._words[_CONSUMED] = consumed


class RingReader:
    """A `DoGet` stream read through the server's shared-memory ring when it
    offers one: `read_chunk`, `read_all`, `cancel` and `schema` as
    `pyarrow.flight.FlightStreamReader` has them. :meth:`start` reads up to
    the ring's announcement, and raises :class:`CannotAttach` when the ring
    cannot be mapped here. With `lend`, batches are views of the ring where
    the server allows it (see the module's overview), else copies."""

    def __init__(self, reader: flight.FlightStreamReader, lend: bool = False) -> None:
        self._reader = reader
        self._lend = lend
        self._map: mmap.mmap | None = None
        self._words: np.ndarray | None = None
        self._lender: _Lender | None = None
        # A message read by `start` that was not the announcement.
        self._first: Chunk | None = None
        self._ended = False

    @property
    def schema(self) -> pa.Schema:
        return self._reader.schema

    @property
    def lends(self) -> bool:
        """Whether batches are handed out as views of the ring."""
        return self._lender is not None

    @property
    def attached(self) -> bool:
        """Whether batches come through shared memory."""
        return self._map is not None

    def start(self) -> None:
        """Reads the stream's first message: the ring's announcement (then
        maps the ring), or the first message of a stream without one."""
        try:
            chunk = self._reader.read_chunk()
        except StopIteration:
            self._ended = True
            return
        meta = chunk.app_metadata
        if chunk.data is None and meta is not None and meta.size >= 24:
            raw = meta.to_pybytes()
            if raw[:8] == _ANNOUNCE:
                self._attach(raw)
                return
        self._first = Chunk(chunk.data, chunk.app_metadata)

    def _attach(self, raw: bytes) -> None:
        cap, offset = struct.unpack_from("<QQ", raw, 8)
        path = raw[24:].decode()
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                mapped = mmap.mmap(fd, offset + cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except (OSError, ValueError) as e:
            raise CannotAttach(f"cannot map the server's shared-memory ring {path}: {e}") from e
        if mapped[:8] != _MAGIC:
            mapped.close()
            raise CannotAttach(f"{path} is not a flightdeck shared-memory ring")
        self._map = mapped
        self._words = np.frombuffer(mapped, dtype=np.uint64, count=_FEATURES + 1)
        if self._lend and int(self._words[_FEATURES]) & _LENDS:
            self._lender = _Lender(mapped, self._words)
        self._words[_ATTACHED] = 1

    def _take(self, raw: bytes) -> pa.RecordBatch:
        """The batch a descriptor names, copied out of the ring or lent."""
        offset, length, end = struct.unpack_from("<QQQ", raw, 8)
        if self._map is None or self._words is None:
            raise flight.FlightServerError(
                "the server sent a shared-memory batch before announcing its ring"
            )
        if offset < 8 * (_FEATURES + 1) or length < 8 or offset + length > len(self._map):
            raise flight.FlightServerError(
                "the server described a shared-memory batch outside its ring; read without "
                "shared memory (FLIGHTDECK_SHM=0) and report it"
            )
        if self._lender is not None:
            out = self._lender.lend(offset, length, end)
        else:
            out = pa.allocate_buffer(length)
            np.copyto(
                np.frombuffer(out, dtype=np.uint8),
                np.frombuffer(self._map, dtype=np.uint8, count=length, offset=offset),
            )
            # The copy is done: the server may write there again.
            self._words[_CONSUMED] = end
        return pa.ipc.read_record_batch(pa.ipc.read_message(out), self.schema)

    def read_chunk(self) -> Chunk:
        """The next message (`StopIteration` at the end)."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self._ended:
            raise StopIteration
        if self._lender is None:
            chunk = self._reader.read_chunk()
        else:
            # Waiting, said while it lasts: a server whose ring is full of
            # batches still lent sends the next ones over the socket.
            assert self._words is not None
            self._words[_WAITING] = 1
            try:
                chunk = self._reader.read_chunk()
            finally:
                self._words[_WAITING] = 0
        meta = chunk.app_metadata
        if chunk.data is not None or meta is None or meta.size < 8:
            return Chunk(chunk.data, meta)
        raw = meta.to_pybytes()
        if raw[:8] == _BATCH:
            return Chunk(self._take(raw), None)
        if raw[:8] == _ANNOUNCE:
            # The server announces its ring right after the schema (read
            # by `start`), never later.
            raise flight.FlightServerError(
                "the server announced a shared-memory ring in the middle of the stream"
            )
        return Chunk(None, meta)

    def read_all(self) -> pa.Table:
        """The rest of the stream as one table."""
        batches = []
        while True:
            try:
                chunk = self.read_chunk()
            except StopIteration:
                return pa.Table.from_batches(batches, schema=self.schema)
            if chunk.data is not None:
                batches.append(chunk.data)

    def cancel(self) -> None:
        """Cancels the call (the server stops sending)."""
        self._reader.cancel()
