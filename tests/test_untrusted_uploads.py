"""Issue 31's attacks, built as they were reported, against a real `kiln serve` with auth on and two tenants.

Vetting on (the deployment as shipped):

1. the TorchScript vetting bypass (no debug_pkl, ``0xFF`` in a comment, ``models/x.json``,
   ``"source_format": "torchscript"``) is refused at submission, and nothing is recorded;
3. SavedModels that read a file through an op attribute (``FixedUnigramCandidateSampler``'s
   ``vocab_file``, ``ImmutableConst``'s ``memory_region_name``) are refused, naming the op;
4. a tenant's job cannot re-point the serving root: ``serving.root: "s3://attacker-bucket/kiln"``
   is FORBIDDEN, and another tenant's ovms/config.json and tfserving/models.config entries keep
   their base path through the attacker's publishes.

And the quotas: a token's queued-job quota answers 429 QUOTA_EXCEEDED past it, and GET /quota
and the dashboard's job list show the tenant's jobs against it; GET /repository shows a tenant
no host path.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_models import (
    file_reading_savedmodels,
    snooping_savedmodels,
    torchscript_file_reader,
    torchscript_vetting_bypass,
)
from jobs_support import KILN_CMD, kiln_serve, service_env, submit

SPEC: dict[str, Any] = {"targets": ["onnxruntime"], "benchmark": False, "validation": {"samples": 2}}


@dataclass
class Service:
    """A `kiln serve` with auth on: each tenant's write token, and the deployment's admin token."""

    base: str
    root: Path
    heads: dict[str, dict[str, str]]

    def get(self, path: str, who: str, **kw: Any) -> httpx.Response:
        return httpx.get(f"{self.base}{path}", headers=self.heads[who], timeout=30, **kw)

    def submit(self, model: Path, spec: dict[str, Any], who: str) -> httpx.Response:
        return submit(self.base, model, spec, headers=self.heads[who])  # type: ignore[no-any-return]

    def wait(self, job_id: str, who: str, timeout: float = 300) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        job: dict[str, Any] = {}
        while time.monotonic() < deadline:
            job = self.get(f"/jobs/{job_id}", who).json()
            if job.get("status") in ("succeeded", "failed", "cancelled"):
                return job
            time.sleep(0.3)
        raise AssertionError(f"job {job_id} did not finish: {json.dumps(job)[:2000]}")


def _token(root: Path, kiln: dict[str, Any], name: str, tenant: str, *quota: str) -> str:
    done = subprocess.run(
        [*KILN_CMD, "token", "create", name, "--scope", "write", "--tenant", tenant, *quota],
        env=service_env(cache_dir=root / "cache", **kiln),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def serve_two_tenants(root: Path, engines: set[str], **settings: Any) -> Iterator[Service]:
    """Run `kiln serve` with auth on; yield it with write tokens of team-a and team-b and the admin token."""
    admin = f"kiln_{secrets.token_hex(4)}_{secrets.token_urlsafe(32)}"
    kiln = {"auth_enabled": "true", "admin_token": admin, **settings}
    heads = {"admin": {"Authorization": f"Bearer {admin}"}}
    with kiln_serve(root, **kiln) as (base, proc):  # it migrates the job database the tokens go in
        for who, tenant, *quota in (
            ("a", "team-a"),
            ("b", "team-b"),
            ("c", "team-c", "--max-queued", "1", "--max-running", "1"),  # a token with quotas of its own
        ):
            heads[who] = {"Authorization": f"Bearer {_token(root, kiln, who, tenant, *quota)}"}
        service = Service(base, root, heads)
        deadline = time.monotonic() + 240
        while True:  # the embedded worker's engines (an anonymous GET /engines is refused with auth on)
            live = {e["name"] for e in service.get("/engines", "admin").json()["engines"] if e["workers"]}
            if engines <= live:
                break
            assert time.monotonic() < deadline and proc.alive(), proc.tail()
            time.sleep(0.5)
        yield service


@pytest.fixture(scope="module")
def vetted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from serve_two_tenants(tmp_path_factory.mktemp("vetted"), {"onnxruntime"})


def _count(service: Service, who: str) -> int:
    return int(service.get("/jobs", who).json()["count"])


def test_the_torchscript_bypass_is_refused_at_submission(vetted: Service, tmp_path: Path) -> None:
    model = torchscript_vetting_bypass(tmp_path / "bypass.pt", "/etc/passwd")
    before = _count(vetted, "a")
    r = vetted.submit(model, {**SPEC, "source_format": "torchscript"}, "a")
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["code"] == "UNSAFE_INPUT" and "byte 0xff" in body["message"], body
    assert _count(vetted, "a") == before  # nothing was recorded


def test_savedmodel_ops_reading_files_are_refused_at_submission(vetted: Service, tmp_path: Path) -> None:
    built = file_reading_savedmodels(tmp_path, "/etc/passwd")
    before = _count(vetted, "a")
    for name, op in (("sampler", "FixedUnigramCandidateSampler"), ("mapped", "ImmutableConst")):
        r = vetted.submit(built[name], SPEC, "a")
        assert r.status_code == 400, (name, r.text)
        assert r.json()["code"] == "UNSAFE_INPUT" and r.json()["details"]["ops"] == [op], r.json()
    assert _count(vetted, "a") == before


def _base_paths(repo: Path) -> dict[str, dict[str, str]]:
    """Return {server: {model name: base_path}} from ovms/config.json and tfserving/models.config."""
    out: dict[str, dict[str, str]] = {"ovms": {}, "tfserving": {}}
    ovms = repo / "ovms" / "config.json"
    if ovms.exists():
        for entry in json.loads(ovms.read_text())["model_config_list"]:
            out["ovms"][entry["config"]["name"]] = entry["config"]["base_path"]
    tfs = repo / "tfserving" / "models.config"
    if tfs.exists():
        from google.protobuf import text_format
        from tensorflow_serving.config import model_server_config_pb2

        config = text_format.Parse(tfs.read_text(), model_server_config_pb2.ModelServerConfig())
        out["tfserving"] = {m.name: m.base_path for m in config.model_config_list.config}
    return out


def test_a_tenant_cannot_move_where_other_tenants_models_are_served_from(vetted: Service, cnn_onnx: Path) -> None:
    """Issue 31, attack 4: serving.root of another bucket, from a tenant's job, is refused; B's entries stay."""
    repo = vetted.root / "repo"
    b = vetted.submit(cnn_onnx, {**SPEC, "name": "b-served"}, "b")
    assert b.status_code == 202, b.text
    assert vetted.wait(b.json()["id"], "b")["status"] == "succeeded"
    before = _base_paths(repo)
    assert before["ovms"]["b-served"].startswith(str(repo))  # the repository's own location
    # GET /repository: the host path is the operator's to see, not a tenant's.
    listing = vetted.get("/repository", "b")
    assert str(repo) not in listing.text and str(vetted.root) not in listing.text, listing.text
    b_model = next(m for m in listing.json()["models"] if m["name"] == "b-served")
    assert b_model["versions"][0]["uri"] == "triton/b-served/1"
    assert str(repo) in vetted.get("/repository", "admin").json()["uri"]
    attack = {**SPEC, "name": "a-served", "serving": {"root": "s3://attacker-bucket/kiln"}}
    r = vetted.submit(cnn_onnx, attack, "a")
    assert r.status_code == 403, r.text
    assert r.json()["code"] == "FORBIDDEN" and r.json()["details"]["field"] == "serving.root", r.json()
    r = httpx.post(
        f"{vetted.base}/jobs/{b.json()['id']}/resubmit",
        json={"spec": attack},
        headers=vetted.heads["a"],
        timeout=30,
    )
    assert r.status_code == 404  # and A cannot reach it through B's job either
    # A's own publishes, without a root, leave B's entries where they were.
    a = vetted.submit(cnn_onnx, {**SPEC, "name": "a-served"}, "a")
    assert vetted.wait(a.json()["id"], "a")["status"] == "succeeded"
    after = _base_paths(repo)
    assert after["ovms"]["b-served"] == before["ovms"]["b-served"]
    assert "attacker-bucket" not in json.dumps(after)
    assert not (repo / "kiln-repository.json").exists() or "attacker" not in (repo / "kiln-repository.json").read_text()
    # The operator (an admin token) may move it: for every model, as an operator's change should.
    admin = vetted.submit(cnn_onnx, {**SPEC, "name": "admin-served", "serving": {"root": "/models"}}, "admin")
    assert admin.status_code == 202, admin.text
    assert vetted.wait(admin.json()["id"], "admin")["status"] == "succeeded"
    assert _base_paths(repo)["ovms"]["b-served"] == "/models/triton/b-served"
    listing = vetted.get("/repository", "b").json()
    assert listing["uri"] == "/models" and listing["models"][0]["versions"][0]["uri"] == "/models/triton/b-served/1"
    # And then a tenant's job may name the root in force (a spec shared with `kiln compile` works).
    same = vetted.submit(cnn_onnx, {**SPEC, "name": "a-served", "serving": {"root": "/models/"}}, "a")
    assert same.status_code == 202, same.text


def test_a_tenant_past_its_quotas_waits_then_gets_429_and_sees_its_quota(vetted: Service, cnn_onnx: Path) -> None:
    """Token c: one job running at once, one waiting. A job that waits for an engine with no worker (TensorRT)
    stays running; the next stays queued (its start deferred); the third is refused."""
    waiting = {**SPEC, "targets": ["tensorrt"], "wait_for_workers": True}

    def status(job_id: str) -> str:
        return str(vetted.get(f"/jobs/{job_id}", "c").json()["status"])

    first = vetted.submit(cnn_onnx, {**waiting, "name": "c-first"}, "c").json()["id"]
    deadline = time.monotonic() + 120
    while status(first) != "running":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    second = vetted.submit(cnn_onnx, {**waiting, "name": "c-second"}, "c")
    assert second.status_code == 202, second.text
    time.sleep(6)  # several deferrals: it does not start while the first runs
    assert status(second.json()["id"]) == "queued"
    quota = vetted.get("/quota", "c").json()
    assert quota == {"tenant": "team-c", "running": 1, "max_running": 1, "queued": 1, "max_queued": 1}
    r = vetted.submit(cnn_onnx, {**waiting, "name": "c-third"}, "c")
    assert r.status_code == 429, r.text
    body = r.json()
    assert body["code"] == "QUOTA_EXCEEDED" and "GET /quota" in body["hint"]
    assert body["details"] == {"tenant": "team-c", "queued": 1, "max_queued": 1, "running": 1, "max_running": 1}
    assert _count(vetted, "c") == 2  # the refused job is not recorded
    # Another tenant's quota is its own, and its jobs run meanwhile; the dashboard shows the caller's.
    assert vetted.get("/quota", "a").json()["max_queued"] == 50
    page = vetted.get("/ui/", "c").text
    assert "team-c</strong>: 1 of 1 jobs running, 1 of 1 waiting to start" in page and "at its quota" in page
    # The first ends: the second starts.
    assert httpx.delete(f"{vetted.base}/jobs/{first}", headers=vetted.heads["c"]).status_code == 202
    deadline = time.monotonic() + 60
    while status(second.json()["id"]) == "queued":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    httpx.delete(f"{vetted.base}/jobs/{second.json()['id']}", headers=vetted.heads["c"])


# --- vetting off: what the sandbox holds on its own ------------------------------------------------


@pytest.fixture(scope="module")
def unvetted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """`kiln serve` with vetting off (KILN_VET_UPLOADS=false: the sandbox's tests only), auth on, two tenants."""
    yield from serve_two_tenants(
        tmp_path_factory.mktemp("unvetted"), {"tensorflow", "onnxruntime"}, vet_uploads="false"
    )


@dataclass
class Victim:
    """Tenant B's upload: its bytes (with a marker no other file holds), where the store keeps it, its job."""

    path: Path
    marker: str
    stored: Path
    job: str


@pytest.fixture(scope="module")
def victim(unvetted: Service, tmp_path_factory: pytest.TempPathFactory) -> Victim:
    import hashlib

    import onnx

    from kiln_testing.models import tiny_cnn_onnx

    root = tmp_path_factory.mktemp("victim")
    marker = f"team-b-private-{secrets.token_hex(8)}"
    model = onnx.load(tiny_cnn_onnx(root / "plain.onnx"))
    model.doc_string = marker
    path = root / "b_private_model.onnx"
    onnx.save(model, path)
    r = unvetted.submit(path, {**SPEC, "name": "b-private"}, "b")
    assert r.status_code == 202, r.text
    assert unvetted.wait(r.json()["id"], "b")["status"] == "succeeded"
    stored = unvetted.root / "cache" / "store" / "sources" / hashlib.sha256(path.read_bytes()).hexdigest() / path.name
    assert marker.encode() in stored.read_bytes()  # where the attack looks: really there, on the host
    return Victim(path, marker, stored, r.json()["id"])


def _log(service: Service, job_id: str, who: str) -> str:
    return service.get(f"/jobs/{job_id}/logs", who).text


def test_a_step_of_one_tenant_lists_nothing_of_another_tenants(
    unvetted: Service, victim: Victim, tmp_path: Path
) -> None:
    """From inside a step of tenant A (SavedModels' MatchingFiles and ReadFile, vetting off): the store, the fetch
    cache, the other children's folders and inputs, the repository and the host's processes are not there: a
    listing finds nothing, or is refused."""
    cache = unvetted.root / "cache"
    globs = [
        f"{cache}/store/sources/*",
        f"{cache}/worker-fetch/*",
        f"{cache}/sandbox-in/*",
        f"{cache}/sandbox/*",
        f"{unvetted.root}/repo/*",
    ]
    models = snooping_savedmodels(tmp_path, str(victim.stored), globs)
    jobs = {name: unvetted.submit(models[name], SPEC, "a").json()["id"] for name in [*models][: len(globs)]}
    jobs["procs"] = unvetted.submit(models["procs"], SPEC, "a").json()["id"]
    for i, pattern in enumerate(globs):
        unvetted.wait(jobs[f"lister_{i}"], "a")
        log = _log(unvetted, jobs[f"lister_{i}"], "a")
        listed = [line for line in log.splitlines() if line.startswith(f"LISTING {pattern} =")]
        refused = "Permission denied" in log or "NOT_FOUND" in log or "not found" in log
        assert listed or refused, (pattern, log[-2000:])  # the step ran the listing
        assert all(line.endswith('= ""') for line in listed), (pattern, listed)  # ... which found nothing
        assert victim.marker not in log and victim.stored.parent.name not in log and "b_private_model" not in log
    unvetted.wait(jobs["procs"], "a")
    log = _log(unvetted, jobs["procs"], "a")
    procs = next(line for line in log.splitlines() if line.startswith("PROCS"))
    assert "forkserver" in procs  # its own sandbox's processes ...
    for host_process in ("kiln serve", "--port", "worker --concurrency", "-m pytest"):
        assert host_process not in procs, procs  # ... and none of the host's: a PID namespace of its own
    assert len(procs.split(" | ")) <= 6, procs  # bubblewrap, the forkserver, its resource tracker, the children


def test_reading_another_tenants_upload_from_the_store_finds_nothing(
    unvetted: Service, victim: Victim, tmp_path: Path
) -> None:
    """Issue 31, attack 2 (and 3 with vetting off): TorchScript's from_file, a SavedModel's ReadFile,
    FixedUnigramCandidateSampler(vocab_file) and ImmutableConst on B's stored upload: B's bytes reach nothing of A's."""
    models = snooping_savedmodels(tmp_path, str(victim.stored), [])
    script = torchscript_file_reader(tmp_path / "from_file.pt", str(victim.stored), 64)
    jobs = {"from_file": unvetted.submit(script, {**SPEC, "inputs": {"x": {"shape": [1, 4]}}}, "a")}
    for name in ("store_reader", "sampler_reader", "mapped_reader"):
        jobs[name] = unvetted.submit(models[name], SPEC, "a")
    for name, r in jobs.items():
        assert r.status_code == 202, (name, r.text)
        job = unvetted.wait(r.json()["id"], "a")
        said = json.dumps(job) + _log(unvetted, r.json()["id"], "a")
        ref = next(s for s in job["steps"] if s["id"] == "reference")
        assert ref["status"] == "failed", (name, ref)  # the file is not there to read ...
        assert victim.marker not in said, name  # ... and nothing of it reached A
        missing = ("No such file", "not found", "NOT_FOUND", "Permission denied", "does not exist")
        assert any(m in said for m in missing), (name, ref["error"], said[-1500:])


def test_a_tenants_hanging_and_aborting_steps_leave_another_tenant_its_slot(
    unvetted: Service, cnn_onnx: Path, tmp_path: Path
) -> None:
    """Issue 31, attack 5: Abort(exit_without_error=True) used to hang its child in teardown until the 3600 s
    limit; now it fails at once. And steps that really hang (an empty queue) never hold every slot: tenant B's
    one-second job finishes on time while two of A's hang."""
    models = snooping_savedmodels(tmp_path, "/nonexistent", [])
    aborted = unvetted.submit(models["abort"], SPEC, "a").json()["id"]
    job = unvetted.wait(aborted, "a", timeout=120)  # not the 3600 s time limit
    assert job["status"] == "failed"
    ref = next(s for s in job["steps"] if s["id"] == "reference")
    assert "SIGABRT" in ref["error"]["message"], ref["error"]
    hanging = [unvetted.submit(models["hang"], SPEC, "a").json()["id"] for _ in range(2)]
    deadline = time.monotonic() + 120
    while unvetted.get(f"/jobs/{hanging[0]}", "a").json()["status"] != "running":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(3)  # the second one's deliveries come and go: the worker's last slot is not A's to take
    b = unvetted.submit(cnn_onnx, {**SPEC, "name": "b-on-time"}, "b").json()["id"]
    assert unvetted.wait(b, "b", timeout=120)["status"] == "succeeded"  # not after A's steps' 3600 s limit ...
    assert unvetted.get(f"/jobs/{hanging[0]}", "a").json()["status"] == "running"  # ... which still hang
    for job_id in hanging:
        assert httpx.delete(f"{unvetted.base}/jobs/{job_id}", headers=unvetted.heads["a"]).status_code == 202
    for job_id in hanging:
        assert unvetted.wait(job_id, "a", timeout=60)["status"] == "cancelled"
