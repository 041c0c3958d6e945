"""Model storage: fetch a model named by a storage URI into a model repository (``aiworks storage fetch``)."""
