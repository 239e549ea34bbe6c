"""POST /plan: the dry run — the route per target and the queues a spec would take."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.deps import ReadAuth, RegistryDep, WorkersDep
from api.schemas import ErrorPublic, PlanPublic, PlanRequest, PlanStepPublic
from services.graph.planner import plan_routes

router = APIRouter(tags=["planning"])


@router.post(
    "/plan",
    response_model=PlanPublic,
    responses={422: {"model": ErrorPublic, "description": "INVALID_SPEC or NO_ROUTE (with what is reachable)"}},
    summary="Plan a spec without running it",
)
def plan(body: PlanRequest, request: Request, _: ReadAuth, workers: WorkersDep, registry: RegistryDep) -> PlanPublic:
    """Return the plan a job with this spec and source format would run; NO_ROUTE explains what is reachable."""
    source = body.spec.source_format or body.source_format
    p = plan_routes(source, body.spec, registry, default_name=body.spec.name or "model")
    live = {e for w in workers.live_workers(request.app.state.worker_max_age) for e in w.engines}
    first_choice = [s for s in p.steps if not s.fallback]  # fallback steps run only if a route fails
    engines = sorted({s.engine for s in first_choice})
    return PlanPublic(
        source_format=p.source_format.value,
        routes=p.routes,
        shared_steps=p.shared,
        steps=[
            PlanStepPublic(
                id=s.id,
                kind=s.kind,
                engine=s.engine,
                queue=s.queue,
                inputs=s.inputs,
                after=s.after,
                target=s.target,
                tool=s.tool,
                fallback=s.fallback,
            )
            for s in p.steps
        ],
        fallback_routes={t: [o.route for o in p.route_options(t)[1:]] for t in p.routes},
        queues=sorted({s.queue for s in first_choice}),
        engines_without_workers=[e for e in engines if e not in live],
    )
