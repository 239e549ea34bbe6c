"""What `pip install` of kiln_client brings into a fresh virtualenv: packages, wheel MB, installed MB, seconds.

Creates a venv with the running Python's ``venv`` module, installs ``clients/python`` (from a
copy, so the checkout gets no build folder) and compares the venv before and after. Needs the
package index (PyPI) pip is configured with.

Run: ``python benchmarks/bench_client_install.py``; results in docs/client.md ("Installing").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _packages(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [str(python), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    ).stdout
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kiln-client-install-") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
        python = work / "venv" / "bin" / "python"
        site = next((work / "venv" / "lib").glob("python3*/site-packages"))
        before_pkgs, before_size = _packages(python), _size(site)
        src = work / "src"
        shutil.copytree(ROOT / "clients" / "python", src)
        start = time.perf_counter()
        subprocess.run([str(python), "-m", "pip", "install", "-q", str(src)], check=True)
        seconds = time.perf_counter() - start
        added = {k: v for k, v in _packages(python).items() if k not in before_pkgs}
        wheels = work / "wheels"
        subprocess.run([str(python), "-m", "pip", "download", "-q", "-d", str(wheels), str(src)], check=True)
        report = {
            "packages": dict(sorted(added.items())),
            "package_count": len(added),
            "wheels_mb": round(_size(wheels) / 1e6, 2),
            "installed_mb": round((_size(site) - before_size) / 1e6, 2),
            "seconds": round(seconds, 1),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
