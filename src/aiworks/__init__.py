"""AIWorks: a distributed AI-inference serving suite."""

import os as _os

__version__ = "0.1.0"

# onnxruntime-extensions' converter module (imported with the package) sets
# PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in os.environ, and every process started afterwards then parses
# protobuf in pure Python, tens of times slower (a 4 MB message of 2 M strings: 1.5 s against 40 ms). What the
# process started with, for the processes it starts (aiworks.supervisor) and for
# aiworks.core.lifecycle.import_onnxruntime_extensions to put back.
PROTOBUF_IMPLEMENTATION_AT_START = _os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
