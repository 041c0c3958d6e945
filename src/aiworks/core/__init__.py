"""Shared core: settings helpers, logging, errors and tensor codecs."""
