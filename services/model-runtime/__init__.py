"""Model runtime: a model repository and the backends that execute batches."""
