"""One contract for every ArtifactStore and every ModelRepository backend, run against each.

The contract classes hold the tests; a backend class adds only fixtures (as fsspec's
tests/abstract does): ``store`` + ``write_partial`` for stores, ``repo`` + ``make_repo`` +
``write_partial_version`` + ``compile_store`` for repositories. The S3 backends run against
a real SeaweedFS server on a free loopback port (tests/storage_servers.py); a few tests of
S3-only behaviour (multipart, lease expiry, upload order) sit in the S3 classes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from storage_servers import S3Server

from services.artifacts import Artifact
from services.errors import KilnError, RepositoryConflict
from services.pipeline import compile_model
from services.repository import MANIFEST, LocalModelRepository, publish_version, read_manifest
from services.repository.base import ModelRepository
from services.settings import Settings
from services.spec import load_spec
from services.storage import LocalArtifactStore
from services.storage.base import ArtifactStore

BIG = 9 * 1024 * 1024  # above the 8 MiB multipart threshold


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="session")
def nested_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with nesting, an empty sub-dir, a small text file and a 9 MiB binary."""
    root = tmp_path_factory.mktemp("nested")
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "top.txt").write_text("top")
    (root / "a" / "mid.json").write_text(json.dumps({"x": 1}))
    (root / "a" / "b" / "deep.bin").write_bytes(os.urandom(1000))
    (root / "big.bin").write_bytes(np.random.default_rng(0).bytes(BIG))
    return root


def tree(root: Path) -> dict[str, str]:
    """Return {relpath: sha256} of every file, plus '<dir>/' entries for empty dirs."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir() and not any(p.iterdir()):
            out[rel + "/"] = ""
    return out


def version_dir(tmp_path: Path, tag: str, files: dict[str, bytes]) -> Path:
    """Return a local dir holding ``files`` plus a manifest (every published version has one)."""
    d = tmp_path / f"v-{tag}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    (d / MANIFEST).write_text(json.dumps({"tag": tag}))
    return d


def spec(**extra):
    # optimize off: this suite is about storage, the ONNX passes have their own tests.
    return load_spec({"targets": ["onnxruntime"], "name": "cnn", "benchmark": False, "optimize": False, **extra})


# --------------------------------------------------------------------------- contracts


class ArtifactStoreContract:
    """What every ArtifactStore promises."""

    @pytest.fixture
    def store(self) -> ArtifactStore:
        raise NotImplementedError

    @pytest.fixture
    def write_partial(self, store) -> Callable[[str, dict[str, bytes]], None]:
        """Return f(key, files) leaving what a writer that died before its marker leaves."""
        raise NotImplementedError

    def test_round_trip_nested_with_big_file(self, store, nested_dir: Path, tmp_path: Path) -> None:
        uri = store.put_dir("steps/abc", nested_dir)
        assert uri == store.uri("steps/abc")
        assert store.exists("steps/abc")
        got = store.fetch_dir("steps/abc", tmp_path / "out")
        assert got == tmp_path / "out"
        assert tree(got) == tree(nested_dir)
        assert (got / "big.bin").stat().st_size == BIG
        assert not (got / ".kiln-complete").exists()

    def test_put_with_move_stores_the_same_tree(self, store, nested_dir: Path, tmp_path: Path) -> None:
        # ``move`` lets a backend take the directory over; what is stored is the same either way.
        expected = tree(nested_dir)
        work = tmp_path / "work"
        shutil.copytree(nested_dir, work)
        store.put_dir("steps/moved", work, move=True)
        assert store.exists("steps/moved")
        assert tree(store.fetch_dir("steps/moved", tmp_path / "out")) == expected

    def test_missing_key(self, store, tmp_path: Path) -> None:
        assert not store.exists("steps/nope")
        with pytest.raises(KilnError) as err:
            store.fetch_dir("steps/nope", tmp_path / "out")
        assert err.value.code == "NOT_FOUND"

    def test_put_of_existing_key_is_a_no_op(self, store, tmp_path: Path) -> None:
        first, second = tmp_path / "first", tmp_path / "second"
        first.mkdir()
        second.mkdir()
        (first / "f.txt").write_text("first")
        (second / "f.txt").write_text("second")
        (second / "extra.txt").write_text("extra")
        assert store.put_dir("sources/k", first) == store.put_dir("sources/k", second)
        got = store.fetch_dir("sources/k", tmp_path / "out")
        assert tree(got) == tree(first)

    def test_partial_key_is_not_there_and_is_replaced(self, store, write_partial, tmp_path: Path) -> None:
        write_partial("steps/half", {"model.onnx": b"half", "stale.txt": b"left over"})
        assert not store.exists("steps/half")
        with pytest.raises(KilnError) as err:
            store.fetch_dir("steps/half", tmp_path / "x")
        assert err.value.code == "NOT_FOUND"
        src = tmp_path / "src"
        src.mkdir()
        (src / "model.onnx").write_bytes(b"whole model")
        store.put_dir("steps/half", src)
        assert store.exists("steps/half")
        assert tree(store.fetch_dir("steps/half", tmp_path / "out")) == tree(src)

    def test_delete(self, store, tmp_path: Path) -> None:
        src = tmp_path / "src"
        (src / "d").mkdir(parents=True)
        (src / "d" / "f").write_text("x")
        store.put_dir("steps/del", src)
        store.put_dir("steps/del-other", src)  # shares the prefix "steps/del": must survive
        store.delete("steps/del")
        assert not store.exists("steps/del")
        assert store.exists("steps/del-other")
        with pytest.raises(KilnError):
            store.fetch_dir("steps/del", tmp_path / "out")
        store.delete("steps/never-there")  # no error
        store.put_dir("steps/del", src)  # a deleted key can be stored again
        assert store.exists("steps/del")

    @pytest.mark.parametrize("key", ["../escape", "/abs", "a/../../b"])
    def test_bad_keys_are_refused(self, store, key: str, tmp_path: Path) -> None:
        with pytest.raises(ValueError):
            store.put_dir(key, tmp_path)


class ModelRepositoryContract:
    """What every ModelRepository promises (publishing is built on these primitives)."""

    @pytest.fixture
    def repo(self, make_repo) -> ModelRepository:
        return make_repo()

    @pytest.fixture
    def make_repo(self) -> Callable[[], ModelRepository]:
        """Return f() giving a NEW instance (own lock handles) on the same repository."""
        raise NotImplementedError

    @pytest.fixture
    def write_partial_version(self, repo) -> Callable[[str, int, dict[str, bytes]], None]:
        """Return f(name, version, files) leaving what a publish that died half-way leaves."""
        raise NotImplementedError

    @pytest.fixture
    def compile_store(self) -> ArtifactStore:
        raise NotImplementedError

    def test_versions_are_numeric_and_ordered(self, repo, tmp_path: Path) -> None:
        assert repo.versions("m") == []
        for v in (10, 2, 1):
            repo.write_version("m", v, version_dir(tmp_path, str(v), {"model.onnx": b"v%d" % v}))
        repo.write_version("other", 3, version_dir(tmp_path, "o", {"model.onnx": b"o"}))
        repo.write_file(".hidden/x", b"not a model")
        assert repo.versions("m") == [1, 2, 10]
        assert repo.model_names() == ["m", "other"]
        assert list(repo.iter_versions()) == [("m", 1), ("m", 2), ("m", 10), ("other", 3)]
        # A server's root is a folder of models (<repo>/triton/<name>/<version>/).
        repo.write_version("triton/m", 4, version_dir(tmp_path, "t", {"model.onnx": b"t"}))
        assert repo.model_names("triton") == ["m"] and repo.model_names("tflite") == []
        assert list(repo.iter_versions("triton")) == [("m", 4)]

    def test_write_and_fetch_version(self, repo, tmp_path: Path) -> None:
        files = {"model.xml": b"<net/>", "model.bin": os.urandom(4096), "variables/variables.index": b"idx"}
        src = version_dir(tmp_path, "1", files)
        repo.write_version("m", 1, src)
        got = repo.fetch_version("m", 1, tmp_path / "out")
        assert tree(got) == tree(src)
        assert repo.read_file(f"m/1/{MANIFEST}") == (src / MANIFEST).read_bytes()
        with pytest.raises(KilnError) as err:
            repo.fetch_version("m", 2, tmp_path / "none")
        assert err.value.code == "NOT_FOUND"

    def test_partial_version_is_invisible_and_replaced(self, repo, write_partial_version, tmp_path: Path) -> None:
        repo.write_version("m", 1, version_dir(tmp_path, "1", {"model.onnx": b"one"}))
        write_partial_version("m", 2, {"model.bin": b"half", "stale.bin": b"left over"})
        assert repo.versions("m") == [1]
        with pytest.raises(KilnError) as err:
            repo.fetch_version("m", 2, tmp_path / "x")
        assert err.value.code == "NOT_FOUND"
        src = version_dir(tmp_path, "2", {"model.onnx": b"two"})
        repo.write_version("m", 2, src)
        assert repo.versions("m") == [1, 2]
        assert tree(repo.fetch_version("m", 2, tmp_path / "out")) == tree(src)

    def test_read_and_write_file(self, repo) -> None:
        assert repo.read_file("m/config.pbtxt") is None
        repo.write_file("m/config.pbtxt", b"name: 'm'")
        repo.write_file("config.json", b"{}")
        assert repo.read_file("m/config.pbtxt") == b"name: 'm'"
        repo.write_file("m/config.pbtxt", b"name: 'm2'")
        assert repo.read_file("m/config.pbtxt") == b"name: 'm2'"
        assert repo.read_file("config.json") == b"{}"
        assert repo.base_path("m") == repo.uri("m")

    def test_write_file_replace_is_atomic_for_readers(self, repo, make_repo) -> None:
        old, new = b"a" * (1 << 20), b"b" * (1 << 20)
        repo.write_file("models.config", old)
        reader_repo = make_repo()
        seen: list[bytes | None] = []
        done = threading.Event()

        def read() -> None:
            while not done.is_set():
                seen.append(reader_repo.read_file("models.config"))

        t = threading.Thread(target=read)
        t.start()
        try:
            for i in range(12):
                repo.write_file("models.config", new if i % 2 == 0 else old)
        finally:
            done.set()
            t.join()
        assert seen, "the reader never ran"
        bad = [len(s) if s is not None else None for s in seen if s not in (old, new)]
        assert bad == [], f"{len(bad)} of {len(seen)} reads saw neither the old nor the new bytes"

    def test_lock_excludes_other_publishers(self, make_repo) -> None:
        repo = make_repo()
        repo.write_file("counter", b"0")
        inside = []
        overlaps = []
        errors: list[BaseException] = []

        def worker() -> None:
            mine = make_repo()  # its own client or file handle, as another process would have
            try:
                for _ in range(4):
                    with mine.lock():
                        inside.append(1)
                        if len(inside) > 1:
                            overlaps.append(len(inside))
                        n = int(mine.read_file("counter") or b"0")
                        time.sleep(0.02)  # widen the read-modify-write window
                        mine.write_file("counter", str(n + 1).encode())
                        inside.pop()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert overlaps == []
        assert repo.read_file("counter") == b"12"

    def test_compile_and_publish_end_to_end(self, repo, compile_store, cnn_onnx: Path, tmp_path: Path) -> None:
        import onnxruntime as ort
        from tritonclient.grpc import model_config_pb2

        first = compile_model(cnn_onnx, spec(), store=compile_store, repository=repo)
        assert first.ok, first.targets["onnxruntime"].error
        assert first.targets["onnxruntime"].published["uri"] == repo.uri("triton/cnn/1")
        assert repo.versions("triton/cnn") == [1]
        manifest = read_manifest(repo, "cnn", 1)
        assert manifest["source"]["sha256"] == hashlib.sha256(cnn_onnx.read_bytes()).hexdigest()
        assert manifest["parity"]["passed"] is True
        assert manifest["version"] == 1

        # The published model is the model: same outputs as the source on the same input.
        out = repo.fetch_version("triton/cnn", 1, tmp_path / "fetched")
        x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
        want = ort.InferenceSession(str(cnn_onnx)).run(None, {"input": x})[0]
        got = ort.InferenceSession(str(out / "model.onnx")).run(None, {"input": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

        config = text_format.Parse(repo.read_file("triton/cnn/config.pbtxt").decode(), model_config_pb2.ModelConfig())
        assert (config.name, config.platform) == ("cnn", "onnxruntime_onnx")
        assert config.max_batch_size == 8 and list(config.input[0].dims) == [3, 32, 32]  # open batch axis
        ovms = json.loads(repo.read_file("ovms/config.json"))
        assert ovms["model_config_list"][0]["config"] == {
            "name": "cnn",
            "base_path": repo.base_path("triton/cnn"),
            "model_version_policy": {"all": {}},
            "plugin_config": {"INFERENCE_PRECISION_HINT": "f32"},
        }

        second = compile_model(cnn_onnx, spec(), store=compile_store, repository=repo)
        assert second.ok
        # Every step but publish came out of the store's cache.
        assert {k: o.cached for k, o in second.steps.items()} == {
            "reference": True,
            "export:onnxruntime": True,
            "publish:onnxruntime": False,
        }
        # The same artifact again: version 1 holds it, so nothing is published twice.
        assert second.targets["onnxruntime"].published["uri"] == repo.uri("triton/cnn/1")
        assert second.steps["publish:onnxruntime"].meta["reused"] is True
        assert repo.versions("triton/cnn") == [1]
        rebuilt = compile_model(cnn_onnx, spec(), store=compile_store, repository=repo, use_cache=False)
        assert rebuilt.targets["onnxruntime"].published["uri"] == repo.uri("triton/cnn/2")  # a rebuild asks for one
        assert repo.versions("triton/cnn") == [1, 2]

        clash = compile_model(cnn_onnx, spec(version=1, precision="fp16"), store=compile_store, repository=repo)
        assert clash.targets["onnxruntime"].error["code"] == "REPOSITORY_CONFLICT"
        assert repo.versions("triton/cnn") == [1, 2]

        # Mounted at /models in the servers' containers: base paths follow, and the root is kept.
        third = compile_model(cnn_onnx, spec(serving={"root": "/models"}), store=compile_store, repository=repo)
        assert third.ok
        ovms = json.loads(repo.read_file("ovms/config.json"))
        assert ovms["model_config_list"][0]["config"]["base_path"] == "/models/triton/cnn"
        assert json.loads(repo.read_file("kiln-repository.json")) == {"serving_root": "/models"}

    def test_reader_during_publish_never_sees_half_a_version(self, repo, make_repo, tmp_path: Path) -> None:
        # An export artifact with many files, so a publish takes many separate writes.
        art_dir = tmp_path / "art"
        (art_dir / "variables").mkdir(parents=True)
        for i in range(10):
            (art_dir / "variables" / f"shard-{i}").write_bytes(os.urandom(32 * 1024))
        (art_dir / "model.onnx").write_bytes(os.urandom(64 * 1024))
        artifact = Artifact(root=art_dir, kind="onnx", entry="model.onnx", meta={"target": "onnxruntime"})
        artifact.save()
        expected = {p.relative_to(art_dir).as_posix() for p in art_dir.rglob("*") if p.is_file()}
        expected = (expected - {"kiln-artifact.json"}) | {MANIFEST}

        reader = make_repo()
        checked: list[int] = []
        violations: list[str] = []
        done = threading.Event()

        def read() -> None:
            n = 0
            while not done.is_set():
                for v in reader.versions("triton/live"):
                    n += 1
                    got = reader.fetch_version("triton/live", v, tmp_path / f"read-{n}")
                    files = {p.relative_to(got).as_posix() for p in got.rglob("*") if p.is_file()}
                    if files != expected:
                        violations.append(f"v{v}: {sorted(files ^ expected)}")
                    elif json.loads((got / MANIFEST).read_text())["version"] != v:
                        violations.append(f"v{v}: manifest of another version")
                    checked.append(v)

        t = threading.Thread(target=read)
        t.start()
        try:
            for _ in range(4):
                publish_version(repo, artifact, name="live", version=None, manifest={"kiln_manifest": 1})
        finally:
            done.set()
            t.join()
        assert violations == []
        assert repo.versions("triton/live") == [1, 2, 3, 4]
        assert checked, "the reader never saw a version"

    @pytest.mark.parametrize("died", ["after the version", "after the model record"])
    def test_a_rerun_of_a_jobs_publish_finds_its_version_instead_of_adding_one(
        self, repo, tmp_path: Path, died: str
    ) -> None:
        """A worker killed after publishing but before the job store heard of it reruns the step.

        The soak benchmark found the second version this used to publish (benchmarks/bench_soak.py).
        """
        art_dir = tmp_path / "art"
        art_dir.mkdir()
        (art_dir / "model.onnx").write_bytes(b"onnx")
        artifact = Artifact(root=art_dir, kind="onnx", entry="model.onnx", meta={"target": "onnxruntime"}).save()
        publish_version(repo, artifact, name="m", version=None, manifest={"job_id": "job-a"})
        first = publish_version(repo, artifact, name="m", version=None, manifest={"job_id": "job-b"})
        publish_version(
            repo, artifact, name="m", version=None, manifest={"job_id": "job-c"}
        )  # others publish meanwhile
        if died == "after the version":  # the model record never learnt of job-b's version 2
            record = json.loads(repo.read_file("triton/m/kiln-model.json") or b"{}")
            record["published_by"].pop("job-b")
            record["latest"] = 1
            repo.write_file("triton/m/kiln-model.json", json.dumps(record).encode())
        again = publish_version(repo, artifact, name="m", version=None, manifest={"job_id": "job-b"})
        assert (first.version, again.version) == (2, 2)
        assert repo.versions("triton/m") == [1, 2, 3]
        with pytest.raises(RepositoryConflict):  # another job asking for that version still may not have it
            publish_version(repo, artifact, name="m", version=2, manifest={"job_id": "job-d"})
        assert publish_version(repo, artifact, name="m", version=2, manifest={"job_id": "job-b"}).version == 2


# --------------------------------------------------------------------------- local backends


class TestLocalArtifactStore(ArtifactStoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> ArtifactStore:
        return LocalArtifactStore(tmp_path / "store")

    @pytest.fixture
    def write_partial(self, store):
        def write(key: str, files: dict[str, bytes]) -> None:
            for rel, data in files.items():
                p = store.root / key / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)

        return write

    def test_move_renames_on_one_filesystem_and_copies_otherwise(
        self, store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        src = tmp_path / "out"
        src.mkdir()
        (src / "model.onnx").write_bytes(b"m" * 1000)
        inode = (src / "model.onnx").stat().st_ino
        store.put_dir("steps/renamed", src, move=True)
        assert not src.exists()  # taken over: the same file, not a copy
        assert (store.root / "steps" / "renamed" / "model.onnx").stat().st_ino == inode
        # A tree with a symbolic link is copied (the link resolved), never renamed.
        linked = tmp_path / "linked"
        linked.mkdir()
        (linked / "model.onnx").write_bytes(b"x")
        (linked / "alias.onnx").symlink_to(linked / "model.onnx")
        store.put_dir("steps/linked", linked, move=True)
        assert linked.exists() and not (store.root / "steps" / "linked" / "alias.onnx").is_symlink()
        # Across filesystems rename fails (EXDEV): the tree is copied and stays in place.
        other = tmp_path / "other"
        other.mkdir()
        (other / "model.onnx").write_bytes(b"y")

        def exdev(a, b):
            raise OSError(18, "Invalid cross-device link")

        import services.storage.local as local_module

        real = os.rename
        monkeypatch.setattr(local_module.os, "rename", lambda a, b: exdev(a, b) if Path(a) == other else real(a, b))
        store.put_dir("steps/copied", other, move=True)
        assert other.exists() and (store.root / "steps" / "copied" / "model.onnx").read_bytes() == b"y"


class TestLocalModelRepository(ModelRepositoryContract):
    @pytest.fixture
    def make_repo(self, tmp_path: Path):
        return lambda: LocalModelRepository(tmp_path / "repo")

    @pytest.fixture
    def write_partial_version(self, repo):
        # The local backend writes a hidden temp dir and renames it: a crash leaves that.
        def write(name: str, version: int, files: dict[str, bytes]) -> None:
            for rel, data in files.items():
                p = repo.root / name / f".tmp-{version}-dead" / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_bytes(data)

        return write

    @pytest.fixture
    def compile_store(self, tmp_path: Path) -> ArtifactStore:
        return LocalArtifactStore(tmp_path / "store")


# --------------------------------------------------------------------------- S3 backends


def _prefix() -> str:
    return f"t-{uuid.uuid4().hex[:10]}/kiln"


@pytest.fixture(scope="module")
def s3_client(s3_server: S3Server):
    """One client for the module: building a boto3 client costs ~0.3 s; clients are thread-safe."""
    return s3_server.client()


class TestS3ArtifactStore(ArtifactStoreContract):
    @pytest.fixture
    def store(self, s3_server: S3Server, s3_client) -> ArtifactStore:
        from services.storage.s3 import S3ArtifactStore

        return S3ArtifactStore(s3_server.bucket, _prefix(), client=s3_client)

    @pytest.fixture
    def write_partial(self, store):
        def write(key: str, files: dict[str, bytes]) -> None:
            for rel, data in files.items():
                store.client.put_object(Bucket=store.location.bucket, Key=store.location.key(key, rel), Body=data)

        return write

    def test_big_file_goes_multipart_and_uri_names_the_object(self, store, nested_dir: Path) -> None:
        uri = store.put_dir("steps/big", nested_dir)
        assert uri == f"s3://{store.location.bucket}/{store.location.prefix}/steps/big"
        head = store.client.head_object(Bucket=store.location.bucket, Key=store.location.key("steps/big/big.bin"))
        assert head["ContentLength"] == BIG
        # A multipart object's ETag is "<md5 of part md5s>-<part count>": 9 MiB in 8 MiB parts.
        assert head["ETag"].strip('"').endswith("-2")
        small = store.client.head_object(Bucket=store.location.bucket, Key=store.location.key("steps/big/top.txt"))
        assert "-" not in small["ETag"]

    def test_fetch_refuses_an_object_replaced_under_a_complete_key(self, store, nested_dir: Path, tmp_path) -> None:
        store.put_dir("steps/k", nested_dir)
        key = store.location.key("steps/k/top.txt")
        store.client.put_object(Bucket=store.location.bucket, Key=key, Body=b"tampered, longer")
        with pytest.raises(KilnError) as err:
            store.fetch_dir("steps/k", tmp_path / "out")
        assert err.value.code == "SERVICE_UNAVAILABLE"
        assert "top.txt" in err.value.message

    def test_errors_become_kiln_errors(self, s3_server: S3Server) -> None:
        from botocore.config import Config

        from services.storage.s3 import S3ArtifactStore

        opts = s3_server.options()
        with pytest.raises(KilnError) as err:
            S3ArtifactStore("no-such-bucket-kiln", "p", **opts).put_dir("k", Path(__file__).parent)
        assert err.value.code == "NOT_FOUND"
        assert "no-such-bucket-kiln" in err.value.message

        with pytest.raises(KilnError) as err:
            S3ArtifactStore(s3_server.bucket, "p", **{**opts, "secret_access_key": "wrong"}).exists("k")
        assert err.value.code == "SERVICE_UNAVAILABLE"
        assert "KILN_S3_SECRET_ACCESS_KEY" in err.value.hint

        import boto3

        closed = boto3.session.Session().client(
            "s3",
            endpoint_url="http://127.0.0.1:9",  # discard port: nothing listens
            aws_access_key_id="x",
            aws_secret_access_key="y",
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=1),
        )
        with pytest.raises(KilnError) as err:
            S3ArtifactStore("b", client=closed).exists("k")
        assert err.value.code == "SERVICE_UNAVAILABLE"
        assert "KILN_S3_ENDPOINT_URL" in err.value.hint


class TestS3ModelRepository(ModelRepositoryContract):
    @pytest.fixture
    def prefix(self) -> str:
        return _prefix()

    @pytest.fixture
    def make_repo(self, s3_server: S3Server, s3_client, prefix: str):
        from services.repository.s3 import S3ModelRepository

        return lambda **kw: S3ModelRepository(
            s3_server.bucket, prefix, client=s3_client, lock_poll=kw.pop("lock_poll", 0.05), **kw
        )

    @pytest.fixture
    def write_partial_version(self, repo):
        # A publish that died before its manifest leaves objects under the numeric prefix.
        def write(name: str, version: int, files: dict[str, bytes]) -> None:
            for rel, data in files.items():
                key = repo.location.key(name, str(version), rel)
                repo.client.put_object(Bucket=repo.location.bucket, Key=key, Body=data)

        return write

    @pytest.fixture
    def compile_store(self, s3_server: S3Server, s3_client, prefix: str) -> ArtifactStore:
        from services.storage.s3 import S3ArtifactStore

        return S3ArtifactStore(s3_server.bucket, prefix + "-store", client=s3_client)

    def test_base_path_is_the_s3_url_servers_take(self, repo, prefix: str, s3_server: S3Server) -> None:
        assert repo.base_path("cnn") == f"s3://{s3_server.bucket}/{prefix}/cnn"
        assert repo.uri() == f"s3://{s3_server.bucket}/{prefix}"

    def test_version_upload_order_puts_model_files_after_their_payload(self, repo, tmp_path: Path) -> None:
        from services.repository.s3 import upload_phases

        assert upload_phases(
            [MANIFEST, "model.xml", "model.bin", "saved_model.pb", "variables/variables.data-00000-of-00001"]
        ) == [["model.bin", "variables/variables.data-00000-of-00001"], ["model.xml", "saved_model.pb"], [MANIFEST]]
        # And write_version really follows it: record the order of PutObject/multipart calls.
        order: list[str] = []
        repo.client.meta.events.register(
            "before-parameter-build.s3.PutObject", lambda params, **kw: order.append(params["Key"].rsplit("/", 1)[-1])
        )
        files = {"model.bin": b"w" * 100, "model.xml": b"<net/>", "extra.txt": b"labels"}
        repo.write_version("ov", 1, version_dir(tmp_path, "1", files))
        assert order[-1] == MANIFEST
        assert set(order[:2]) == {"model.bin", "extra.txt"}
        assert order[2] == "model.xml"

    def test_write_version_refuses_a_complete_version_and_needs_a_manifest(self, repo, tmp_path: Path) -> None:
        repo.write_version("m", 1, version_dir(tmp_path, "1", {"model.onnx": b"one"}))
        with pytest.raises(KilnError) as err:
            repo.write_version("m", 1, version_dir(tmp_path, "again", {"model.onnx": b"other"}))
        assert err.value.code == "REPOSITORY_CONFLICT"
        bare = tmp_path / "bare"
        bare.mkdir()
        (bare / "model.onnx").write_bytes(b"x")
        with pytest.raises(KilnError):
            repo.write_version("m", 2, bare)
        assert repo.versions("m") == [1]

    def test_lock_held_elsewhere_times_out_with_a_code(self, make_repo) -> None:
        holder, waiter = make_repo(), make_repo(lock_timeout=0.5)
        with holder.lock():
            t0 = time.monotonic()
            with pytest.raises(KilnError) as err:
                with waiter.lock():
                    pass
            assert err.value.code == "SERVICE_UNAVAILABLE"
            assert time.monotonic() - t0 < 5
        with waiter.lock():  # released: free again
            pass

    def test_lock_of_a_crashed_holder_expires(self, make_repo) -> None:
        repo = make_repo(lock_ttl=1.0, lock_timeout=15)
        # A holder that died: its lease object stays, nobody renews it.
        repo.client.put_object(
            Bucket=repo.location.bucket,
            Key=repo.location.key(".kiln-lock"),
            Body=json.dumps({"owner": "dead-host:1", "ttl": 1.0}).encode(),
            IfNoneMatch="*",
        )
        t0 = time.monotonic()
        with repo.lock():
            waited = time.monotonic() - t0
        assert 0.5 < waited < 10, waited

    @pytest.mark.parametrize(
        ("code", "grace", "taken"),
        [("InternalError", 60.0, True), ("InternalError", 0.0, False), ("AccessDenied", 60.0, False)],
    )
    def test_lock_rides_out_a_server_that_says_try_again(
        self, make_repo, monkeypatch: pytest.MonkeyPatch, code: str, grace: float, taken: bool
    ) -> None:
        # SeaweedFS just restarted answers InternalError until its volumes are ready, for
        # longer than botocore's retries; taking the lock keeps trying for TRANSIENT_GRACE.
        from botocore.exceptions import ClientError

        import services.repository.s3 as s3_repo

        monkeypatch.setattr(s3_repo, "TRANSIENT_GRACE", grace)
        repo = make_repo()
        real_put, failures = repo.client.put_object, [0]

        def put_failing_three_times(**kw):
            if kw.get("IfNoneMatch") == "*" and failures[0] < 3:
                failures[0] += 1
                raise ClientError({"Error": {"Code": code, "Message": "please try again"}}, "PutObject")
            return real_put(**kw)

        monkeypatch.setattr(repo.client, "put_object", put_failing_three_times)
        if taken:
            with repo.lock():
                pass
            assert failures[0] == 3
        else:
            with pytest.raises(KilnError) as err:
                with repo.lock():
                    pass
            assert err.value.code == "SERVICE_UNAVAILABLE" and code in err.value.message
            assert failures[0] == 1  # a refusal, or no grace left, fails at once

    @pytest.mark.parametrize("noticed_by", ["renewal", "release"])
    def test_lock_lost_while_held_is_reported(self, make_repo, noticed_by: str) -> None:
        repo = make_repo(lock_ttl=0.6 if noticed_by == "renewal" else 60)
        with pytest.raises(KilnError) as err:
            with repo.lock():
                # Another party breaks the lease (as a waiter would after a long stall).
                repo.client.delete_object(Bucket=repo.location.bucket, Key=repo.location.key(".kiln-lock"))
                if noticed_by == "renewal":
                    time.sleep(0.6)
        assert err.value.code == "SERVICE_UNAVAILABLE"
        assert "lost the lock" in err.value.message


# --------------------------------------------------------------------------- factory


def _settings(s3_server: S3Server | None = None) -> Settings:
    if s3_server is None:
        return Settings(_env_file=None)
    return Settings(
        _env_file=None,
        s3_endpoint_url=s3_server.endpoint_url,
        s3_region=s3_server.region,
        s3_access_key_id=s3_server.access_key_id,
        s3_secret_access_key=s3_server.secret_access_key,
    )


def test_factory_builds_local_backends_from_paths_and_file_urls(tmp_path: Path) -> None:
    from services.storage.factory import artifact_store_from_url, repository_from_url

    store = artifact_store_from_url(str(tmp_path / "s"), _settings())
    assert isinstance(store, LocalArtifactStore) and store.root == tmp_path / "s"
    store = artifact_store_from_url((tmp_path / "s2").as_uri(), _settings())
    assert isinstance(store, LocalArtifactStore) and store.root == tmp_path / "s2"
    repo = repository_from_url(f"file://{tmp_path}/r", _settings())
    assert isinstance(repo, LocalModelRepository) and repo.root == (tmp_path / "r").resolve()


def test_factory_builds_s3_backends_with_settings(s3_server: S3Server, tmp_path: Path) -> None:
    from services.repository.s3 import S3ModelRepository
    from services.storage.factory import artifact_store_from_url, repository_from_url
    from services.storage.s3 import S3ArtifactStore

    prefix = _prefix()
    settings = _settings(s3_server)
    store = artifact_store_from_url(f"s3://{s3_server.bucket}/{prefix}/store/", settings)
    assert isinstance(store, S3ArtifactStore)
    assert (store.location.bucket, store.location.prefix) == (s3_server.bucket, f"{prefix}/store")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("via settings")
    store.put_dir("k", tmp_path / "d")  # the settings' credentials reached the client
    assert store.exists("k")
    repo = repository_from_url(f"s3://{s3_server.bucket}/{prefix}/repo", settings)
    assert isinstance(repo, S3ModelRepository)
    assert repo.base_path("m") == f"s3://{s3_server.bucket}/{prefix}/repo/m"


@pytest.mark.parametrize("url", ["gs://bucket/models", "ftp://host/x", "s3:///no-bucket", "file://remote/x", ""])
def test_factory_refuses_unknown_locations_with_a_hint(url: str) -> None:
    from services.storage.factory import artifact_store_from_url, repository_from_url

    for build in (artifact_store_from_url, repository_from_url):
        with pytest.raises(KilnError) as err:
            build(url, _settings())
        assert err.value.code == "INVALID_SPEC"
        assert "s3://bucket/prefix" in err.value.hint
