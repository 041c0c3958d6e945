"""A pipeline model folder for split stages: Triton's ensemble config, run by the scheduler.

``write_pipeline(out, name, stages)`` writes ``<out>/<name>/config.pbtxt``
with ``platform: "ensemble"`` and an ``ensemble_scheduling`` step per stage
folder, in order, plus the empty version folder ``1/`` Triton expects. The
stages keep the original graph's tensor names (``aiworks split`` cuts at
named tensors), so each step maps a tensor to the tensor of the same name.

The pipeline declares as inputs every tensor a stage reads that no earlier
stage produces (the request's inputs, including any a later stage still
needs), and as outputs the last stage's outputs; their entries (data type,
dims, reshape) are copied from the stage configs. ``micro_batch_rows``
becomes the pipeline's parameter of that name: requests with more rows flow
through the stages in micro-batches, several in flight at once.

The runtime never loads the pipeline itself; it reports the config and the
scheduler runs the steps (aiworks.scheduler.pipeline).
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from aiworks.core.model_config import parse_config, read_config


def pipeline_config(name: str, stages: list[Path], *, micro_batch_rows: int = 0) -> str:
    """The ``config.pbtxt`` text of a pipeline chaining ``stages`` (model folders) in order."""
    if not stages:
        raise ValueError("a pipeline needs at least one stage")
    configs = [read_config(Path(s)) for s in stages]
    batch_sizes = {c.max_batch_size for c in configs}
    if len(batch_sizes) != 1:
        raise ValueError(f"the stages disagree on max_batch_size ({sorted(batch_sizes)}); give them one value")
    msg = mc.ModelConfig(name=name, platform="ensemble", max_batch_size=batch_sizes.pop())
    produced: set[str] = set()
    declared: set[str] = set()
    for config in configs:
        for entry in config.document.get("input", []):
            if entry["name"] not in produced and entry["name"] not in declared:
                declared.add(entry["name"])
                json_format.ParseDict(entry, msg.input.add())
        step = msg.ensemble_scheduling.step.add(model_name=config.name, model_version=-1)
        for t in config.inputs:
            step.input_map[t.name] = t.name
        for t in config.outputs:
            step.output_map[t.name] = t.name
            produced.add(t.name)
    for entry in configs[-1].document.get("output", []):
        json_format.ParseDict(entry, msg.output.add())
    if micro_batch_rows:
        msg.parameters["micro_batch_rows"].string_value = str(int(micro_batch_rows))
    text = text_format.MessageToString(msg)
    parse_config(text, fmt="pbtxt", model_name=name)  # the suite's parser accepts what it wrote
    return text


def write_pipeline(out: Path, name: str, stages: list[Path], *, micro_batch_rows: int = 0) -> Path:
    """Write the pipeline folder ``<out>/<name>`` (config and empty version 1); returns it."""
    text = pipeline_config(name, stages, micro_batch_rows=micro_batch_rows)
    folder = Path(out) / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(text)
    return folder
