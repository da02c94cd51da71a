"""The ASGI shell of the web placement planner: routes, errors, limits and auth around a ``Planner``.

``create_app(settings)`` opens the store and returns a FastAPI app; importing
this module does nothing else. A :class:`~hetsched.server.guard.Guard` checks
each request's Host, token (every API route but ``/api/info``: plans, models
and the store are not for strangers), JSON content type and body. Solves run
on ``SOLVE_THREADS`` worker threads, each stopping at the deadline
``settings.web.solve_timeout_s`` from its start, so an abandoned solve never
holds a thread that a later one waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from importlib import resources
from typing import Annotated, Any

from fastapi import Body, FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.routing import Match
from starlette.types import Scope

import hetsched
from hetsched.catalog import host_catalog
from hetsched.store.calibrations import calibrated_constants
from hetsched.errors import DeadlineError, HetschedError, InputError
from hetsched.optimizer.build import CapacitySource
from hetsched.optimizer.plan import Plan
from hetsched.optimizer.spec import ClusterSpec
from hetsched.server.guard import Guard
from hetsched.server.refusals import Refusal
from hetsched.settings import Settings
from hetsched.store import open_configured_store
from hetsched.store.cache import cached_capacity_source
from hetsched.store.tables import NAME_LENGTH
from hetsched.web.planner import Planner, field_under
from hetsched.web.schemas import (
    AcceleratorInfo,
    CapacityInfo,
    ClusterFile,
    ErrorBody,
    ModelInfo,
    PlanOrigin,
    PlanSummary,
    ProfileInfo,
    ServerInfo,
    SolveRequest,
    StoredPlan,
    WhatIfRequest,
    WhatIfResult,
)
from hetsched.web.whatif import change_field

STATIC = resources.files("hetsched.web") / "static"
YAML_MEDIA_TYPE = "application/yaml"
MODEL_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_LENGTH - 1}}}$"
DEFAULT_ENGINE_IMAGE = "vllm/vllm-openai:latest"
PlanId = Annotated[int, Path(ge=1, le=2**31 - 1, description="a plan's id, as GET /api/plans lists them")]
SOLVE_THREADS = 2
PUBLIC_PATHS = frozenset({"/", "/api/info", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
"""Paths that answer without the token: the page, its static files, what it needs to ask for a token, the docs."""

_STORE_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in ((401, "a bearer token is required (HETSCHED_WEB_TOKEN is set)"),
                         (503, "the store is unavailable (its database is down, unreachable, locked or out of "
                               "connections); try again"))
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    **_STORE_ERRORS, **{status: {"model": ErrorBody, "description": text}
                        for status, text in ((404, "no such plan or model"),
                                             (422, "invalid input; `field` names where"))},
}
_WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **_ERRORS, 408: {"model": ErrorBody, "description": "the request body did not arrive in time"},
    413: {"model": ErrorBody, "description": "request body too large"},
    415: {"model": ErrorBody, "description": "the body is not sent as application/json"},
}
_SOLVE_ERRORS: dict[int | str, dict[str, Any]] = {
    **_WRITE_ERRORS, 504: {"model": ErrorBody, "description": "the solve did not finish within the deadline"},
}


def create_app(settings: Settings, *, capacity_source: CapacitySource | None = None) -> FastAPI:
    """The planner app on the store and prices ``settings`` name.

    ``capacity_source`` gives SLO capacities for models a spec has no
    ``capacities`` rows for; by default the simulator's SLO search, cached in
    the store as ``hetsched plan`` and ``hetsched capacity`` cache it.
    """
    store = open_configured_store(settings.store)
    if capacity_source is None:
        capacity_source = cached_capacity_source(store)
    base = host_catalog().with_perf(calibrated_constants(store))
    planner = Planner(store=store, catalog=base.with_prices(settings.web.prices) if settings.web.prices else base,
                      list_prices={k: a.price_per_hour for k, a in base.accelerators.items()},
                      capacity_source=capacity_source)
    solver = ThreadPoolExecutor(max_workers=SOLVE_THREADS, thread_name_prefix="hetsched-solve")

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        store.engine.dispose()  # connections close; the app may start again (the engine reconnects)

    app = FastAPI(
        lifespan=lifespan,
        title="hetsched placement planner",
        version=hetsched.__version__,
        description="Plan which models run on which accelerators (whole GPUs, MIG slices, partitions) at the "
                    "lowest cost that meets each model's SLO; compare what-ifs; export the plan as custom "
                    "resources or a mig-parted config. When the server has a token, every API route but "
                    "`/api/info` takes `Authorization: Bearer <token>`; bodies are `application/json`.",
    )
    def routed(scope: Scope) -> bool:
        return any(route.matches(scope)[0] is Match.FULL for route in app.router.routes)

    app.add_middleware(Guard, limits=settings.web.limits(), render=_refusal_body, token=settings.web.token or None,
                       public=_public, routed=routed)
    _add_error_handlers(app)

    async def compute(spec: ClusterSpec, *, current: Plan | None = None) -> Plan:
        """The solve on a solver thread; past its deadline it stops and the request gets 504."""
        work = partial(_in_spec, planner.compute, spec, timeout_s=settings.web.solve_timeout_s, current=current)
        try:
            return await asyncio.get_running_loop().run_in_executor(solver, work)
        except DeadlineError as exc:
            raise _SolveTimeout(settings.web.solve_timeout_s) from exc

    @app.get("/", include_in_schema=False)
    def index() -> FileResponse:
        return FileResponse(str(STATIC / "index.html"), media_type="text/html")

    app.mount("/static", StaticFiles(directory=str(STATIC)), name="static")

    @app.get("/api/info", response_model=ServerInfo, tags=["about"])
    def info() -> ServerInfo:
        """Version, limits, and whether the API needs a token."""
        return ServerInfo(version=hetsched.__version__, auth_required=bool(settings.web.token),
                        solve_timeout_s=settings.web.solve_timeout_s, max_body_bytes=settings.web.max_body_bytes,
                        database=store.engine.url.render_as_string(hide_password=True))

    @app.get("/api/accelerators", response_model=list[AcceleratorInfo], tags=["catalog"])
    def accelerators() -> list[AcceleratorInfo]:
        """The accelerator catalog with the prices in effect (HETSCHED_PRICES overrides the catalog's)."""
        return planner.accelerators()

    @app.get("/api/models", response_model=list[ModelInfo], responses=_STORE_ERRORS, tags=["models"])
    def models() -> list[ModelInfo]:
        """Bundled model configs and the ones uploaded to this store."""
        return planner.models()

    @app.put("/api/models/{name}", response_model=ModelInfo, responses=_WRITE_ERRORS, tags=["models"])
    def upload_model(name: Annotated[str, Path(pattern=MODEL_NAME_PATTERN)],
                     config: Annotated[dict[str, Any], Body(description="a Hugging Face config.json")]) -> ModelInfo:
        """Upload (or replace) a model's config.json under ``name``; it is validated before it is stored."""
        return planner.upload_model(name, config)

    @app.delete("/api/models/{name}", status_code=204, responses=_WRITE_ERRORS, tags=["models"])
    def delete_model(name: Annotated[str, Path(pattern=MODEL_NAME_PATTERN)]) -> Response:
        """Remove an uploaded model (plans that used it keep their inlined config)."""
        planner.delete_model(name)
        return Response(status_code=204)

    @app.get("/api/profiles", response_model=list[ProfileInfo], responses=_STORE_ERRORS, tags=["store"])
    def profiles(model: str | None = None, accelerator: str | None = None) -> list[ProfileInfo]:
        """Stored latency profiles, newest first."""
        return planner.profiles(model=model, accelerator=accelerator)

    @app.get("/api/capacities", response_model=list[CapacityInfo], responses=_STORE_ERRORS, tags=["store"])
    def capacities(model: str | None = None, device: str | None = None) -> list[CapacityInfo]:
        """Stored SLO capacities (requests/s per replica), newest first."""
        return planner.capacities(model=model, device=device)

    @app.post("/api/specs/parse", response_model=ClusterSpec, responses=_WRITE_ERRORS, tags=["plans"])
    def parse_cluster_file(file: ClusterFile) -> ClusterSpec:
        """Validate a cluster file (YAML/JSON, hetsched's format or a Mélange-style profile) into a spec."""
        return planner.parse_cluster_file(file.text, filename=file.filename)

    @app.get("/api/plans", response_model=list[PlanSummary], responses=_STORE_ERRORS, tags=["plans"])
    def plans(origin: PlanOrigin | None = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 100) -> list[PlanSummary]:
        """Plan history, newest first: from this page, `hetsched plan --save`, and the operator."""
        return planner.plans(origin=origin, limit=limit)

    @app.get("/api/plans/{plan_id}", response_model=StoredPlan, responses=_ERRORS, tags=["plans"])
    def plan(plan_id: PlanId) -> StoredPlan:
        """One stored plan with the spec that produced it."""
        return planner.plan(plan_id)

    @app.post("/api/plans", response_model=StoredPlan, status_code=201, responses=_SOLVE_ERRORS, tags=["plans"])
    async def solve(request: SolveRequest) -> StoredPlan:
        """Solve a cluster spec (the input of `hetsched plan`) and store the plan with it.

        An infeasible spec is stored and returned too: its explanation says why.
        """
        spec = await run_in_threadpool(partial(planner.resolve, request.spec, deadline_s=settings.web.solve_timeout_s))
        result = await compute(spec)
        return await run_in_threadpool(planner.save, spec, result, note=request.note)

    @app.post("/api/plans/{plan_id}/what-if", response_model=WhatIfResult, status_code=201,
              responses=_SOLVE_ERRORS, tags=["plans"])
    async def what_if(plan_id: PlanId, request: WhatIfRequest) -> WhatIfResult:
        """Re-solve a stored plan's spec with changed prices, demand or inventory; store it; diff the two."""
        base_plan = await run_in_threadpool(planner.plan, plan_id)
        changed = planner.what_if_spec(base_plan, request.changes)
        spec = await run_in_threadpool(partial(planner.resolve, changed, deadline_s=settings.web.solve_timeout_s))
        try:
            result = await compute(spec, current=base_plan.plan)
        except InputError as exc:  # a field the what-if changed is named as the change, not in the stored spec
            change = change_field(spec, request.changes, (exc.field or "").removeprefix("spec."))
            if change is None:
                raise
            raise InputError(str(exc).removeprefix(f"{exc.field}: "), field=f"changes.{change}") from exc
        note = request.note or f"what-if of plan {plan_id}: {request.changes.summary()}"
        stored = await run_in_threadpool(planner.save, spec, result, note=note)
        return WhatIfResult(base_id=plan_id, result=stored, diff=planner.diff(base_plan, result))

    @app.get("/api/plans/{plan_id}/resources.yaml", response_class=PlainTextResponse, responses=_ERRORS,
             tags=["export"])
    def export_resources(
        plan_id: PlanId,
        namespace: Annotated[str, Query(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)] = "default",
        engine_image: Annotated[str, Query(min_length=1, max_length=500)] = DEFAULT_ENGINE_IMAGE,
    ) -> PlainTextResponse:
        """AcceleratorPool, ModelDeployment and PlacementPlan resources (YAML) that reproduce the plan."""
        text = planner.export_resources(plan_id, namespace=namespace, engine_image=engine_image)
        return _attachment(text, f"plan-{plan_id}-resources.yaml")

    @app.get("/api/plans/{plan_id}/mig-parted.yaml", response_class=PlainTextResponse, responses=_ERRORS,
             tags=["export"])
    def export_mig_config(plan_id: PlanId) -> PlainTextResponse:
        """The NVIDIA MIG manager's config for the plan's layouts, and the node labels that select them."""
        return _attachment(planner.export_mig_config(plan_id), f"plan-{plan_id}-mig-parted.yaml")

    @app.get("/api/plans/{plan_id}/dcm-config.json", response_class=PlainTextResponse, responses=_ERRORS,
             tags=["export"])
    def export_dcm_config(plan_id: PlanId) -> PlainTextResponse:
        """The AMD Device Config Manager's profiles for the plan's partitioned nodes (``config.json``)."""
        return _attachment(planner.export_dcm_config(plan_id), f"plan-{plan_id}-dcm-config.json",
                           media_type="application/json")

    return app


def _in_spec(compute: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a solve; an input error from the optimizer names its field inside the request's ``spec``."""
    try:
        return compute(*args, **kwargs)
    except InputError as exc:
        if exc.field is None or exc.field.startswith("spec."):
            raise
        raise field_under("spec", exc) from exc


def _attachment(text: str, filename: str, *, media_type: str = YAML_MEDIA_TYPE) -> PlainTextResponse:
    return PlainTextResponse(text, media_type=media_type,
                             headers={"Content-Disposition": f'attachment; filename="{filename}"'})


class _SolveTimeout(Exception):
    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    """``("body", "spec", "models", 0, "slo")`` → ``spec.models[0].slo``."""
    parts = list(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header") else list(loc)
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")


def _json_error(error: Mapping[str, Any]) -> dict[str, Any]:
    """A body that is not JSON: the body is at fault, at the character the parser stopped (FastAPI puts that
    offset where a field's path goes)."""
    at = error.get("loc", ("body", None))[-1]
    reason = error.get("ctx", {}).get("error", "not valid JSON")
    return {"field": "body", "message": f"the request body is not valid JSON: {reason} at character {at}"}


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HetschedError)
    async def hetsched_error(_request: Request, exc: HetschedError) -> JSONResponse:
        return _error(exc.http_status, str(exc), getattr(exc, "field", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [_json_error(e) if e.get("type") == "json_invalid" else
                  {"field": _field_path(e.get("loc", ())), "message": e.get("msg", "")} for e in exc.errors()]
        first = errors[0] if errors else {"field": None, "message": "invalid request"}
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        detail = f"{first['field']}: {first['message']}{more}" if first["field"] else f"{first['message']}{more}"
        return _error(422, detail, first["field"] or None, errors=errors)

    @app.exception_handler(Exception)
    async def unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
        """A fault in hetsched, not in the request: the error shape every answer has; the server logs the trace."""
        return _error(500, f"internal error ({type(exc).__name__}); the server's log has the details")

    @app.exception_handler(_SolveTimeout)
    async def solve_timeout(_request: Request, exc: _SolveTimeout) -> JSONResponse:
        return _error(504, f"the solve did not finish within {exc.seconds:g} s; lower solver.time_limit_s, plan "
                           "fewer models or pools, or raise HETSCHED_WEB_SOLVE_TIMEOUT_S; no plan was stored")


def _error(status: int, detail: str, field: str | None = None, *,
           errors: list[dict[str, Any]] | None = None) -> JSONResponse:
    body = ErrorBody(detail=detail, field=field, errors=errors)
    return JSONResponse(body.model_dump(mode="json", exclude_none=True), status_code=status)


def _public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith("/static/")


def _refusal_body(refusal: Refusal) -> bytes:
    return ErrorBody(detail=refusal.message, field=refusal.header).model_dump_json(exclude_none=True).encode()
