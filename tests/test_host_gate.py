"""Benchmarks run alone on their host: steps hold shares, a benchmark waits for them (host_gate).

Other steps run as real separate processes holding real flock locks; the assertions are about
order (who got in before whom), never about how long anything took.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.steps.host_gate import host_alone, host_share

ROOT = Path(__file__).resolve().parents[1]

# A step in another process: holds a share, says so, waits for its cue, says it is ending.
STEP = """
import sys, time
from pathlib import Path
from services.steps.host_gate import host_share
d = Path(sys.argv[1])
with host_share():
    (d / "started").touch()
    while not (d / "finish").exists():
        time.sleep(0.02)
    (d / "ended").touch()
"""


@pytest.fixture(autouse=True)
def _own_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_HOST_LOCK_DIR", str(tmp_path / "locks"))


def _step(d: Path) -> subprocess.Popen[bytes]:
    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", STEP, str(d)], env=env)


def _until(path: Path, proc: subprocess.Popen[bytes] | None = None, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc is None or proc.poll() in (None, 0), f"the step process died ({proc.returncode})"
        assert time.monotonic() < deadline, f"{path.name} never came"
        time.sleep(0.02)


def test_a_benchmark_waits_for_running_steps_and_holds_new_ones_back(tmp_path: Path) -> None:
    first = _step(tmp_path / "first")
    _until(tmp_path / "first" / "started", first)
    entered = threading.Event()
    leave = threading.Event()
    seen: dict[str, object] = {}

    def benchmark() -> None:
        with host_alone(max_wait=60) as quiet:
            seen["quiet"] = quiet
            seen["first_ended_before"] = (tmp_path / "first" / "ended").exists()
            entered.set()
            leave.wait(60)

    bench = threading.Thread(target=benchmark)
    bench.start()
    assert not entered.wait(0.5)  # a step is running: the benchmark must not start
    (tmp_path / "first" / "finish").touch()
    assert entered.wait(30)
    assert seen["first_ended_before"] is True
    assert seen["quiet"].alone is True  # type: ignore[attr-defined]
    assert first.wait(30) == 0

    # While the benchmark runs, a new step waits at the turnstile.
    second = _step(tmp_path / "second")
    time.sleep(0.5)
    assert not (tmp_path / "second" / "started").exists()
    leave.set()
    bench.join(30)
    _until(tmp_path / "second" / "started", second)
    (tmp_path / "second" / "finish").touch()
    assert second.wait(30) == 0


def test_a_busy_host_benchmarks_anyway_after_the_wait_and_says_so(tmp_path: Path) -> None:
    step = _step(tmp_path / "busy")
    try:
        _until(tmp_path / "busy" / "started", step)
        with host_alone(max_wait=0.3) as quiet:
            assert quiet.alone is False
            assert quiet.waited_s >= 0.3
    finally:
        (tmp_path / "busy" / "finish").touch()
        step.wait(30)
    with host_alone(max_wait=5) as quiet:  # quiet again: alone
        assert quiet.alone is True


def test_a_step_benchmarks_inside_its_own_share_and_keeps_it_after(tmp_path: Path) -> None:
    with host_share():
        with host_alone(max_wait=5) as quiet:  # its own share does not block it
            assert quiet.alone is True
        # Afterwards the share is held again: a benchmark elsewhere cannot be alone.
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "from services.steps.host_gate import host_alone\nwith host_alone(max_wait=0.2) as q: print(q.alone)",
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert probe.stdout.strip() == "False", probe.stderr


def test_a_killed_step_does_not_leave_the_host_locked(tmp_path: Path) -> None:
    step = _step(tmp_path / "killed")
    _until(tmp_path / "killed" / "started", step)
    os.kill(step.pid, signal.SIGKILL)
    step.wait(30)
    with host_alone(max_wait=10) as quiet:  # the kernel dropped the dead process's lock
        assert quiet.alone is True
