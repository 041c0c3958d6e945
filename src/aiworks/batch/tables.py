"""Parquet batch files: rows of a table as inference requests, and the answers as a table.

The rule (docs/tiers.md, "Parquet jobs"):

- Each model input is filled from columns of the row. By default every
  column but ``custom_id`` is the input of the same name. ``input_columns``
  (given at submission) maps an input to one column name, or to a list of
  column names.
- One list-typed column (``list``, ``large_list`` or ``fixed_size_list`` of
  numbers, booleans or strings) holds the row's tensor: ``shape [1, n]`` for
  a list of ``n`` elements. One scalar column is ``shape [1, 1]``. A list of
  ``k`` scalar columns of one type is ``shape [1, k]``, in the list's order.
- The datatype comes from the column's Arrow type (``float`` is FP32,
  ``double`` FP64, ``int64`` INT64, ``string`` BYTES, ...): write the
  columns in the type the model expects.
- An optional string column ``custom_id`` names the row in the output and
  error files. Rows are numbered from 1, as lines are.

The output table has ``row`` (int64, the input row's number), ``custom_id``
(string, null where absent) and one column per output tensor, in input
order: a scalar column when every row's tensor has one element, a list
column otherwise. Rows that failed are only in the (JSONL) error file.

pyarrow is an optional dependency (the ``parquet`` extra), imported here
only: without it a Parquet job is refused with 501. The input is read in
record batches of at most one chunk of rows; only one chunk is ever turned
into Python objects at once.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import orjson

from aiworks.batch import objects
from aiworks.batch.lines import BATCH_PRIORITY, MAX_CUSTOM_ID_CHARS, Line
from aiworks.core.errors import AIWorksError, InvalidArgument, Status

FORMATS = ("jsonl", "parquet")
CUSTOM_ID = "custom_id"
MAX_INPUTS = 64
MAX_COLUMNS_PER_INPUT = 16_384
MAX_ROW_BYTES = 32 << 20  # decoded, on average over a row group: the gateway's default largest request
MEDIA_TYPES = {"jsonl": "application/jsonl", "parquet": "application/vnd.apache.parquet"}


def format_of(name: str, explicit: object = None) -> str:
    """``explicit`` when given (``jsonl`` or ``parquet``), else by the name's extension: ``.parquet`` or JSONL."""
    if explicit is not None:
        if explicit not in FORMATS:
            raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, not '{str(explicit)[:40]}'")
        return str(explicit)
    return "parquet" if name.lower().endswith((".parquet", ".pq")) else "jsonl"


def _arrow():
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise AIWorksError(
            "Parquet batch files need pyarrow, which is not installed here: pip install 'aiworks[parquet]'",
            Status.UNIMPLEMENTED,
        ) from None
    return pa, pq


def _datatype(arrow_type) -> str | None:
    """The OIP datatype of a scalar Arrow type, or None when it has none."""
    pa, _ = _arrow()
    t = pa.types
    if t.is_boolean(arrow_type):
        return "BOOL"
    if t.is_string(arrow_type) or t.is_large_string(arrow_type):
        return "BYTES"
    if t.is_floating(arrow_type):
        return {16: "FP16", 32: "FP32", 64: "FP64"}[arrow_type.bit_width]
    if t.is_integer(arrow_type):
        return f"{'INT' if t.is_signed_integer(arrow_type) else 'UINT'}{arrow_type.bit_width}"
    return None


def _arrow_type(datatype: str):
    pa, _ = _arrow()
    table = {"BOOL": pa.bool_(), "BYTES": pa.string(), "FP16": pa.float32(), "FP32": pa.float32(),
             "FP64": pa.float64(), "INT8": pa.int8(), "INT16": pa.int16(), "INT32": pa.int32(), "INT64": pa.int64(),
             "UINT8": pa.uint8(), "UINT16": pa.uint16(), "UINT32": pa.uint32(), "UINT64": pa.uint64()}  # fmt: skip
    return table.get(datatype)


def _is_list(arrow_type) -> bool:
    pa, _ = _arrow()
    return pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type) or pa.types.is_fixed_size_list(arrow_type)


@dataclass(frozen=True)
class InputColumns:
    """One model input and the columns that fill it."""

    name: str
    columns: tuple[str, ...]
    datatype: str
    is_list: bool  # one list-typed column holding the tensor


def check_mapping(input_columns: object) -> dict[str, list[str]]:
    """The submitted ``input_columns`` in one shape (input name to column names), or a 400 saying what is wrong."""
    if input_columns is None or input_columns == {}:
        return {}  # the default: each column the input of its name
    if not isinstance(input_columns, dict) or not 1 <= len(input_columns) <= MAX_INPUTS:
        raise InvalidArgument(f"input_columns must be an object of 1 to {MAX_INPUTS} inputs")
    mapping = {}
    for name, columns in input_columns.items():
        if isinstance(columns, str):
            columns = [columns]
        if (not isinstance(columns, list) or not 1 <= len(columns) <= MAX_COLUMNS_PER_INPUT
                or not all(isinstance(c, str) and c for c in columns)):  # fmt: skip
            raise InvalidArgument(
                f"input_columns['{str(name)[:80]}'] must be a column name or a list of 1 to "
                f"{MAX_COLUMNS_PER_INPUT} column names"
            )
        mapping[str(name)] = list(columns)
    return mapping


def plan(schema, input_columns: dict[str, list[str]]) -> list[InputColumns]:
    """How each input is filled from ``schema``'s columns; a 400 naming the first missing or unusable column."""
    names = set(schema.names)
    if CUSTOM_ID in names and _datatype(schema.field(CUSTOM_ID).type) != "BYTES":
        raise InvalidArgument(f"column '{CUSTOM_ID}' must be a string column, not {schema.field(CUSTOM_ID).type}")
    mapping = input_columns or {name: [name] for name in schema.names if name != CUSTOM_ID}
    if not mapping:
        raise InvalidArgument("the Parquet file has no column besides custom_id: no input to send")
    plans = []
    for name, columns in mapping.items():
        for column in columns:
            if column not in names:
                shown = ", ".join(sorted(names)[:20]) + (", ..." if len(names) > 20 else "")
                raise InvalidArgument(f"input '{name[:80]}': column '{column[:80]}' is not in the file (it has {shown})")
        types = [schema.field(c).type for c in columns]
        if len(columns) == 1 and _is_list(types[0]):
            datatype = _datatype(types[0].value_type)
            if datatype is None:
                raise InvalidArgument(f"column '{columns[0][:80]}' is a list of {types[0].value_type}, which no "
                                      "tensor datatype holds")  # fmt: skip
            plans.append(InputColumns(name, tuple(columns), datatype, True))
            continue
        datatypes = set()
        for column, arrow_type in zip(columns, types, strict=True):
            datatype = _datatype(arrow_type)
            if datatype is None:
                raise InvalidArgument(
                    f"column '{column[:80]}' of input '{name[:80]}' is {arrow_type}: an input takes one list column "
                    "or scalar columns of numbers, booleans or strings"
                )
            datatypes.add(datatype)
        if len(datatypes) > 1:
            raise InvalidArgument(f"the columns of input '{name[:80]}' mix types ({', '.join(sorted(datatypes))}); "
                                  "one input's columns share one type")  # fmt: skip
        plans.append(InputColumns(name, tuple(columns), datatypes.pop(), False))
    return plans


def open_file(url: str):
    """A ``pyarrow.parquet.ParquetFile``: a local file is read from disk as needed, an S3 object in ranges as
    needed (the footer, then each row group's column chunks: no copy on disk)."""
    pa, pq = _arrow()
    objects.check_url(url)
    try:
        if url.startswith("s3://"):
            return pq.ParquetFile(io.BufferedReader(objects.RangedFile(url), buffer_size=1 << 20))
        return pq.ParquetFile(url[len("file://") :] if url.startswith("file://") else url)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InvalidArgument(f"the input file is not a readable Parquet file: {str(exc)[:300]}") from None


_WIDTHS = {"BOOLEAN": 1, "INT32": 4, "FLOAT": 4, "INT64": 8, "DOUBLE": 8, "INT96": 12}


def check_sizes(metadata) -> None:
    """Refuse row groups whose rows, decoded, are larger on average than a request may be.

    This bounds what one chunk costs the runner to decode before any row of
    it is looked at: a list of nine million zeros compresses to a few
    hundred bytes. Decoded size is the column's number of values times its
    width (strings: their encoded size, at least 8 bytes a value).
    """
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        decoded = 0
        for c in range(group.num_columns):
            column = group.column(c)
            width = _WIDTHS.get(column.physical_type)
            if width is None:
                decoded += max(column.total_uncompressed_size, 8 * column.num_values)
            else:
                decoded += width * column.num_values
        per_row = decoded / max(1, group.num_rows)
        if per_row > MAX_ROW_BYTES:
            raise InvalidArgument(f"row group {index} holds {per_row:.0f} bytes a row decoded, more than the "
                                  f"{MAX_ROW_BYTES} a batch row may hold")  # fmt: skip


def check_input(url: str, input_columns: dict[str, list[str]]) -> int:
    """Submission's check of a Parquet input (its footer only): the columns exist and fit; its number of rows."""
    parquet = open_file(url)
    plan(parquet.schema_arrow, input_columns)
    check_sizes(parquet.metadata)
    return parquet.metadata.num_rows


class ParquetInput:
    """A Parquet input file read one chunk of rows at a time, each chunk turned into :class:`Line` s."""

    def __init__(self, url: str, input_columns: dict[str, list[str]]):
        self.file = open_file(url)
        schema = self.file.schema_arrow
        self.plans = plan(schema, input_columns)
        check_sizes(self.file.metadata)
        self.has_custom_id = CUSTOM_ID in schema.names
        wanted = {c for p in self.plans for c in p.columns} | ({CUSTOM_ID} if self.has_custom_id else set())
        self.columns = [name for name in schema.names if name in wanted]
        self.total = self.file.metadata.num_rows

    def chunks(self, chunk_size: int) -> Iterator[Callable[[], list[Line]]]:
        """One callable per chunk of ``chunk_size`` rows, in order, that makes the chunk's lines.

        Reading the next chunk decodes its record batches (columnar, at
        most ``chunk_size`` rows); the rows become Python objects only when
        the callable runs, so a finished chunk a resumed job skips costs
        little.
        """
        pa, _ = _arrow()
        pending, held, first = [], 0, 1
        batches = self.file.iter_batches(batch_size=chunk_size, columns=self.columns)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as exc:
                raise InvalidArgument(f"the input file cannot be read past row {first + held - 1}: "
                                      f"{str(exc)[:300]}") from None  # fmt: skip
            if batch is None:
                break
            while batch.num_rows:
                take = min(chunk_size - held, batch.num_rows)
                pending.append(batch.slice(0, take))
                batch, held = batch.slice(take), held + take
                if held == chunk_size:
                    yield self._maker(pa.Table.from_batches(pending), first)
                    pending, held, first = [], 0, first + chunk_size
        if held:
            yield self._maker(pa.Table.from_batches(pending), first)

    def _maker(self, table, first: int) -> Callable[[], list[Line]]:
        return lambda: self._lines(table, first)

    def _lines(self, table, first: int) -> list[Line]:
        values = {name: table.column(name).to_pylist() for name in self.columns}
        custom_ids = values.get(CUSTOM_ID) or [None] * table.num_rows
        return [self._line(first + i, i, custom_ids[i], values) for i in range(table.num_rows)]

    def _line(self, number: int, i: int, custom_id: str | None, values: dict[str, list]) -> Line:
        if custom_id is not None and len(custom_id) > MAX_CUSTOM_ID_CHARS:
            return Line(number, None, None, f"custom_id must be a string of at most {MAX_CUSTOM_ID_CHARS} characters")
        inputs = []
        for p in self.plans:
            if p.is_list:
                data = values[p.columns[0]][i]
                if data is None:
                    return Line(number, custom_id, None, f"column '{p.columns[0]}' is null")
                if not data:
                    return Line(number, custom_id, None, f"column '{p.columns[0]}' is an empty list")
            else:
                data = [values[c][i] for c in p.columns]
            if any(v is None for v in data):
                where = p.columns[0] if p.is_list else next(c for c, v in zip(p.columns, data, strict=True) if v is None)
                return Line(number, custom_id, None, f"column '{where}' has a null value (input '{p.name}')")
            inputs.append({"name": p.name, "datatype": p.datatype, "shape": [1, len(data)], "data": data})
        return Line(number, custom_id, {"inputs": inputs, "parameters": {"priority": BATCH_PRIORITY}})


def write_output(chunks: Iterable[bytes]) -> bytes:
    """:func:`write_output_to` in memory: the table's bytes."""
    chunks = list(chunks)
    sink = io.BytesIO()
    write_output_to(sink, lambda: chunks)
    return sink.getvalue()


def write_output_to(sink: BinaryIO, chunks: Callable[[], Iterable[bytes]]) -> None:
    """The output table (module docstring) of a job's output lines, one row group per chunk of lines.

    ``chunks()``: each chunk's output lines (JSONL, as the runner records
    them), in order; called twice, once for the columns' types, once to
    write, so only one chunk is in memory at a time.
    """
    pa, pq = _arrow()
    outputs: dict[str, list] = {}  # name: [datatype, every row has one element]
    for chunk in chunks():
        for raw in chunk.splitlines():
            for out in orjson.loads(raw)["response"].get("outputs", []):
                seen = outputs.setdefault(out["name"], [out.get("datatype", ""), True])
                seen[1] = seen[1] and len(out.get("data") or ()) == 1
    fields = [pa.field("row", pa.int64(), nullable=False), pa.field(CUSTOM_ID, pa.string())]
    for name, (datatype, scalar) in outputs.items():
        arrow_type = _arrow_type(datatype)
        if arrow_type is None:  # a datatype with no column type: its values as JSON text
            arrow_type = pa.string()
        fields.append(pa.field(name, arrow_type if scalar else pa.list_(arrow_type)))
    schema = pa.schema(fields)
    with pq.ParquetWriter(sink, schema) as writer:
        for chunk in chunks():
            docs = [orjson.loads(raw) for raw in chunk.splitlines()]
            if not docs:
                continue
            columns = {"row": [d["line"] for d in docs], CUSTOM_ID: [d.get("custom_id") for d in docs]}
            for name, (datatype, scalar) in outputs.items():
                text = _arrow_type(datatype) is None
                column = []
                for d in docs:
                    data = next((o.get("data") for o in d["response"].get("outputs", []) if o["name"] == name), None)
                    if data is not None and text:
                        data = [orjson.dumps(v).decode() for v in data]
                    column.append(None if data is None else data[0] if scalar else data)
                columns[name] = column
            writer.write_table(pa.Table.from_pydict(columns, schema=schema))
