"""Server errors as Python exceptions that keep the gRPC code and message.

pyarrow maps gRPC status codes onto a handful of Arrow exception classes and
folds the code into the text; :func:`translate` recovers the code so callers
can act on it: ``except flightdeck.NotFound``, or ``err.code == "NOT_FOUND"``.
"""

from __future__ import annotations

import re
from typing import Callable, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

T = TypeVar("T")


class FlightDeckError(Exception):
    """An error answered by a flightdeck server (or on the way to it).

    ``code`` is the gRPC status code name (``"INVALID_ARGUMENT"``, ...) and
    ``message`` the server's message, which names the dataset, partition or
    column at fault and says what to do.
    """

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgument(FlightDeckError, ValueError):
    """Malformed request: bad schema, column, plan or ticket."""

    code = "INVALID_ARGUMENT"


class NotFound(FlightDeckError, KeyError):
    """No dataset of that name."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would quote the message
        return FlightDeckError.__str__(self)


class AlreadyExists(FlightDeckError):
    """The attempt was committed before; use a new attempt number."""

    code = "ALREADY_EXISTS"


class FailedPrecondition(FlightDeckError):
    """The dataset is not in the state the call needs (e.g. read before seal)."""

    code = "FAILED_PRECONDITION"


class Unauthenticated(FlightDeckError, PermissionError):
    """The server needs a token (``token=``, or ``FLIGHTDECK_TOKEN``), or
    does not accept the one sent."""

    code = "UNAUTHENTICATED"


class PermissionDenied(FlightDeckError, PermissionError):
    """The call names something the server may not touch (e.g. a checkpoint
    outside its checkpoint root)."""

    code = "PERMISSION_DENIED"


class ResourceExhausted(FlightDeckError, MemoryError):
    """The server's memory budget cannot hold the data."""

    code = "RESOURCE_EXHAUSTED"


class Aborted(FlightDeckError):
    """A write was broken off; nothing of it was stored."""

    code = "ABORTED"


class Unavailable(FlightDeckError, ConnectionError):
    """The server could not be reached."""

    code = "UNAVAILABLE"


class DataLoss(FlightDeckError, IOError):
    """A dataset's stored copy (spilled or persisted) is gone or damaged;
    no retry brings it back: write the dataset again."""

    code = "DATA_LOSS"


class Unimplemented(FlightDeckError, NotImplementedError):
    """The server does not offer this call."""

    code = "UNIMPLEMENTED"


_CLASSES = {
    c.code: c
    for c in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        PermissionDenied,
        Unauthenticated,
        ResourceExhausted,
        Aborted,
        Unavailable,
        DataLoss,
        Unimplemented,
    )
}

# How pyarrow's Flight client names each gRPC code in its error text.
_PYARROW_NAMES = {
    "internal": "INTERNAL",
    "invalid argument": "INVALID_ARGUMENT",
    "timeout": "DEADLINE_EXCEEDED",
    "not found": "NOT_FOUND",
    "already exists": "ALREADY_EXISTS",
    "unauthenticated": "UNAUTHENTICATED",
    "unauthorized": "PERMISSION_DENIED",
    "unimplemented": "UNIMPLEMENTED",
    "unavailable": "UNAVAILABLE",
    "resource exhausted": "RESOURCE_EXHAUSTED",
    "precondition failed": "FAILED_PRECONDITION",
    "aborted": "ABORTED",
    "out-of-range": "OUT_OF_RANGE",
    "data loss": "DATA_LOSS",
}
_PATTERN = re.compile(
    r"(?:Flight|gRPC) returned (?P<name>[a-z -]+?) error, with message: (?P<msg>.*?)"
    r"(?:\. gRPC client debug context:.*|\. Client context:.*|\. Detail:.*)?$",
    re.DOTALL,
)


#: Advice the server gives in Flight's words, as a Python user acts on it.
_IN_PYTHON_TERMS = {
    "write it with DoPut, or list datasets with ListFlights": (
        "write it with client.put_partition(), or list datasets with client.list_datasets()"
    ),
    "call GetFlightInfo again": "plan again (client.plan())",
    "get tickets from GetFlightInfo": "get tickets from client.plan()",
    "read the dataset with DoGet instead": (
        "read the dataset with ShardedDataset or client.read_shard() instead"
    ),
    "read it with DoGet (FlightDeckIterableDataset)": "read it with FlightDeckIterableDataset",
}


def in_python_terms(message: str) -> str:
    """`message` with the server's protocol advice said as this client's calls."""
    for flight_words, python_words in _IN_PYTHON_TERMS.items():
        message = message.replace(flight_words, python_words)
    return message


def from_exception(exc: BaseException) -> FlightDeckError:
    """The :class:`FlightDeckError` for an exception raised by pyarrow."""
    text = str(exc)
    m = _PATTERN.search(text)
    if m:
        code = _PYARROW_NAMES.get(m.group("name"), "UNKNOWN")
        message = in_python_terms(m.group("msg"))
    elif isinstance(exc, flight.FlightUnavailableError):
        code, message = "UNAVAILABLE", text
    elif isinstance(exc, flight.FlightCancelledError):
        code, message = "CANCELLED", text
    elif isinstance(exc, flight.FlightTimedOutError):
        code, message = "DEADLINE_EXCEEDED", text
    else:
        code, message = "UNKNOWN", text
    if code == "UNAVAILABLE" and "failed to connect to all addresses" in message:
        # The transport's: no server answered at all.
        message += (
            "; is a flightdeck server running there? Start one with `flightdeck serve`, or "
            "connect to another (for 'local': FLIGHTDECK_URI, else grpc://127.0.0.1:50051)"
        )
    cls = _CLASSES.get(code, FlightDeckError)
    return cls(message, code)


def translate(call: Callable[[], T]) -> T:
    """Runs `call`, turning pyarrow's Flight errors into FlightDeckErrors."""
    try:
        return call()
    except FlightDeckError:
        raise
    except (pa.ArrowException, flight.FlightError) as exc:
        raise from_exception(exc) from exc
