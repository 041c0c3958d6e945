"""Gateway: the Open Inference Protocol (KServe v2) over HTTP and gRPC."""
