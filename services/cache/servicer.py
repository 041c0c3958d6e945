"""gRPC transport of the cache: translate messages and delegate to the data plane."""

from __future__ import annotations

from aiworks.cache.dataplane import CacheDataPlane
from aiworks.core.rpc import handle_errors
from aiworks.core.stream import serve_stream
from aiworks.pb.cache.v1 import cache_pb2 as pb
from aiworks.pb.cache.v1 import cache_pb2_grpc
from aiworks.security.callers import ANY_CALLER

# Who may call each method (docs/security.md), checked once per call or stream by CallerCheck.
CALLERS_BY_METHOD = {
    **dict.fromkeys(("Get", "Put", "GetStream", "PutStream"), {"gateway"}),
    "Invalidate": {"gateway", "admin"},
    "Stats": ANY_CALLER,
}


class CacheServicer(cache_pb2_grpc.CacheServiceServicer):
    """``aiworks.cache.v1.CacheService``."""

    def __init__(self, dataplane: CacheDataPlane):
        self.dataplane = dataplane

    async def _get(self, request) -> pb.GetResponse:
        found = await self.dataplane.get(request.model, request.key)
        return pb.GetResponse(
            found=found.found, value=found.value or b"", epoch=found.epoch, bypassed=found.bypassed
        )

    async def _put(self, request) -> pb.PutResponse:
        stored, reason = await self.dataplane.put(
            request.model, request.key, request.value, request.epoch, request.ttl_ms / 1000
        )
        return pb.PutResponse(stored=stored, reason=reason)

    @handle_errors
    async def Get(self, request, context):
        return await self._get(request)

    @handle_errors
    async def Put(self, request, context):
        return await self._put(request)

    async def GetStream(self, request_iterator, context):
        await serve_stream(
            request_iterator,
            context,
            self._get,
            lambda code, message: pb.GetResponse(error_code=code, error_message=message),
            pb.GetResponseFrame,
        )

    async def PutStream(self, request_iterator, context):
        await serve_stream(
            request_iterator,
            context,
            self._put,
            lambda code, message: pb.PutResponse(error_code=code, error_message=message),
            pb.PutResponseFrame,
        )

    @handle_errors
    async def Invalidate(self, request, context):
        removed, epoch = await self.dataplane.invalidate(request.model)
        return pb.InvalidateResponse(removed=removed, epoch=epoch)

    @handle_errors
    async def Stats(self, request, context):
        s = await self.dataplane.stats()
        return pb.StatsResponse(
            store=s.store,
            store_available=s.store_available,
            entries=s.entries,
            bytes=s.bytes,
            max_bytes=s.max_bytes,
            evictions=s.evictions,
            expired=s.expired,
            **s.counters.as_dict(),
        )
