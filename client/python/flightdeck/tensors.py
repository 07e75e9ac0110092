"""Zero-copy views of Arrow columns as NumPy arrays and torch tensors.

Primitive numeric columns become 1-D arrays; `fixed_size_list<number>[D]`
columns and variable-size lists whose rows all have the same length (Spark's
`array<float>`) become `(rows, D)` arrays over the same memory. Nullable data
and ragged lists are refused with a clear error rather than copied silently.
"""

from __future__ import annotations

from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.types as pat

Column = Union[pa.Array, pa.ChunkedArray]


def _column(data: pa.RecordBatch | pa.Table | Column, column: str | int | None) -> pa.Array:
    if isinstance(data, (pa.RecordBatch, pa.Table)):
        if column is None:
            raise TypeError("name the column to convert")
        data = data.column(column)
    elif column is not None:
        raise TypeError("column is only for record batches and tables")
    if isinstance(data, pa.ChunkedArray):
        if data.num_chunks != 1:
            raise ValueError(
                f"column has {data.num_chunks} chunks; convert each record batch, or "
                "combine_chunks() first (a copy)"
            )
        data = data.chunk(0)
    return data


def _check_numeric(values: pa.Array, what: str) -> None:
    t = values.type
    if not (pat.is_integer(t) or pat.is_floating(t)):
        raise TypeError(f"{what} has type {t}; only integer and floating-point data convert")
    if values.null_count:
        raise ValueError(f"{what} has {values.null_count} nulls; fill them before converting")


def _flat_values(arr: pa.Array) -> tuple[pa.Array, tuple[int, ...]]:
    """The contiguous numeric values behind `arr` and the shape they take."""
    t = arr.type
    if pat.is_fixed_size_list(t):
        if arr.null_count:
            raise ValueError(f"list column has {arr.null_count} null rows")
        values = arr.flatten()  # honours the array's offset, no copy
        _check_numeric(values, "list values")
        return values, (len(arr), t.list_size)
    if pat.is_list(t) or pat.is_large_list(t):
        if arr.null_count:
            raise ValueError(f"list column has {arr.null_count} null rows")
        offsets = arr.offsets.to_numpy(zero_copy_only=True)
        lengths = np.diff(offsets)
        width = int(lengths[0]) if len(lengths) else 0
        if len(lengths) and not (lengths == width).all():
            raise ValueError(
                f"list column is ragged (row lengths {int(lengths.min())}..{int(lengths.max())});"
                " only lists of one length convert to a 2-D array"
            )
        values = arr.flatten()
        _check_numeric(values, "list values")
        return values, (len(arr), width)
    _check_numeric(arr, "column")
    return arr, (len(arr),)


def to_numpy(data: pa.RecordBatch | pa.Table | Column, column: str | int | None = None) -> np.ndarray:
    """A read-only NumPy view of a numeric or fixed-width list column."""
    values, shape = _flat_values(_column(data, column))
    return values.to_numpy(zero_copy_only=True).reshape(shape)


def to_torch(data: pa.RecordBatch | pa.Table | Column, column: str | int | None = None):
    """A torch tensor over the column's memory (DLPack), shaped like
    :func:`to_numpy`. The tensor must not be written to: it is Arrow's
    immutable buffer."""
    import torch

    values, shape = _flat_values(_column(data, column))
    if len(values) == 0:
        return torch.from_numpy(values.to_numpy(zero_copy_only=True).copy()).reshape(shape)
    try:
        tensor = torch.from_dlpack(values)
    except (TypeError, BufferError, RuntimeError):
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer
            tensor = torch.from_numpy(values.to_numpy(zero_copy_only=True))
    return tensor.reshape(shape)
