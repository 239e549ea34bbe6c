"""`kiln cache prune` and the cache cap: by age, by size (least recently used first), never under a running job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.errors import InvalidSpec, ServiceUnavailable
from services.storage.local import LocalArtifactStore
from services.storage.prune import parse_age, parse_size, prune_store

KILN = str(Path(sys.executable).parent / "kiln")
DAY = 86400.0


def _entry(store: LocalArtifactStore, tmp: Path, key: str, size: int, last_used: float) -> None:
    src = tmp / f"src-{key.replace('/', '_')}"
    src.mkdir()
    (src / "payload.bin").write_bytes(b"x" * size)
    store.put_dir(key, src)
    os.utime(store.root / key / ".kiln-complete", (last_used, last_used))


@pytest.fixture
def store(tmp_path: Path) -> LocalArtifactStore:
    s = LocalArtifactStore(tmp_path / "store")
    now = time.time()
    _entry(s, tmp_path, "steps/old", 1000, now - 10 * DAY)
    _entry(s, tmp_path, "steps/week", 2000, now - 6 * DAY)
    _entry(s, tmp_path, "steps/new", 4000, now - 60)
    return s


def test_prune_by_age_keeps_recent_entries(store: LocalArtifactStore) -> None:
    report = prune_store(store.root, older_than=7 * DAY)
    assert report.removed == ["steps/old"] and report.freed_bytes == 1000
    assert (report.kept, report.kept_bytes) == (2, 6000)
    assert not store.exists("steps/old") and store.exists("steps/week") and store.exists("steps/new")
    assert not list(store.root.glob(".trash-*"))


def test_prune_by_size_goes_least_recently_used_first_and_reads_count_as_use(store: LocalArtifactStore) -> None:
    assert store.local_path("steps/old") is not None  # a cache hit: now the most recently used
    report = prune_store(store.root, max_bytes=4500)
    assert report.removed == ["steps/week", "steps/new"]  # 7000 bytes; LRU order until <= 4500
    assert store.exists("steps/old") and report.kept_bytes == 1000


def test_dry_run_removes_nothing(store: LocalArtifactStore) -> None:
    report = prune_store(store.root, max_bytes=0, dry_run=True)
    assert report.removed == ["steps/old", "steps/week", "steps/new"] and report.freed_bytes == 7000
    assert all(store.exists(k) for k in ("steps/old", "steps/week", "steps/new"))


def test_prune_waits_for_a_running_job(store: LocalArtifactStore) -> None:
    with store.in_use(), pytest.raises(ServiceUnavailable, match="in use by a running job"):
        prune_store(store.root, max_bytes=0)
    assert store.exists("steps/old")  # refused: nothing removed

    released = threading.Event()

    def job() -> None:
        with store.in_use():
            time.sleep(0.6)
        released.set()

    t = threading.Thread(target=job)
    t.start()
    time.sleep(0.1)
    report = prune_store(store.root, max_bytes=0, wait=10)
    assert released.is_set(), "prune ran while the job held the cache"
    assert len(report.removed) == 3
    t.join()


@pytest.mark.parametrize(("text", "value"), [("500MB", 500_000_000), ("2GiB", 2 * 1024**3), ("0", 0), ("1.5k", 1500)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize(("text", "value"), [("30m", 1800.0), ("12h", 43200.0), ("7d", 7 * DAY), ("2w", 14 * DAY)])
def test_parse_age(text: str, value: float) -> None:
    assert parse_age(text) == value


@pytest.mark.parametrize("bad", ["", "ten", "5 parsecs", "-1d"])
def test_bad_sizes_and_ages_are_invalid_spec(bad: str) -> None:
    with pytest.raises(InvalidSpec):
        parse_size(bad)
    with pytest.raises(InvalidSpec):
        parse_age(bad)


def _kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [KILN, *args], capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "200", **(env or {})}
    )


def test_cache_cap_and_prune_command_end_to_end(cnn_onnx: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    common = ("-t", "onnxruntime", "--repo", str(tmp_path / "repo"), "--no-benchmark", "--cache-dir", str(cache))
    first = _kiln("compile", str(cnn_onnx), *common)
    assert first.returncode == 0, first.stderr
    entries = sorted(p.parent.name for p in (cache / "store").rglob(".kiln-complete"))
    assert len(entries) == 3  # reference, optimize, export:onnxruntime
    dry = _kiln("cache", "prune", "--max-size", "0", "--dry-run", "--json", "--cache-dir", str(cache))
    assert dry.returncode == 0, dry.stderr
    assert len(json.loads(dry.stdout)["removed"]) == len(entries)
    pruned = _kiln("cache", "prune", "--older-than", "0s", "--cache-dir", str(cache))
    assert pruned.returncode == 0 and f"removed {len(entries)} entries" in pruned.stdout, pruned.stdout + pruned.stderr
    assert not list((cache / "store").rglob(".kiln-complete"))

    # With a cap, the job's own entries are pruned after it (here: a cap nothing fits under).
    capped = _kiln("compile", str(cnn_onnx), *common, env={"KILN_CACHE_MAX_BYTES": "1"})
    assert capped.returncode == 0, capped.stderr
    assert "cache over its cap: removed" in capped.stderr
    assert not list((cache / "store").rglob(".kiln-complete"))

    bad = _kiln("cache", "prune", "--cache-dir", str(cache))
    assert bad.returncode == 2 and "INVALID_SPEC" in bad.stderr and "--older-than" in bad.stderr


def test_the_job_database_lives_in_the_data_dir_not_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.jobs.db import database_url
    from services.settings import Settings

    settings = Settings(cache_dir=tmp_path / "cache", data_dir=tmp_path / "data")
    assert database_url(settings) == f"sqlite:///{(tmp_path / 'data' / 'kiln.db').resolve()}"
    assert not (tmp_path / "cache").exists()  # nothing of the job store in the cache
    monkeypatch.delenv("KILN_DATA_DIR")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert Settings().data_dir == tmp_path / "xdg" / "kiln"  # the default: XDG's data home
