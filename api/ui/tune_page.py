"""The Tune page: a form that starts a tune (POST /tune) and leads to its job page, where it runs live."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from api.tune_submission import BUDGET_SHARE
from api.ui.pages import live_engines, source_formats
from api.ui.session import error_page, render, viewer
from services.descriptors import registry
from services.errors import NotFound
from services.tune.plan import TUNE_ENGINE
from services.tune.space import TUNABLE_TARGETS

__all__ = ["router"]

router = APIRouter(prefix="/ui", include_in_schema=False)

#: CPU targets a tune can time: those with a settings grid, then the others at their runner's defaults.
_CPU_TARGETS = (*TUNABLE_TARGETS, "tvm", "mnn", "ncnn")


def _targets(live: set[str]) -> list[dict[str, object]]:
    """Return the targets the form offers: tunable ones a live tune worker runs are checked."""
    known = registry().targets
    runs = {e.split("-")[0] for e in live} if TUNE_ENGINE in live else set()
    out = []
    for name in _CPU_TARGETS:
        if name not in known:
            continue
        is_live = known[name].engine in runs
        out.append(
            {
                "name": name,
                "tunable": name in TUNABLE_TARGETS,
                "live": is_live,
                "checked": is_live and name in TUNABLE_TARGETS,
            }
        )
    return out


@router.get("/tune")
async def tune_page(request: Request) -> Response:
    who = await viewer(request, "write")
    if isinstance(who, Response):
        return who
    if not who.allows("write"):
        return error_page(request, who, NotFound("tuning needs a token with the write scope"))
    live = await run_in_threadpool(live_engines, request)
    settings = request.app.state.settings
    return render(
        request,
        "tune.html",
        who,
        nav="tune",
        targets=_targets(live),
        budget_cap=settings.step_soft_time_limit * BUDGET_SHARE,
        **source_formats(),
    )
