"""Triton's classification extension: an output answered with its top N classes instead of the tensor.

A requested output with the parameter ``classification: N`` comes back as a
BYTES tensor holding, per batch row, the N largest values as strings
``"<value>:<index>"``, or ``"<value>:<index>:<label>"`` when the output has a
``label_filename`` (a file in the model's folder, one label per line). Its
shape is ``[batch, N]`` for a batching model and ``[N]`` otherwise; N is
capped at the number of classes a row has. Values print as C's ``%f`` for
floating-point outputs and as integers otherwise, as Triton does.

The labels are read once, when the version loads (:func:`read_labels`); the
top N is taken per request after its batch ran (:func:`classify`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aiworks.core.datatypes import Tensor, element_count, serialize_items
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import ModelSpec, TensorSpec
from aiworks.core.names import inside

# Datatypes whose values rank: all numeric ones (not BOOL, not BYTES).
NUMERIC = frozenset(("UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"))
MAX_LABELS_BYTES = 16 * 2**20


def read_labels(folder: Path, root: Path, model: str, outputs: tuple[TensorSpec, ...]) -> dict[str, tuple[str, ...]]:
    """The labels of each output that names a ``label_filename``, read from the model's ``folder`` (blocking).

    Errors name the model and the file as the config gives it, never the server's path.
    """
    labels = {}
    for out in outputs:
        name = out.label_filename
        if not name:
            continue
        where = f"model '{model}': output '{out.name}' label_filename '{name[:64]}'"
        if "/" in name or "\\" in name or name in (".", ".."):
            raise InvalidArgument(f"{where} must be a plain file name in the model's folder")
        path = inside(root, folder / name, where)
        try:
            if path.stat().st_size > MAX_LABELS_BYTES:
                raise InvalidArgument(f"{where} is larger than {MAX_LABELS_BYTES // 2**20} MiB")
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            raise InvalidArgument(f"{where} cannot be read ({exc.strerror})") from None
        labels[out.name] = tuple(text.splitlines())
    return labels


def check(spec: ModelSpec, classification: dict[str, int]) -> None:
    """Refuse classification of an output that is unknown or not numeric, or a class count that is not positive."""
    declared = {o.name: o.datatype for o in spec.outputs}
    for name, count in classification.items():
        if name not in declared:
            raise InvalidArgument(f"model '{spec.name}' has no output '{name[:64]}' to classify")
        if declared[name] not in NUMERIC:
            raise InvalidArgument(
                f"output '{name}' of model '{spec.name}' is {declared[name]}: classification needs a numeric output"
            )
        if type(count) is not int or count <= 0:
            raise InvalidArgument(f"output '{name}': parameter 'classification' must be a positive integer")


def classify(tensor: Tensor, count: int, labels: tuple[str, ...], batched: bool) -> Tensor:
    """``tensor``'s top ``count`` classes per row, as Triton's BYTES tensor of ``value:index[:label]``."""
    values = tensor.to_numpy()
    rows = int(tensor.shape[0]) if batched and tensor.shape else 1
    per_row = element_count(tensor.shape) // rows if rows else 0
    table = values.reshape(rows, per_row)
    n = min(count, per_row)
    floating = table.dtype.kind == "f"
    # Ascending order of the key is descending order of the values: ~x never overflows as -x does on integers.
    key = -table if floating else ~table
    if n < per_row:  # only the top n are sorted
        top = np.argpartition(key, n - 1, axis=1)[:, :n]
        order = np.lexsort((top, np.take_along_axis(key, top, axis=1)), axis=1)  # ties: the lower index first
        top = np.take_along_axis(top, order, axis=1)
    else:
        top = np.argsort(key, axis=1, kind="stable")
    items = []
    for r in range(rows):
        for i in top[r].tolist():
            value = table[r, i]
            text = f"{float(value):f}:{i}" if floating else f"{int(value)}:{i}"
            if i < len(labels) and labels[i]:
                text = f"{text}:{labels[i]}"
            items.append(text)
    shape = (rows, n) if batched else (n,)
    return Tensor(tensor.name, "BYTES", shape, serialize_items(items))


def apply(outputs: list[Tensor], classification: dict[str, int], labels: dict, batched: bool) -> list[Tensor]:
    """``outputs`` with each output the request classifies replaced by its classes."""
    return [
        classify(t, classification[t.name], labels.get(t.name, ()), batched) if t.name in classification else t
        for t in outputs
    ]
