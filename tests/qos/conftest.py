"""Fixtures of the QoS tests; the helpers live in qos_support.py (a unique module name)."""

from qos_support import *  # noqa: F401,F403
