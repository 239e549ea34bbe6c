"""`kiln tune`: search engines × precisions × engine settings for the fastest artifact meeting an SLO.

One concern per module: the search space (:mod:`.space`), building and pruning the artifacts
(:mod:`.build`), timing them side by side (:mod:`.measure`), choosing (:mod:`.recommend`),
the throughput-vs-concurrency curve that picks batch × instances (:mod:`.concurrency`),
per-layer profiles (:mod:`.profile`), the budget (:mod:`.budget`), and the search that runs
them in order (:mod:`.search`).
"""

from services.tune.budget import Deadline, parse_budget
from services.tune.report import Candidate, TuneReport
from services.tune.search import TuneRequest, tune_model
from services.tune.space import default_targets

__all__ = ["Candidate", "Deadline", "TuneReport", "TuneRequest", "default_targets", "parse_budget", "tune_model"]
