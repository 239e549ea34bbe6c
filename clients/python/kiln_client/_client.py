"""The client: submit a model, follow and wait for its job, download artifacts, cancel, resubmit."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

from kiln_client._errors import KilnError
from kiln_client._http import Http, RetryPolicy
from kiln_client._models import Event, JobInfo, Plan
from kiln_client._sse import parse_events

__all__ = ["FINAL_STATES", "Client", "Job", "JobsPage"]

log = logging.getLogger("kiln_client")

#: A job in one of these states has ended; nothing moves it out again.
FINAL_STATES = ("succeeded", "failed", "cancelled")
_CHUNK = 1 << 20


@dataclass
class Job(JobInfo):
    """A job of the service: the fields of the API's ``JobPublic``, and the calls that act on it.

    Fields are as of the last read (:meth:`refresh`, :meth:`wait`); ``targets`` maps each
    target to its :class:`~kiln_client.Target` (route, status, error, parity, benchmark,
    published version).
    """

    _client: Client | None = field(default=None, repr=False, compare=False)
    _etag: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_dict(cls, body: dict[str, Any], client: Client | None = None, etag: str | None = None) -> Job:
        """Return the job a ``JobPublic`` JSON body describes, bound to ``client``."""
        return cls(**JobInfo.fields_from(body), _client=client, _etag=etag)

    @property
    def client(self) -> Client:
        if self._client is None:
            raise KilnError("INTERNAL", "this Job is not bound to a Client", "Get jobs from Client.job(id).")
        return self._client

    @property
    def done(self) -> bool:
        """True once the job has ended (succeeded, failed or cancelled)."""
        return self.status in FINAL_STATES

    @property
    def ok(self) -> bool:
        """True when the job succeeded: every target passed parity and was published."""
        return self.status == "succeeded"

    def refresh(self) -> Job:
        """Read the job again (a cheap 304 while nothing changed) and return it, updated in place."""
        fresh = self.client._read_job(self.id, self._etag)
        if fresh is not None:
            self.__dict__.update({k: v for k, v in fresh.__dict__.items() if k != "_client"})
        return self

    def wait(self, timeout: float | None = None, poll: float = 0.5) -> Job:
        """Return the job once it has ended, reading it every ``poll`` seconds (at most every 2 s).

        Raises :class:`KilnError` ``TIMEOUT`` when ``timeout`` seconds pass first (the job
        goes on; wait again or cancel it). A failed job is returned, not raised: see
        :meth:`raise_for_failure`.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = poll
        while not self.refresh().done:
            if deadline is not None and time.monotonic() >= deadline:
                raise KilnError(
                    "TIMEOUT",
                    f"job {self.id} is still {self.status} after {timeout:g} s",
                    "The job keeps running on the server: wait again, or cancel it with Client.cancel(id).",
                    {"job_id": self.id, "status": self.status},
                )
            pause = interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic()))
            time.sleep(pause)
            interval = min(interval * 1.5, 2.0)
        return self

    def follow(self, timeout: float | None = None) -> Iterator[Event]:
        """Yield the job's events (planned, step_started, progress, step_finished, ...) up to ``finished``.

        A dropped stream is resumed where it stopped (``Last-Event-ID``), so no event is
        missed or repeated. Following a job that already ended yields its whole history.
        """
        return self.client.follow(self.id, timeout=timeout)

    def download(self, target: str, dest: str | os.PathLike[str], *, extract: bool = True) -> Path:
        """Download ``target``'s artifact; return the folder it was extracted to under ``dest`` (or the tar).

        With ``extract`` (the default) ``dest`` is a directory and the artifact lands in
        ``dest/<name>-<target>/``; otherwise ``dest`` is the path of the tar to write.
        """
        return self.client.download(self.id, target, dest, extract=extract)

    def cancel(self) -> Job:
        """Cancel the job (queued steps never run, a running one is stopped); return it updated."""
        fresh = self.client.cancel(self.id)
        self.__dict__.update({k: v for k, v in fresh.__dict__.items() if k != "_client"})
        return self

    def logs(self, tail: int | None = None) -> str:
        """Return the job's log: its events, then each step's tool output (``tail``: the last N lines)."""
        return self.client.logs(self.id, tail=tail)

    def raise_for_failure(self) -> Job:
        """Return the job when it succeeded; else raise :class:`KilnError` with the first failed target's error.

        ``details`` carries ``job_id`` and each failed target's code, so a pipeline fails with
        ``PARITY_FAILED`` (say) rather than a generic message.
        """
        if self.ok:
            return self
        failed = {name: t.error.code for name, t in self.targets.items() if t.error is not None}
        first = next((t.error for t in self.targets.values() if t.error is not None), None) or self.error
        details = {"job_id": self.id, "status": self.status, "targets": failed}
        if first is None:
            raise KilnError("INTERNAL", f"job {self.id} is {self.status}", "See the job's log.", details)
        raise KilnError(first.code, f"job {self.id}: {first.message}", first.hint, details)


@dataclass
class JobsPage:
    """One page of jobs, newest first, and how many match (the API's ``JobsPublic``)."""

    data: list[Job]
    count: int


def _spec_text(spec: Any) -> str:
    """Return the spec as JSON: a dict, a JSON string, or an object with ``model_dump`` (Kiln's CompileSpec)."""
    if isinstance(spec, str):
        return spec
    if hasattr(spec, "model_dump"):
        spec = spec.model_dump(mode="json", exclude_none=True)
    if not isinstance(spec, Mapping):
        raise KilnError(
            "INVALID_SPEC",
            f"a spec must be a dict or JSON text, not {type(spec).__name__}",
            'e.g. {"targets": ["onnxruntime"]}',
        )
    return json.dumps(dict(spec))


@contextmanager
def _upload_path(model: Path) -> Iterator[Path]:
    """Yield a file to upload for ``model``: the file itself, or a directory packed into a tar on disk."""
    if not model.exists():
        raise KilnError("SOURCE_UNREADABLE", f"{model} does not exist", "Give the path of the model file or folder.")
    if not model.is_dir():
        yield model
        return
    tmp = Path(tempfile.mkdtemp(prefix="kiln-upload-"))
    try:
        archive = tmp / f"{model.name}.tar"
        with tarfile.open(archive, "w") as tf:  # streamed file by file: never the whole model in memory
            tf.add(model, arcname=model.name)
        yield archive
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _safe_members(tf: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """Return the archive's members, refusing links, devices and paths that leave the folder."""
    members = []
    for m in tf.getmembers():
        parts = PurePosixPath(m.name).parts
        if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
            raise KilnError("UNSAFE_INPUT", f"the artifact archive holds an unsafe member {m.name!r}", "Report this.")
        members.append(m)
    return members


class Client:
    """A connection to one Kiln service.

    ``url`` is the service's base URL (``http://127.0.0.1:8000``); ``token`` an API token
    from ``kiln token create`` (needed when the service has auth on). Requests that are
    safe to repeat are retried on connection errors and on 502/503/504 (``retries`` times,
    backoff doubling from ``backoff`` seconds); submits carry an ``Idempotency-Key`` so they
    are safe to repeat too. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        backoff: float = 0.5,
        max_backoff: float = 10.0,
        transport: httpx.BaseTransport | None = None,
        verify: Any = True,
    ) -> None:
        from kiln_client import __version__

        self.url = url.rstrip("/")
        self.timeout = timeout
        self.http = Http(
            self.url,
            token,
            timeout=timeout,
            policy=RetryPolicy(retries, backoff, max_backoff),
            transport=transport,
            verify=verify,
            user_agent=f"kiln-client/{__version__}",
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self.http.close()

    # --- submitting ----------------------------------------------------------------------

    def compile(
        self,
        model_path: str | os.PathLike[str],
        spec: Any,
        calibration: str | os.PathLike[str] | None = None,
        *,
        evaluation: str | os.PathLike[str] | None = None,
        wait: bool = True,
        timeout: float | None = None,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> Job:
        """Upload a model with its CompileSpec and return the job (ended, with ``wait``).

        ``model_path``: a model file, an archive, or a folder (SavedModel, Hugging Face
        checkpoint, Paddle model), which is packed into a tar first; the upload streams from
        disk. ``spec``: a dict, JSON text, or a CompileSpec. ``calibration``: an ``.npz``
        keyed by input name (samples on axis 0) or whole feeds keyed ``<sample>/<input>``.
        ``evaluation``: the labelled ``.npz`` the spec's ``evaluation`` scores (the inputs as in
        ``calibration``, plus ``labels``); the spec needs ``evaluation`` (metric, ``max_drop``),
        and each target's ``evaluation`` then holds the source's and the artifact's scores.
        ``timeout``: seconds to wait for the job (``TIMEOUT`` after).
        ``idempotency_key``: one is made when not given, so a submit retried after a dropped
        connection returns the first job instead of making a second. Refusals (bad spec,
        unsafe model, no route) raise :class:`KilnError`; a job that fails does not — check
        ``job.ok`` or call ``job.raise_for_failure()``.
        """
        parts = {"spec": _spec_text(spec)}
        uploads = {"calibration": calibration, "evaluation": evaluation}
        return self._submit("/compile", model_path, parts, uploads, wait, timeout, cache, idempotency_key)

    def tune(
        self,
        model_path: str | os.PathLike[str],
        tune: Mapping[str, Any] | None = None,
        spec: Any = None,
        calibration: str | os.PathLike[str] | None = None,
        *,
        evaluation: str | os.PathLike[str] | None = None,
        wait: bool = True,
        timeout: float | None = None,
        cache: bool = True,
        idempotency_key: str | None = None,
    ) -> Job:
        """Upload a model for a tune (POST /tune) and return its job (ended, with ``wait``).

        ``tune``: the search's goals, as ``kiln tune``'s flags (``objective``, ``batch``,
        ``max_p99_ms``, ``targets``, ``precisions``, ``budget_s``, ``rounds``...; none: the
        defaults). ``spec``: the compile settings every candidate shares (inputs,
        tolerances, ``name`` to publish under). The ended job's ``tune`` is the report
        (candidates, ``recommendation`` with runner-up and margin, profiles); its ``tune``
        target is the recommended artifact (``job.download("tune", ...)``). With ``evaluation``
        (and the spec's ``evaluation``) a candidate that loses more than ``max_drop`` is out of
        the running: the recommendation meets the accuracy floor. The rest as :meth:`compile`; ``cache=False`` measures again where an identical tune ran before.
        """
        parts = {"tune": json.dumps(dict(tune or {}))}
        if spec is not None:
            parts["spec"] = _spec_text(spec)
        uploads = {"calibration": calibration, "evaluation": evaluation}
        return self._submit("/tune", model_path, parts, uploads, wait, timeout, cache, idempotency_key)

    def _submit(
        self,
        route: str,
        model_path: str | os.PathLike[str],
        fields: dict[str, str],
        uploads: Mapping[str, str | os.PathLike[str] | None],
        wait: bool,
        timeout: float | None,
        cache: bool,
        idempotency_key: str | None,
    ) -> Job:
        """POST the model, the JSON ``fields`` and the data files (calibration, evaluation) to ``route``; return the job."""
        key = idempotency_key or uuid.uuid4().hex
        data = {part: Path(path) for part, path in uploads.items() if path is not None}
        for part, path in data.items():
            if not path.is_file():
                raise KilnError("SOURCE_UNREADABLE", f"{path} is not a file", f"Give the path of the {part} .npz.")
        with _upload_path(Path(model_path)) as upload:

            def parts() -> dict[str, Any]:
                files: dict[str, Any] = {"model": (upload.name, open(upload, "rb"), "application/octet-stream")}
                for name, text in fields.items():
                    files[name] = (None, text, "application/json")
                for part, path in data.items():
                    files[part] = (path.name, open(path, "rb"), "application/octet-stream")
                return {"files": files}

            response = self.http.request(
                "POST",
                route,
                idempotent=True,  # the key makes a repeat return the first job
                build=parts,
                params=None if cache else {"cache": "false"},
                headers={"Idempotency-Key": key},
                # Detecting and storing a large upload takes a while after its last byte.
                timeout=httpx.Timeout(self.timeout, read=max(self.timeout, 600.0)),
            )
        job = self.job(response.json()["id"])
        return job.wait(timeout) if wait else job

    def resubmit(
        self,
        job_id: str,
        spec: Any = None,
        *,
        wait: bool = False,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> Job:
        """Queue a new job on ``job_id``'s stored source with its spec, or ``spec``; return the new job.

        Nothing is uploaded again, and unchanged steps come from the cache.
        """
        body = {"spec": json.loads(_spec_text(spec))} if spec is not None else {}
        response = self.http.request(
            "POST",
            f"/jobs/{job_id}/resubmit",
            idempotent=True,
            json=body,
            headers={"Idempotency-Key": idempotency_key or uuid.uuid4().hex},
        )
        job = self.job(response.json()["id"])
        return job.wait(timeout) if wait else job

    def plan(self, spec: Any, source_format: str = "onnx") -> Plan:
        """Return what a job with ``spec`` would run on a model of ``source_format`` (POST /plan); runs nothing."""
        body = {"source_format": source_format, "spec": json.loads(_spec_text(spec))}
        return Plan.from_dict(self.http.request("POST", "/plan", idempotent=True, json=body).json())

    # --- reading -------------------------------------------------------------------------

    def job(self, job_id: str) -> Job:
        """Return the job ``job_id`` (NOT_FOUND for an unknown one, or another tenant's)."""
        job = self._read_job(job_id, None)
        assert job is not None  # no ETag sent: never 304
        return job

    def _read_job(self, job_id: str, etag: str | None) -> Job | None:
        headers = {"If-None-Match": etag} if etag else None
        response = self.http.request("GET", f"/jobs/{job_id}", idempotent=True, headers=headers)
        if response.status_code == 304:
            return None
        return Job.from_dict(response.json(), self, response.headers.get("etag"))

    def jobs(self, *, limit: int = 50, offset: int = 0, **filters: Any) -> JobsPage:
        """Return one page of jobs, newest first.

        ``filters`` are GET /jobs's: ``status``, ``name``, ``target``, ``engine``,
        ``precision``, ``source_sha256``, ``created_after``, ``created_before``, ``sort``.
        """
        params = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in filters.items() if v is not None}
        body = self.http.request(
            "GET", "/jobs", idempotent=True, params={**params, "limit": limit, "offset": offset}
        ).json()
        return JobsPage(data=[Job.from_dict(j, self) for j in body["data"]], count=int(body["count"]))

    def logs(self, job_id: str, *, tail: int | None = None, offset: int = 0, limit: int | None = None) -> str:
        """Return the job's log (events, then each step's tool output); ``tail``: only the last N lines."""
        params: dict[str, Any] = {"offset": offset}
        if tail is not None:
            params["tail"] = tail
        if limit is not None:
            params["limit"] = limit
        return self.http.request("GET", f"/jobs/{job_id}/logs", idempotent=True, params=params).text

    def engines(self) -> dict[str, Any]:
        """Return GET /engines: each engine's queue, live workers and tool versions."""
        body: dict[str, Any] = self.http.request("GET", "/engines", idempotent=True).json()
        return body

    def ready(self) -> dict[str, Any]:
        """Return GET /readyz's body (``status`` is ``ready`` when the service can take jobs); never raises for 503."""
        try:
            response = self.http.client.get("/readyz")
        except httpx.TransportError as exc:
            return {"status": "unreachable", "checks": {"api": f"{type(exc).__name__}: {exc}"}}
        body: dict[str, Any] = response.json()
        return body

    # --- acting ----------------------------------------------------------------------------

    def cancel(self, job_id: str) -> Job:
        """Cancel ``job_id`` and return it; a job that already ended is returned as it is."""
        return Job.from_dict(self.http.request("DELETE", f"/jobs/{job_id}", idempotent=True).json(), self)

    def follow(self, job_id: str, *, after: int = 0, timeout: float | None = None) -> Iterator[Event]:
        """Yield ``job_id``'s events after event id ``after``, up to its ``finished`` event.

        A stream that breaks off is opened again with ``Last-Event-ID`` (after the retry
        backoff), so every event comes exactly once. ``timeout``: TIMEOUT after that long.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last = after
        failures = 0
        policy = self.http.policy
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                raise KilnError("TIMEOUT", f"job {job_id} did not finish in {timeout:g} s", "Follow it again later.")
            headers = {"Accept": "text/event-stream"}
            if last:
                headers["Last-Event-ID"] = str(last)
            read = 60.0 if deadline is None else max(1.0, min(60.0, deadline - time.monotonic()))
            try:
                with self.http.stream(
                    "GET", f"/jobs/{job_id}/events", headers=headers, timeout=httpx.Timeout(read, connect=10.0)
                ) as response:
                    for event in parse_events(response.iter_lines()):
                        failures = 0
                        last = max(last, event.id)
                        yield event
                        if event.type == "finished":
                            return
            except httpx.TransportError as exc:
                failures += 1
                if failures > policy.retries:
                    raise self.http._unreachable(exc, "GET", f"/jobs/{job_id}/events") from None
                log.info("event stream of job %s broke off (%s); resuming after event %s", job_id, exc, last)
                time.sleep(policy.delay(failures - 1))
                continue
            except KilnError as err:
                failures += 1
                if err.status not in (502, 503, 504) or failures > policy.retries:
                    raise
                time.sleep(policy.delay(failures - 1))
                continue
            # The server ended the stream without `finished`: the job ended before `after`, or a
            # proxy cut an idle stream. Only the job's state tells which.
            if self.job(job_id).done:
                return

    def download(self, job_id: str, target: str, dest: str | os.PathLike[str], *, extract: bool = True) -> Path:
        """Download ``target``'s artifact of ``job_id``; see :meth:`Job.download`."""
        dest = Path(dest)
        attempt = 0
        while True:
            try:
                return self._download_once(job_id, target, dest, extract)
            except httpx.TransportError as exc:
                if attempt >= self.http.policy.retries:
                    raise self.http._unreachable(exc, "GET", f"/jobs/{job_id}/artifacts/{target}") from None
                time.sleep(self.http.policy.delay(attempt))
                attempt += 1
            except KilnError as err:
                if err.status not in (502, 503, 504) or attempt >= self.http.policy.retries:
                    raise
                time.sleep(self.http.policy.delay(attempt))
                attempt += 1

    def _download_once(self, job_id: str, target: str, dest: Path, extract: bool) -> Path:
        folder = dest if extract else dest.parent
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".kiln-download-", suffix=".tar", dir=folder)
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as fh, self.http.stream("GET", f"/jobs/{job_id}/artifacts/{target}") as r:
                for chunk in r.iter_bytes(_CHUNK):
                    fh.write(chunk)
            if not extract:
                tmp.replace(dest)
                return dest
            with tarfile.open(tmp) as tf:
                members = _safe_members(tf)
                for m in members:
                    out = dest / m.name
                    if m.isdir():
                        out.mkdir(parents=True, exist_ok=True)
                        continue
                    out.parent.mkdir(parents=True, exist_ok=True)
                    src = tf.extractfile(m)
                    assert src is not None
                    with src, open(out, "wb") as fh:
                        shutil.copyfileobj(src, fh, _CHUNK)
            tops = sorted({PurePosixPath(m.name).parts[0] for m in members})
            return dest / tops[0] if len(tops) == 1 else dest
        finally:
            tmp.unlink(missing_ok=True)
