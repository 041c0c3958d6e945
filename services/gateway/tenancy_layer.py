"""The gateway's tenancy layer in one object: who calls, what they may send, their limits, their usage,
what their answers hide, and the audit trail (docs/tenancy.md). Built once at start-up from the settings,
or empty in demo mode; the data plane calls it for both front ends."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aiworks.core.errors import InvalidArgument
from aiworks.gateway.auth import Authenticator, Principal
from aiworks.gateway.filters import InputFilter, InputLimits
from aiworks.gateway.limits import TenantLimiter
from aiworks.gateway.masking import MaskingPolicies
from aiworks.gateway.metering import UsageMeter
from aiworks.gateway.settings import GatewaySettings
from aiworks.gateway.tenancy import demo_config, load_tenancy
from aiworks.security.audit import AuditLog
from aiworks.security.audit_redis import RedisStreamSink


@dataclass
class Tenancy:
    """The gateway's tenancy layer (docs/tenancy.md), built once at start-up; demo mode without a tenants file."""

    auth: Authenticator
    filters: InputFilter
    limiter: TenantLimiter
    meter: UsageMeter
    masking: MaskingPolicies
    audit: AuditLog | None = None

    @classmethod
    def demo(cls) -> Tenancy:
        """No tenants, no limits, no shared state, no audit: a gateway without tenancy settings."""
        return cls(Authenticator(demo_config()), InputFilter(), TenantLimiter(), UsageMeter(), MaskingPolicies())

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> Tenancy:
        """Read the tenants, API keys, JWT key and audit key files the settings name; errors name the file."""
        config = load_tenancy(settings.tenants_file, settings.api_keys_file)
        audit = None
        if settings.audit_log is not None or settings.audit_sink == "redis":
            key = None
            if settings.audit_key_file is not None:
                key = Path(settings.audit_key_file).read_bytes().strip()
                if not key:
                    raise InvalidArgument(f"audit key file {settings.audit_key_file} is empty")
            sink = None
            if settings.audit_sink == "redis":
                if not settings.redis_url:
                    raise InvalidArgument("audit_sink redis needs redis_url (AIWORKS_GATEWAY_REDIS_URL)")
                sink = RedisStreamSink(settings.redis_url, writer=settings.audit_writer, stream=settings.audit_stream)
            audit = AuditLog(None if sink else settings.audit_log, sink=sink, key=key,
                             flush_interval_s=settings.audit_flush_interval_s)  # fmt: skip
        return cls(
            auth=Authenticator.from_files(config, settings.jwt_key_file, settings.credential_key_file),
            filters=InputFilter(
                limits=InputLimits(
                    max_tensor_elements=settings.max_tensor_elements,
                    max_request_elements=settings.max_request_elements,
                    max_string_elements=settings.max_string_elements,
                    max_listed_values=settings.max_listed_values,
                    max_request_tensors=settings.max_request_tensors,
                ),
                max_string_bytes=settings.max_string_bytes,
                deny_patterns=config.deny_patterns,
            ),
            limiter=TenantLimiter(
                settings.redis_url,
                timeout_s=settings.limits_timeout_s,
                expected_replicas=settings.limits_expected_replicas,
                lease_ttl_s=settings.limits_lease_ttl_s,
                retry_after_s=settings.limits_retry_after_s,
            ),
            meter=UsageMeter(
                settings.redis_url,
                window_s=settings.usage_window_s,
                flush_interval_s=settings.usage_flush_interval_s,
                timeout_s=settings.usage_timeout_s,
                retention_s=settings.usage_retention_s,
            ),
            masking=MaskingPolicies(max_scan_bytes=settings.mask_max_scan_bytes),
            audit=audit,
        )

    @property
    def demo_mode(self) -> bool:
        return not self.auth.required

    async def start(self) -> None:
        await self.limiter.start()
        await self.meter.start()
        if self.audit is not None:
            await self.audit.start()

    async def close(self) -> None:
        await self.limiter.close()
        await self.meter.close()
        if self.audit is not None:
            await self.audit.close()


def request_limit(principal: Principal, gateway_limit: int) -> int:
    """The largest request body ``principal`` may send: the gateway's limit, or its tenant's lower one."""
    own = principal.tenant.max_request_bytes
    return min(gateway_limit, own) if own else gateway_limit
