"""Signed versions: `kiln compile` signs what it publishes (OpenSSF model-signing, Kiln's key), and
`kiln verify` tells each kind of tampering apart, on a local repository and on a real S3 server.

A real tiny CNN is compiled and published once per module with the real CLI; each case copies
the published version, tampers with the copy the way an attacker or a failing disk would, and
runs the real `kiln verify` on it.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jobs_support import KILN_CMD, service_env

from services.repository.signing import SIGNATURE, sign_version
from services.repository.signing_keys import generate_signing_key, load_signing_key

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny_cnn.onnx"
FAST_SPEC = {"benchmark": False, "validation": {"samples": 2}}


@dataclass
class Published:
    version: Path  # <repo>/triton/tiny/1
    env: dict[str, str]  # the environment that published it (its data dir holds the signing key)
    root: Path


def _kiln(*args: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KILN_CMD, *args], env=env, capture_output=True, text=True, timeout=300, cwd=cwd)


def _compile(repo: str, env: dict[str, str], work: Path) -> dict[str, Any]:
    spec = work / "spec.json"
    spec.write_text(json.dumps(FAST_SPEC))
    done = _kiln(
        "compile", str(TINY), "-t", "onnxruntime", "--name", "tiny", "--repo", repo, "--spec", str(spec), "--json",
        env=env,
        cwd=work,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    published: dict[str, Any] = json.loads(done.stdout)["targets"]["onnxruntime"]["published"]
    return published


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Published:
    root = tmp_path_factory.mktemp("signed")
    env = service_env(cache_dir=root / "cache")
    record = _compile(str(root / "repo"), env, root)
    version = root / "repo" / "triton" / "tiny" / "1"
    assert record["uri"] == str(version)
    return Published(version=version, env=env, root=root)


def _verify(target: Path | str, env: dict[str, str], *extra: str) -> tuple[int, dict[str, Any]]:
    done = _kiln("verify", str(target), "--json", *extra, env=env)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout)


def _copy(published: Published, tmp_path: Path) -> Path:
    dest = tmp_path / "tiny.v1"
    shutil.copytree(published.version, dest)
    return dest


def test_a_published_version_is_signed_over_every_file_and_verifies(published: Published, tmp_path: Path) -> None:
    files = sorted(p.name for p in published.version.iterdir())
    assert files == ["kiln-manifest.json", SIGNATURE, "model.onnx"]
    manifest = json.loads((published.version / "kiln-manifest.json").read_text())
    assert manifest["files"] == {"model.onnx": {"bytes": (published.version / "model.onnx").stat().st_size}}
    # The signature's statement lists every file but itself, the manifest included, by SHA-256.
    bundle = json.loads((published.version / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    import hashlib

    digests = {r["name"]: r["digest"] for r in statement["predicate"]["resources"]}
    assert digests == {
        name: hashlib.sha256((published.version / name).read_bytes()).hexdigest()
        for name in ("kiln-manifest.json", "model.onnx")
    }
    code, verdict = _verify(published.version, published.env)
    assert (code, verdict["code"], verdict["status"], verdict["signed_files"]) == (0, "VERIFIED", "verified", 2)
    # The public half, as a verifier elsewhere gets it, verifies the same version with --key, and
    # OpenSSF's own command line accepts Kiln's signature as it is.
    public = _kiln("secrets", "public-key", env=published.env)
    assert public.returncode == 0 and public.stdout.startswith("-----BEGIN PUBLIC KEY-----")
    key = tmp_path / "kiln.pub"
    key.write_text(public.stdout)
    assert verdict["key_id"] == hashlib.sha256(public.stdout.encode()).hexdigest()
    code, _ = _verify(published.version, service_env(cache_dir=tmp_path / "elsewhere"), "--key", str(key))
    assert code == 0
    model_signing = Path(KILN_CMD[0]).parent / "model_signing"
    theirs = subprocess.run(
        [str(model_signing), "verify", "key", "--public_key", str(key), "--signature",
         str(published.version / SIGNATURE), str(published.version)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr


def _flip_byte(d: Path) -> None:
    data = bytearray((d / "model.onnx").read_bytes())
    data[len(data) // 2] ^= 0x01
    (d / "model.onnx").write_bytes(bytes(data))


def _replace_model(d: Path) -> None:
    # Another real ONNX model put in its place: the kind of swap a signature exists to catch.
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["input"], ["output"])],
        "swapped",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 3, 32, 32])],
    )
    onnx.save(helper.make_model(graph), d / "model.onnx")


def _link_model(d: Path) -> None:
    # A link in place of the model (to another one a server would then load): never followed, never verified.
    other = d.parent / "elsewhere.onnx"
    shutil.move(d / "model.onnx", other)
    (d / "model.onnx").symlink_to(other)


def _foreign(d: Path) -> None:
    # Same files, signed again by a key that is not Kiln's.
    sign_version(d, load_signing_key(generate_signing_key(), "an attacker's key"))


def _forged_digest(d: Path) -> None:
    # The signature still names Kiln's key, but a digest in it was rewritten to match a swapped model.
    bundle = json.loads((d / SIGNATURE).read_text())
    statement = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    statement["predicate"]["resources"][1]["digest"] = "0" * 64
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (d / SIGNATURE).write_text(json.dumps(bundle))


def _edit_manifest(d: Path) -> None:
    manifest = json.loads((d / "kiln-manifest.json").read_text())
    manifest["parity"] = {"verdict": "pass", "doctored": True}
    (d / "kiln-manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))


CASES = {
    "flipped byte": (_flip_byte, 9, "FILE_MODIFIED", "model.onnx was modified in place"),
    "replaced file": (_replace_model, 8, "FILE_REPLACED", "model.onnx was replaced"),
    "missing file": (lambda d: (d / "model.onnx").unlink(), 7, "FILE_MISSING", "model.onnx is missing"),
    "missing manifest": (
        lambda d: (d / "kiln-manifest.json").unlink(),
        7,
        "FILE_MISSING",
        "kiln-manifest.json is missing",
    ),
    "edited manifest": (_edit_manifest, 9, "FILE_MODIFIED", "kiln-manifest.json differs from the file signed"),
    "added file": (
        lambda d: shutil.copy(d / "model.onnx", d / "other.onnx"),
        10,
        "FILE_UNSIGNED",
        "other.onnx is not covered by the signature",
    ),
    "model made a link": (_link_model, 8, "FILE_REPLACED", "model.onnx is a symbolic link"),
    "foreign signature": (_foreign, 5, "SIGNATURE_FOREIGN", "signed by another key"),
    "forged digest": (_forged_digest, 6, "SIGNATURE_INVALID", "the signature or the digests in it were altered"),
    "signature removed": (lambda d: (d / SIGNATURE).unlink(), 4, "UNSIGNED", "no kiln-signature.sig"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kiln_verify_names_each_kind_of_tampering_with_its_own_exit_status(
    case: str, published: Published, tmp_path: Path
) -> None:
    tamper, status, code, said = CASES[case]
    version = _copy(published, tmp_path)
    assert _verify(version, published.env)[0] == 0  # the copy verifies before it is touched
    tamper(version)
    got, verdict = _verify(version, published.env)
    assert (got, verdict["code"], verdict["exit_status"]) == (status, code, status), verdict
    assert said in verdict["message"] and verdict["status"] != "verified"


def test_kiln_verify_prints_the_verdict_a_person_reads(published: Published, tmp_path: Path) -> None:
    version = _copy(published, tmp_path)
    _flip_byte(version)
    (version / "added.bin").write_bytes(b"x")
    done = _kiln("verify", str(version), env=published.env)
    assert done.returncode == 9 and "Traceback" not in done.stderr
    assert "error FILE_MODIFIED" in done.stderr and "model.onnx was modified in place" in done.stderr
    assert "(and 1 more)" in done.stderr and "hint: Do not deploy this version" in done.stderr
    assert "FILE_UNSIGNED: added.bin is not covered" in done.stdout
    # A foreign key that is trusted on purpose (a key from before a rotation) verifies.
    other = load_signing_key(generate_signing_key(), "the old key")
    resigned = tmp_path / "resigned"
    shutil.copytree(published.version, resigned)
    sign_version(resigned, other)
    old_pub = tmp_path / "old.pub"
    old_pub.write_bytes(other.public.pem)
    assert _verify(resigned, published.env)[0] == 5
    assert _verify(resigned, {**published.env, "KILN_SIGNING_TRUSTED_KEYS": str(old_pub)})[0] == 0
    # Bad input is exit 2 with a hint: a private key given as --key, a path that is no directory.
    private = tmp_path / "private.pem"
    private.write_bytes(other.pem)
    done = _kiln("verify", str(published.version), "--key", str(private), env=published.env)
    assert done.returncode == 2 and "error INVALID_SETTINGS" in done.stderr and "private key" in done.stderr
    assert "BEGIN" not in done.stdout + done.stderr  # never the key itself
    done = _kiln("verify", str(tmp_path / "nothing"), env=published.env)
    assert done.returncode == 2 and "error NOT_FOUND" in done.stderr


def test_kiln_verify_checks_a_version_in_s3(s3_server: Any, tmp_path: Path) -> None:
    """Published to the real SeaweedFS server by `kiln compile`, verified there, and caught when changed there."""
    prefix = f"signing-{tmp_path.name}/repo"
    env = {
        **service_env(cache_dir=tmp_path / "cache"),
        "KILN_S3_ENDPOINT_URL": s3_server.endpoint_url,
        "KILN_S3_REGION": s3_server.region,
        "KILN_S3_ACCESS_KEY_ID": s3_server.access_key_id,
        "KILN_S3_SECRET_ACCESS_KEY": s3_server.secret_access_key,
    }
    record = _compile(f"s3://{s3_server.bucket}/{prefix}", env, tmp_path)
    url = f"s3://{s3_server.bucket}/{prefix}/triton/tiny/1"
    assert record["uri"] == url and SIGNATURE in record["files"] and len(record["signed_by"]) == 64
    code, verdict = _verify(url, env)
    assert (code, verdict["code"], verdict["key_id"]) == (0, "VERIFIED", record["signed_by"])
    client, bucket = s3_server.client(), s3_server.bucket
    key = f"{prefix}/triton/tiny/1/model.onnx"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[100] ^= 0x80
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    code, verdict = _verify(url, env)
    assert (code, verdict["code"]) == (9, "FILE_MODIFIED")
    client.delete_object(Bucket=bucket, Key=key)
    assert _verify(url, env)[1]["code"] == "FILE_MISSING"
    # Another machine without Kiln's key: foreign until given the public key.
    elsewhere = {**env, "KILN_DATA_DIR": str(tmp_path / "elsewhere")}
    assert _verify(url, elsewhere)[0] == 5
    done = _kiln("verify", f"s3://{s3_server.bucket}/{prefix}/triton/tiny/9", env=env)
    assert done.returncode == 2 and "error NOT_FOUND" in done.stderr


def test_the_signature_is_uploaded_before_the_manifest_that_commits_a_version() -> None:
    from services.repository.s3 import upload_phases

    phases = upload_phases(["kiln-manifest.json", SIGNATURE, "model.onnx", "model.onnx.data"])
    assert phases[-1] == ["kiln-manifest.json"] and SIGNATURE in phases[0]


def _service_repo(published: Published, root: Path) -> Path:
    """Return a repository holding tiny v1 as published, v2 with a flipped byte, v3 unsigned, v4 signed by another key."""
    repo = root / "repo"
    shutil.copytree(published.version.parents[2], repo)
    model = repo / "triton" / "tiny"
    for v in (2, 3, 4):
        shutil.copytree(model / "1", model / str(v))
    _flip_byte(model / "2")
    (model / "3" / SIGNATURE).unlink()
    _foreign(model / "4")
    return repo


def test_the_api_and_the_dashboard_show_each_version_signed_and_flag_changed_files(
    published: Published, tmp_path: Path
) -> None:
    from fastapi.testclient import TestClient
    from jobs_support import redis_url

    from api.app import create_app
    from services.settings import Settings
    from workers.app import create_celery_app

    repo = _service_repo(published, tmp_path)
    settings = Settings(
        cache_dir=tmp_path / "cache",
        data_dir=Path(published.env["KILN_DATA_DIR"]),  # where the key that signed v1 lives
        repository=str(repo),
        artifact_store=str(tmp_path / "store"),
        broker_url=redis_url(14),
    )
    app = create_app(settings, create_celery_app(settings))

    def statuses(client: TestClient) -> dict[int, dict[str, Any]]:
        listing = client.get("/repository")
        assert listing.status_code == 200, listing.text
        (model,) = listing.json()["models"]
        return {v["version"]: v["signature"] for v in model["versions"]}

    with TestClient(app) as client:
        seen = statuses(client)
        assert {v: s["status"] for v, s in seen.items()} == {1: "verified", 2: "mismatch", 3: "unsigned", 4: "foreign"}
        assert seen[2]["code"] == "FILE_MODIFIED" and seen[2]["problems"][0]["path"] == "model.onnx"
        assert seen[1]["key_id"] == seen[2]["key_id"] != seen[4]["key_id"]
        # A file changed after a check is caught at the next look, never shown from a stale "verified".
        v1 = repo / "triton" / "tiny" / "1" / "model.onnx"
        original = v1.read_bytes()
        v1.write_bytes(original + b"\0")
        assert statuses(client)[1]["code"] == "FILE_REPLACED"
        v1.write_bytes(original)
        assert statuses(client)[1]["status"] == "verified"
        page = client.get("/ui/repository/tiny/2")
        assert page.status_code == 200 and "FILE_MODIFIED" in page.text and "Do not deploy this version" in page.text

    from browser_support import launch_chromium, screenshot
    from playwright.sync_api import expect
    from test_api_errors import _Server

    with _Server(app) as base, launch_chromium() as browser:
        context = browser.new_context(viewport={"width": 1280, "height": 720}, color_scheme="light")
        page = context.new_page()
        page.goto(f"{base}/ui/repository")
        cells = page.get_by_test_id("signature")
        expect(cells).to_have_count(4)
        # Newest first: v4 foreign, v3 unsigned, v2 files changed, v1 verified; words and icons, not colour alone.
        expect(cells).to_have_text(["✗ foreign signature", "– unsigned", "✗ files changed", "✓ verified"])
        screenshot(page, "repository-signatures")
        page.get_by_role("link", name="v2", exact=True).click()
        expect(page.get_by_test_id("signature-problem")).to_contain_text("model.onnx was modified in place")
        expect(page.get_by_role("heading", name="FILE_MODIFIED")).to_be_visible()
        screenshot(page, "version-tampered")
        context.close()


def test_the_signing_key_is_cut_out_of_anything_a_step_prints() -> None:
    from services.sandbox import Redactor
    from services.settings import Settings

    pem = generate_signing_key().decode()
    redactor = Redactor.from_settings(Settings(signing_key=pem), {})
    body = pem.splitlines()[1:-1]
    said = redactor.text(f"leaked: {pem} and a line alone: {body[1]}")
    assert not any(line in said for line in body) and "[redacted]" in said
    shown = repr(load_signing_key(pem.encode(), "KILN_SIGNING_KEY"))
    assert "PRIVATE" not in shown and not any(line in shown for line in body)


def _certificate(subject: str, key: Any, issuer: tuple[str, Any] | None, *, ca: bool) -> bytes:
    """Return a PEM certificate for ``key``, issued by ``issuer`` (name, key) or self-signed."""
    from datetime import UTC, datetime, timedelta

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    issuer_name, issuer_key = issuer or (subject, key)
    now = datetime.now(UTC)
    usage = x509.KeyUsage(
        digital_signature=not ca, key_cert_sign=ca, crl_sign=ca, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, encipher_only=False, decipher_only=False,
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder()
        .subject_name(name(subject))
        .issuer_name(name(issuer_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .sign(issuer_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_a_version_signed_with_a_certificate_verifies_against_its_ca_only(tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    signing = ec.generate_private_key(ec.SECP384R1())
    ca = _certificate("Kiln test CA", ca_key, None, ca=True)
    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(_certificate("Another CA", other_ca_key, None, ca=True))
    (tmp_path / "ca.pem").write_bytes(ca)
    pem = signing.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    env = {
        **service_env(cache_dir=tmp_path / "cache"),
        "KILN_SIGNING_KEY": pem,
        "KILN_SIGNING_CERTIFICATE": _certificate(
            "kiln publisher", signing, ("Kiln test CA", ca_key), ca=False
        ).decode(),
        "KILN_SIGNING_CERTIFICATE_CHAIN": ca.decode(),
    }
    record = _compile(str(tmp_path / "repo"), env, tmp_path)
    version = Path(record["uri"])
    bundle = json.loads((version / SIGNATURE).read_text())
    assert len(bundle["verificationMaterial"]["x509CertificateChain"]["certificates"]) == 2  # the leaf, then the CA
    code, verdict = _verify(version, env)  # the root of the configured chain is trusted by default
    assert (code, verdict["code"]) == (0, "VERIFIED") and "CN=kiln publisher" in verdict["message"]
    elsewhere = service_env(cache_dir=tmp_path / "elsewhere")
    assert _verify(version, elsewhere, "--ca", str(tmp_path / "ca.pem"))[0] == 0
    code, verdict = _verify(version, elsewhere)
    assert code == 5 and "no CA is trusted here" in verdict["message"]
    code, verdict = _verify(version, elsewhere, "--ca", str(other_ca))
    assert code == 5 and "does not chain to --ca" in verdict["message"]
    _flip_byte(version)
    assert _verify(version, elsewhere, "--ca", str(tmp_path / "ca.pem"))[1]["code"] == "FILE_MODIFIED"
    # A certificate for another key is refused before anything is compiled, naming the setting, not the key.
    wrong = {**env, "KILN_SIGNING_CERTIFICATE": other_ca.read_text()}
    done = _kiln("compile", str(TINY), "-t", "onnxruntime", "--repo", str(tmp_path / "r2"), env=wrong, cwd=tmp_path)
    assert done.returncode == 2 and "INVALID_SETTINGS" in done.stderr and "KILN_SIGNING_CERTIFICATE" in done.stderr
    assert "PRIVATE KEY" not in done.stdout + done.stderr


def _classifier(path: Path) -> tuple[Path, Any]:
    """Write a one-Gemm classifier x[N,16] -> logits[N,4]; return it and its weights."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["logits"])],
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path, weights


def test_kiln_verify_scores_the_artifact_again_on_its_engine(published: Published, tmp_path: Path) -> None:
    """`--evaluation`: each verified artifact run on its own engine scores what its manifest recorded; data it does
    worse on fails with both scores; tampered files are not scored; a version published without labels says so."""
    import numpy as np

    model, weights = _classifier(tmp_path / "classifier.onnx")
    x = np.random.default_rng(1).standard_normal((40, 16)).astype(np.float32)
    labels = (x @ weights).argmax(axis=1)
    labels[:6] = (labels[:6] + 1) % 4  # six wrong labels: the source scores 34/40
    np.savez(tmp_path / "eval.npz", x=x, labels=labels)
    env = service_env(cache_dir=tmp_path / "cache")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({**FAST_SPEC, "evaluation": {"metric": "top1", "max_drop": 0.0}}))
    done = _kiln(
        "compile", str(model), "-t", "onnxruntime", "-t", "openvino", "--name", "clf", "--repo",
        str(tmp_path / "repo"), "--spec", str(spec), "--evaluation", str(tmp_path / "eval.npz"), "--json",
        env=env, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for target in ("onnxruntime", "openvino"):
        version = tmp_path / "repo" / "triton" / f"clf-{target}" / "1"
        code, verdict = _verify(version, env, "--evaluation", str(tmp_path / "eval.npz"))
        assert code == 0, verdict
        ev = verdict["evaluation"]
        assert (ev["engine"], ev["metric"], ev["samples"]) == (target, "top1", 40)
        assert ev["artifact"] == pytest.approx(34 / 40) and ev["recorded"]["artifact"] == pytest.approx(34 / 40)
        assert ev["passed"] is True and ev["drop"] == 0
    # Data the artifact does worse on than the source did at publish: a drop past max_drop, exit 1, both scores.
    worse = labels.copy()
    worse[6:16] = (worse[6:16] + 1) % 4  # ten more wrong labels: 24/40
    np.savez(tmp_path / "worse.npz", x=x, labels=worse)
    version = tmp_path / "repo" / "triton" / "clf-onnxruntime" / "1"
    code, verdict = _verify(version, env, "--evaluation", str(tmp_path / "worse.npz"))
    ev = verdict["evaluation"]
    assert (code, verdict["code"], ev["error"]["code"]) == (1, "VERIFIED", "ACCURACY_DROP_EXCEEDED")
    assert ev["artifact"] == pytest.approx(24 / 40) and ev["source"] == pytest.approx(34 / 40) and not ev["passed"]
    done = _kiln("verify", str(version), "--evaluation", str(tmp_path / "worse.npz"), env=env)
    assert done.returncode == 1 and "error ACCURACY_DROP_EXCEEDED" in done.stderr and "Traceback" not in done.stderr
    # Files that are not the ones signed are not scored.
    tampered = tmp_path / "tampered"
    shutil.copytree(version, tampered)
    data = bytearray((tampered / "model.onnx").read_bytes())
    data[-3] ^= 0x01
    (tampered / "model.onnx").write_bytes(bytes(data))
    code, verdict = _verify(tampered, env, "--evaluation", str(tmp_path / "eval.npz"))
    assert code == 9 and "skipped" in verdict["evaluation"]
    # A version published without evaluation has no metric or source score to hold the artifact to.
    done = _kiln("verify", str(published.version), "--evaluation", str(tmp_path / "eval.npz"), env=published.env)
    assert done.returncode == 2 and "error INVALID_SPEC" in done.stderr and "without an evaluation" in done.stderr
