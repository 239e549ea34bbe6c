"""Which of a target's routes is live: the first one, or the next when every one before it failed.

A plan lists each target's routes in the order to try them (``Plan.route_options``). From
the state of the job's steps this module works out, per target, how each route ended or
whether it is the one in progress, which steps are needed now, and which can never be
needed again. Both orchestrations (the in-process compile and the job store behind the
queues) ask it the same questions, so a fallback behaves alike in both.

A route falls back to the next one only when a conversion, optimisation or export step
failed with CONVERSION_FAILED or PARITY_FAILED: a tool that could not convert the model, or
an artifact that does not compute what the source computes. A source Kiln cannot read,
a cancelled job, a timeout or a repository conflict end the target there: another route
would meet the same fate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.graph.planner import Plan, RouteOption

__all__ = [
    "FALLBACK_CODES",
    "RouteAttempt",
    "TargetRouting",
    "all_routes_failed",
    "needed_steps",
    "route_failed_event",
    "route_failures",
    "route_step_ids",
    "routing",
]

#: Error codes that make a target try its next route.
FALLBACK_CODES = frozenset({"CONVERSION_FAILED", "PARITY_FAILED"})
#: Kinds of step whose failure is the route's own (not the source's, nor the repository's).
#: A GPU check's PARITY_FAILED is the route's too: the artifact does not compute the source's outputs on its GPU.
_ROUTE_KINDS = frozenset({"convert", "optimize", "export", "check"})
_DONE_BAD = ("failed", "skipped", "cancelled")


@dataclass
class RouteAttempt:
    """How one route of a target went."""

    rank: int  # 1 = the first choice
    route: str
    status: str  # succeeded | failed | running | not tried
    step: str | None = None  # the step that failed
    tool: str | None = None
    code: str | None = None
    message: str | None = None
    error: dict[str, Any] | None = field(default=None, repr=False)  # the failing step's whole error

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "error"}


@dataclass
class TargetRouting:
    """A target's routes as the job stands: each attempt, and the one in progress (if any)."""

    target: str
    options: list[RouteOption]
    attempts: list[RouteAttempt] = field(default_factory=list)
    active: int | None = None  # index into options of the route in progress
    winner: int | None = None  # index of the route that succeeded

    @property
    def decided(self) -> bool:
        return self.active is None

    @property
    def tried(self) -> list[RouteAttempt]:
        """Return the attempts that ran (or are running), leaving out routes never started."""
        return [a for a in self.attempts if a.status != "not tried"]


def route_step_ids(plan: Plan, option: RouteOption) -> list[str]:
    """Return the ids of every step a route needs, reference and shared steps included, in plan order."""
    by_id = {s.id: s for s in plan.steps}
    needed: set[str] = set()
    frontier = [option.publish]
    while frontier:
        sid = frontier.pop()
        if sid in needed or sid not in by_id:
            continue
        needed.add(sid)
        frontier.extend(by_id[sid].depends_on)
    return [s.id for s in plan.steps if s.id in needed]


def _failure(ids: list[str], status: Mapping[str, str]) -> str | None:
    """Return the id of the step that broke a route: the first that failed, else the first skipped or cancelled."""
    bad = [sid for sid in ids if status.get(sid) in _DONE_BAD]
    if not bad:
        return None
    return next((sid for sid in bad if status.get(sid) == "failed"), bad[0])


def _target_routing(
    plan: Plan, target: str, status: Mapping[str, str], errors: Mapping[str, dict[str, Any]]
) -> TargetRouting:
    options = plan.route_options(target)
    result = TargetRouting(target, options)
    by_id = {s.id: s for s in plan.steps}
    for i, option in enumerate(options):
        rank = i + 1
        if result.winner is not None or (result.attempts and result.attempts[-1].status != "failed"):
            result.attempts.append(RouteAttempt(rank, option.route, "not tried"))
            continue
        if status.get(option.publish) == "succeeded":
            result.winner = i
            result.attempts.append(RouteAttempt(rank, option.route, "succeeded"))
            continue
        ids = route_step_ids(plan, option)
        broken = _failure(ids, status)
        if broken is None:
            result.active = i
            result.attempts.append(RouteAttempt(rank, option.route, "running"))
            continue
        err = errors.get(broken) or {}
        step = by_id[broken]
        failed_at = (err.get("details") or {}).get("step") or broken
        culprit = by_id.get(failed_at, step)
        attempt = RouteAttempt(
            rank,
            option.route,
            "failed",
            step=culprit.id,
            tool=(err.get("details") or {}).get("tool") or culprit.tool,
            code=err.get("code", "INTERNAL"),
            message=err.get("message", f"step {broken} {status.get(broken)}"),
            error=err or None,
        )
        result.attempts.append(attempt)
        can_fall_back = attempt.code in FALLBACK_CODES and culprit.kind in _ROUTE_KINDS
        if not can_fall_back:
            # Later routes are not tried: mark the rest and stop.
            for j in range(i + 1, len(options)):
                result.attempts.append(RouteAttempt(j + 1, options[j].route, "not tried"))
            break
    return result


def routing(plan: Plan, status: Mapping[str, str], errors: Mapping[str, dict[str, Any]]) -> dict[str, TargetRouting]:
    """Return every target's routing from each step's ``status`` and the ``errors`` of failed or skipped ones."""
    return {t: _target_routing(plan, t, status, errors) for t in plan.routes}


def needed_steps(plan: Plan, routes: Mapping[str, TargetRouting]) -> tuple[set[str], set[str]]:
    """Return (steps needed now, steps that may still be needed).

    Needed now: the steps of each undecided target's route in progress. May still be
    needed: those and the steps of the routes after it. A pending step in neither set is
    never going to run.
    """
    now: set[str] = set()
    later: set[str] = set()
    for r in routes.values():
        if r.active is None:
            continue
        now.update(route_step_ids(plan, r.options[r.active]))
        for option in r.options[r.active :]:
            later.update(route_step_ids(plan, option))
    return now, later


def route_failures(
    before: Mapping[str, TargetRouting], after: Mapping[str, TargetRouting]
) -> list[tuple[str, RouteAttempt, str | None]]:
    """Return (target, attempt, next route or None) for each route that failed between two routings."""
    out = []
    for target, now in after.items():
        was = before.get(target)
        seen = {a.rank for a in (was.attempts if was else []) if a.status == "failed"}
        for a in now.attempts:
            if a.status == "failed" and a.rank not in seen:
                nxt = next((b.route for b in now.attempts if b.rank == a.rank + 1 and b.status != "not tried"), None)
                out.append((target, a, nxt))
    return out


def all_routes_failed(r: TargetRouting) -> dict[str, Any] | None:
    """Return the error of a target whose routes all failed, naming each attempt.

    None when they all failed at one step (a conversion every route shares, such as the
    source's own importer): that step's error says it all. The code is that of the failure
    that decided the target: an artifact that was built and computed the wrong numbers
    (PARITY_FAILED) says more than a later route's tool that could not build one, so a
    parity failure is never hidden behind it; otherwise the last attempt's.
    """
    tried = [a for a in r.tried if a.status == "failed"]
    if len({a.step for a in tried}) < 2:
        return None
    said = "; ".join(_said(a, tried[:i]) for i, a in enumerate(tried))
    decided = next((a for a in tried if a.code == "PARITY_FAILED"), tried[-1])
    # The first route's own hint (e.g. "use fp32, fp16 or int8") is what the user acts on.
    first_hint = ((tried[0].error or {}).get("hint") or "").strip()
    where = "Each route's error is in details.attempts; the first route's tool output is in the job log."
    details: dict[str, Any] = {"attempts": [a.to_dict() for a in tried]}
    # The first route's parity numbers, when parity ended it: what the job's parity table shows.
    parity = next(
        (((a.error or {}).get("details") or {}).get("parity") for a in tried if a.code == "PARITY_FAILED"), None
    )
    if parity:
        details["parity"] = parity
    return {
        "code": decided.code,
        "message": f"every route to {r.target} failed: {said}",
        "hint": f"Route 1: {first_hint} {where}" if first_hint else where,
        "details": details,
    }


def route_failed_event(target: str, attempt: RouteAttempt, next_route: str | None) -> dict[str, Any]:
    """Return the job-log event recording a failed route and the route tried next (None: the target failed).

    ``message`` is the line the job log shows; ``error`` is the failed step's own message.
    """
    then = f"trying route {attempt.rank + 1}: {next_route}" if next_route else "no route left"
    said = f"{target}: route {attempt.rank} ({attempt.route}) failed in {attempt.tool} with {attempt.code}; {then}"
    body = {k: v for k, v in attempt.to_dict().items() if k != "message"}
    return {
        "type": "route_failed",
        "target": target,
        **body,
        "error": attempt.message,
        "next_route": next_route,
        "message": said,
    }


def _said(a: RouteAttempt, earlier: list[RouteAttempt]) -> str:
    if any(e.step == a.step for e in earlier):
        return f"({a.rank}) {a.route}: {a.step} again"
    return f"({a.rank}) {a.route}: {a.code} in {a.step} ({a.tool}): {a.message}"
