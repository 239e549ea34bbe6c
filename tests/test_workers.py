"""Workers: the child-process step runner (crashes, limits, cancel), the engine probe, task declarations."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from jobs_support import KILN_CMD, TESTS_DIR, service_env

from services.errors import KilnError
from services.graph.engines import ENGINES, queue_name
from services.graph.planner import PlanStep
from services.settings import Settings
from services.storage import LocalArtifactStore
from workers import child
from workers.child import StepRequest, run_in_child

# Step children import the fault-provoking entries from tests/; the forkserver (started by
# the first child of this process) inherits this path.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cnn_onnx: Path) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("workers")
    settings = Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",
        artifact_store=str(root / "store"),
        repository=str(root / "repo"),
    )
    store = LocalArtifactStore(root / "store")
    upload = root / "upload"
    upload.mkdir()
    shutil.copy(cnn_onnx, upload / "cnn.onnx")
    store.put_dir("sources/cnn", upload)
    return {"root": root, "settings": settings, "store": store}


def _request(env: dict[str, Any], entry: str, name: str) -> StepRequest:
    step = PlanStep(
        id=f"convert-{name}",
        kind="convert",
        engine="onnxruntime",
        entry=entry,
        inputs={"model": "source"},
        tool="test tool",
    )
    return StepRequest(
        job_id="job-" + name,
        step=step.to_dict(),
        spec={"targets": ["onnxruntime"], "benchmark": False},
        source_key="sources/cnn",
        source_filename="cnn.onnx",
        input_keys={},
        settings=env["settings"],
        scratch=env["root"] / "scratch" / name,
        use_cache=False,
    )


def _run(env: dict[str, Any], entry: str, name: str, **kw: Any):
    kw.setdefault("soft_limit", 60)
    kw.setdefault("hard_limit", 90)
    return run_in_child(_request(env, f"jobs_support:{entry}", name), **kw)


def test_a_working_step_reports_progress_output_and_its_artifact(env: dict[str, Any]) -> None:
    progress: list[str] = []
    res = _run(env, "ok_step", "ok", on_progress=progress.append)
    assert res.ok, res.error
    assert progress == ["halfway there"]
    assert res.meta["answer"] == 42 and res.key and env["store"].exists(res.key)
    assert (env["store"].local_path(res.key) / "out.txt").read_text() != ""
    assert "tool output line" in res.log


def test_a_segfaulting_converter_fails_its_step_and_the_worker_lives_on(env: dict[str, Any]) -> None:
    res = _run(env, "segfault_step", "segv")
    assert not res.ok
    assert res.error["code"] == "CONVERSION_FAILED"
    assert "SIGSEGV" in res.error["message"] and "test tool" in res.error["message"]
    assert "Segmentation fault" in res.error["details"]["output_tail"]  # faulthandler's dump
    assert res.error["details"]["exit_code"] == -11
    again = _run(env, "ok_step", "after-segv")  # same process, same forkserver: still works
    assert again.ok


def test_a_step_killed_like_by_the_oom_killer_names_the_signal(env: dict[str, Any]) -> None:
    res = _run(env, "sigkill_step", "oom")
    assert res.error["code"] == "CONVERSION_FAILED"
    assert "SIGKILL" in res.error["message"] and "out of memory" in res.error["message"]


def test_a_python_error_in_a_converter_is_conversion_failed_with_its_traceback(env: dict[str, Any]) -> None:
    res = _run(env, "raising_step", "raise")
    assert res.error["code"] == "CONVERSION_FAILED"
    assert "FancyOp" in res.error["message"]
    assert "RuntimeError" in res.error["details"]["output_tail"]


def test_soft_then_hard_time_limit_stop_a_step_that_ignores_sigterm(env: dict[str, Any]) -> None:
    started = time.monotonic()
    res = _run(env, "stubborn_sleep_step", "timeout", soft_limit=1.0, hard_limit=2.0)
    elapsed = time.monotonic() - started
    assert res.error["code"] == "TIMEOUT"
    assert "time limit of 1s" in res.error["message"]
    assert elapsed < 30  # stopped long before the step's 120 s sleep would end


def test_cancel_kills_the_running_child(env: dict[str, Any]) -> None:
    calls = []

    def tick() -> str | None:
        calls.append(time.monotonic())
        return "cancel" if len(calls) >= 2 else None

    started = time.monotonic()
    res = _run(env, "sleep_step", "cancel", tick=tick, tick_interval=0.2)
    assert res.error["code"] == "CANCELLED"
    assert time.monotonic() - started < 30


def test_a_step_taken_over_elsewhere_is_dropped_without_a_result(env: dict[str, Any]) -> None:
    res = _run(env, "sleep_step", "lost", tick=lambda: "lost", tick_interval=0.2)
    assert res.lost and not res.ok and res.error is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_child_that_succeeded_serves_the_next_step_with_its_own_log(env: dict[str, Any]) -> None:
    first = _run(env, "ok_step", "reuse-1")
    second = _run(env, "ok_step", "reuse-2")
    assert first.ok and second.ok
    assert second.pid == first.pid and second.pid != os.getpid()  # warm: no fork, no first-use costs
    assert second.log.count("tool output line") == 1  # each step's output is its own


def _observe(env: dict[str, Any], entry: str, name: str) -> tuple[Any, str]:
    """Run ``entry`` under its own cache key; return the result and what its out.txt says."""
    req = _request(env, f"jobs_support:{entry}", name)
    req.step["options"] = {"run": name}  # outputs are content-addressed: keep each run's own
    res = run_in_child(req, soft_limit=60, hard_limit=90)
    assert res.ok, res.error
    return res, (env["store"].local_path(res.key) / "out.txt").read_text()


def test_a_reused_child_starts_each_step_from_its_own_environment(env: dict[str, Any]) -> None:
    _, before = _observe(env, "probe_step", "probe-before")
    untidy, _ = _observe(env, "untidy_step", "untidy")
    probe, after = _observe(env, "probe_step", "probe-after")
    assert probe.pid == untidy.pid  # the same process ran both ...
    # ... yet the second saw neither the variable nor the directory the first one left: each
    # step starts in its own scratch folder (cwd, HOME and TMPDIR), a fresh one per step.
    (var_before, cwd_before), (var_after, cwd_after) = before.split(" "), after.split(" ")
    assert var_before == var_after == "-" and cwd_after != "/"
    assert cwd_before.endswith("/scratch") and cwd_after.endswith("/scratch") and cwd_after != cwd_before


def test_a_failed_step_takes_its_child_with_it(env: dict[str, Any]) -> None:
    ok = _run(env, "ok_step", "before-raise")
    failed = _run(env, "raising_step", "raise-retires")
    after = _run(env, "ok_step", "after-raise")
    assert ok.ok and not failed.ok and after.ok
    assert failed.pid == ok.pid  # the idle child took the step ...
    assert not _alive(failed.pid) and after.pid != failed.pid  # ... and left with the failure


def test_an_idle_child_that_died_is_replaced_without_failing_the_step(env: dict[str, Any]) -> None:
    first = _run(env, "ok_step", "idle-victim")
    os.kill(first.pid, signal.SIGKILL)  # e.g. the OOM killer picked the idle child
    deadline = time.monotonic() + 10
    while _alive(first.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    second = _run(env, "ok_step", "after-idle-death")
    assert second.ok, second.error
    assert second.pid != first.pid


def test_cancel_and_timeout_leave_no_child_behind(env: dict[str, Any]) -> None:
    res = _run(env, "sleep_step", "cancel-reaped", tick=lambda: "cancel", tick_interval=0.2)
    assert res.error["code"] == "CANCELLED" and not _alive(res.pid)
    again = _run(env, "ok_step", "after-cancel")
    assert again.ok and again.pid != res.pid


def test_a_plain_file_source_is_taken_as_the_api_recorded_it_not_hashed_per_step(env: dict[str, Any]) -> None:
    req = _request(env, "jobs_support:ok_step", "recorded-source")
    req.source_format, req.source_sha256, req.source_seen = "onnx", "ab" * 32, "ONNX ModelProto"
    res = run_in_child(req, soft_limit=60, hard_limit=90)
    assert res.ok, res.error
    # ok_step writes the sha256 the step was given: the recorded one, not a fresh hash.
    assert (env["store"].local_path(res.key) / "out.txt").read_text() == "ab" * 32
    plain = _run(env, "ok_step", "hashed-source")
    real = hashlib.sha256((env["store"].local_path("sources/cnn") / "cnn.onnx").read_bytes()).hexdigest()
    assert (env["store"].local_path(plain.key) / "out.txt").read_text() == real


def test_forkserver_preloads_the_engines_it_serves() -> None:
    mods = child.preload_modules(["onnxruntime", "openvino", "tensorflow"])
    assert "onnxruntime" in mods and "openvino" in mods
    assert "tensorflow" not in mods and "torch" not in mods  # not fork-safe after import
    assert mods.index("workers._forkserver_main") < mods.index("numpy")


def test_the_probe_refuses_an_engine_whose_sdk_is_missing() -> None:
    from workers.probe import resolve_engines

    installed = resolve_engines([])
    assert "onnxruntime" in installed and "openvino" in installed
    with pytest.raises(KilnError) as exc:
        resolve_engines(["tensorrt-cu13"])
    assert exc.value.code == "ENGINE_UNAVAILABLE" and "tensorrt" in exc.value.message
    with pytest.raises(KilnError):
        resolve_engines(["no-such-engine"])


@pytest.mark.parametrize("engine", ["tensorrt-cu13", "no-such-engine"])
def test_kiln_worker_refuses_to_start_on_a_missing_engine(engine: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [*KILN_CMD, "worker", "--engine", engine],
        env=service_env(cache_dir=tmp_path, broker_url="redis://127.0.0.1:1/0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "ENGINE_UNAVAILABLE" in proc.stderr and engine in proc.stderr
    assert "Traceback" not in proc.stderr


def test_each_engine_has_its_own_reliable_task_on_its_own_queue(tmp_path: Path) -> None:
    import sqlalchemy.exc

    from workers.app import create_celery_app
    from workers.queues import queue_engines, task_name

    settings = Settings(cache_dir=tmp_path, step_hard_time_limit=100)
    app = create_celery_app(settings)
    assert app.conf.broker_url == "filesystem://"  # no KILN_BROKER_URL: the embedded broker
    assert app.conf.worker_prefetch_multiplier == 1 and app.conf.task_acks_late
    # Every engine's queue, and the tune queue (POST /tune's search steps).
    assert queue_engines() == [*ENGINES, "tune"]
    assert {q.name for q in app.conf.task_queues} == {queue_name(e) for e in queue_engines()}
    for name in queue_engines():
        task = app.tasks[task_name(name)]
        assert task.queue == queue_name(name)
        assert task.acks_late and task.reject_on_worker_lost
        assert task.soft_time_limit == 160 and task.time_limit == 220
        assert sqlalchemy.exc.OperationalError in task.autoretry_for
        assert not any(issubclass(KilnError, e) for e in task.autoretry_for)  # user errors never retry


def test_only_transient_errors_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sqlalchemy.exc

    import workers.tasks
    from workers.app import create_celery_app
    from workers.queues import task_name

    app = create_celery_app(Settings(cache_dir=tmp_path))
    task = app.tasks[task_name("onnxruntime")]

    calls: list[str] = []

    def db_blip(*_: Any, **__: Any) -> Any:
        calls.append("db")
        raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception("connection reset"))

    monkeypatch.setattr(workers.tasks, "execute_step", db_blip)
    task.apply(args=["job", "step"])  # eager: retries run at once, then the error surfaces
    assert len(calls) == task.max_retries + 1

    def user_error(*_: Any, **__: Any) -> Any:
        calls.append("user")
        raise KilnError("not transient")

    monkeypatch.setattr(workers.tasks, "execute_step", user_error)
    assert task.apply(args=["job", "step"]).state == "FAILURE"
    assert calls.count("user") == 1


def test_the_embedded_broker_never_hands_out_a_half_written_message(tmp_path: Path) -> None:
    from workers.app import create_celery_app

    app = create_celery_app(Settings(cache_dir=tmp_path))
    assert app.conf.broker_transport == "workers.broker:Transport"
    folder = Path(app.conf.broker_transport_options["data_folder_in"])
    # What kombu's own transport leaves visible while a publisher is still writing:
    (folder / ".tmp-1_x.kiln.onnxruntime.msg").write_bytes(b"")
    app.send_task("kiln.step.onnxruntime", args=["job", "step"], queue="kiln.onnxruntime")
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("kiln.onnxruntime")
        message = queue.get(timeout=5)
        assert message.headers["task"] == "kiln.step.onnxruntime"
        assert message.payload[0] == ["job", "step"]
        message.ack()
        queue.close()
    assert [p.name for p in folder.iterdir()] == [".tmp-1_x.kiln.onnxruntime.msg"]


def test_a_child_that_dies_while_starting_reports_its_traceback(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault of issue 27: the child's preparation chdirs to a folder it cannot see and dies.

    Nothing of Kiln's ran in that child: what it printed (multiprocessing's traceback) must
    still reach the step's error and its log, not only the worker's stderr.
    """
    from multiprocessing import spawn

    child._context(settings=env["settings"])  # installs Kiln's own preparation hook first
    kiln_prepared = spawn.get_preparation_data

    def unreachable_dir(name: str) -> dict[str, Any]:
        data = kiln_prepared(name)
        if name == "kiln-step":
            data["dir"] = str(env["root"] / "gone" / "where-kiln-serve-started")
        return data

    child.shutdown_children()  # no idle child: the step needs a fresh one
    monkeypatch.setattr(spawn, "get_preparation_data", unreachable_dir)
    res = _run(env, "ok_step", "dies-starting")
    assert not res.ok and res.error["code"] == "CONVERSION_FAILED"
    assert "while its step child was starting" in res.error["message"]
    assert "exited with status 1" in res.error["message"]
    tail = res.error["details"]["output_tail"]
    # The traceback's last lines: where it failed and why.
    assert "os.chdir(data['dir'])" in tail and "FileNotFoundError" in tail and "where-kiln-serve-started" in tail
    assert "FileNotFoundError" in res.log  # the job log has it too
    monkeypatch.undo()
    assert _run(env, "ok_step", "after-dying-start").ok  # the next child starts where it can


def test_a_child_starts_in_its_own_area_whatever_the_worker_s_working_directory(
    env: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kiln serve` started from a folder the sandbox does not bind (issue 27): the step runs."""
    away = tmp_path / "started-here"
    away.mkdir()
    monkeypatch.chdir(away)
    child.shutdown_children()
    res = _run(env, "ok_step", "from-elsewhere")
    assert res.ok, res.error


def test_an_idle_child_is_handed_only_steps_of_the_tenant_it_served(env: dict[str, Any]) -> None:
    """Issue 31: children were reused across tenants, so a step that hid in its child saw another tenant's steps."""
    import dataclasses

    def run(name: str, tenant: str) -> Any:
        req = dataclasses.replace(_request(env, "jobs_support:ok_step", name), tenant=tenant)
        res = run_in_child(req, soft_limit=60, hard_limit=90)
        assert res.ok, res.error
        return res

    a1, a2 = run("tenant-a-1", "team-a"), run("tenant-a-2", "team-a")
    b1 = run("tenant-b-1", "team-b")
    a3 = run("tenant-a-3", "team-a")
    assert a1.pid == a2.pid == a3.pid  # a tenant's steps still reuse its warm child ...
    assert b1.pid != a1.pid and _alive(a1.pid) and _alive(b1.pid)  # ... another tenant gets its own


def test_the_last_free_slot_of_a_worker_is_kept_from_a_tenant_already_running_there() -> None:
    from workers.slots import TenantSlots

    slots = TenantSlots()
    slots.configure(3, shared=True)
    assert slots.take("a") and slots.take("a")
    assert not slots.take("a")  # a third would leave the others nothing
    assert slots.take("b")  # another tenant takes the last one
    slots.give_back("a")  # a: 1, b: 1 of 3 slots
    assert not slots.take("a")  # the last free one is not a's, which runs here already
    assert slots.take("c") and not slots.take("c")  # a tenant new here may take it, once
    assert slots.running() == {"a": 1, "b": 1, "c": 1}
    alone = TenantSlots()
    alone.configure(2, shared=False)  # auth off: one caller, no reservation
    assert alone.take("x") and alone.take("x")
    single = TenantSlots()
    single.configure(1, shared=True)  # one slot: nothing to reserve
    assert single.take("x")
