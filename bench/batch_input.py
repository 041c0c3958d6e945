"""What reading a batch job's input costs the runner: Parquet against JSONL, the same rows.

No suite: the runner's own input path only, in this process. N random
digits-shaped rows (64 FP32 values, a ``custom_id``) are written once as
Parquet (one list column) and once as JSONL (OIP requests); each file is then
cut into chunks and turned into requests exactly as the runner does
(``aiworks.batch.tables.ParquetInput`` / the mapped file and
``aiworks.batch.lines.LineIndex``). For comparison, JSONL is also read as the
runner did before it mapped its input: the whole file read and split into
lines. Printed: file sizes, rows/s, and the peak of Python allocations
(tracemalloc; Arrow's own buffers and the mapped file's pages are not
counted) while reading. Then the Parquet output table of
N answers (``label`` and ten ``probabilities``) is written from JSONL chunk
records, as the runner does when the job ends.

Usage: python bench/batch_input.py [--rows 100000] [--chunk-size 100] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from aiworks.batch import objects
from aiworks.batch.lines import LineIndex, chunk_bounds, parse_line
from aiworks.batch.tables import ParquetInput, write_output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--chunk-size", type=int, default=100)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    n, size = args.rows, args.chunk_size
    work = Path(args.dir)
    parquet_path, jsonl_path = work / "batch_input_bench.parquet", work / "batch_input_bench.jsonl"
    x = np.random.default_rng(0).random((n, 64), dtype=np.float32)
    ids = [f"row-{i}" for i in range(n)]
    pq.write_table(pa.table({"custom_id": ids, "input": pa.array(list(x), pa.list_(pa.float32()))}), parquet_path)
    with jsonl_path.open("wb") as f:
        for i, row in enumerate(x):
            request = {"custom_id": ids[i], "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64],
                                                       "data": row.tolist()}]}  # fmt: skip
            f.write(orjson.dumps(request) + b"\n")
    print(f"{n} rows: parquet {os.path.getsize(parquet_path) / 1e6:.1f} MB, jsonl {os.path.getsize(jsonl_path) / 1e6:.1f} MB")

    tracemalloc.start()
    started, rows = time.perf_counter(), 0
    for make in ParquetInput(str(parquet_path), {}).chunks(size):
        rows += len(make())
    parquet_s, parquet_peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    started, lines_done = time.perf_counter(), 0
    with objects.mapped(str(jsonl_path)) as data:  # as the runner reads it
        index = LineIndex(data)
        for start, end in chunk_bounds(index.total, size):
            lines_done += len([parse_line(start + i + 1, raw, "/v2/models/m/infer")
                               for i, raw in enumerate(index.lines(start, end))])  # fmt: skip
        del index
    jsonl_s, jsonl_peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    started, whole_done = time.perf_counter(), 0
    lines = jsonl_path.read_bytes().split(b"\n")[:-1]  # the whole file, split: how the runner read it before
    for start, end in chunk_bounds(len(lines), size):
        whole_done += len([parse_line(start + i + 1, raw, "/v2/models/m/infer") for i, raw in enumerate(lines[start:end])])
    whole_s, whole_peak = time.perf_counter() - started, tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    del lines
    print(f"read and convert, chunks of {size}: parquet {parquet_s:.2f} s ({rows / parquet_s:,.0f} rows/s, "
          f"Python peak {parquet_peak / 1e6:.1f} MB); jsonl mapped {jsonl_s:.2f} s ({lines_done / jsonl_s:,.0f} "
          f"rows/s, Python peak {jsonl_peak / 1e6:.1f} MB); jsonl read whole {whole_s:.2f} s "
          f"({whole_done / whole_s:,.0f} rows/s, Python peak {whole_peak / 1e6:.1f} MB)")  # fmt: skip

    chunks = []
    for start in range(0, n, size):
        chunks.append(b"".join(orjson.dumps({"line": i + 1, "custom_id": ids[i], "response": {"outputs": [
            {"name": "label", "datatype": "INT64", "shape": [1], "data": [i % 10]},
            {"name": "probabilities", "datatype": "FP32", "shape": [1, 10], "data": [0.1] * 10},
        ]}}) + b"\n" for i in range(start, min(n, start + size))))  # fmt: skip
    started = time.perf_counter()
    table = write_output(chunks)
    print(f"parquet output of {n} answers: {time.perf_counter() - started:.2f} s, {len(table) / 1e6:.1f} MB")
    parquet_path.unlink()
    jsonl_path.unlink()


if __name__ == "__main__":
    main()
