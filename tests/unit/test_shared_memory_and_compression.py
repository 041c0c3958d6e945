"""The gateway's shared memory registry and HTTP compression, in process (the e2e tests use real clients)."""

from __future__ import annotations

import asyncio
import gzip
import os
import zlib

import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, PayloadTooLarge, ResourceExhausted
from aiworks.gateway.compression import inflate, request_encoding, response_encoding
from aiworks.gateway.shared_memory import SharedMemoryRegistry, ShmRef, shm_ref, write_outputs


@pytest.fixture
def root(tmp_path):
    (tmp_path / "data").write_bytes(bytes(range(256)))
    (tmp_path / "other").write_bytes(bytes(64))
    return tmp_path


def test_regions_are_per_tenant_and_bounded(root):
    registry = SharedMemoryRegistry(max_regions=2, root=root)
    registry.register("alice", "r", "/data", 16, 64)
    registry.register("bob", "r", "other", 0, 8)  # the same name, bob's own
    assert registry.status("alice") == [{"name": "r", "key": "/data", "offset": 16, "byte_size": 64}]
    view = registry.view("alice", ShmRef("r", 4, 2), "input 'x'")
    assert bytes(view) == bytes([18, 19, 20, 21])
    with pytest.raises(InvalidArgument, match="runs past the end of shared memory region 'r' \\(64 bytes\\)"):
        registry.view("alice", ShmRef("r", 8, 60), "input 'x'")
    with pytest.raises(InvalidArgument, match="Unable to find system shared memory region: 'nope'"):
        registry.view("alice", ShmRef("nope", 1), "input 'x'")
    registry.unregister("bob")
    with pytest.raises(InvalidArgument, match="Unable to find"):
        registry.status("bob", "r")
    assert len(registry.status("alice")) == 1
    registry.close()


def test_keys_are_exclusive_and_stay_in_the_root(root, tmp_path):
    registry = SharedMemoryRegistry(max_regions=2, root=root)
    registry.register("alice", "a", "/data", 0, 8)
    with pytest.raises(InvalidArgument, match="Unable to open"):
        registry.register("bob", "b", "data", 0, 8)  # alice's key
    for key in ("../data", "/a/b", "..", "", "x" * 300):
        with pytest.raises(InvalidArgument, match="POSIX"):
            registry.register("alice", "k", key, 0, 8)
    os.symlink(root / "data", root / "link")
    with pytest.raises(InvalidArgument, match="Unable to open"):
        registry.register("alice", "k", "link", 0, 8)
    with pytest.raises(InvalidArgument, match="runs past the end of key"):
        registry.register("alice", "k", "data", 200, 100)
    registry.register("alice", "b", "data", 0, 8)
    with pytest.raises(ResourceExhausted, match="unregister one first"):
        registry.register("alice", "c", "data", 0, 8)
    with pytest.raises(InvalidArgument, match="off on this server"):
        SharedMemoryRegistry(max_regions=0, root=root).register("alice", "a", "data", 0, 8)


def test_outputs_are_written_once_and_must_fit(root):
    registry = SharedMemoryRegistry(root=root)
    registry.register("t", "out", "data", 0, 32)
    placements = registry.placements("t", {"y": ShmRef("out", 8, 4)})
    write_outputs([Tensor("y", "UINT8", (4,), b"\xff" * 4), Tensor("z", "UINT8", (1,), b"\0")], placements)
    assert (root / "data").read_bytes()[:14] == bytes(range(4)) + b"\xff" * 4 + bytes(range(8, 14))
    with pytest.raises(InvalidArgument, match="has 9 bytes, more than the 8 of its shared memory region"):
        write_outputs([Tensor("y", "UINT8", (9,), b"\1" * 9)], placements)
    registry.unregister("t")  # the placement's slice stays valid until released
    placements.clear()


def test_shm_parameters_must_be_whole():
    assert shm_ref({}, "input 'x'") is None
    assert shm_ref({"shared_memory_region": "r", "shared_memory_byte_size": 4}, "x") == ShmRef("r", 4, 0)
    for params in (
        {"shared_memory_region": "r"},
        {"shared_memory_byte_size": 4},
        {"shared_memory_offset": 4},
        {"shared_memory_region": "r", "shared_memory_byte_size": -1},
        {"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": "0"},
        {"shared_memory_region": "", "shared_memory_byte_size": 4},
    ):
        with pytest.raises(InvalidArgument):
            shm_ref(params, "input 'x'")


def test_inflate_within_the_limit():
    body = b"{}" * 1000
    assert asyncio.run(inflate(gzip.compress(body), "gzip", 2000)) == body
    assert asyncio.run(inflate(zlib.compress(body), "deflate", 2000)) == body
    raw = zlib.compressobj(6, zlib.DEFLATED, -15)
    assert asyncio.run(inflate(raw.compress(body) + raw.flush(), "deflate", 2000)) == body
    with pytest.raises(PayloadTooLarge, match="inflates past the limit of 1999 bytes"):
        asyncio.run(inflate(gzip.compress(body), "gzip", 1999))
    with pytest.raises(AIWorksError, match="not valid gzip data"):
        asyncio.run(inflate(gzip.compress(body)[:-10], "gzip", 5000))


def test_a_bomb_stops_at_the_limit():
    bomb = gzip.compress(bytes(256 << 20), compresslevel=9)  # 256 MiB of zeros in about 256 KB
    with pytest.raises(PayloadTooLarge):
        asyncio.run(inflate(bomb, "gzip", 4 << 20))


def test_encoding_headers():
    assert request_encoding(None) is None and request_encoding("identity") is None
    assert request_encoding(" GZIP ") == "gzip"
    with pytest.raises(AIWorksError, match="not supported") as info:
        request_encoding("br")
    assert info.value.status.http == 415
    assert response_encoding("gzip, deflate") == "gzip"
    assert response_encoding("deflate;q=1.0, gzip;q=0") == "deflate"
    assert response_encoding("br") is None and response_encoding("") is None
    assert response_encoding("*") == "gzip"
