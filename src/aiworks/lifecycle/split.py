"""``aiworks split``: cut an ONNX graph at named tensors into stages, one model folder each.

Stage *k* reads the tensors of cut *k-1* (and any original graph inputs it
still needs) and produces the tensors of cut *k*; the last stage produces the
original outputs. Stages are cut with ``onnx.utils.extract_model``. When the
source sits in a model folder (``<repo>/<name>/<version>/model.onnx``), each
stage inherits its config's serving settings (dynamic batching, instance
group, optimization, parameters), so a stage batches and runs as the unsplit
model does.

:class:`EdgeStage` runs the front stage on the device with onnxruntime and
returns the intermediate tensors to send; :func:`measure_split` reports the
bytes sent against the raw input and the latency against the unsplit model.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx

from aiworks.lifecycle.layout import DEFAULT_MAX_BATCH_SIZE, graph_io, make_config, write_model_folder
from aiworks.lifecycle.sessions import open_session


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple

    def __str__(self) -> str:
        return f"{self.name}  {self.dtype}{list(self.shape)}"


def cut_candidates(model: onnx.ModelProto) -> list[TensorInfo]:
    """Intermediate tensors (in graph order) with their inferred types and shapes: where a cut can go."""
    inferred = onnx.shape_inference.infer_shapes(model)
    info = {v.name: v for v in inferred.graph.value_info}
    out = []
    for node in inferred.graph.node:
        for name in node.output:
            v = info.get(name)
            if v is None or not v.type.HasField("tensor_type"):
                continue
            tt = v.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in tt.shape.dim)
            out.append(TensorInfo(name, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name, dims))
    return out


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _needed_inputs(graph: onnx.GraphProto, outputs: list[str], available: set[str]) -> set[str]:
    """Graph inputs that ``outputs`` depend on without passing through ``available``."""
    producers = _producers(graph)
    inits = {i.name for i in graph.initializer}
    graph_inputs = {i.name for i in graph.input} - inits
    needed, seen, stack = set(), set(), list(outputs)
    while stack:
        name = stack.pop()
        if name in seen or name in available or name in inits or not name:
            continue
        seen.add(name)
        if name in graph_inputs:
            needed.add(name)
            continue
        node = producers.get(name)
        if node is None:
            raise ValueError(f"tensor '{name}' is neither produced by a node nor a graph input")
        stack.extend(node.input)
        # Subgraphs (Loop/If bodies) may read outer-scope tensors too.
        for attr in node.attribute:
            for g in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                local = (
                    {o for n in g.node for o in n.output} | {i.name for i in g.input} | {i.name for i in g.initializer}
                )
                stack.extend(i for n in g.node for i in n.input if i and i not in local)
    return needed


def _ordered(model: onnx.ModelProto, names: set[str]) -> list[str]:
    order = [i.name for i in model.graph.input]
    return [n for n in order if n in names] + sorted(n for n in names if n not in order)


def plan_stages(model: onnx.ModelProto, cuts: list[list[str]]) -> list[tuple[list[str], list[str]]]:
    """(inputs, outputs) of each stage for the cut points ``cuts`` (each a list of tensor names)."""
    known = {t.name for t in cut_candidates(model)}
    for cut in cuts:
        for name in cut:
            if name not in known:
                raise ValueError(f"'{name}' is not an intermediate tensor of the graph; see `aiworks split --list`")
    final = [o.name for o in model.graph.output]
    bounds = [[]] + [list(c) for c in cuts] + [final]
    stages = []
    for k in range(1, len(bounds)):
        prev, outs = bounds[k - 1], bounds[k]
        originals = _needed_inputs(model.graph, outs, set(prev))
        if k > 1:
            # Tensors from before the previous cut must be cut there too (no skipping a stage).
            earlier = {n for b in bounds[1 : k - 1] for n in b}
            stray = _needed_inputs_through(model.graph, outs, set(prev) | originals, earlier)
            if stray:
                raise ValueError(f"stage {k} needs {sorted(stray)} from an earlier stage: add them to cut {k - 1}")
        stages.append((list(prev) + _ordered(model, originals), outs))
    return stages


def _needed_inputs_through(graph, outputs, available, candidates) -> set[str]:
    """Which of ``candidates`` the outputs reach without passing ``available``."""
    producers = _producers(graph)
    hit, seen, stack = set(), set(), list(outputs)
    while stack:
        name = stack.pop()
        if name in seen or name in available or not name:
            continue
        seen.add(name)
        if name in candidates:
            hit.add(name)
            continue
        node = producers.get(name)
        if node is not None:
            stack.extend(node.input)
    return hit


def split_model(
    src: Path,
    cuts: list[list[str]],
    out: Path,
    *,
    name: str | None = None,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
) -> list[Path]:
    """Write one model folder per stage (``<name>_stage1`` ...) under ``out``; returns the folders."""
    src = Path(src)
    model = onnx.load(str(src))
    name = name or (src.parent.name if src.name == "model.onnx" else src.stem)
    folders = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, (inputs, outputs) in enumerate(plan_stages(model, cuts), 1):
            path = Path(tmp) / f"stage{k}.onnx"
            onnx.utils.extract_model(str(src), str(path), inputs, outputs, check_model=True)
            stage = onnx.load(str(path))
            stage_name = f"{name}_stage{k}"
            config = _inherit(make_config(stage_name, stage, max_batch_size=max_batch_size), src)
            folders.append(write_model_folder(Path(out), stage_name, stage, config))
    return folders


def _inherit(config_text: str, src: Path) -> str:
    """The stage's config with the serving settings of the source's model folder config, if there is one."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    folder = src.parent.parent if src.name == "model.onnx" and src.parent.name.isdigit() else None
    source = folder / "config.pbtxt" if folder is not None else None
    if source is None or not source.is_file():
        return config_text
    original = text_format.Parse(source.read_text(), mc.ModelConfig())
    stage = text_format.Parse(config_text, mc.ModelConfig())
    if original.HasField("dynamic_batching") and stage.HasField("dynamic_batching"):
        stage.dynamic_batching.CopyFrom(original.dynamic_batching)
        largest = stage.max_batch_size
        kept = [b for b in original.dynamic_batching.preferred_batch_size if b <= largest]
        del stage.dynamic_batching.preferred_batch_size[:]
        stage.dynamic_batching.preferred_batch_size.extend(kept)
    if original.instance_group:
        stage.ClearField("instance_group")
        stage.instance_group.extend(original.instance_group)
    for key, value in original.parameters.items():  # the stage's own (onnxruntime_extensions) stay
        stage.parameters[key].CopyFrom(value)
    if original.HasField("optimization"):
        stage.optimization.CopyFrom(original.optimization)
    return text_format.MessageToString(stage)


class EdgeStage:
    """The front stage, run on the edge device: input tensors in, the tensors to send out."""

    def __init__(self, stage: Path, *, threads: int = 1):
        from aiworks.lifecycle.layout import find_onnx

        self.path = find_onnx(Path(stage))
        self.session = open_session(self.path, threads=threads)
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The intermediate tensors, by name, ready to send to the next stage."""
        return dict(zip(self.output_names, self.session.run(self.output_names, feeds)))

    @staticmethod
    def payload_bytes(tensors: dict[str, np.ndarray]) -> int:
        """Raw tensor bytes on the wire (KServe binary tensor data, headers excluded)."""
        return int(sum(np.asarray(t).nbytes for t in tensors.values()))


def run_stages(stages: list[Path], feeds: dict[str, np.ndarray], *, threads: int = 1) -> dict[str, np.ndarray]:
    """Chain the stages in-process: each stage gets what earlier stages (and the request) produced."""
    available = dict(feeds)
    result: dict[str, np.ndarray] = {}
    for stage in stages:
        edge = EdgeStage(stage, threads=threads)
        wanted = {i.name: available[i.name] for i in edge.session.get_inputs()}
        result = edge.run(wanted)
        available.update(result)
    return result


@dataclass(slots=True)
class SplitReport:
    """Bytes on the wire and latency of the split pipeline against the unsplit model."""

    batch: int
    input_bytes: int
    sent_bytes: list[int]
    unsplit_ms: float
    stage_ms: list[float]
    max_abs_diff: float
    sent_tensors: list[list[str]] = field(default_factory=list)

    def format(self) -> str:
        lines = [f"split report (batch {self.batch}, in-process, median latency)"]
        lines.append(f"  raw input:            {self.input_bytes:>12,} bytes")
        for k, (b, names) in enumerate(zip(self.sent_bytes, self.sent_tensors), 1):
            ratio = b / self.input_bytes if self.input_bytes else float("nan")
            lines.append(f"  sent after stage {k}:   {b:>12,} bytes ({ratio:.2f}× the raw input): {', '.join(names)}")
        lines.append(f"  unsplit model:        {self.unsplit_ms:>9.3f} ms")
        for k, ms in enumerate(self.stage_ms, 1):
            lines.append(f"  stage {k}:              {ms:>9.3f} ms")
        total = sum(self.stage_ms)
        lines.append(
            f"  stages together:      {total:>9.3f} ms ({total - self.unsplit_ms:+.3f} ms, network not counted)"
        )
        lines.append(f"  max |chained - unsplit|: {self.max_abs_diff:.3g}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_split(
    unsplit: Path, stages: list[Path], feeds: dict[str, np.ndarray], *, repeats: int = 20, threads: int = 1
) -> SplitReport:
    """Compare the chained stages with the unsplit model on ``feeds``."""
    whole = open_session(Path(unsplit), threads=threads)
    edges = [EdgeStage(s, threads=threads) for s in stages]
    expected = dict(zip([o.name for o in whole.get_outputs()], whole.run(None, feeds)))

    available = dict(feeds)
    stage_ms = []
    for edge in edges:
        wanted = {i.name: available[i.name] for i in edge.session.get_inputs()}
        stage_ms.append(_median_ms(lambda e=edge, w=wanted: e.run(w), repeats))
        available.update(edge.run(wanted))
    # What crosses each boundary: everything the next stage reads (cut tensors, and any
    # request inputs it still needs, which the edge forwards).
    sent, names = [], []
    for edge in edges[1:]:
        crossing = {i.name: available[i.name] for i in edge.session.get_inputs()}
        sent.append(EdgeStage.payload_bytes(crossing))
        names.append(list(crossing))
    diff = 0.0
    for name, value in expected.items():
        got = available[name]
        if value.dtype.kind in "fc":
            diff = max(
                diff, float(np.max(np.abs(got.astype(np.float64) - value.astype(np.float64)))) if value.size else 0.0
            )
        elif not np.array_equal(got, value):
            diff = float("inf")
    unsplit_ms = _median_ms(lambda: whole.run(None, feeds), repeats)
    batch = len(next(iter(feeds.values())))
    return SplitReport(
        batch=batch,
        input_bytes=EdgeStage.payload_bytes(feeds),
        sent_bytes=sent,
        unsplit_ms=unsplit_ms,
        stage_ms=stage_ms,
        max_abs_diff=diff,
        sent_tensors=names,
    )


def stage_io(folder: Path) -> tuple[list[str], list[str]]:
    """A stage folder's input and output names."""
    from aiworks.lifecycle.layout import find_onnx

    ins, outs = graph_io(onnx.load(str(find_onnx(folder)), load_external_data=False))
    return [t.name for t in ins], [t.name for t in outs]
