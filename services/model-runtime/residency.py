"""Model residency: which versions stay in memory, which load at start, and how they warm up.

- **Residency.** A replica *serves* every version it was asked to load, but
  keeps only as many *resident* (sessions in memory) as fit its memory
  budget, evicting the least recently used. An evicted version is still
  advertised to the scheduler; its next request loads it again (a cold start,
  counted in its statistics). A version's size is estimated as the size of
  its folder on disk, which for ONNX models is dominated by the weights.
- **Preload.** Models whose config has ``parameters { key: "preload" value:
  { string_value: "true" } }`` load at start, with the ones ``--models``
  names. When no model is marked and ``--models`` is not given, every model
  loads at start (the default before preload existed). Other models load on
  an explicit load request (Triton's explicit model control).
- **Warm-up.** Before a loaded version is reported ready it runs its warm-up
  batches: the config's ``model_warmup`` samples when it has any (Triton's
  semantics: ``zero_data``, ``random_data`` or ``input_data_file`` from the
  model's ``warmup/`` folder, ``batch_size``, ``count``), otherwise one batch
  of one row of zeros generated from the config's inputs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiworks.core.datatypes import NUMPY_DTYPES, Tensor, element_count, encode, serialize_bytes
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import ModelStatistics
from aiworks.core.model_config import ModelConfig
from aiworks.core.names import inside

Key = tuple[str, str]  # (model, version)


@dataclass(slots=True)
class RuntimeModelStatistics(ModelStatistics):
    """A version's counters plus its residency and cold-start figures (runtime.proto ModelStatistics)."""

    resident: bool = False
    resident_bytes: int = 0
    preloaded: bool = False
    load_ns: int = 0
    warmup_ns: int = 0
    cold_start_ns: int = 0
    first_request_ns: int = 0
    load_count: int = 0
    eviction_count: int = 0


class ResidencyLRU:
    """Resident versions in least-recently-used order, with their sizes, within ``budget_bytes`` (0: no bound)."""

    def __init__(self, budget_bytes: int = 0):
        self.budget_bytes = budget_bytes
        self._sizes: OrderedDict[Key, int] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._sizes

    def keys(self) -> list[Key]:
        """Least recently used first."""
        return list(self._sizes)

    def add(self, key: Key, size: int) -> None:
        self.remove(key)
        self._sizes[key] = size
        self.used_bytes += size

    def remove(self, key: Key) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def touch(self, key: Key) -> None:
        if key in self._sizes:
            self._sizes.move_to_end(key)

    def victims(self, size: int, keep: Key) -> list[Key]:
        """The least recently used versions to evict so that ``size`` more bytes fit; never ``keep``.

        When even evicting everything else cannot make room, the version is
        admitted over the budget (serving beats refusing); the list then
        holds every other version.
        """
        if not self.budget_bytes:
            return []
        used = self.used_bytes - self._sizes.get(keep, 0)
        out = []
        for key, held in self._sizes.items():
            if used + size <= self.budget_bytes:
                break
            if key == keep:
                continue
            out.append(key)
            used -= held
        return out


def estimate_bytes(version_dir: Path) -> int:
    """Memory a version is expected to take: the size of the files in its folder."""
    return sum(p.stat().st_size for p in Path(version_dir).rglob("*") if p.is_file())


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def wants_preload(config: ModelConfig | None) -> bool:
    return config is not None and _truthy(config.parameters.get("preload"))


def startup_models(configs: dict[str, ModelConfig | None], requested: list[str] | None) -> list[str]:
    """The models to load at start: those ``--models`` names plus those marked preload.

    When nothing is marked and ``--models`` is not given: every model.
    """
    marked = [name for name, config in configs.items() if wants_preload(config)]
    if requested is not None:
        return list(requested) + [m for m in marked if m not in requested]
    return marked or list(configs)


def response_cache_enabled(config: ModelConfig) -> bool:
    """Triton's ``response_cache { enable: true }`` in the config."""
    return bool(config.document.get("response_cache", {}).get("enable", False))


# ---- warm-up -----------------------------------------------------------------------------------


def _sample_tensor(name: str, datatype: str, shape: tuple[int, ...], how: dict, model_dir: Path, rng) -> Tensor:
    count = element_count(shape)
    if how.get("input_data_file"):
        shown = f"warmup/{how['input_data_file']}"
        path = inside(model_dir / "warmup", model_dir / "warmup" / how["input_data_file"], f"warm-up file {shown}")
        if not path.is_file():
            raise InvalidArgument(f"warm-up input '{name}': {shown} does not exist")
        return Tensor(name, datatype, shape, path.read_bytes())
    if datatype == "BYTES":  # random_data of a string input is empty strings, as in Triton
        words = [b""] * count
        return Tensor(name, datatype, shape, serialize_bytes(np.array(words, dtype=np.object_)))
    dtype = NUMPY_DTYPES[datatype]
    if how.get("random_data"):
        if dtype.kind == "f":
            array = rng.random(shape).astype(dtype)
        elif dtype.kind == "b":
            array = rng.random(shape) > 0.5
        else:
            array = rng.integers(0, 2, shape).astype(dtype)
    else:
        array = np.zeros(shape, dtype=dtype)
    return Tensor(name, datatype, shape, encode(array, datatype))


def _datatype(triton_type: str) -> str:
    return "BYTES" if triton_type == "TYPE_STRING" else triton_type.removeprefix("TYPE_")


def configured_warmup(config: ModelConfig) -> bool:
    """The config has Triton's ``model_warmup``: its samples must run, and their failure fails the load."""
    return bool(config.document.get("model_warmup"))


def warmup_batches(config: ModelConfig, model_dir: Path) -> list[tuple[str, list[Tensor]]]:
    """The warm-up batches of a (completed) config, each ``(sample name, input tensors)``, in order.

    With ``model_warmup`` in the config: its samples as Triton runs them (a sample of batch_size 0 is skipped;
    ``count`` runs of each). Without: the suite's own default, one row of zeros per input.
    """
    rng = np.random.default_rng(0)
    batched = config.max_batch_size > 0
    samples = config.document.get("model_warmup") or []
    batches = []
    if not samples:
        batch = []
        for t in config.inputs:
            dims = tuple(1 if d < 0 else d for d in t.dims)
            batch.append(_sample_tensor(t.name, t.datatype, ((1,) if batched else ()) + dims, {}, model_dir, rng))
        return [("default", batch)] if batch else []
    for sample in samples:
        label = sample.get("name", "")
        size = int(sample.get("batch_size", 0) or 0)
        if size == 0:  # Triton skips a sample of batch size 0
            continue
        if batched and size > config.max_batch_size:
            raise InvalidArgument(
                f"warmup sample '{label}': batch_size {size} exceeds max_batch_size {config.max_batch_size}"
            )
        batch = []
        for name, how in (sample.get("inputs") or {}).items():
            dims = tuple(int(d) for d in how.get("dims", []))
            if any(d < 0 for d in dims):
                raise InvalidArgument(
                    f"warmup sample '{label}': all variable-size dimensions must be specified for input '{name}'"
                )
            # Without a batch dim a batch_size above 1 repeats the sample; the shape stays the config's.
            shape = ((size,) if batched else ()) + dims
            batch.append(_sample_tensor(name, _datatype(how.get("data_type", "TYPE_FP32")), shape, how, model_dir, rng))
        batches.extend([(label, batch)] * max(1, int(sample.get("count", 1) or 1)))
    return batches
