"""How a PyTorch model's config tensors map onto its ``forward``, as Triton's pytorch backend maps them.

Inputs, in the order Triton tries them:

1. every config input is named after an argument of ``forward``: by that name;
2. every config input is named ``<anything>__<index>`` (``INPUT__0``): by the index;
3. otherwise: by the order of the config's inputs.

A ``forward`` that takes one ``Dict[str, Tensor]`` gets the inputs by their
config names instead. Outputs are named ``<anything>__<index>`` (``OUTPUT__0``)
for the index in what ``forward`` returns, else taken in the config's order;
a ``forward`` that returns a dict is read by the output names as keys.

Nothing here imports torch: the rules are plain functions of names, so they
are tested without loading a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from aiworks.core.errors import InvalidArgument

_INDEXED = re.compile(r"^.+__(\d+)$")


def _indices(names: list[str]) -> list[int] | None:
    found = [_INDEXED.match(n) for n in names]
    if not names or not all(found):
        return None
    return [int(m.group(1)) for m in found]


@dataclass(frozen=True, slots=True)
class InputPlan:
    """Where each config input goes: a position of ``forward`` (``dict_input`` False), or a dict key."""

    names: tuple[str, ...]  # config order
    positions: tuple[int, ...]  # forward position of names[i]
    dict_input: bool = False
    convention: str = "config order"

    def arguments(self, values: list) -> list:
        """``values`` (in config order) as the positional arguments of ``forward``."""
        args = [None] * len(values)
        for value, position in zip(values, self.positions):
            args[position] = value
        return args


def plan_inputs(
    model: str, config_names: list[str], forward_args: list[str] | None, dict_input: bool = False
) -> InputPlan:
    """Triton's naming rules for ``config_names`` against ``forward_args`` (None: unknown)."""
    names = tuple(config_names)
    if dict_input:
        return InputPlan(names, tuple(range(len(names))), True, "dict")
    if forward_args is not None and names and all(n in forward_args for n in names):
        if len(names) != len(forward_args):
            missing = [a for a in forward_args if a not in names]
            raise InvalidArgument(f"model '{model}': forward() also takes {missing}, which the config does not give")
        return InputPlan(names, tuple(forward_args.index(n) for n in names), False, "forward argument names")
    indices = _indices(list(names))
    if indices is not None:
        if sorted(indices) != list(range(len(names))):
            raise InvalidArgument(f"model '{model}': input indices {sorted(indices)} must be 0..{len(names) - 1}")
        convention = "<name>__<index>"
    else:
        indices, convention = list(range(len(names))), "config order"
    if forward_args is not None and len(forward_args) != len(names):
        raise InvalidArgument(
            f"model '{model}': forward() takes {len(forward_args)} input(s) {forward_args}, the config gives {len(names)}"
        )
    return InputPlan(names, tuple(indices), False, convention)


def plan_outputs(config_names: list[str]) -> tuple[int, ...]:
    """The index in ``forward``'s result of each config output (its ``__<index>``, else its config position)."""
    indices = _indices(list(config_names))
    return tuple(indices) if indices is not None else tuple(range(len(config_names)))


def select_outputs(model: str, result, names: list[str], indices: tuple[int, ...]) -> list:
    """The config outputs ``names`` from what ``forward`` returned (a tensor, a sequence or a dict)."""
    if isinstance(result, dict):
        try:
            return [result[n] for n in names]
        except KeyError as exc:
            raise InvalidArgument(f"model '{model}' returned no output {exc}; it returned {sorted(result)}") from None
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    out = []
    for name, index in zip(names, indices):
        if index >= len(items):
            raise InvalidArgument(f"model '{model}' returned {len(items)} output(s); '{name}' asks for index {index}")
        out.append(items[index])
    return out


# ---- CUDA graphs ---------------------------------------------------------------------------------

Signature = tuple[tuple[int, ...], ...]
"""The non-batch dims of every input, in config order: the shapes one set of CUDA graphs serves."""


def graph_plan(config) -> dict[Signature, tuple[int, ...]]:
    """The CUDA graphs a config asks for: input dims -> batch sizes, from Triton's ``optimization.cuda``.

    ``optimization { cuda { graphs: true } }`` turns them on. Each
    ``graph_spec { batch_size, input { key: NAME value { dim: [...] } } }``
    names one graph: its batch size and the dims of the inputs whose config
    dims are variable. Without ``graph_spec``, every input must have fixed
    dims and the batch sizes are the dynamic batcher's preferred sizes, else
    powers of two up to ``max_batch_size``. Empty when graphs are off, or for
    a model that does not batch.
    """
    cuda = (config.document.get("optimization") or {}).get("cuda") or {}
    if not cuda.get("graphs") or config.max_batch_size <= 0:
        return {}
    # The graphs see what the model takes: an input's reshape when its config has one.
    inputs = [replace(t, dims=t.reshape) if t.reshape is not None else t for t in config.inputs]
    specs = cuda.get("graph_spec") or []
    plan: dict[Signature, set[int]] = {}
    if not specs:
        variable = [t.name for t in inputs if any(d < 0 for d in t.dims)]
        if variable:
            raise InvalidArgument(
                f"model '{config.name}': CUDA graphs need fixed input dims; inputs {variable} vary, so give a "
                "graph_spec with their dims for each batch size"
            )
        sizes = config.batching.preferred_batch_sizes or _powers_of_two(config.max_batch_size)
        return {tuple(tuple(t.dims) for t in inputs): tuple(sorted(sizes))}
    for spec in specs:
        size = int(spec.get("batch_size", 0) or 0)
        if not 0 < size <= config.max_batch_size:
            raise InvalidArgument(f"model '{config.name}': graph_spec batch_size {size} is not in 1..max_batch_size")
        given = {name: tuple(int(d) for d in shape.get("dim", [])) for name, shape in (spec.get("input") or {}).items()}
        unknown = set(given) - {t.name for t in inputs}
        if unknown:
            raise InvalidArgument(f"model '{config.name}': graph_spec names unknown inputs {sorted(unknown)}")
        dims = []
        for t in inputs:
            shape = given.get(t.name, tuple(t.dims))
            if len(shape) != len(t.dims) or any(d < 1 or (c > 0 and d != c) for d, c in zip(shape, t.dims)):
                raise InvalidArgument(
                    f"model '{config.name}': graph_spec dims {list(shape)} of input '{t.name}' do not fit "
                    f"its config dims {list(t.dims)}"
                )
            dims.append(shape)
        plan.setdefault(tuple(dims), set()).add(size)
    return {signature: tuple(sorted(sizes)) for signature, sizes in plan.items()}


def _powers_of_two(limit: int) -> tuple[int, ...]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return (*sizes, limit)


def padded_size(rows: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured batch size that holds ``rows`` (the batch is padded to it); None if none does."""
    for size in sizes:
        if size >= rows:
            return size
    return None
