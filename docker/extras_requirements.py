"""Print the requirements of Kiln's core plus the named extras, as read from pyproject.toml.

The Dockerfiles install these in a layer of their own, before Kiln's sources are copied in, so
that editing the code does not reinstall every engine. Run with the image's Python 3.11
(tomllib); self-references such as ``kiln[service]`` inside an extra are expanded.

    python extras_requirements.py pyproject.toml onnxruntime,service > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib

__all__ = ["requirements"]

_SELF_REF = re.compile(r"^\s*([A-Za-z0-9._-]+)\s*\[([^\]]*)\]\s*$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    """Return the core requirements plus those of ``extras``, deduplicated, in order."""
    name = project["name"].lower()
    optional = project.get("optional-dependencies", {})
    out: dict[str, None] = dict.fromkeys(project.get("dependencies", []))
    seen: set[str] = set()
    pending = list(extras)
    while pending:
        extra = pending.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; pyproject.toml defines: {', '.join(sorted(optional))}")
        seen.add(extra)
        for req in optional[extra]:
            ref = _SELF_REF.match(req)
            if ref and ref.group(1).lower() == name:
                pending.extend(e.strip() for e in ref.group(2).split(",") if e.strip())
            else:
                out.setdefault(req)
    return list(out)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [e.strip() for e in argv[2].split(",") if e.strip()]
    print("\n".join(requirements(project, extras)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
