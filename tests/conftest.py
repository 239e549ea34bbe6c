"""Shared fixtures: tiny models built once per session, a fresh repository and store per test."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).parent))
# kiln_testing (models shared with the benchmarks) lives at the repository root, outside the wheel.
sys.path.insert(0, str(Path(__file__).parents[1]))
# kiln_client is a package of its own (clients/python); the tests use the checkout's copy.
sys.path.insert(0, str(Path(__file__).parents[1] / "clients" / "python"))

from storage_servers import s3_server  # noqa: F401 - session fixture: a real S3 server on loopback

from kiln_testing.models import tiny_cnn_onnx, tiny_transformer_onnx


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def cnn_onnx(models_dir: Path) -> Path:
    """A small CNN (Conv, BatchNorm, Relu, pooling, Gemm) as ONNX, dynamic batch, input 'input' [N,3,32,32]."""
    return tiny_cnn_onnx(models_dir / "cnn.onnx")


@pytest.fixture(scope="session")
def transformer_onnx(models_dir: Path) -> Path:
    """A transformer encoder block (LayerNorm, attention with Softmax, GELU) as ONNX, input [N,16,32]."""
    return tiny_transformer_onnx(models_dir / "transformer.onnx")


@pytest.fixture(scope="session", autouse=True)
def _session_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep the embedded job database (KILN_DATA_DIR) out of the user's home for the whole session.

    Session-scoped so it is in place before any module-scoped fixture builds its Settings;
    those that count jobs give their own data_dir as well.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_DATA_DIR", str(tmp_path_factory.mktemp("kiln-data")))
        # Benchmarks wait for the host to be quiet (services/steps/host_gate.py): this run's
        # steps take turns among themselves, not with another test run on the same machine,
        # and a step held at a test's gate delays a benchmark by seconds, not minutes.
        mp.setenv("KILN_HOST_LOCK_DIR", str(tmp_path_factory.mktemp("host-locks")))
        mp.setenv("KILN_BENCH_QUIET_WAIT", "10")
        # A tvm library at static shapes is tuned by default (minutes of MetaSchedule); tests ask for
        # the budget they exercise (options.tvm.tuning_trials, or this variable set in the test).
        mp.setenv("KILN_TVM_DEFAULT_TRIALS", "0")
        mp.setenv("KILN_TVM_TUNING_DIR", str(tmp_path_factory.mktemp("tvm-tuning")))
        yield


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give each test its own KILN_DATA_DIR (the embedded job database), never the user's."""
    monkeypatch.setenv("KILN_DATA_DIR", str(tmp_path_factory.mktemp("kiln-data")))


@pytest.fixture
def repo_dir(tmp_path: Path) -> Path:
    return tmp_path / "repo"


@pytest.fixture
def store(tmp_path: Path):
    from services.storage import LocalArtifactStore

    return LocalArtifactStore(tmp_path / "store")


@pytest.fixture
def repository(repo_dir: Path):
    from services.repository import LocalModelRepository

    return LocalModelRepository(repo_dir)
