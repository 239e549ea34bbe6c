"""The light start: what `make demo` installs (the core with the onnxruntime and openvino extras) and whether it runs.

Copies the checkout's tracked files (git archive) to a temporary folder, creates a venv there
with the running Python, installs ``.[onnxruntime,openvino]`` under constraints.txt as
`make demo` does, then runs the demo's `kiln compile` (examples/tiny_cnn.onnx for both
targets). Reports the packages, wheel MB (pip download of the same set), installed MB and the
seconds of each part. Needs the package index pip is configured with; a warm pip cache makes
the install much faster than a first one.

Run: ``python benchmarks/bench_light_start.py``; results in docs/benchmarks.md ("The light start").
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "onnxruntime,openvino"


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-light-") as tmp:
        work = Path(tmp) / "kiln"
        work.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(work)], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "venv", str(work / ".venv")], check=True)
        python = work / ".venv" / "bin" / "python"
        start = time.perf_counter()
        install = [str(python), "-m", "pip", "install", "-q", "-c", "constraints.txt", "-e", f".[{EXTRAS}]"]
        subprocess.run(install, cwd=work, check=True)
        installed_s = time.perf_counter() - start
        subprocess.run([str(python), "-m", "pip", "check"], cwd=work, check=True)
        packages = json.loads(
            subprocess.run(
                [str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
            ).stdout
        )
        start = time.perf_counter()
        demo = subprocess.run(
            [str(work / ".venv" / "bin" / "kiln"), "compile", "examples/tiny_cnn.onnx", "--target", "onnxruntime",
             "--target", "openvino", "--repo", "model-repository", "--name", "tiny-cnn", "--json", "-q"],
            cwd=work, capture_output=True, text=True, env={"HOME": tmp, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        demo_s = time.perf_counter() - start
        wheels = work / "wheels"
        subprocess.run(
            [str(python), "-m", "pip", "download", "-q", "-c", "constraints.txt", "-d", str(wheels), f".[{EXTRAS}]"],
            cwd=work,
            check=True,
        )
        site = next((work / ".venv" / "lib").glob("python3*/site-packages"))
        report = {
            "extras": EXTRAS,
            "packages": len(packages),
            "wheels_mb": round(_size(wheels) / 1e6),
            "installed_mb": round(_size(site) / 1e6),
            "install_s": round(installed_s, 1),
            "demo_exit": demo.returncode,
            "demo_ok": demo.returncode == 0 and json.loads(demo.stdout)["ok"],
            "demo_s": round(demo_s, 1),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
