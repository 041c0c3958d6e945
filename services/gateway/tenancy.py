"""Tenants: who may call the gateway, which models they may use, and within which limits.

Two files, named by gateway settings, hold the configuration; neither holds a
secret, so the tenants file can live in a ConfigMap:

- the tenants file (``AIWORKS_GATEWAY_TENANTS_FILE``, YAML or JSON): the
  tenants with their models and limits, the JWT verification settings (never
  the key), and the input deny-list (``filters.deny_patterns``);
- the API keys file (``AIWORKS_GATEWAY_API_KEYS_FILE``, optional): which
  tenant each API key belongs to, by the key's SHA-256 hash only. Keys are
  added with :func:`aiworks.gateway.auth.add_api_key`; the key itself is
  shown once and stored nowhere. Hashes may also sit in a tenant's own
  ``api_keys`` list.

Secrets (the JWT verification key) come from files named in the settings.

Modes: without a tenants file the gateway runs in an explicit demo mode:
nothing is authenticated and every request belongs to the anonymous tenant
``""``, which has no limits. With a tenants file every inference must carry
credentials that resolve to one of its tenants.

Field names are snake_case; the camelCase spelling (``requestsPerSecond``)
and ``name`` for ``id`` are accepted too, which is how the Helm chart's
``config.tenants`` values are written.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from aiworks.core.errors import InvalidArgument
from aiworks.core.options import Priority as OptionPriority
from aiworks.gateway.filters import compile_deny_list
from aiworks.nearline.callbacks import CallbackConfig
from aiworks.streams.store import NAME_RULE, StreamRule, is_stream_name

log = logging.getLogger(__name__)

ANONYMOUS_ID = ""
KEY_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Tenant ids appear in Redis keys, usage records and metric labels: keep them plain.
TENANT_ID_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
_MODEL_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
HMAC_ALGORITHMS = frozenset({"HS256", "HS384", "HS512"})
PUBLIC_KEY_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
Priority = Literal["realtime", "standard", "batch"]
_RANK = {"realtime": 0, "standard": 1, "batch": 2}  # aiworks.core.options.Priority's values
# Response parameter naming the class a request was served in when it asked for more than its tenant's ceiling.
PRIORITY_CLAMPED = "priority_clamped"


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, validate_by_name=True, validate_by_alias=True
    )


class ComputeQuota(_Section):
    """Runtime-seconds a tenant may use per window (windows are aligned to multiples of ``window_s``)."""

    seconds: float = Field(gt=0, description="Runtime-seconds allowed per window.")
    window_s: float = Field(3600.0, ge=1, description="Length of one window in seconds.")


class Tenant(_Section):
    """One tenant: its models, limits, default class of service and credentials. Unset limits mean none."""

    id: str = Field(validation_alias=AliasChoices("id", "name"), pattern=TENANT_ID_PATTERN)
    models: tuple[str, ...] = Field(("*",), description='Model names it may use; "*" means all.')
    requests_per_second: float | None = Field(None, gt=0, description="Token-bucket refill rate.")
    burst: int | None = Field(None, ge=1, description="Token-bucket size; default: requests_per_second rounded up.")
    max_concurrent_requests: int | None = Field(None, ge=1, description="Requests in flight at once, all replicas.")
    max_request_bytes: int | None = Field(None, ge=1, description="Largest body, when lower than the gateway's.")
    max_tokens: int | None = Field(
        None, ge=1, description="Most new tokens one generation may ask for (its max_tokens); unset: the model's cap."
    )
    max_tokens_per_minute: int | None = Field(
        None, ge=1, description="Tokens (prompt and completion) its generations may use per minute, all replicas."
    )
    default_priority: Priority | None = Field(None, description="Class of requests that name none.")
    max_priority: Priority | None = Field(
        None, description="Most urgent class it may ask for; unset: its default_priority (or any, without one)."
    )
    compute_quota: ComputeQuota | None = None
    api_keys: tuple[str, ...] = Field((), description='Hashes of its API keys, "sha256:<hex>".')
    jwt_subjects: tuple[str, ...] = Field((), description="Tenant-claim values besides its id that map to it.")
    admin: bool = Field(False, description="May load and unload models and read every tenant's usage.")
    stream_rules: tuple[StreamRule, ...] = Field(
        (), description="Rules on its result streams: an output element compared with a value appends an event "
        "to another of its streams (docs/tiers.md).",
    )  # fmt: skip
    stream_policies: tuple[tuple[str, Literal["drop", "pause"]], ...] = Field(
        (), description="What happens to a subscriber of one of its result streams that stops "
        "reading, per stream name (\"*\": the others): drop (the default) or pause (docs/tiers.md).",
    )  # fmt: skip
    max_async_backlog: int | None = Field(
        None, ge=1, description="Its asynchronous requests queued at once, all replicas; unset: the gateway's "
        "async_max_backlog_per_tenant.",
    )  # fmt: skip
    max_stream_subscribers: int | None = Field(
        None, ge=1, description="Subscribers to its result streams one gateway replica serves at once; unset: the "
        "gateway's stream_max_subscribers_per_tenant.",
    )  # fmt: skip
    callbacks: CallbackConfig | None = Field(
        None, description="Hosts its asynchronous requests' callback URLs may name, and its signing secret's source.",
    )

    @field_validator("models")
    @classmethod
    def _models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name != "*" and not _MODEL_NAME_RE.match(name):
                raise ValueError(f"'{name}' is not a model name (or \"*\" for all models)")
        return value

    @field_validator("stream_policies", mode="before")
    @classmethod
    def _stream_policies_mapping(cls, value: Any) -> Any:
        # Written as a mapping {stream: policy}; kept as pairs so that a tenant stays hashable.
        if not isinstance(value, Mapping):
            raise ValueError("expected a mapping of stream names to drop or pause")
        return tuple(value.items())

    @field_validator("stream_policies")
    @classmethod
    def _stream_names(cls, value: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        for name, _ in value:
            if name != "*" and not is_stream_name(name):
                raise ValueError(f"stream_policies names '{name[:64]}', not a stream: names are {NAME_RULE}")
        return value

    @field_validator("api_keys")
    @classmethod
    def _hashes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for entry in value:
            if not KEY_HASH_RE.match(entry):
                raise ValueError(
                    "entries must be key hashes 'sha256:<64 lower-case hex digits>'; never put a key itself "
                    "in the config (aiworks.gateway.auth.add_api_key prints a key and stores its hash)"
                )
        return value

    @model_validator(mode="after")
    def _burst_needs_rate(self) -> Tenant:
        if self.burst is not None and self.requests_per_second is None:
            raise ValueError("'burst' is set but 'requests_per_second' is not")
        return self

    @model_validator(mode="after")
    def _default_within_ceiling(self) -> Tenant:
        if self.max_priority and self.default_priority and _RANK[self.default_priority] < _RANK[self.max_priority]:
            raise ValueError(
                f"'default_priority' {self.default_priority} is more urgent than 'max_priority' {self.max_priority}"
            )
        return self

    @property
    def priority_ceiling(self) -> str | None:
        """The most urgent class its requests get: ``max_priority``, else ``default_priority``, else none."""
        return self.max_priority or self.default_priority

    @property
    def bucket_size(self) -> int:
        """Tokens the bucket holds: ``burst``, else one second's worth of requests."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.requests_per_second or 1))

    @property
    def limited(self) -> bool:
        return bool(
            self.requests_per_second or self.max_concurrent_requests or self.compute_quota or self.max_tokens_per_minute
        )

    @property
    def limits_requests(self) -> bool:
        """Whether a limit applies to every request (rate, concurrency, quota), not only to generations' tokens."""
        return bool(self.requests_per_second or self.max_concurrent_requests or self.compute_quota)

    def stream_policy(self, name: str) -> str:
        """The slow-consumer policy of its stream ``name``: ``drop`` or ``pause``."""
        policies = dict(self.stream_policies)
        return policies.get(name) or policies.get("*") or "drop"

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


ANONYMOUS = Tenant.model_construct(id=ANONYMOUS_ID, models=("*",))


class JwtSettings(_Section):
    """How bearer JWTs are verified. The key itself comes from the gateway's ``jwt_key_file`` setting."""

    algorithms: tuple[str, ...] = Field(min_length=1, description="Accepted algorithms, all HS* or all public-key.")
    issuer: str | None = Field(None, description="Required 'iss'; unset: not checked.")
    audience: str | None = Field(None, description="Required 'aud'; unset: tokens with an 'aud' are refused.")
    tenant_claim: str = Field("tenant", description="Claim naming the tenant.")
    tenant_from_subject: bool = Field(
        False, description="Let 'sub' name the tenant when the token lacks tenant_claim (off: such tokens are 403)."
    )
    leeway_s: float = Field(10.0, ge=0, description="Clock skew allowed on 'exp' and 'nbf'.")

    @field_validator("algorithms")
    @classmethod
    def _algorithms(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [a for a in value if a not in HMAC_ALGORITHMS | PUBLIC_KEY_ALGORITHMS]
        if unknown:
            raise ValueError(f"unknown algorithm(s) {unknown}; use {sorted(HMAC_ALGORITHMS | PUBLIC_KEY_ALGORITHMS)}")
        if set(value) & HMAC_ALGORITHMS and set(value) & PUBLIC_KEY_ALGORITHMS:
            # One key verifies all of them; mixing families is the classic algorithm-confusion hole.
            raise ValueError("mixes HMAC (HS*) and public-key algorithms; one key cannot serve both")
        return value


class FilterSettings(_Section):
    """Input filter settings that belong with the tenants (the size caps are gateway settings)."""

    deny_patterns: dict[str, str | None] = Field(
        default_factory=dict, description="Named regexes refused in BYTES inputs; no regex: the built-in one."
    )


class _Document(_Section):
    tenants: list[dict[str, Any]] = Field(default_factory=list)
    jwt: JwtSettings | None = None
    filters: FilterSettings = FilterSettings()


@dataclass(frozen=True)
class TenancyConfig:
    """The tenants and how their credentials are recognised; ``demo`` when no tenants file is configured."""

    tenants: Mapping[str, Tenant] = field(default_factory=dict)
    key_hashes: Mapping[str, str] = field(default_factory=dict)  # "sha256:<hex>" -> tenant id
    jwt: JwtSettings | None = None
    deny_patterns: Mapping[str, Any] = field(default_factory=dict)  # name -> masking.TextPattern
    source: str = "demo"

    @property
    def demo(self) -> bool:
        return not self.tenants

    def get(self, tenant_id: str) -> Tenant | None:
        if self.demo and tenant_id == ANONYMOUS_ID:
            return ANONYMOUS
        return self.tenants.get(tenant_id)


def demo_config() -> TenancyConfig:
    return TenancyConfig()


def _read(path: Path, what: str) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"{what} {path} cannot be read: {exc.strerror or exc}") from None
    try:
        return yaml.safe_load(text)  # YAML is a superset of JSON: one parser reads both
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{what} {path} is not valid YAML or JSON: {exc}") from None


def _field_errors(exc: ValidationError) -> list[str]:
    out = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        out.append(f"field '{loc}': {err['msg']}" if loc else err["msg"])
    return out


def parse_tenants(document: Any, source: str) -> TenancyConfig:
    """Validate a tenants document (already parsed); every problem names the tenant and field."""
    if not isinstance(document, dict):
        raise InvalidArgument(f"tenants file {source}: expected a mapping with a 'tenants' list")
    try:
        doc = _Document.model_validate(document)
    except ValidationError as exc:
        raise InvalidArgument(f"tenants file {source}: " + "; ".join(_field_errors(exc))) from None
    if not doc.tenants:
        raise InvalidArgument(
            f"tenants file {source} defines no tenants; unset AIWORKS_GATEWAY_TENANTS_FILE to run in demo mode"
        )
    tenants: dict[str, Tenant] = {}
    problems: list[str] = []
    for index, entry in enumerate(doc.tenants):
        label = f"tenant #{index + 1}"
        if isinstance(entry, dict) and isinstance(entry.get("id", entry.get("name")), str):
            label = f"tenant '{entry.get('id', entry.get('name'))}'"
        try:
            tenant = Tenant.model_validate(entry)
        except ValidationError as exc:
            problems.extend(f"{label}: {msg}" for msg in _field_errors(exc))
            continue
        if tenant.id in tenants:
            problems.append(f"{label}: defined twice")
            continue
        tenants[tenant.id] = tenant
    if problems:
        raise InvalidArgument(f"tenants file {source}: " + "; ".join(problems))

    key_hashes: dict[str, str] = {}
    subjects: dict[str, str] = {}
    for tenant in tenants.values():
        for digest in tenant.api_keys:
            _claim_hash(key_hashes, digest, tenant.id, f"tenants file {source}: tenant '{tenant.id}' field 'api_keys'")
        for subject in tenant.jwt_subjects:
            other = subject if subject in tenants else subjects.get(subject)
            if other is not None and other != tenant.id:
                raise InvalidArgument(
                    f"tenants file {source}: tenant '{tenant.id}' field 'jwt_subjects': '{subject}' already maps to "
                    f"tenant '{other}'"
                )
            subjects[subject] = tenant.id
    deny = compile_deny_list(doc.filters.deny_patterns, f"tenants file {source}: filters.deny_patterns")
    return TenancyConfig(tenants=tenants, key_hashes=key_hashes, jwt=doc.jwt, deny_patterns=deny, source=source)


def _claim_hash(key_hashes: dict[str, str], digest: str, tenant_id: str, where: str) -> None:
    owner = key_hashes.setdefault(digest, tenant_id)
    if owner != tenant_id:
        raise InvalidArgument(f"{where}: key hash {digest[:15]}... already belongs to tenant '{owner}'")


def parse_api_keys(document: Any, source: str, tenants: Mapping[str, Tenant]) -> dict[str, str]:
    """The API keys file: ``keys: [{hash: "sha256:<hex>", tenant: <id>, label: <text>}, ...]``."""
    if document is None:
        return {}
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise InvalidArgument(f"API keys file {source}: expected a mapping with a 'keys' list")
    out: dict[str, str] = {}
    for index, entry in enumerate(entries):
        where = f"API keys file {source}: key #{index + 1}"
        if not isinstance(entry, dict):
            raise InvalidArgument(f"{where}: expected a mapping with 'hash' and 'tenant'")
        if entry.get("label"):
            where += f" ('{entry['label']}')"
        unknown = set(entry) - {"hash", "tenant", "label"}
        if unknown:
            raise InvalidArgument(f"{where}: unknown field(s) {sorted(unknown)}; use hash, tenant, label")
        digest, tenant_id = entry.get("hash"), entry.get("tenant")
        if not isinstance(digest, str) or not KEY_HASH_RE.match(digest):
            raise InvalidArgument(
                f"{where}: field 'hash' must be 'sha256:<64 lower-case hex digits>', not a key itself"
            )
        if tenant_id not in tenants:
            raise InvalidArgument(
                f"{where}: field 'tenant' names '{tenant_id}', which the tenants file does not define"
            )
        _claim_hash(out, digest, tenant_id, where)
    return out


def load_tenancy(tenants_file: Path | str | None, api_keys_file: Path | str | None = None) -> TenancyConfig:
    """Read the tenants file and the API keys file; demo mode when there is no tenants file."""
    if tenants_file is None or str(tenants_file) == "":
        if api_keys_file:
            raise InvalidArgument(
                "AIWORKS_GATEWAY_API_KEYS_FILE is set but AIWORKS_GATEWAY_TENANTS_FILE is not: keys need tenants"
            )
        log.warning("no tenants file: demo mode, requests are not authenticated and have no limits")
        return demo_config()
    path = Path(tenants_file)
    config = parse_tenants(_read(path, "tenants file"), str(path))
    if api_keys_file:
        keys_path = Path(api_keys_file)
        from_file = parse_api_keys(_read(keys_path, "API keys file"), str(keys_path), config.tenants)
        merged = dict(config.key_hashes)
        for digest, tenant_id in from_file.items():
            _claim_hash(merged, digest, tenant_id, f"API keys file {keys_path}")
        config = TenancyConfig(
            tenants=config.tenants, key_hashes=merged, jwt=config.jwt, deny_patterns=config.deny_patterns,
            source=config.source,
        )  # fmt: skip
    log.info("tenancy: %d tenant(s), %d API key(s) from %s", len(config.tenants), len(config.key_hashes), path)
    return config


def tenant_classes(tenant: Tenant) -> tuple[OptionPriority | None, OptionPriority | None]:
    """A tenant's default class (for requests that name none) and its ceiling (the most urgent it gets).

    :func:`aiworks.core.options.read_options` applies them: ``priority`` 0 or
    absent means "default" in Triton's convention, which is exactly when the
    default applies; a more urgent class than the ceiling is lowered to it,
    and the response says so (:data:`PRIORITY_CLAMPED`).
    """
    default = OptionPriority.named(tenant.default_priority) if tenant.default_priority else None
    ceiling = tenant.priority_ceiling
    return default, OptionPriority.named(ceiling) if ceiling else None
