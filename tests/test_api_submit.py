"""POST /compile and the job resources: what is accepted, what is refused (exact codes), nothing lost.

The API runs in-process against a SQLite job store and the real Redis (database 14); no
worker runs here, so accepted jobs stay queued and their first message waits in Redis.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from jobs_support import redis_url

from api.app import create_app
from services.settings import Settings
from workers.app import create_celery_app

LIMIT = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    root = tmp_path_factory.mktemp("api")
    return Settings(
        cache_dir=root / "cache",
        data_dir=root / "data",
        repository=str(root / "repo"),
        artifact_store=str(root / "store"),
        broker_url=redis_url(14),
        max_upload_bytes=LIMIT,
    )


@pytest.fixture(scope="module")
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings, create_celery_app(settings))) as c:
        yield c


def _post(client: TestClient, name: str, data: bytes, spec: Any, **extra: Any) -> Any:
    # No worker runs in this module: a spec object asks to queue the job anyway (what is
    # refused without that has its own test).
    if isinstance(spec, dict):
        spec = {"wait_for_workers": True, **spec}
    files: dict[str, Any] = {"model": (name, data, "application/octet-stream")}
    if spec is not None:
        files["spec"] = (None, spec if isinstance(spec, str) else json.dumps(spec), "application/json")
    files.update(extra)
    return client.post("/compile", files=files)


def _job_count(client: TestClient) -> int:
    return int(client.get("/jobs", params={"limit": 1}).json()["count"])


def _refused(client: TestClient, status: int, code: str, name: str, data: bytes, spec: Any = None) -> dict[str, Any]:
    before = _job_count(client)
    r = _post(client, name, data, {"targets": ["onnxruntime"]} if spec is None else spec)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["code"] == code and body["hint"], body
    assert _job_count(client) == before  # a refused upload leaves no job behind
    return body


def test_an_accepted_upload_is_stored_by_hash_recorded_and_queued(
    client: TestClient, settings: Settings, cnn_onnx: Path
) -> None:
    data = cnn_onnx.read_bytes()
    queue = redis.Redis.from_url(settings.broker_url)
    waiting = queue.llen("kiln.onnxruntime")
    r = _post(client, "my model (v2).onnx", data, {"targets": ["onnxruntime", "openvino"], "name": "cnn"})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert r.headers["location"] == f"/jobs/{job_id}" == r.json()["url"]
    sha = hashlib.sha256(data).hexdigest()
    stored = Path(settings.store_location) / "sources" / sha / "my_model_v2_.onnx"
    assert stored.read_bytes() == data  # the sanitized name, under the content address
    job = client.get(f"/jobs/{job_id}").json()
    assert job["status"] == "queued" and job["name"] == "cnn"
    assert job["source"] == {
        "filename": "my_model_v2_.onnx",
        "sha256": sha,
        "format": "onnx",
        "detected_as": "protobuf starting with ir_version (ONNX ModelProto)",
        "size": len(data),
    }
    steps = {s["id"]: s for s in job["steps"]}
    assert steps["reference"]["status"] == "queued" and steps["export:openvino"]["status"] == "pending"
    assert steps["export:openvino"]["queue"] == "kiln.openvino"
    assert set(job["targets"]) == {"onnxruntime", "openvino"}
    assert job["targets"]["openvino"]["steps"][-1] == "publish:openvino"
    # The broker carries only ids: one message for the first step, on its engine's queue.
    assert queue.llen("kiln.onnxruntime") == waiting + 1
    body = json.loads(queue.lindex("kiln.onnxruntime", 0))
    assert json.loads(__import__("base64").b64decode(body["body"]))[0] == [job_id, "reference"]


def test_an_archive_upload_is_vetted_and_accepted(client: TestClient, cnn_onnx: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        tf.add(cnn_onnx, arcname="model/cnn.onnx")
    r = _post(client, "bundle.tar.gz", buf.getvalue(), {"targets": ["onnxruntime"]})
    assert r.status_code == 202, r.text
    assert client.get(f"/jobs/{r.json()['id']}").json()["source"]["format"] == "onnx"


def test_an_invalid_spec_is_422_naming_the_field(client: TestClient, cnn_onnx: Path) -> None:
    body = _refused(
        client, 422, "INVALID_SPEC", "m.onnx", cnn_onnx.read_bytes(), {"targets": ["onnxruntime"], "precision": "fp64"}
    )
    assert [e["field"] for e in body["details"]["errors"]] == ["precision"]
    body = _refused(client, 422, "INVALID_SPEC", "m.onnx", cnn_onnx.read_bytes(), "{not json")
    assert "JSON" in body["message"]
    body = _refused(
        client,
        422,
        "INVALID_SPEC",
        "m.onnx",
        cnn_onnx.read_bytes(),
        {"targets": ["onnxruntime"], "calibration": "/etc/passwd"},
    )
    assert body["details"]["errors"][0]["field"] == "calibration"  # the server reads no paths


def test_an_unknown_target_is_422_listing_the_valid_ones(client: TestClient, cnn_onnx: Path) -> None:
    body = _refused(client, 422, "INVALID_SPEC", "m.onnx", cnn_onnx.read_bytes(), {"targets": ["coreml"]})
    assert body["details"]["errors"][0]["field"] == "targets.0"
    for t in ("onnxruntime", "openvino", "tflite", "tfserving", "tensorrt"):
        assert t in body["hint"]


def test_a_model_no_route_leads_from_is_422_no_route(client: TestClient) -> None:
    body = _refused(client, 422, "NO_ROUTE", "engine.plan", b"\x13\x37" * 64, {"targets": ["onnxruntime"]})
    assert "TensorRT plan" in body["message"] and body["details"]["source_format"] == "tensorrt_plan"


def test_missing_parts_are_refused(client: TestClient, cnn_onnx: Path) -> None:
    r = _post(client, "m.onnx", cnn_onnx.read_bytes(), None)
    assert r.status_code == 422 and r.json()["code"] == "INVALID_SPEC"
    r = client.post("/compile", files={"spec": (None, '{"targets":["onnxruntime"]}')})
    assert r.status_code == 400 and r.json()["code"] == "SOURCE_UNREADABLE"
    r = client.post("/compile", json={"targets": ["onnxruntime"]})
    assert r.status_code == 400 and "multipart/form-data" in r.json()["message"]


def test_corrupt_or_unknown_models_are_refused_at_submit(client: TestClient) -> None:
    _refused(client, 400, "SOURCE_UNREADABLE", "empty.onnx", b"")
    _refused(client, 415, "UNSUPPORTED_FORMAT", "noise.bin", b"\x13\x37" * 500)
    _refused(client, 400, "UNSAFE_INPUT", "weights.pt", pickle.dumps({"w": [1.0, 2.0]}, protocol=4))
    _refused(client, 415, "UNSUPPORTED_FORMAT", "broken.zip", b"PK\x03\x04" + b"\0" * 64)  # no central directory


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _tar(add: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        add(tf)
    return buf.getvalue()


def test_unsafe_archives_are_400_unsafe_input(client: TestClient, cnn_onnx: Path) -> None:
    model = cnn_onnx.read_bytes()
    body = _refused(client, 400, "UNSAFE_INPUT", "up.zip", _zip({"../../escape/model.onnx": model}))
    assert ".." in body["message"]

    def absolute(tf: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("/etc/model.onnx")
        info.size = len(model)
        tf.addfile(info, io.BytesIO(model))

    body = _refused(client, 400, "UNSAFE_INPUT", "abs.tar", _tar(absolute))
    assert "absolute" in body["message"]

    def link(tf: tarfile.TarFile) -> None:
        info = tarfile.TarInfo("model.onnx")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tf.addfile(info)

    body = _refused(client, 400, "UNSAFE_INPUT", "link.tar", _tar(link))
    assert "link" in body["message"]

    def deep(tf: tarfile.TarFile) -> None:  # once a RecursionError in the API: 500 INTERNAL
        info = tarfile.TarInfo("/".join(["d"] * 2100) + "/model.onnx")
        info.size = len(model)
        tf.addfile(info, io.BytesIO(model))

    body = _refused(client, 400, "UNSAFE_INPUT", "deep.tar", _tar(deep))
    assert "name of 4210 bytes" in body["message"]


def test_a_decompression_bomb_is_400_unsafe_input(client: TestClient) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("saved_model/saved_model.pb", b"\x08\x01")
        with zf.open("saved_model/variables/data", "w") as fh:
            for _ in range(64):
                fh.write(b"\0" * (1 << 20))  # 64 MiB of zeros, ~64 KiB compressed
    assert len(buf.getvalue()) < LIMIT
    body = _refused(client, 400, "UNSAFE_INPUT", "bomb.zip", buf.getvalue())
    assert "bomb" in body["hint"]


def test_an_oversized_upload_is_413_declared_or_streamed(client: TestClient) -> None:
    big = b"\x08\x08" + b"\0" * (LIMIT + 10)
    _refused(client, 413, "UPLOAD_TOO_LARGE", "big.onnx", big)


def test_a_streamed_upload_stops_being_read_once_over_the_limit(tmp_path: Path) -> None:
    """No Content-Length (chunked): the parser stops pulling the body as soon as the cap is crossed."""
    import anyio
    from starlette.requests import Request

    from api.upload import receive_upload
    from services.errors import UploadTooLarge

    boundary = "kilnboundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="big.onnx"\r\n\r\n').encode()
    pulled = []

    async def receive() -> dict[str, Any]:
        pulled.append(1)
        body = head if len(pulled) == 1 else b"\0" * (256 * 1024)
        return {"type": "http.request", "body": body, "more_body": len(pulled) < 64}  # 16 MiB offered

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/compile",
        "headers": [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())],
    }

    async def main() -> None:
        with pytest.raises(UploadTooLarge):
            await receive_upload(Request(scope, receive), max_bytes=LIMIT, tmp_root=tmp_path)

    anyio.run(main)
    assert len(pulled) == 1 + LIMIT // (256 * 1024)  # the head, then chunks until just past 2 MiB: no more
    assert list(tmp_path.iterdir()) == []  # the partial file is gone


def test_a_streamed_upload_is_hashed_on_the_way(tmp_path: Path, cnn_onnx: Path) -> None:
    import anyio
    from starlette.requests import Request

    from api.upload import receive_upload

    data = cnn_onnx.read_bytes()
    boundary = "b0undary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="spec"\r\n\r\n{{"targets":["onnxruntime"]}}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="model"; filename="../../x/cnn.onnx"\r\n\r\n'
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/compile",
        "headers": [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())],
    }

    async def main() -> Any:
        return await receive_upload(Request(scope, receive), max_bytes=LIMIT, tmp_root=tmp_path)

    up = anyio.run(main)
    model = up.files["model"]
    assert model.filename == "cnn.onnx"  # no directories from the client
    assert model.sha256 == hashlib.sha256(data).hexdigest() and model.path.read_bytes() == data
    assert json.loads(up.fields["spec"]) == {"targets": ["onnxruntime"]}
    up.cleanup()


def test_unknown_jobs_are_404(client: TestClient) -> None:
    for method, path in (
        ("GET", "/jobs/nope"),
        ("DELETE", "/jobs/nope"),
        ("GET", "/jobs/nope/events"),
        ("GET", "/jobs/nope/logs"),
        ("GET", "/jobs/nope/artifacts/onnxruntime"),
    ):
        r = client.request(method, path)
        assert r.status_code == 404, (method, path, r.text)
        assert r.json()["code"] == "NOT_FOUND"


def test_cancelling_a_queued_job_means_it_never_runs(client: TestClient, cnn_onnx: Path) -> None:
    job_id = _post(client, "c.onnx", cnn_onnx.read_bytes(), {"targets": ["onnxruntime"]}).json()["id"]
    r = client.delete(f"/jobs/{job_id}")
    assert r.status_code == 202
    job = r.json()
    assert job["status"] == "cancelled" and job["error"]["code"] == "CANCELLED"
    assert {s["status"] for s in job["steps"]} == {"cancelled"}
    assert client.delete(f"/jobs/{job_id}").json()["status"] == "cancelled"  # idempotent
    # Its events stream ends (the job is final) and says so.
    stream = client.get(f"/jobs/{job_id}/events")
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: ")]
    ids = [int(line[4:]) for line in stream.text.splitlines() if line.startswith("id: ")]
    assert [e["type"] for e in events][-2:] == ["cancelled", "finished"]
    # A client reconnecting with Last-Event-ID gets only what it missed; after the end, nothing.
    resumed = client.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": str(ids[-3])}).text
    assert [int(line[4:]) for line in resumed.splitlines() if line.startswith("id: ")] == ids[-2:]
    assert "id: " not in client.get(f"/jobs/{job_id}/events", headers={"Last-Event-ID": str(ids[-1])}).text
    r = client.get(f"/jobs/{job_id}/artifacts/onnxruntime")
    assert r.status_code == 404 and "no artifact" in r.json()["message"]
    r = client.get(f"/jobs/{job_id}/artifacts/tflite")
    assert r.status_code == 404 and "onnxruntime" in r.json()["hint"]


def test_jobs_are_listed_filtered_and_paged(client: TestClient, cnn_onnx: Path) -> None:
    spec = {"targets": ["onnxruntime"], "name": "listed"}
    ids = [_post(client, "l.onnx", cnn_onnx.read_bytes(), spec).json()["id"] for _ in range(3)]
    page = client.get("/jobs", params={"name": "listed", "limit": 2}).json()
    assert page["count"] == 3 and [j["id"] for j in page["data"]] == ids[::-1][:2]
    rest = client.get("/jobs", params={"name": "listed", "limit": 2, "offset": 2}).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]]
    assert client.get("/jobs", params={"status": "running", "name": "listed"}).json()["count"] == 0
    r = client.get("/jobs", params={"status": "exploded"})
    assert (
        r.status_code == 422
        and r.json()["code"] == "INVALID_SPEC"
        and r.json()["details"]["errors"][0]["field"] == "status"
    )


def test_a_calibration_file_travels_as_its_own_part(client: TestClient, cnn_onnx: Path) -> None:
    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, input=np.zeros((2, 3, 32, 32), np.float32))
    r = _post(
        client,
        "q.onnx",
        cnn_onnx.read_bytes(),
        {"targets": ["onnxruntime"], "precision": "int8", "calibration": "x"},
        calibration=("calib.npz", buf.getvalue(), "application/octet-stream"),
    )
    assert r.status_code == 202, r.text
    job = client.get(f"/jobs/{r.json()['id']}").json()
    assert job["spec"]["calibration"] == "calib.npz"


def _model_with_unique() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Unique", ["r"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return bytes(model.SerializeToString())


def test_a_model_tensorrt_cannot_parse_is_refused_at_submit_with_its_ops(client: TestClient, cnn_onnx: Path) -> None:
    # Refused before anything is queued: the job would otherwise wait for a GPU worker only
    # to fail there (or forever, where no GPU worker runs).
    spec = {"targets": ["onnxruntime", "tensorrt"], "tensorrt_variant": "cu12"}
    body = _refused(client, 422, "UNSUPPORTED_OPS", "unique.onnx", _model_with_unique(), spec)
    assert body["details"]["ops"] == {"Unique": 1} and "Unique" in body["message"]
    assert body["details"]["tensorrt"].startswith("10.")
    # The same model without the TensorRT target, and a model TensorRT can parse, are accepted.
    assert _post(client, "unique.onnx", _model_with_unique(), {"targets": ["onnxruntime"]}).status_code == 202
    assert _post(client, "cnn.onnx", cnn_onnx.read_bytes(), spec).status_code == 202


def _model_with_foldable_unique() -> bytes:
    """Unique (which TensorRT's parser refuses) only on a constant: constant folding removes it."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    const = numpy_helper.from_array(np.array([3.0, 1.0, 3.0, 2.0], np.float32), "c")
    graph = helper.make_graph(
        [
            helper.make_node("Unique", ["c"], ["u"], sorted=1),
            helper.make_node("ReduceSum", ["u"], ["s"], keepdims=1),
            helper.make_node("Add", ["x", "s"], ["y"]),
        ],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
        initializer=[const],
    )
    return bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString())


def test_tensorrt_pre_flight_judges_the_model_the_worker_will_build(client: TestClient) -> None:
    # The GPU worker builds the optimised model, in which the Unique on a constant is folded away.
    spec = {"targets": ["tensorrt"], "tensorrt_variant": "cu12"}
    assert _post(client, "foldable.onnx", _model_with_foldable_unique(), spec).status_code == 202
    # Without the optimiser the model is built as uploaded, Unique and all: refused now.
    body = _refused(
        client, 422, "UNSUPPORTED_OPS", "foldable.onnx", _model_with_foldable_unique(), {**spec, "optimize": False}
    )
    assert body["details"]["ops"] == {"Unique": 1}


def test_an_input_the_onnx_model_does_not_have_is_422_at_submit(client: TestClient, cnn_onnx: Path) -> None:
    spec = {"targets": ["onnxruntime"], "inputs": {"images": {"shape": [1, 3, 32, 32]}}}
    body = _refused(client, 422, "INVALID_SPEC", "cnn.onnx", cnn_onnx.read_bytes(), spec)
    assert body["details"]["errors"] == [{"field": "inputs.images", "problem": "the model has no such input"}]
    assert "['input']" in body["message"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"version": 10**30}, "version"),
        ({"validation": {"seed": -5}}, "validation.seed"),
        ({"benchmark": {"iterations": 10**12}}, "benchmark.iterations"),
        ({"inputs": {"input": {"shape": [4096, 3, 1024, 1024]}}}, "inputs.input"),
    ],
)
def test_out_of_bounds_specs_are_422_naming_the_field(
    client: TestClient, cnn_onnx: Path, extra: dict, field: str
) -> None:
    body = _refused(
        client, 422, "INVALID_SPEC", "cnn.onnx", cnn_onnx.read_bytes(), {"targets": ["onnxruntime"], **extra}
    )
    assert field in [e["field"] for e in body["details"]["errors"]]


def test_int4_for_a_target_without_int4_is_422_no_route(client: TestClient, cnn_onnx: Path) -> None:
    spec = {"targets": ["tensorrt"], "precision": "int4"}
    body = _refused(client, 422, "NO_ROUTE", "m.onnx", cnn_onnx.read_bytes(), spec)
    assert "to tensorrt at int4" in body["message"]
    assert "Kiln can build: onnxruntime, openvino." in body["hint"]
