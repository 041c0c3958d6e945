"""Triton's trace and log settings (its ``trace`` and ``logging`` extensions), mapped onto the gateway's own.

Trace settings. Triton samples one request in ``trace_rate`` and records
what ``trace_level`` names; here ``trace_rate`` N becomes the sampling ratio
1/N of the traces that start at this gateway (:data:`aiworks.core.tracing.SAMPLING`),
for every model or for one, and ``trace_level`` is ``OFF`` (ratio 0) or
``TIMESTAMPS`` (spans with their timings). A request that brings a sampled
``traceparent`` keeps its caller's decision. Spans are recorded only when the
gateway exports them (``otlp_endpoint`` or ``trace_file``): without an exporter
the level reads ``OFF`` and ``TIMESTAMPS`` is refused. Triton's other settings
are reported with the values this server works by (``trace_count`` -1: no
limit, ``log_frequency`` 0, ``trace_mode`` opentelemetry, ``trace_file`` the
file's name only) and refused, by name, when set to anything else.

Log settings. The gateway logs at one level, so Triton's categories map onto
it: ``log_verbose_level`` > 0 is DEBUG, then ``log_info`` INFO, ``log_warning``
WARNING, ``log_error`` ERROR. A category can be on only when every more severe
one is; a combination one level cannot express is refused. ``log_format``
(ISO8601) and ``log_file`` ("": standard error) are reported and cannot change.

Values arrive and leave as Triton's: trace settings as lists of strings (a
scalar setting is a one-item list; ``None`` clears a setting: a model's goes
back to the server's, the server's to its value at start), log settings as
bool, int or str. The front ends only translate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from aiworks.core import tracing
from aiworks.core.errors import InvalidArgument
from aiworks.core.logging import log_level, set_log_level

log = logging.getLogger(__name__)

TRACE_LEVELS = ("OFF", "TIMESTAMPS")
TRACE_MODE = "opentelemetry"
LOG_FORMAT = "ISO8601"
_OFF = logging.CRITICAL + 10  # every category off
TraceSettings = dict[str, list[str]]
LogSettings = dict[str, bool | int | str]


class Diagnostics:
    """The gateway's trace and log settings: read and changed here, by both front ends."""

    def __init__(self, trace_file_name: str = "") -> None:
        self.trace_file_name = trace_file_name
        initial = tracing.SAMPLING.initial
        # (level, rate) for all models and per model; the ratio they make is pushed to tracing.SAMPLING.
        self._start = ("TIMESTAMPS" if initial > 0 else "OFF", _rate(initial))
        self._all = self._start
        self._models: dict[str, tuple[str, int]] = {}
        self._verbose_level = 1
        self._lock = threading.Lock()

    # ---- trace ----------------------------------------------------------------------------------

    def trace_settings(self, model: str = "") -> TraceSettings:
        """The settings in force for ``model`` (every model when "")."""
        level, rate = self._models.get(model, self._all) if model else self._all
        return {
            "trace_level": [level if tracing.enabled() else "OFF"],
            "trace_rate": [str(rate)],
            "trace_count": ["-1"],
            "log_frequency": ["0"],
            "trace_file": [self.trace_file_name],
            "trace_mode": [TRACE_MODE],
        }

    def update_trace_settings(self, updates: Mapping[str, list[str] | None], model: str = "") -> TraceSettings:
        """Apply Triton's trace ``updates`` for ``model`` (all models when ""); returns the settings then in force."""
        current = self.trace_settings(model)
        level = rate = None
        cleared = False
        for key, value in updates.items():
            if key not in current:
                raise InvalidArgument(f"unknown trace setting '{key[:64]}' (known: {', '.join(current)})")
            if value is None:
                cleared = cleared or key in ("trace_level", "trace_rate")
            elif key == "trace_level":
                level = _trace_level(value)
            elif key == "trace_rate":
                rate = _trace_rate(value)
            elif value != current[key]:
                raise InvalidArgument(
                    f"trace setting '{key}' cannot be changed on this server: it stays {_show(current[key])} "
                    f"(asked: {_show(value)})"
                )
        if level is None and rate is None and not cleared:
            return current
        if not tracing.SAMPLING.adjustable:
            raise InvalidArgument(
                "trace_level and trace_rate cannot be changed: OTEL_TRACES_SAMPLER fixes this gateway's sampling"
            )
        with self._lock:
            if cleared:  # back to the server's settings (a model), or to those at start (the server)
                if model:
                    self._models.pop(model, None)
                else:
                    self._all = self._start
            if level is not None or rate is not None:
                old_level, old_rate = self._models.get(model, self._all) if model else self._all
                new = (level or old_level, rate or old_rate)
                if model:
                    self._models[model] = new
                else:
                    self._all = new
            self._push()
        log.info("trace settings of %s now %s", model or "every model", self.trace_settings(model))
        return self.trace_settings(model)

    def _push(self) -> None:
        """The levels and rates as sampling ratios, for the sampler."""
        sampling = tracing.SAMPLING
        sampling.ratio = _ratio(*self._all)
        sampling.models = {model: _ratio(*setting) for model, setting in self._models.items()}

    # ---- log ------------------------------------------------------------------------------------

    def log_settings(self) -> LogSettings:
        level = log_level()
        return {
            "log_file": "",
            "log_info": level <= logging.INFO,
            "log_warning": level <= logging.WARNING,
            "log_error": level <= logging.ERROR,
            "log_verbose_level": self._verbose_level if level <= logging.DEBUG else 0,
            "log_format": LOG_FORMAT,
        }

    def update_log_settings(self, updates: Mapping[str, bool | int | str | None]) -> LogSettings:
        current = self.log_settings()
        wanted = dict(current)
        for key, value in updates.items():
            if key not in current:
                raise InvalidArgument(f"unknown log setting '{key[:64]}' (known: {', '.join(current)})")
            if value is None:
                continue
            if key in ("log_info", "log_warning", "log_error"):
                if not isinstance(value, bool):
                    raise InvalidArgument(f"log setting '{key}' must be a boolean")
            elif key == "log_verbose_level":
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise InvalidArgument("log setting 'log_verbose_level' must be an integer >= 0")
            elif value != current[key]:
                shown = "standard error" if key == "log_file" else current[key]
                raise InvalidArgument(
                    f"log setting '{key}' cannot be changed on this server: it stays {shown!r} (asked: {_show(value)})"
                )
            wanted[key] = value
        chain = [
            ("log_error", wanted["log_error"]),
            ("log_warning", wanted["log_warning"]),
            ("log_info", wanted["log_info"]),
            ("log_verbose_level", wanted["log_verbose_level"] > 0),
        ]
        for (severe, severe_on), (milder, milder_on) in zip(chain, chain[1:]):
            if milder_on and not severe_on:
                raise InvalidArgument(
                    f"{milder} on with {severe} off cannot be honoured: the gateway logs from one level up, "
                    "so a category is on only when every more severe one is"
                )
        if wanted["log_verbose_level"] > 0:
            level = logging.DEBUG
        elif wanted["log_info"]:
            level = logging.INFO
        elif wanted["log_warning"]:
            level = logging.WARNING
        elif wanted["log_error"]:
            level = logging.ERROR
        else:
            level = _OFF
        with self._lock:
            if wanted["log_verbose_level"] > 0:
                self._verbose_level = int(wanted["log_verbose_level"])
            if level != log_level():
                log.warning("log level now %s (logging API)", logging.getLevelName(level))
            set_log_level(level)
        return self.log_settings()


def _rate(ratio: float) -> int:
    return max(1, round(1 / ratio)) if ratio > 0 else 1


def _ratio(level: str, rate: int) -> float:
    return 0.0 if level == "OFF" else 1.0 / rate


def _one(value: list[str], key: str) -> str:
    if len(value) != 1:
        raise InvalidArgument(f"trace setting '{key}' takes one value, not {len(value)}")
    return value[0]


def _trace_level(value: list[str]) -> str:
    levels = {v.upper() for v in value}
    unknown = sorted(levels - set(TRACE_LEVELS))
    if unknown:
        raise InvalidArgument(
            f"trace_level {', '.join(v[:32] for v in unknown)} is not supported on this server: spans carry "
            f"timings, not tensors (supported: {', '.join(TRACE_LEVELS)})"
        )
    if not levels or levels == {"OFF"}:
        return "OFF"
    if "OFF" in levels:
        raise InvalidArgument("trace_level OFF cannot be combined with another level")
    if not tracing.enabled():
        raise InvalidArgument(
            "trace_level TIMESTAMPS needs a span exporter: start the gateway with otlp_endpoint or trace_file"
        )
    return "TIMESTAMPS"


def _trace_rate(value: list[str]) -> int:
    text = _one(value, "trace_rate")
    try:
        rate = int(text)
    except ValueError:
        raise InvalidArgument(f"trace_rate must be an integer, not '{text[:32]}'") from None
    if rate < 1:
        raise InvalidArgument(f"trace_rate must be at least 1 (one request in trace_rate is traced), not {rate}")
    return rate


def _show(value) -> str:
    text = ", ".join(value) if isinstance(value, list) else str(value)
    return repr(text[:64])
