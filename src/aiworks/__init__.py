"""AIWorks: a distributed AI-inference serving suite."""

__version__ = "0.1.0"
