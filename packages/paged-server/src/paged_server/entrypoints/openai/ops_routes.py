"""What operators and load balancers call: ``/health`` (and ``/ping``),
``/load``, ``/metrics`` and ``/admin/reclaim``, on one ``APIRouter``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from paged_server.entrypoints.openai.api_routes import ERRORS
from paged_server.entrypoints.openai.async_engine import AsyncEngine, EngineLike
from paged_server.entrypoints.openai.errors import APIError
from paged_server.entrypoints.openai.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from paged_server.entrypoints.openai.metrics import ServerMetrics

HEALTH_TIMEOUT_S = 10.0


def ops_router(
    engine: EngineLike, async_engine: AsyncEngine, metrics: ServerMetrics, api_key: str | None
) -> APIRouter:
    """The operator routes; engine calls run on the engine thread (``async_engine``)."""
    router = APIRouter()

    @router.get("/load")
    async def load() -> dict[str, int]:
        """Requests running or waiting (vLLM's server load, for load balancers)."""
        m = async_engine.metrics()
        return {"server_load": int(m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0))}

    @router.get("/health", responses={503: {"description": "Engine, rank or replica dead, or block audit failed"}})
    # /ping: the same check under SageMaker's and vLLM's name (not in the schema: an alias)
    @router.api_route("/ping", methods=["GET", "POST"], include_in_schema=False)
    async def health() -> JSONResponse:
        """200 when the engine thread answers and its audit is clean: KV
        blocks, every rank and data-parallel replica alive (``/ping`` is the
        same check, as SageMaker and vLLM ask it)."""
        if not async_engine.alive:
            return _unhealthy(async_engine.last_error or "engine thread is not running")
        try:
            problems = await async_engine.call(engine.audit, timeout=HEALTH_TIMEOUT_S)
        except TimeoutError:
            return _unhealthy(f"engine thread did not answer within {HEALTH_TIMEOUT_S:.0f} s")
        except Exception as exc:
            return _unhealthy(f"audit failed: {type(exc).__name__}: {exc}")
        if problems:  # KV blocks, or a dead rank or replica (the rest may still serve)
            reason = f"the engine's audit found {len(problems)} problem(s): {problems[0]}"
            return _unhealthy(reason, audit=list(problems))
        return JSONResponse({"status": "ok", "audit": []})

    @router.get("/metrics", response_class=PlainTextResponse, responses={401: ERRORS[401]})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @router.post(
        "/admin/reclaim",
        responses={401: ERRORS[401], 403: {"description": "The server runs without an API key"}},
        summary="Free KV blocks the audit reports as leaked (operator action)",
    )
    async def reclaim() -> JSONResponse:
        """Reclaim leaked KV blocks (see docs/serving.md); the periodic audit
        only reports them. Served only when the server has an API key."""
        if api_key is None:
            raise APIError(403, "admin endpoints need the server to run with --api-key")
        reclaimed = await async_engine.call(engine.reclaim_leaked, timeout=HEALTH_TIMEOUT_S)
        problems = await async_engine.call(engine.audit, timeout=HEALTH_TIMEOUT_S)
        return JSONResponse({"reclaimed_blocks": list(reclaimed), "audit": list(problems)})

    return router


def _unhealthy(reason: str, **extra: object) -> JSONResponse:
    return JSONResponse({"status": "unhealthy", "reason": reason, **extra}, status_code=503)
