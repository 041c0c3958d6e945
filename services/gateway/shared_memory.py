"""Triton's system shared memory extension: regions a client registered, read and written in place.

A client on the gateway's host creates a POSIX shared memory object
(``/dev/shm/<key>``), registers a region of it under a name, and then names
that region in an input's or requested output's parameters
(``shared_memory_region``, ``shared_memory_byte_size``, optional
``shared_memory_offset``). The gateway maps the object once, at
registration; an input is a memoryview slice of the mapping (no copy until
it is put into the protobuf to the runtime), and an output is copied into the
mapping once, and the response then carries no data for it.

Regions belong to the tenant that registered them: names are per tenant
(two tenants may both use ``input_data``), and another tenant's name is an
unknown region (400), never a hint that it exists. A key already registered
by one tenant cannot be registered by another. Each tenant may hold at most
``max_regions`` regions. CUDA shared memory is refused on both front ends
(:data:`CUDA_UNSUPPORTED`). See docs/triton.md, "System shared memory", and
docs/security.md.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiworks.core.errors import AIWorksError, InvalidArgument, ResourceExhausted, Status
from aiworks.core.looplag import offload

SHM_ROOT = Path("/dev/shm")
REGION = "shared_memory_region"
BYTE_SIZE = "shared_memory_byte_size"
OFFSET = "shared_memory_offset"
CUDA_UNSUPPORTED = "CUDA shared memory is not supported by this server"
DEFAULT_MAX_REGIONS = 64
# Outputs with more bytes than this are copied into their regions in a worker thread.
OFF_LOOP_BYTES = 1 << 20

# A POSIX shared memory name: one path component, with or without the leading '/'.
_KEY = re.compile(r"/?[A-Za-z0-9_.\-]{1,200}")
_NAME_MAX = 256


def _unknown(name: str) -> InvalidArgument:
    return InvalidArgument(f"Unable to find system shared memory region: '{name[:_NAME_MAX]}'")


@dataclass(frozen=True, slots=True)
class ShmRef:
    """Where one tensor lies: a region's name, and an offset and size inside it."""

    region: str
    byte_size: int
    offset: int = 0


def shm_ref(params: dict, where: str) -> ShmRef | None:
    """The shared memory parameters of one input or requested output, checked; None when it has none."""
    region = params.get(REGION)
    size = params.get(BYTE_SIZE)
    offset = params.get(OFFSET, 0)
    if region is None and size is None:
        if OFFSET in params:
            raise InvalidArgument(f"{where}: '{OFFSET}' needs '{REGION}' and '{BYTE_SIZE}'")
        return None
    if region is None or size is None:
        raise InvalidArgument(f"{where}: shared memory needs both '{REGION}' and '{BYTE_SIZE}'")
    if type(region) is not str or not region:
        raise InvalidArgument(f"{where}: '{REGION}' must be a non-empty string")
    for key, value in ((BYTE_SIZE, size), (OFFSET, offset)):
        if type(value) is not int or value < 0:
            raise InvalidArgument(f"{where}: '{key}' must be a non-negative integer")
    return ShmRef(region, size, offset)


@dataclass(eq=False)
class Region:
    """One registered region: ``byte_size`` bytes at ``offset`` of the shared memory object ``key``."""

    name: str
    key: str
    offset: int
    byte_size: int
    _map: mmap.mmap = field(repr=False)
    view: memoryview = field(repr=False)

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}

    def slice(self, ref: ShmRef, where: str) -> memoryview:
        if ref.offset + ref.byte_size > self.byte_size:
            raise InvalidArgument(
                f"{where}: offset {ref.offset} + byte size {ref.byte_size} runs past the end of shared memory "
                f"region '{self.name}' ({self.byte_size} bytes)"
            )
        return self.view[ref.offset : ref.offset + ref.byte_size]

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a request in flight still reads a slice: the mapping goes when its last view does


def _open(key: str, offset: int, byte_size: int, root: Path) -> tuple[mmap.mmap, memoryview]:
    path = root / key.lstrip("/")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise InvalidArgument(f"Unable to open shared memory key '{key}'") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"shared memory key '{key}' is not a shared memory object")
        if offset + byte_size > info.st_size:
            raise InvalidArgument(
                f"shared memory region of {byte_size} bytes at offset {offset} runs past the end of key '{key}' "
                f"({info.st_size} bytes)"
            )
        mapping = mmap.mmap(fd, offset + byte_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return mapping, memoryview(mapping)[offset : offset + byte_size]


class SharedMemoryRegistry:
    """The system shared memory regions of every tenant on this gateway replica."""

    def __init__(self, max_regions: int = DEFAULT_MAX_REGIONS, root: Path = SHM_ROOT):
        self.max_regions = max_regions
        self.root = Path(root)
        self._regions: dict[tuple[str, str], Region] = {}
        self._lock = threading.Lock()  # register, unregister and lookups run on the loop; close may not

    def register(self, tenant: str, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes at ``offset`` of ``/dev/shm/<key>`` as ``tenant``'s region ``name``."""
        if self.max_regions == 0:
            raise InvalidArgument("system shared memory is off on this server (setting shared_memory_max_regions)")
        if not isinstance(name, str) or not name or len(name) > _NAME_MAX:
            raise InvalidArgument(f"a shared memory region needs a name of 1 to {_NAME_MAX} characters")
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.lstrip("/") in (".", ".."):
            raise InvalidArgument(
                "shared memory key must be one POSIX shared memory name (letters, digits, '_', '.', '-'; "
                "an optional leading '/')"
            )
        for what, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidArgument(f"shared memory '{what}' must be a non-negative integer")
        if byte_size == 0:
            raise InvalidArgument("shared memory 'byte_size' must be positive")
        with self._lock:
            if (tenant, name) in self._regions:
                raise AIWorksError(f"shared memory region '{name}' already in manager", Status.INVALID_ARGUMENT)
            owned = sum(1 for t, _ in self._regions if t == tenant)
            if owned >= self.max_regions:
                raise ResourceExhausted(
                    f"tenant holds {owned} shared memory regions, the most allowed (setting shared_memory_max_regions)"
                    "; unregister one first"
                )
            bare = key.lstrip("/")
            if any(r.key.lstrip("/") == bare and t != tenant for (t, _), r in self._regions.items()):
                raise InvalidArgument(f"Unable to open shared memory key '{key}'")  # another tenant's: not said
            mapping, view = _open(key, offset, byte_size, self.root)
            self._regions[(tenant, name)] = Region(name, key, offset, byte_size, mapping, view)

    def status(self, tenant: str, name: str = "") -> list[dict]:
        """The tenant's regions (one, when ``name`` is given: 400 when it has none of that name)."""
        with self._lock:
            if name:
                return [self._get(tenant, name).status()]
            return [r.status() for (t, _), r in sorted(self._regions.items()) if t == tenant]

    def unregister(self, tenant: str, name: str = "") -> None:
        """Forget the tenant's region ``name``, or all its regions; an unknown name is not an error (as Triton)."""
        with self._lock:
            names = [name] if name else [n for t, n in self._regions if t == tenant]
            gone = [self._regions.pop((tenant, n)) for n in names if (tenant, n) in self._regions]
        for region in gone:
            region.close()

    def _get(self, tenant: str, name: str) -> Region:
        region = self._regions.get((tenant, name))
        if region is None:
            raise _unknown(name)
        return region

    def view(self, tenant: str, ref: ShmRef, where: str) -> memoryview:
        """The bytes ``ref`` names in the tenant's region, as a slice of the mapping (no copy)."""
        with self._lock:
            return self._get(tenant, ref.region).slice(ref, where)

    def placements(self, tenant: str, refs: dict[str, ShmRef]) -> dict[str, tuple[ShmRef, memoryview]]:
        """The slices the requested outputs ``refs`` go to, checked before the request is computed."""
        return {name: (ref, self.view(tenant, ref, f"output '{name[:64]}'")) for name, ref in refs.items()}

    def close(self) -> None:
        with self._lock:
            regions = list(self._regions.values())
            self._regions.clear()
        for region in regions:
            region.close()

    def __len__(self) -> int:
        return len(self._regions)


async def store_outputs(outputs, placements: dict[str, tuple[ShmRef, memoryview]]) -> None:
    """:func:`write_outputs`, in a worker thread when there is more than :data:`OFF_LOOP_BYTES` to copy."""
    if placements:
        size = sum(len(t.raw) for t in outputs if t.name in placements)
        await offload(write_outputs, outputs, placements, large=size > OFF_LOOP_BYTES)


def write_outputs(outputs, placements: dict[str, tuple[ShmRef, memoryview]]) -> None:
    """Copy each output placed in shared memory into its slice; 400 when one does not fit its byte size."""
    for tensor in outputs:
        placed = placements.get(tensor.name)
        if placed is None:
            continue
        ref, target = placed
        size = len(tensor.raw)
        if size > ref.byte_size:
            raise InvalidArgument(
                f"output '{tensor.name}' has {size} bytes, more than the {ref.byte_size} of its shared memory "
                f"region '{ref.region}'"
            )
        target[:size] = tensor.raw
