"""One input line to a request or a refusal; chunk bounds fixed by the input."""

from __future__ import annotations

import orjson

from aiworks.batch import objects
from aiworks.batch.lines import LineIndex, chunk_bounds, parse_line

PATH = "/v2/models/iris/infer"
REQUEST = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}


def test_an_oip_request_with_custom_id_is_sent_as_batch_class():
    line = parse_line(7, orjson.dumps({**REQUEST, "custom_id": "row-7", "parameters": {"priority": 1}}), PATH)
    assert line.error is None and line.custom_id == "row-7" and line.number == 7
    assert "custom_id" not in line.request
    assert line.request["parameters"] == {"priority": "batch"}  # a line cannot jump into the online classes


def test_the_openai_line_shape_is_accepted_and_its_url_checked():
    line = parse_line(1, orjson.dumps({"custom_id": "a", "method": "POST", "url": PATH, "body": REQUEST}), PATH)
    assert line.error is None and line.request["inputs"] == REQUEST["inputs"]
    other = parse_line(2, orjson.dumps({"custom_id": "b", "url": "/v2/models/digits/infer", "body": REQUEST}), PATH)
    assert other.request is None and "not this job's endpoint" in other.error


def test_malformed_lines_say_why():
    cases = {
        b"{not json": "malformed JSON",
        b"[1, 2]": "JSON object, not list",
        b'{"inputs": []}': "'inputs' must be a non-empty list",
        b'{"custom_id": 5, "inputs": [{}]}': "custom_id must be a string",
        b'{"inputs": [{}], "parameters": 3}': "'parameters' must be a JSON object",
        b"   ": "empty line",
    }
    for raw, reason in cases.items():
        line = parse_line(3, raw, PATH)
        assert line.request is None and reason in line.error, (raw, line.error)


def test_chunks_cover_every_line_once():
    bounds = chunk_bounds(1001, 100)
    assert bounds[0] == (0, 100) and bounds[-1] == (1000, 1001) and len(bounds) == 11
    covered = [i for start, end in bounds for i in range(start, end)]
    assert covered == list(range(1001))
    assert chunk_bounds(0, 100) == []


def test_a_line_index_keeps_inner_empty_lines_and_drops_the_final_newline():
    def lines(data: bytes) -> list[bytes]:
        index = LineIndex(data)
        return index.lines(0, index.total)

    assert lines(b"a\n\nb\r\n") == [b"a", b"", b"b"]
    assert lines(b"a") == [b"a"] and lines(b"a\n") == [b"a"]
    assert lines(b"") == [] and lines(b"\n") == [b""] and lines(b"\n\n") == [b"", b""]
    index = LineIndex(b"ab\ncd\r\nef")
    assert index.total == 3 and index.lines(1, 3) == [b"cd", b"ef"] and index.lines(2, 9) == [b"ef"]
    assert index.lines(3, 4) == []


def test_a_mapped_file_agrees_with_its_line_count_and_closes(tmp_path, monkeypatch):
    import aiworks.batch.lines as lines_module

    monkeypatch.setattr(lines_module, "_SCAN", 7)  # many scan blocks, a line across each boundary
    rows = [b'{"n": %d}' % i for i in range(50)] + [b"", b"last"]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(rows))  # no final newline
    with objects.mapped(str(path)) as data:
        index = LineIndex(data)
        assert index.total == len(rows) == objects.count_lines(str(path))
        assert index.lines(0, index.total) == rows
        assert [line for start, end in chunk_bounds(index.total, 8) for line in index.lines(start, end)] == rows
    # the mapping closed with the block (no array still pointed into it)
    assert data.closed
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with objects.mapped(str(tmp_path / "empty.jsonl")) as data:
        assert LineIndex(data).total == 0 == objects.count_lines(str(tmp_path / "empty.jsonl"))


class _Ranges:
    """A source read in ranges, as ``objects.Ranged`` is (an S3 object): counts its reads."""

    def __init__(self, data: bytes):
        self.data, self.reads = data, []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, span: slice) -> bytes:
        self.reads.append((span.start, span.stop))
        return self.data[span]

    def blocks(self, size: int):
        for start in range(0, len(self.data), size):
            yield self[start : start + size]


def test_a_source_read_in_ranges_is_scanned_in_blocks_and_read_once_a_chunk(monkeypatch):
    import aiworks.batch.lines as lines_module

    monkeypatch.setattr(lines_module, "_SCAN", 7)
    rows = [b'{"n": %d}' % i for i in range(50)] + [b"", b"last\r"]
    source = _Ranges(b"\n".join(rows) + b"\n")
    index = LineIndex(source)
    assert index.total == len(rows) and len(source.reads) == -(-len(source.data) // 7)  # the scan: blocks of 7
    source.reads.clear()
    chunks = chunk_bounds(index.total, 8)
    assert [line for start, end in chunks for line in index.lines(start, end)] == rows[:-1] + [b"last"]
    assert len(source.reads) == len(chunks)  # one ranged read a chunk, not one a line


def test_a_sink_leaves_the_object_whole_or_untouched(tmp_path):
    target = tmp_path / "out" / "result.jsonl"
    with objects.sink(str(target)) as f:
        f.write(b"a\n")
        f.write(b"b\n")
    assert target.read_bytes() == b"a\nb\n"
    try:
        with objects.sink(str(target)) as f:
            f.write(b"half")
            raise RuntimeError("the writer died")
    except RuntimeError:
        pass
    assert target.read_bytes() == b"a\nb\n"  # the old file stands
    assert sorted(p.name for p in target.parent.iterdir()) == ["result.jsonl"]  # no temporary left behind
