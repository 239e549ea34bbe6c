"""The Tune page: a form that starts a tune (POST /tune) and leads to its job page, where it runs live."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from api.tune_submission import BUDGET_SHARE, tune_worker_engines
from api.ui.pages import source_formats
from api.ui.session import render, writer
from services.descriptors import registry
from services.tune.space import THREADED_TARGETS, TUNABLE_TARGETS

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

#: CPU targets a tune can time: the default ones, those it searches threads for when asked, then tvm (its defaults).
_CPU_TARGETS = (*TUNABLE_TARGETS, *THREADED_TARGETS, "tvm")


def _targets(runs: set[str]) -> list[dict[str, object]]:
    """Return the targets the form offers: the default ones a live tune worker runs are checked."""
    known = registry().targets
    out = []
    for name in _CPU_TARGETS:
        if name not in known:
            continue
        grid = "default" if name in TUNABLE_TARGETS else "threads" if name in THREADED_TARGETS else "none"
        is_live = known[name].engine in runs
        out.append({"name": name, "grid": grid, "live": is_live, "checked": is_live and grid == "default"})
    return out


@router.get("/tune")
async def tune_page(request: Request) -> Response:
    who = await writer(request, "tuning")
    if isinstance(who, Response):
        return who
    state = request.app.state
    runs = await run_in_threadpool(tune_worker_engines, state.workers, state.worker_max_age)
    settings = request.app.state.settings
    return render(
        request,
        "tune.html",
        who,
        nav="tune",
        targets=_targets(runs),
        budget_cap=settings.step_soft_time_limit * BUDGET_SHARE,
        **source_formats(),
    )
