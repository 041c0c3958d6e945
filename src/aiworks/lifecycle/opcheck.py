"""Operator compatibility of an ONNX graph with a target backend, as a readable report.

Targets:

- ``onnxruntime-cpu``: the kernels the *installed* onnxruntime registers for
  the CPU execution provider, matched by domain, op, the schema version the
  model's opset selects, and the element type of the node's first input.
- ``tensorrt``: the declared operator list in :mod:`.tensorrt_ops`.

Custom ops of onnxruntime-extensions (domain ``ai.onnx.contrib``) count as
supported on ONNX Runtime when that package is installed, with a note that the
session must register its library.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache

import onnx

from aiworks.lifecycle.sessions import EXTENSIONS_DOMAIN

TARGETS = ("onnxruntime-cpu", "tensorrt")


@dataclass(frozen=True, slots=True)
class OpStatus:
    domain: str
    op: str
    nodes: int
    supported: bool
    note: str = ""


@dataclass(slots=True)
class OpReport:
    """The per-operator verdicts for one model and one target."""

    target: str
    target_detail: str
    opsets: dict[str, int]
    ops: list[OpStatus] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(o.supported for o in self.ops)

    @property
    def unsupported(self) -> list[OpStatus]:
        return [o for o in self.ops if not o.supported]

    def format(self) -> str:
        nodes = sum(o.nodes for o in self.ops)
        opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(self.opsets.items()))
        verdict = "all supported" if self.ok else f"{len(self.unsupported)} NOT supported"
        lines = [
            f"operator check: target {self.target} ({self.target_detail}); opsets: {opsets}",
            f"  {len(self.ops)} operator types in {nodes} nodes: {verdict}",
        ]
        width = max([len(o.op) for o in self.ops] + [8])
        dwidth = max([len(o.domain or "ai.onnx") for o in self.ops] + [6])
        lines.append(f"  {'operator':<{width}}  {'domain':<{dwidth}}  nodes  status")
        for o in sorted(self.ops, key=lambda o: (o.supported, o.domain, o.op)):
            status = "ok" if o.supported else "UNSUPPORTED"
            if o.note:
                status += f" ({o.note})"
            lines.append(f"  {o.op:<{width}}  {o.domain or 'ai.onnx':<{dwidth}}  {o.nodes:>5}  {status}")
        return "\n".join(lines)


def _walk(graph: onnx.GraphProto):
    """Every node of a graph and of its subgraphs (Loop, If, Scan bodies)."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _walk(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for g in attr.graphs:
                    yield from _walk(g)


def _domain(d: str) -> str:
    return "" if d in ("", "ai.onnx") else d


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor whose type shape inference can tell."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # custom ops or a huge model: work with what is declared
        inferred = model
    types = {}
    g = inferred.graph
    for v in list(g.input) + list(g.output) + list(g.value_info):
        if v.type.HasField("tensor_type"):
            types[v.name] = v.type.tensor_type.elem_type
    for init in g.initializer:
        types[init.name] = init.data_type
    return types


@lru_cache(maxsize=1)
def _ort_kernels() -> dict[tuple[str, str], list[tuple[int, int, dict[str, frozenset[str]]]]]:
    from onnxruntime.capi import _pybind_state as C

    kernels: dict[tuple[str, str], list] = {}
    for k in C.get_all_opkernel_def():
        if k.provider != "CPUExecutionProvider":
            continue
        types = {param: frozenset(ts) for param, ts in k.type_constraints.items()}
        kernels.setdefault((_domain(k.domain), k.op_name), []).append((k.version_range[0], k.version_range[1], types))
    return kernels


def _since_version(op: str, domain: str, opset: int) -> int:
    try:
        return onnx.defs.get_schema(op, opset, domain).since_version
    except Exception:  # not an ONNX-defined op (com.microsoft, custom domains)
        return opset


def _type_name(elem_type: int) -> str:
    name = {
        onnx.TensorProto.FLOAT: "float",
        onnx.TensorProto.FLOAT16: "float16",
        onnx.TensorProto.BFLOAT16: "bfloat16",
        onnx.TensorProto.DOUBLE: "double",
        onnx.TensorProto.STRING: "string",
    }
    return f"tensor({name.get(elem_type, onnx.helper.tensor_dtype_to_np_dtype(elem_type).name)})"


def _first_input_param(op: str, domain: str, opset: int) -> str:
    """The type parameter (``T``, ``T1``...) of the op's first input, per its ONNX schema."""
    try:
        schema = onnx.defs.get_schema(op, opset, domain)
    except Exception:
        return ""
    return schema.inputs[0].type_str if schema.inputs else ""


def _check_ort(domain, op, opset, first_input_types) -> tuple[bool, str]:
    if domain == EXTENSIONS_DOMAIN:
        from aiworks.core.lifecycle import import_onnxruntime_extensions

        try:
            import_onnxruntime_extensions()
        except ImportError:
            return False, "custom op: onnxruntime-extensions is not installed"
        return True, "custom op: the session must register onnxruntime-extensions"
    if (domain, op) == ("", "Constant"):
        return True, ""  # folded into initializers when the session loads
    kernels = _ort_kernels().get((domain, op))
    if not kernels:
        return False, "no CPU kernel"
    since = _since_version(op, domain, opset)
    matching = [k for k in kernels if k[0] <= since <= k[1]]
    if not matching:
        ranges = ", ".join(f"{a}-{b if b < 2**30 else 'latest'}" for a, b, _ in kernels)
        return False, f"schema version {since} has no CPU kernel (kernels for {ranges})"
    param = _first_input_param(op, domain, opset)
    allowed: set[str] = set()
    for k in matching:
        allowed |= k[2].get(param, set())
    missing = sorted({_type_name(t) for t in first_input_types if t and allowed and _type_name(t) not in allowed})
    if missing == ["tensor(float16)"]:
        return True, "no float16 CPU kernel: ONNX Runtime inserts casts and computes in float"
    if missing:
        return False, f"no CPU kernel for {', '.join(missing)}"
    return True, ""


def _check_tensorrt(domain, op) -> tuple[bool, str]:
    from aiworks.lifecycle.tensorrt_ops import TENSORRT_OPS, TENSORRT_RESTRICTED

    if domain != "":
        return False, f"TensorRT parses no {domain} operators"
    if op not in TENSORRT_OPS:
        return False, "not in TensorRT's ONNX operator list"
    return True, TENSORRT_RESTRICTED.get(op, "")


def check_ops(model: onnx.ModelProto, target: str = "onnxruntime-cpu") -> OpReport:
    """Check every operator of ``model`` (subgraphs included) against ``target``."""
    if target not in TARGETS:
        raise ValueError(f"unknown target '{target}'; choose one of {', '.join(TARGETS)}")
    opsets = {_domain(o.domain): int(o.version) for o in model.opset_import}
    counts: Counter[tuple[str, str]] = Counter()
    first_types: dict[tuple[str, str], set[int]] = {}
    types = _value_types(model) if target == "onnxruntime-cpu" else {}
    for node in _walk(model.graph):
        key = (_domain(node.domain), node.op_type)
        counts[key] += 1
        if node.input and node.input[0] in types:
            first_types.setdefault(key, set()).add(types[node.input[0]])
    if target == "onnxruntime-cpu":
        import onnxruntime

        detail = f"onnxruntime {onnxruntime.__version__}, CPUExecutionProvider"
    else:
        from aiworks.lifecycle.tensorrt_ops import TENSORRT_VERSION

        detail = f"declared operator list for TensorRT {TENSORRT_VERSION}"
    report = OpReport(target, detail, opsets)
    for (domain, op), n in counts.items():
        if target == "onnxruntime-cpu":
            supported, note = _check_ort(domain, op, opsets.get(domain, 1), first_types.get((domain, op), set()))
        else:
            supported, note = _check_tensorrt(domain, op)
        report.ops.append(OpStatus(domain, op, n, supported, note))
    return report
