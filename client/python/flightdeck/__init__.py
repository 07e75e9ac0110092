"""flightdeck: Spark DataFrames to multi-GPU training over Arrow Flight.

- :func:`connect` → :class:`Client`: `put_partition`, `seal`, `drop`,
  `describe`, `stats`, `list_datasets`, `plan`, `read_shard`, and SQL over
  the cache: `sql`, `derive`.
- :class:`ShardedDataset`: one rank's balanced, shuffled shard of each epoch,
  with `set_epoch` and `state_dict`/`load_state_dict` for exact resume.
- :func:`to_numpy`, :func:`to_torch`: zero-copy views of numeric and
  fixed-width list columns.
- `flightdeck.torch.FlightDeckIterableDataset` (needs torch) and
  `flightdeck.spark` (needs pyspark) are imported on demand.

Server errors raise :class:`FlightDeckError` subclasses carrying the gRPC code.
"""

from . import _wire as messages
from .client import DEFAULT_PORT, Client, Plan, Shard, connect, dataset_schema, sealed_as
from .dataset import ShardedDataset
from .errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    FlightDeckError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from .tensors import to_numpy, to_torch

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PORT",
    "Aborted",
    "AlreadyExists",
    "Client",
    "DataLoss",
    "FailedPrecondition",
    "FlightDeckError",
    "InvalidArgument",
    "NotFound",
    "PermissionDenied",
    "Plan",
    "ResourceExhausted",
    "Shard",
    "ShardedDataset",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "connect",
    "dataset_schema",
    "messages",
    "sealed_as",
    "to_numpy",
    "to_torch",
]
