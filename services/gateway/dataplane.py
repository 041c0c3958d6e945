"""The gateway's logic, shared by the HTTP and gRPC front ends.

Both transports translate their requests into the domain types of
:mod:`aiworks.core.inference` and call this class; it answers with plain
Python structures shaped like the Open Inference Protocol's responses.
The tenancy layer (docs/tenancy.md) and the result cache hook in here, once,
for both.

Which operations need credentials (in tenancy mode; demo mode lets every
caller in as the anonymous tenant, which may do everything):

- none: liveness, readiness and server metadata (probes and load balancers
  call them without credentials, as they do with Triton and KServe);
- a tenant that may use the model: inference, model metadata, config,
  readiness and statistics;
- a tenant: the repository index and all-model statistics (each filtered to
  the models it may use), and its own usage;
- an admin tenant (``admin: true``): model load and unload (with Triton's
  config and file overrides), trace and log settings, and every tenant's usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiworks import __version__
from aiworks.cache.client import CacheClient
from aiworks.core import metrics
from aiworks.core.datatypes import element_count
from aiworks.core.errors import (
    AIWorksError,
    InvalidArgument,
    PayloadTooLarge,
    PermissionDenied,
    Status,
    Unauthenticated,
    no_available_version,
)
from aiworks.core.inference import InferRequest, InferResponse, PendingInputs
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.looplag import offload
from aiworks.core.model_config import ModelSpec
from aiworks.core.names import check_model_name, check_version
from aiworks.core.options import ONLINE_LOAD, read_options
from aiworks.gateway.auth import Headers, Principal
from aiworks.gateway.diagnostics import Diagnostics, LogSettings, TraceSettings
from aiworks.gateway.filters import InputLimits
from aiworks.gateway.limit_rules import Admission
from aiworks.gateway.shared_memory import CUDA_UNSUPPORTED, SharedMemoryRegistry
from aiworks.gateway.telemetry import GatewayTelemetry, short
from aiworks.gateway.tenancy import PRIORITY_CLAMPED, tenant_classes
from aiworks.gateway.tenancy_layer import Tenancy
from aiworks.gateway.token_budget import TokenCount, check_max_tokens, counted_tokens, text_token_reserve, token_reserve
from aiworks.runtime.client import Work, outstanding_compute_s
from aiworks.scheduler.client import Routing, SchedulerClient
from aiworks.streams.store import Publisher, check_name, result_record

log = logging.getLogger(__name__)

EXTENSIONS = [
    "binary_tensor_data", "model_repository", "statistics", "schedule_policy", "trace", "logging",
    "system_shared_memory",
]

# The request parameter that publishes the answer to a result stream of the caller's tenant (docs/tiers.md).
PUBLISH_PARAMETER = "publish"
_UNAUTHENTICATED = metrics.GATEWAY_REFUSED.labels("unauthenticated")
# Reads a load request's overrides (its body, or its gRPC parameters): called only once the caller may load.
ReadOverrides = Callable[[], Awaitable[LoadOverrides]]

# Requests whose tensor data or checks handle more elements than this one at a time in Python (JSON data,
# BYTES elements) are decoded and checked in a worker thread, so the event loop keeps answering others.
OFF_LOOP_ELEMENTS = 32_768


class GatewayDataPlane:
    """Open Inference Protocol operations, transport-agnostic."""

    def __init__(
        self,
        scheduler: SchedulerClient,
        routing: Routing,
        server_name: str = "aiworks",
        cache: CacheClient | None = None,
        tenancy: Tenancy | None = None,
        diagnostics: Diagnostics | None = None,
        max_load_file_bytes: int = 32 << 20,
        shared_memory: SharedMemoryRegistry | None = None,
        streams: Publisher | None = None,
    ):
        self.scheduler = scheduler
        # Result streams (docs/tiers.md): where a request's ``publish`` parameter sends its answer; None: off.
        self.streams = streams
        self.max_load_file_bytes = max_load_file_bytes
        # Triton's trace and log settings over the gateway's tracing sample ratio and log level.
        self.diagnostics = diagnostics if diagnostics is not None else Diagnostics()
        # The scheduler's routing table, watched: model specs, versions and replicas come from it.
        self.routing = routing
        self.server_name = server_name
        self.cache = cache
        self.tenancy = tenancy if tenancy is not None else Tenancy.demo()
        # Triton's system shared memory regions, per tenant; the front ends read inputs and write outputs there.
        self.shared_memory = shared_memory if shared_memory is not None else SharedMemoryRegistry()
        # Per-request metrics, the server span and the audit line; the front ends wrap each inference in it.
        self.telemetry = GatewayTelemetry(audit=self.tenancy.audit)
        # Set on SIGTERM for ``drain_s``: still serving, but reporting not ready so new traffic goes elsewhere.
        self.draining = False

    # ---- who is asking ------------------------------------------------------------------------

    def authenticate(self, credentials: Headers = ()) -> Principal:
        """The caller's principal from HTTP headers or gRPC metadata; 401 without valid credentials.

        A refusal is counted (``aiworks_gateway_refused_requests_total``), not
        audited or logged one by one: strangers must not be able to fill the disk.
        """
        try:
            return self.tenancy.auth.authenticate(credentials)
        except Unauthenticated:
            _UNAUTHENTICATED.inc()
            raise

    def _for_model(self, credentials: Headers, model: str, version: str = "") -> Principal:
        """The caller, allowed to use ``model``: authenticated, the names checked (400), then authorized."""
        principal = self.authenticate(credentials)
        check_model_name(model)
        check_version(version)
        self.tenancy.auth.authorize(principal, model)
        return principal

    @staticmethod
    def is_admin(principal: Principal) -> bool:
        """An admin tenant's own credential; never a work token (what a job or queued request runs with)."""
        return principal.method == "anonymous" or (principal.tenant.admin and not principal.is_work_token)

    @staticmethod
    def refuse_work_token(principal: Principal, what: str) -> None:
        """403 for a work token where it may not go: it runs its job's or request's inference, nothing else."""
        if principal.is_work_token:
            raise PermissionDenied(f"a batch job's or queued request's work token may not {what}; it runs inference only")

    def _require_admin(self, principal: Principal, what: str) -> None:
        if not self.is_admin(principal):
            raise PermissionDenied(
                f"tenant '{principal.tenant_id}' may not {what}; only tenants with 'admin: true' in the tenants file may"
            )

    # ---- health and metadata ------------------------------------------------------------------

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        """Ready while the routing table has arrived and lists a live replica (the scheduler may be away),
        and the gateway is not draining before its stop (``drain_s``)."""
        return not self.draining and self.routing.ready()

    def server_metadata(self) -> dict:
        return {"name": self.server_name, "version": __version__, "extensions": EXTENSIONS}

    async def model_metadata(self, name: str, version: str, credentials: Headers = ()) -> dict:
        self._for_model(credentials, name, version)
        spec = await self._spec(name, version)
        versions = self.routing.versions(name)
        return {
            "name": spec.name,
            "versions": versions,
            "platform": spec.platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.full_shape(t)} for t in spec.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.full_shape(t)} for t in spec.outputs],
        }

    async def model_config(self, name: str, version: str, credentials: Headers = ()) -> dict:
        """The model's config in Triton's JSON form (the fields the suite uses)."""
        self._for_model(credentials, name, version)
        return spec_to_triton_config(await self._spec(name, version))

    async def model_ready(self, name: str, version: str, credentials: Headers = ()) -> bool:
        self._for_model(credentials, name, version)
        try:
            return self.routing.model_ready(name, version)
        except AIWorksError as exc:
            raise await self._unknown_refined(exc, name) from None

    async def _spec(self, name: str, version: str) -> ModelSpec:
        try:
            return self.routing.spec(name, version)
        except AIWorksError as exc:
            raise await self._unknown_refined(exc, name) from None

    async def _unknown_refined(self, exc: AIWorksError, name: str) -> AIWorksError:
        """A model the routing table does not know may still be in the repository (unloaded, or its load
        failed): then Triton says it has no available versions (NOT_FOUND), not that it is unknown. Only this
        error path asks the scheduler for the repository's index."""
        if exc.status is not Status.INVALID_ARGUMENT or not exc.message.startswith("Request for unknown model:"):
            return exc
        try:
            specs = await self.scheduler.index(False)
        except AIWorksError:
            return exc
        failed = next((s for s in specs if s.name == name), None)
        if failed is None:
            return exc
        return no_available_version(name, f"load failed: {failed.reason}" if failed.reason else "it is not loaded")

    # ---- inference ----------------------------------------------------------------------------

    @property
    def limits(self) -> InputLimits:
        """The caps the front ends check while parsing a request's header (its tensor count, its JSON size)."""
        return self.tenancy.filters.limits

    def authorize(self, principal: Principal, model: str, version: str = "") -> None:
        """400 for a bad model or version name, 403 unless ``principal`` may use ``model``.

        The front ends ask before any of the request is read or decoded.
        """
        check_model_name(model)
        check_version(version)
        self.tenancy.auth.authorize(principal, model)

    async def infer(
        self, request: InferRequest, principal: Principal | None = None, pending: PendingInputs | None = None, *,
        request_id: str = "", transport_deadline_s: float | None = None, api: str = "this API",
    ) -> InferResponse:  # fmt: skip
        """One inference, in the order of docs/tenancy.md.

        The front end has authenticated the caller (``principal``), read the
        body within :func:`request_limit` and parsed the request's header;
        ``pending`` decodes its tensor data (None: already decoded). Here:
        check the names, authorize the model, check the element caps on the
        declared shapes, resolve its version (weights apply), and only then
        decode, filter the inputs against the model's spec, read the request's
        options once (its class, within the tenant's default and ceiling, and
        its deadline), admit (rate, concurrency, quota), answer from the cache
        or a runtime replica, release the slot charging the runtime time it
        cost (:meth:`_settle`), meter, and mask outputs.
        ``transport_deadline_s`` is the time a gRPC client's own deadline leaves. ``api`` names the
        front end in Triton's refusal of a decoupled model (which only a stream can serve).
        """
        tenancy = self.tenancy
        publish_to = self._publish_target(request)
        tenant, spec, rows, options = await self._checked(
            request, principal, pending, request_id, transport_deadline_s, one_answer=api
        )
        admission = await tenancy.limiter.admit(tenant, text_token_reserve(tenant, spec, request), "text")
        work = Work()
        response = None
        try:

            async def compute(req: InferRequest) -> InferResponse:
                answer = await self.routing.infer(req, options, spec=spec, work=work)
                reply = InferResponse(spec.name, spec.version, answer.outputs, id=req.id, compute_s=work.compute_s)
                online = answer.parameters.get(ONLINE_LOAD)
                if online is not None:  # a batch-class answer's signal for its client (aiworks.batch.pacing)
                    reply.parameters[ONLINE_LOAD] = online
                return reply

            if self.cache is not None:
                # ---- result cache hook (docs/cache.md): lookup, a replica on a miss, store in the background.
                response = await self.cache.infer(request, spec, compute)
            else:
                response = await compute(request)
        finally:  # the Redis round trip of a release stays off the answer's latency
            prompt_tokens = counted_tokens(response) if response is not None else 0
            admission.used_tokens = prompt_tokens  # a text model's reserve settles to its count (0: failed)
            self._settle(admission, spec.name, work, answered=response is not None)
        # A cache hit cost no runtime time: work.compute_s is 0 then.
        tenancy.meter.record(tenant.id, spec.name, rows=rows, compute_s=work.compute_s, cache_hit=response.cache_hit,
                             prompt_tokens=prompt_tokens)  # fmt: skip
        if options.clamped:
            response.parameters[PRIORITY_CLAMPED] = options.priority.label
        response = await tenancy.masking.mask_async(spec, response)
        if publish_to is not None:  # what the caller sees, masked; appended in the background
            record = result_record(response, publish_to, self.streams.max_record_bytes)
            record["id"] = record["id"] or request_id
            self.streams.publish(tenant.id, publish_to, record, tenant.stream_rules)
        return response

    def _publish_target(self, request: InferRequest) -> str | None:
        """The stream named by the request's ``publish`` parameter (taken out: no model sees it); 400 when bad."""
        name = request.parameters.pop(PUBLISH_PARAMETER, None)
        if name is None:
            return None
        if self.streams is None:
            raise InvalidArgument(
                f"parameter '{PUBLISH_PARAMETER}': result streams are off on this gateway (setting result_streams)"
            )
        return check_name(name)

    async def infer_stream(
        self, request: InferRequest, principal: Principal | None = None, pending: PendingInputs | None = None, *,
        request_id: str = "", transport_deadline_s: float | None = None, tokens: TokenCount | None = None,
    ) -> AsyncIterator[InferResponse]:  # fmt: skip
        """One inference whose responses may be many (a decoupled model's), yielded as they come.

        The checks, options and admission of :meth:`infer`; no result cache (a
        stream's answers are not stored). The tenant's slot is held until the
        last response, the runtime time charged then, and the request metered
        once. Each response is masked; all but the last have ``final`` unset.
        A model that is not decoupled gives one response. Close the iterator
        (``contextlib.aclosing``) to stop early: that cancels the request at
        its replica. ``tokens`` counts the generation's tokens (the front
        end's, for its audit line; else one of its own).
        """
        tenancy = self.tenancy
        if PUBLISH_PARAMETER in request.parameters:
            raise InvalidArgument(f"parameter '{PUBLISH_PARAMETER}' applies to one-answer inferences, not to streams")
        tenant, spec, rows, options = await self._checked(request, principal, pending, request_id, transport_deadline_s)
        scores = "logprobs" in request.parameters or "prompt_logprobs" in request.parameters
        if scores and tenancy.masking.for_spec(spec) is not None:
            raise InvalidArgument(f"model '{spec.name}' masks its outputs; log probabilities would show its tokens "
                                  "unmasked, so it does not give them")  # fmt: skip
        admission = await tenancy.limiter.admit(tenant, token_reserve(tenant, spec, request))
        work = Work()
        tokens = tokens if tokens is not None else TokenCount()
        finished = False
        # A masked stream's text goes out a line at a time, so a match across pieces is masked too.
        hold = tenancy.masking.hold_for(spec) if spec.decoupled else None
        try:
            stream = self.routing.infer_stream(request, options, spec=spec, work=work)
            async with contextlib.aclosing(stream) as answers:
                async for answer in answers:
                    tokens.see(answer.parameters, bool(answer.outputs))
                    response = InferResponse(
                        spec.name, spec.version, answer.outputs, id=request.id, parameters=dict(answer.parameters),
                        compute_s=work.compute_s, final=answer.final,
                    )  # fmt: skip
                    if options.clamped:
                        response.parameters[PRIORITY_CLAMPED] = options.priority.label
                    if hold is None:
                        yield await tenancy.masking.mask_async(spec, response)
                        continue
                    bare = answer.final and not answer.outputs  # the stream's end flag: the text held goes first
                    for out in (hold.end(), response) if bare else (hold.push(response),):
                        if out is not None:
                            yield await tenancy.masking.mask_async(spec, out)
            if hold is not None and (out := hold.end()) is not None:
                yield await tenancy.masking.mask_async(spec, out)
            finished = True
        finally:
            admission.used_tokens = tokens.prompt + tokens.completion  # the reserve settles to it at release
            self._settle(admission, spec.name, work, answered=finished)
            if finished:
                tenancy.meter.record(tenant.id, spec.name, rows=rows, compute_s=work.compute_s,
                                     prompt_tokens=tokens.prompt, completion_tokens=tokens.completion)  # fmt: skip
            elif tokens.prompt or tokens.completion:  # stopped early: the tokens it cost are usage all the same
                tenancy.meter.record(tenant.id, spec.name, requests=0, rows=0, prompt_tokens=tokens.prompt,
                                     completion_tokens=tokens.completion)  # fmt: skip

    async def _checked(self, request: InferRequest, principal: Principal | None, pending: PendingInputs | None,
                       request_id: str, transport_deadline_s: float | None, one_answer: str = ""):  # fmt: skip
        """Authenticate, check, resolve the version, decode, filter and read the options: what precedes admission."""
        tenancy = self.tenancy
        if principal is None:
            principal = tenancy.auth.authenticate(())
        tenant = principal.tenant
        request.tenant = tenant.id
        check_model_name(request.model)
        check_version(request.version)
        tenancy.auth.authorize(principal, request.model)
        tenancy.filters.check_bounds(request)  # caps on what the header declares: nothing decoded yet
        check_max_tokens(tenant, request.parameters)
        try:
            spec = self.routing.resolve(request.model, request.version)
        except AIWorksError as exc:
            raise await self._unknown_refined(exc, request.model) from None
        if one_answer and spec.decoupled:  # Triton's words, per front end; UNIMPLEMENTED (501) as Triton's
            raise AIWorksError(
                f"{one_answer} doesn't support models with decoupled transaction policy", Status.UNIMPLEMENTED
            )
        slow = pending.slow_elements if pending is not None else 0
        slow += sum(element_count(t.shape) for t in request.inputs if t.datatype == "BYTES")
        rows = await offload(self._prepare, request, pending, spec, large=slow > OFF_LOOP_ELEMENTS)
        default, ceiling = tenant_classes(tenant)
        options = read_options(
            request.parameters, default=default or self.routing.default_priority, ceiling=ceiling,
            tenant=tenant.id, request_id=request_id or request.id, transport_deadline_s=transport_deadline_s,
        )  # fmt: skip
        request.version, request.resolved = spec.version, True
        return tenant, spec, rows, options

    def _prepare(self, request: InferRequest, pending: PendingInputs | None, spec: ModelSpec) -> int:
        """Decode the tensor data and apply the input filters; the batch rows (in a worker thread when large)."""
        if pending is not None:
            pending.decode()
        return self.tenancy.filters.check(request, spec, against_metadata=not self.tenancy.demo_mode)

    def _settle(self, admission: Admission, model: str, work: Work, *, answered: bool) -> None:
        """Free the request's slot and charge what the runtime spent: now, or once that work has ended.

        When the request was answered before the scheduler (the client's
        deadline passed, or the client went away while its batch ran), the
        slot stays taken and the charge waits for the scheduler's answer,
        which comes when the batch has ended (bounded by the call's own
        timeout). A request that failed after costing runtime time shows in
        usage as compute without a request.
        """
        tenancy = self.tenancy
        tenant_id = admission.tenant.id
        if work.outstanding is None:
            tenancy.limiter.release_soon(admission, work.compute_s)
            if not answered and work.compute_s > 0:
                tenancy.meter.record(tenant_id, model, requests=0, rows=0, compute_s=work.compute_s)
            return

        def settle(reply: asyncio.Future) -> None:
            compute_s = work.compute_s + outstanding_compute_s(reply)
            tenancy.limiter.release_soon(admission, compute_s)
            if compute_s > 0:
                tenancy.meter.record(tenant_id, model, requests=0, rows=0, compute_s=compute_s)

        work.outstanding.add_done_callback(settle)

    # ---- system shared memory (docs/triton.md): a tenant's own regions, any authenticated tenant ----------

    async def shm_status(self, name: str = "", credentials: Headers = ()) -> list[dict]:
        return self.shared_memory.status(self.authenticate(credentials).tenant_id, name)

    async def shm_register(self, name: str, key, offset, byte_size, credentials: Headers = ()) -> None:
        principal = self.authenticate(credentials)
        self.shared_memory.register(principal.tenant_id, name, key, offset, byte_size)

    async def shm_unregister(self, name: str = "", credentials: Headers = ()) -> None:
        self.shared_memory.unregister(self.authenticate(credentials).tenant_id, name)

    def cuda_shm(self, action: str, name: str = "", credentials: Headers = ()) -> list[dict]:
        """CUDA shared memory, as a Triton built without GPUs answers: no region can be registered (400), so the
        status is empty (a named region is unknown) and unregistering is a no-op (clients clean up with it first)."""
        self.authenticate(credentials)
        if action == "register":
            raise InvalidArgument(CUDA_UNSUPPORTED)
        if action == "status" and name:
            raise InvalidArgument(f"Unable to find cuda shared memory region: '{name[:128]}'; {CUDA_UNSUPPORTED}")
        return []

    # ---- usage --------------------------------------------------------------------------------

    async def usage(
        self,
        credentials: Headers = (),
        *,
        start: float,
        end: float | None = None,
        tenant: str | None = None,
        model: str | None = None,
    ) -> dict:
        """Usage per tenant and model (docs/tenancy.md): a tenant sees its own, an admin anyone's."""
        principal = self.authenticate(credentials)
        if not self.is_admin(principal):
            if tenant is not None and tenant != principal.tenant_id:
                raise PermissionDenied(
                    f"tenant '{principal.tenant_id}' may read only its own usage, not tenant '{short(tenant, 64)}'s"
                )
            tenant = principal.tenant_id
        report = await self.tenancy.meter.report(start, end, tenant=tenant, model=model)
        return report.to_dict()

    # ---- model repository ---------------------------------------------------------------------

    async def repository_index(self, ready_only: bool = False, credentials: Headers = ()) -> list[dict]:
        principal = self.authenticate(credentials)
        specs = await self.scheduler.index(ready_only)
        if not self.is_admin(principal):
            specs = [s for s in specs if principal.tenant.allows(s.name)]
        return [{"name": s.name, "version": s.version, "state": s.state.value, "reason": s.reason} for s in specs]

    async def load(self, name: str, credentials: Headers = (), overrides: ReadOverrides | None = None) -> None:
        """(Re)load ``name`` everywhere; ``overrides`` reads Triton's load parameters once the caller may load."""

        async def run(model: str) -> None:
            await self._load(model, await overrides() if overrides is not None else None)

        await self._admin("model.load", name, credentials, run)

    async def unload(self, name: str, credentials: Headers = ()) -> None:
        await self._admin("model.unload", name, credentials, self._unload)

    async def _load(self, name: str, overrides: LoadOverrides | None) -> None:
        check_model_name(name)
        try:
            if overrides and overrides.file_bytes > self.max_load_file_bytes:
                raise PayloadTooLarge(
                    f"the load's files hold {overrides.file_bytes} bytes, "
                    f"more than the {self.max_load_file_bytes} bytes this server accepts"
                )
            _, generation = await self.scheduler.load(name, overrides)
            await self.routing.caught_up(generation)  # this gateway's next request sees the load
        except AIWorksError as exc:  # Triton's words first: scripts match on them
            if not exc.message.startswith("failed to load"):
                exc.message = f"failed to load '{name}': {exc.message}"
            raise
        finally:
            # ---- result cache hook: a (re)loaded model's old results must not be served.
            if self.cache is not None:
                await self.cache.invalidate(name)

    async def _unload(self, name: str) -> None:
        check_model_name(name)
        try:
            await self.routing.caught_up(await self.scheduler.unload(name))
        finally:
            # ---- result cache hook: an unloaded model's results go with it.
            if self.cache is not None:
                await self.cache.invalidate(name)

    async def _admin(self, action: str, model: str, credentials: Headers, run, what: str = ""):
        """Run an admin action for an admin tenant, and audit the attempt whatever its outcome; returns its result."""
        started = time.perf_counter()
        principal: Principal | None = None
        error: BaseException | None = None
        try:
            principal = self.authenticate(credentials)
            self._require_admin(principal, what or f"{action.replace('model.', '')} models")
            return await run(model)
        except BaseException as exc:
            error = exc
            raise
        finally:
            audit = self.tenancy.audit
            if audit is not None and not isinstance(error, Unauthenticated):
                actor = None if principal is None else (principal.tenant_id or "anonymous")
                details = {"latency_ms": round((time.perf_counter() - started) * 1e3, 3)}
                if principal is not None:
                    details.update(auth=principal.method, subject=principal.subject or None)
                try:
                    audit.admin(
                        actor=actor, action=action, status=metrics.status_label(error),
                        tenant=None if principal is None else principal.tenant_id,
                        model=short(model), details=details,
                    )  # fmt: skip
                except AIWorksError as exc:
                    log.warning("audit of %s %s failed: %s", action, short(model, 64), exc)

    # ---- trace and log settings (Triton's trace and logging extensions; aiworks.gateway.diagnostics) -----------

    async def trace_settings(self, model: str = "", credentials: Headers = ()) -> TraceSettings:
        self._require_admin(self.authenticate(credentials), "read trace settings")
        if model:
            check_model_name(model)
        return self.diagnostics.trace_settings(model)

    async def update_trace_settings(
        self, model: str, updates: dict[str, list[str] | None], credentials: Headers = ()
    ) -> TraceSettings:
        async def run(name: str) -> TraceSettings:
            if name:
                check_model_name(name)
            return self.diagnostics.update_trace_settings(updates, name)

        return await self._admin("trace.settings", model, credentials, run, "change trace settings")

    async def log_settings(self, credentials: Headers = ()) -> LogSettings:
        self._require_admin(self.authenticate(credentials), "read log settings")
        return self.diagnostics.log_settings()

    async def update_log_settings(self, updates: dict, credentials: Headers = ()) -> LogSettings:
        async def run(_: str) -> LogSettings:
            return self.diagnostics.update_log_settings(updates)

        return await self._admin("log.settings", "", credentials, run, "change log settings")

    async def statistics(self, name: str, version: str, credentials: Headers = ()) -> list[dict]:
        """Triton's statistics extension, summed over replicas, with a per-replica breakdown."""
        principal = self._for_model(credentials, name, version) if name else self.authenticate(credentials)
        allowed = None if self.is_admin(principal) else principal.tenant.allows
        merged: dict[tuple[str, str], dict] = {}
        for replica_id, models in await self.scheduler.statistics(name, version):
            for s in models:
                if allowed is not None and not allowed(s.name):
                    continue
                entry = merged.setdefault(
                    (s.name, s.version),
                    {
                        "name": s.name,
                        "version": s.version,
                        "last_inference": 0,
                        "inference_count": 0,
                        "execution_count": 0,
                        "inference_stats": {
                            "success": {"count": 0, "ns": 0},
                            "fail": {"count": 0, "ns": 0},
                            "compute_infer": {"count": 0, "ns": 0},
                        },
                        "replicas": [],
                    },
                )
                entry["last_inference"] = max(entry["last_inference"], s.last_inference_ms)
                entry["inference_count"] += s.inference_count
                entry["execution_count"] += s.execution_count
                stats = entry["inference_stats"]
                stats["success"]["count"] += s.success_count
                stats["fail"]["count"] += s.failure_count
                stats["compute_infer"]["count"] += s.execution_count
                stats["compute_infer"]["ns"] += s.compute_ns
                entry["replicas"].append(
                    {
                        "replica_id": replica_id,
                        "inference_count": s.inference_count,
                        "execution_count": s.execution_count,
                    }
                )
        return [merged[k] for k in sorted(merged)]


_TRITON_TYPES = {"BYTES": "TYPE_STRING"}


def spec_to_triton_config(spec: ModelSpec) -> dict:
    def tensors(specs):
        out = []
        for t in specs:
            data_type = _TRITON_TYPES.get(t.datatype, f"TYPE_{t.datatype}")
            entry = {"name": t.name, "data_type": data_type, "dims": list(t.dims)}
            if t.reshape is not None:
                entry["reshape"] = {"shape": list(t.reshape)}
            if t.format:
                entry["format"] = t.format
            if t.label_filename:
                entry["label_filename"] = t.label_filename
            out.append(entry)
        return out

    config = {
        "name": spec.name,
        "platform": spec.platform,
        "max_batch_size": spec.max_batch_size,
        "input": tensors(spec.inputs),
        "output": tensors(spec.outputs),
        "instance_group": [{"count": spec.instance_count, "kind": "KIND_CPU"}],
        "parameters": {k: {"string_value": v} for k, v in spec.parameters.items()},
    }
    if spec.decoupled:  # clients (perf_analyzer, for one) read it to choose streaming
        config["model_transaction_policy"] = {"decoupled": True}
    if spec.sequence is not None:
        config["sequence_batching"] = {
            "max_sequence_idle_microseconds": spec.sequence.max_idle_us, spec.sequence.strategy: {}
        }
    if spec.batching.enabled:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(spec.batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": spec.batching.max_queue_delay_us,
        }
    return config
