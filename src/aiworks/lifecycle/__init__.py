"""Offline model-lifecycle tools: convert, optimize, split, and the MiniLM text model.

Everything here runs before serving and writes Triton-layout model folders
(``<out>/<name>/config.pbtxt`` and ``<out>/<name>/<version>/model.onnx``) that
the model runtime loads unchanged. Framework packages (torch, transformers,
tensorflow, onnxruntime-extensions, tqdm) are imported inside the functions
that need them, so the core install never pulls them in; they come from
``requirements-lifecycle.txt``.
"""
