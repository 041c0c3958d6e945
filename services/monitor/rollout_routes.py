"""The rollout API on the monitor's HTTP server; the routes translate and delegate.

::

    POST /v1/rollouts                   start: {"model": "digits", "canary": "2", ...}   -> 201, the rollout
    GET  /v1/rollouts                   every model's latest rollout: {"rollouts": [...]}
    GET  /v1/rollouts/{model}           one model's latest rollout (404: none yet)
    POST /v1/rollouts/{model}/abort     stop where it is, all traffic to stable
    POST /v1/rollouts/{model}/rollback  all traffic back to the previous stable, also after completion

A start body names ``model`` and ``canary`` (alias ``to``), optionally
``stable`` (alias ``from``; default: the version serving now) and any
:class:`~aiworks.monitor.rollout.RolloutPolicy` field: ``steps`` (list or
``"5,20,50,100"``), ``dwell_s``, ``max_error_rate_increase`` (a fraction),
``max_p99_ratio``, ``min_requests``, ``max_extensions``, ``p99_floor_s``.
Errors answer ``{"error": message}`` with the status from the one error
table (409 while a rollout of the model runs, 412 for an action the
rollout's phase does not allow), whether or not the app has the monitor's
error middleware.
"""

from __future__ import annotations

import functools
import json

from aiohttp import web

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.monitor.rollout import RolloutController

_ALIASES = {"to": "canary", "from": "stable"}


def _handle(handler):
    @functools.wraps(handler)
    async def wrapper(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except AIWorksError as exc:
            return web.json_response({"error": exc.message}, status=exc.status.http)

    return wrapper


async def _body(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("the body must be a JSON object")
    out = {}
    for key, value in body.items():
        name = _ALIASES.get(key, key)
        if name in out:
            raise InvalidArgument(f"'{key}' and '{name}' name the same field; give one")
        out[name] = value
    return out


def add_rollout_routes(app: web.Application, controller: RolloutController) -> None:
    """Add the ``/v1/rollouts`` routes to ``app``, delegating to ``controller``."""

    @_handle
    async def start(request: web.Request) -> web.Response:
        body = await _body(request)
        model, canary = body.pop("model", None), body.pop("canary", None)
        if not isinstance(model, str) or not model:
            raise InvalidArgument('give the model to roll out: {"model": ..., "canary": ...}')
        if canary is None or canary == "":
            raise InvalidArgument('give the canary version: {"model": ..., "canary": "2"}')
        stable = body.pop("stable", None)
        rollout = await controller.start(model, str(canary), stable=str(stable) if stable else None, **body)
        return web.json_response(rollout, status=201)

    @_handle
    async def list_rollouts(request: web.Request) -> web.Response:
        return web.json_response({"rollouts": controller.status()})

    @_handle
    async def one(request: web.Request) -> web.Response:
        return web.json_response(controller.status(request.match_info["model"]))

    @_handle
    async def abort(request: web.Request) -> web.Response:
        return web.json_response(await controller.abort(request.match_info["model"]))

    @_handle
    async def rollback(request: web.Request) -> web.Response:
        return web.json_response(await controller.rollback(request.match_info["model"]))

    app.router.add_post("/v1/rollouts", start)
    app.router.add_get("/v1/rollouts", list_rollouts)
    app.router.add_get("/v1/rollouts/{model}", one)
    app.router.add_post("/v1/rollouts/{model}/abort", abort)
    app.router.add_post("/v1/rollouts/{model}/rollback", rollback)
