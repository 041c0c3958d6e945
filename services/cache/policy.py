"""Which requests are cached, and how: per model from its config, per request from its parameters.

A model is cached only when its config enables it, as in Triton::

    response_cache { enable: true }
    parameters { key: "cache_mode"            value: { string_value: "similar" } }  # exact (default) | similar
    parameters { key: "cache_round_decimals"  value: { string_value: "3" } }        # similar mode, floats
    parameters { key: "cache_ttl_s"           value: { string_value: "600" } }      # 0: the cache's default
    parameters { key: "cache_max_entry_bytes" value: { string_value: "1048576" } }  # bigger results are not stored
    parameters { key: "cache_scope"           value: { string_value: "shared" } }   # tenant (default) | shared
    parameters { key: "report_cache_hit"      value: { string_value: "true" } }     # tell clients (default false)

Entries are per tenant unless the model opts into ``cache_scope: shared``:
a tenant's lookups never find what another tenant asked. Whether a request
was a hit is counted in the gateway's metrics and the tenant's usage; the
client is told (response parameter ``cache_hit``) only with
``report_cache_hit: true``.

The runtime passes ``response_cache`` on as the spec parameter
``response_cache: "true"`` (the internal ModelSpec has no field of its own
for it), so writing that parameter directly works the same. A request skips
the cache (no lookup, no store) with any of the parameters ``cache: false``,
``cache_bypass: true``, ``nondeterministic: true`` or a ``sequence_id``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

EXACT = "exact"
SIMILAR = "similar"
TENANT = "tenant"
SHARED = "shared"
DEFAULT_MAX_ENTRY_BYTES = 1024 * 1024

# Request parameters that change how a response travels, not what it holds,
# or that steer the cache itself: they are left out of the key.
NEUTRAL_PARAMETERS = frozenset(
    {"binary_data_output", "priority", "timeout", "cache", "cache_bypass", "nondeterministic", "headers"}
)


def _truthy(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


@dataclass(frozen=True)
class CachePolicy:
    """How one model version's results are cached."""

    enabled: bool = False
    mode: str = EXACT
    round_decimals: int = 3
    ttl_s: float = 0.0
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    shared: bool = False  # cache_scope: shared, one entry for every tenant (else one per tenant)
    report_hit: bool = False  # report_cache_hit: the response tells the client whether it was a hit

    @property
    def tag(self) -> str:
        """Goes into every key, so the two modes never share entries."""
        return EXACT if self.mode == EXACT else f"{SIMILAR}:{self.round_decimals}"

    @classmethod
    def from_parameters(cls, parameters: dict[str, str], model: str = "") -> CachePolicy:
        """The policy a model's config parameters ask for; a bad value disables caching (and says why)."""
        if not _truthy(parameters.get("response_cache", "false")):
            return cls()
        try:
            mode = parameters.get("cache_mode", EXACT).strip().lower()
            if mode not in (EXACT, SIMILAR):
                raise ValueError(f"cache_mode must be '{EXACT}' or '{SIMILAR}', not {mode!r}")
            decimals = int(parameters.get("cache_round_decimals", "3"))
            if not 0 <= decimals <= 12:
                raise ValueError(f"cache_round_decimals must lie in 0..12, not {decimals}")
            ttl_s = float(parameters.get("cache_ttl_s", "0"))
            if not math.isfinite(ttl_s) or ttl_s < 0:
                raise ValueError(f"cache_ttl_s must be >= 0, not {ttl_s}")
            max_entry = int(parameters.get("cache_max_entry_bytes", str(DEFAULT_MAX_ENTRY_BYTES)))
            if max_entry <= 0:
                raise ValueError(f"cache_max_entry_bytes must be > 0, not {max_entry}")
            scope = parameters.get("cache_scope", TENANT).strip().lower()
            if scope not in (TENANT, SHARED):
                raise ValueError(f"cache_scope must be '{TENANT}' or '{SHARED}', not {scope!r}")
            report = parameters.get("report_cache_hit", "false").strip().lower()
            if report not in ("true", "false"):
                raise ValueError(f"report_cache_hit must be 'true' or 'false', not {report!r}")
        except ValueError as exc:
            log.warning("model %s: response cache disabled, its config is invalid: %s", model, exc)
            return cls()
        return cls(True, mode, decimals, ttl_s, max_entry, shared=scope == SHARED, report_hit=report == "true")


def skip_reason(parameters: dict) -> str | None:
    """Why a request must neither be looked up nor stored, or None."""
    if not parameters:
        return None
    if "cache" in parameters and not _truthy(parameters["cache"]):
        return "bypass"
    if _truthy(parameters.get("cache_bypass", False)):
        return "bypass"
    if _truthy(parameters.get("nondeterministic", False)):
        return "nondeterministic"
    if parameters.get("sequence_id") not in (None, 0, "", "0"):
        return "sequence"
    return None
