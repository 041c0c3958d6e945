"""The pytorch backend on a GPU: a CUDA stream per instance, pinned-memory copies, CUDA graphs.

- **Instances.** The config's ``instance_group.count`` instances share the
  weights; each has its own CUDA stream, so batches of one model overlap on
  the GPU as Triton's instances do. A batch holds one instance from its
  host-to-device copy to its device-to-host copy.
- **Copies.** Inputs go host → device through page-locked (pinned) buffers
  from PyTorch's caching host allocator, asynchronously on the instance's
  stream; outputs come back the same way, and the numpy arrays handed back
  are views of those pinned buffers (no further copy).
- **CUDA graphs.** For the batch sizes :func:`aiworks.runtime.torch_io.graph_plan`
  names, each instance captures ``forward`` once per size after three
  warm-up runs, largest first, in one memory pool of its own (its graphs never
  replay at once, so they can share it). A batch whose non-batch dims match a
  capture is copied into the graph's static inputs, padded with zero rows up
  to the next captured size, and replayed; its rows of the static outputs are
  copied out. Other batches run eagerly on the same stream.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np

from aiworks.runtime.torch_io import Signature, padded_size

log = logging.getLogger(__name__)

WARMUP_RUNS = 3


class _Graph:
    """One captured ``forward`` at one batch size: its static input and output tensors."""

    __slots__ = ("size", "graph", "inputs", "outputs")

    def __init__(self, size, graph, inputs, outputs):
        self.size, self.graph, self.inputs, self.outputs = size, graph, inputs, outputs


def _pinned(torch, array: np.ndarray, dtype):
    host = torch.empty(array.shape, dtype=dtype, pin_memory=True)
    host.numpy()[...] = array  # the one host copy: into page-locked memory the GPU reads directly
    return host


class _Instance:
    """One execution instance: a stream, and its CUDA graphs by input dims."""

    def __init__(self, model, plan: dict[Signature, tuple[int, ...]]):
        torch = model.torch
        self.model = model
        self.stream = torch.cuda.Stream(model.device)
        self.pool = torch.cuda.graph_pool_handle() if plan else None
        self.graphs: dict[Signature, list[_Graph]] = {}
        for signature, sizes in plan.items():
            captured = [self._capture(signature, size) for size in sorted(sizes, reverse=True)]
            self.graphs[signature] = sorted(captured, key=lambda g: g.size)

    def _capture(self, signature: Signature, size: int) -> _Graph:
        model, torch = self.model, self.model.torch
        inputs = [
            torch.zeros((size, *dims), dtype=dtype, device=model.device)
            for dims, dtype in zip(signature, model._in_dtypes)
        ]
        with torch.cuda.stream(self.stream), model.modes():
            for _ in range(WARMUP_RUNS):  # TorchScript's profiling runs, cuBLAS workspaces, allocator blocks
                model.forward(inputs)
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with model.modes():
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = model.forward(inputs)
        return _Graph(size, graph, inputs, outputs)

    def run(self, arrays: list[np.ndarray], picks: list[int], batched: bool) -> list[np.ndarray]:
        model, torch = self.model, self.model.torch
        graph = None
        rows = arrays[0].shape[0] if batched and arrays else 0
        if self.graphs and batched:
            captured = self.graphs.get(tuple(tuple(a.shape[1:]) for a in arrays))
            if captured:
                size = padded_size(rows, tuple(g.size for g in captured))
                graph = next((g for g in captured if g.size == size), None)
        with torch.cuda.device(model.device), torch.cuda.stream(self.stream):
            if graph is not None:
                for array, static, dtype in zip(arrays, graph.inputs, model._in_dtypes):
                    static[:rows].copy_(_pinned(torch, array, dtype), non_blocking=True)
                    if rows < graph.size:
                        static[rows:].zero_()  # padding rows: zeros, never an earlier batch's data
                graph.graph.replay()
                outs = [graph.outputs[i][:rows] for i in picks]
            else:
                with model.modes():
                    tensors = [
                        _pinned(torch, a, dtype).to(model.device, non_blocking=True)
                        for a, dtype in zip(arrays, model._in_dtypes)
                    ]
                    results = model.forward(tensors)
                outs = [results[i] for i in picks]
            host = []
            for out in outs:
                pinned = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
                pinned.copy_(out, non_blocking=True)
                host.append(pinned)
        self.stream.synchronize()
        return [h.numpy() for h in host]


class CudaInstances:
    """The instances of one model version on its GPU; ``run`` takes a free one (the data plane bounds concurrency)."""

    def __init__(self, model, count: int, plan: dict[Signature, tuple[int, ...]]):
        torch = model.torch
        self.model = model
        started = time.perf_counter()
        with torch.cuda.device(model.device):
            self._instances = [_Instance(model, plan) for _ in range(max(1, count))]
            torch.cuda.synchronize(model.device)
        self.batch_sizes = tuple(sorted({s for sizes in plan.values() for s in sizes}))
        if plan:
            log.info(
                "model %s: captured CUDA graphs for %d instance(s), batch sizes %s, in %.0f ms",
                model.name,
                len(self._instances),
                list(self.batch_sizes),
                (time.perf_counter() - started) * 1e3,
            )
        self._free: queue.SimpleQueue[_Instance] = queue.SimpleQueue()
        for instance in self._instances:
            self._free.put(instance)

    def run(self, arrays: list[np.ndarray], picks: list[int]) -> list[np.ndarray]:
        instance = self._free.get()
        try:
            return instance.run(arrays, picks, self.model.batched)
        finally:
            self._free.put(instance)
            self.model.after_run()

    def close(self) -> None:
        torch = self.model.torch
        torch.cuda.synchronize(self.model.device)
        self._instances = []
