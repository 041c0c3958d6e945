"""A batch job's files: its input read a chunk at a time, the recorded chunks (parts), the output and error files.

The runner (:mod:`aiworks.batch.runner`) writes each recorded chunk as a
part beside the output file (``<output>.parts/``), then, when every chunk is
in, copies the parts in order into the output and error files, one part in
memory at a time. A JSONL input is mapped with 8 bytes kept per line (an
S3 input's also written beside the parts, ``line-ends``, so a runner that
resumes the job reads them rather than the object); a Parquet input is read
one chunk of rows at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from aiworks.batch import objects, tables
from aiworks.batch.jobs import Job
from aiworks.batch.lines import Line, LineIndex, chunk_bounds, parse_line


def output_file_id(job_id: str) -> str:
    return f"file-{job_id}-output"


def error_file_id(job_id: str) -> str:
    return f"file-{job_id}-error"


def open_input(job: Job, stack: contextlib.ExitStack) -> tuple[int, Iterator[Callable[[], list[Line]]]]:
    """The job's number of input lines (rows), and one callable per chunk, in order, that makes its lines.

    A JSONL input stays mapped until ``stack`` closes."""
    if job.format == "parquet":
        source = tables.ParquetInput(job.input_url, job.input_columns)
        return source.total, source.chunks(job.chunk_size)
    # An S3 input's line ends are kept beside the parts: a runner that resumes the job does not scan it again.
    index = LineIndex(stack.enter_context(objects.mapped(job.input_url)), keep_url=parts_prefix(job) + "line-ends")

    def chunks() -> Iterator[Callable[[], list[Line]]]:
        for start, end in chunk_bounds(index.total, job.chunk_size):
            yield lambda start=start, end=end: [
                parse_line(start + i + 1, raw, job.infer_path) for i, raw in enumerate(index.lines(start, end))
            ]

    return index.total, chunks()


def parts_prefix(job: Job) -> str:
    """Where a job's recorded chunks are written until its files are: beside its output file."""
    return job.output_url + ".parts/"


def part_urls(job: Job, part: str) -> tuple[str | None, str | None]:
    """The output-lines and error-lines files of a part (None where it has none)."""
    head, _, kinds = part.rpartition(".")
    prefix = parts_prefix(job) + head
    return (prefix + ".out" if "o" in kinds else None), (prefix + ".err" if "e" in kinds else None)


def write_part(job: Job, part: str, out: bytes, err: bytes) -> None:
    for url, data in zip(part_urls(job, part), (out, err)):
        if url is not None:
            objects.write_bytes(url, data)


def write_results(job: Job, parts: list[str]) -> tuple[int, int]:
    """The output and error files, copied from ``parts`` in order, one part in memory at a time; their sizes."""

    def lines(which: int) -> Iterator[bytes]:
        for part in parts:
            url = part_urls(job, part)[which]
            if url is not None:
                yield objects.read_bytes(url)

    with objects.sink(job.output_url) as output:
        if job.format == "parquet":
            tables.write_output_to(output, lambda: lines(0))
        else:
            for data in lines(0):
                output.write(data)
        output.flush()
        out_size = output.tell()
    with objects.sink(job.error_url) as errors:
        for data in lines(1):
            errors.write(data)
        err_size = errors.tell()
    return out_size, err_size
