"""kiln_client: the Python client of the Kiln compile service (depends on httpx only).

    from kiln_client import Client

    with Client("http://127.0.0.1:8000", token=None) as kiln:
        job = kiln.compile("model.onnx", {"targets": ["onnxruntime", "openvino"]})
        job.raise_for_failure()
        job.download("openvino", "artifacts/")

Every error is a :class:`KilnError` carrying the API's ``code``, ``message`` and ``hint``.
The reference is docs/client.md in the Kiln repository.
"""

from __future__ import annotations

__all__ = [
    "FINAL_STATES",
    "Client",
    "ErrorInfo",
    "Event",
    "Job",
    "JobInfo",
    "JobsPage",
    "KilnError",
    "Plan",
    "PlanStep",
    "Source",
    "Step",
    "Target",
    "__version__",
    "verify_webhook",
]

__version__ = "0.1.0"

from kiln_client._client import FINAL_STATES, Client, Job, JobsPage
from kiln_client._errors import KilnError
from kiln_client._models import ErrorInfo, Event, JobInfo, Plan, PlanStep, Source, Step, Target
from kiln_client._webhooks import verify_webhook
