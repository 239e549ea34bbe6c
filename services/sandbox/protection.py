"""What confinement this host allows for steps, probed once per process, and how to say it in one line.

bubblewrap needs user namespaces (refused inside most unprivileged containers: Docker's
default seccomp profile, Ubuntu's AppArmor userns restriction); Landlock needs Linux 5.13+
with the LSM enabled (network rules 6.7+, signal and abstract-socket scoping 6.12+). The
probe runs ``bwrap`` for real (``true`` in fresh namespaces) rather than trusting a version.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from functools import cache

from services.errors import EngineUnavailable

__all__ = ["Protection", "host_protection", "landlock_abi"]


@dataclass(frozen=True)
class Protection:
    """The confinement steps get: bubblewrap namespaces, Landlock (its ABI), both or neither."""

    bwrap: str | None  # path of the bwrap binary in use, None when namespaces are not used
    landlock: int  # Landlock ABI applied per step; 0 = none
    why: str = ""  # why the stronger parts are missing, for the summary line

    @property
    def mode(self) -> str:
        if self.bwrap and self.landlock:
            return "bwrap+landlock"
        return "bwrap" if self.bwrap else ("landlock" if self.landlock else "off")

    @property
    def confined(self) -> bool:
        return bool(self.bwrap or self.landlock)

    def summary(self) -> str:
        """Return the one line `kiln serve`, `kiln worker` and `kiln compile` print about it."""
        if self.mode == "bwrap+landlock":
            return (
                f"sandbox: bubblewrap + Landlock ABI {self.landlock}: steps run without network or secrets, "
                "each writing only its own scratch directory"
            )
        if self.mode == "bwrap":
            return (
                "sandbox: bubblewrap only (no Landlock here: "
                f"{self.why}): no network, no secrets, read-only host; the steps of one worker share a "
                "scratch area and are not isolated from each other"
            )
        if self.mode == "landlock":
            net = "TCP refused" if self.landlock >= 4 else "network NOT restricted (Landlock ABI < 4)"
            return (
                f"sandbox: Landlock ABI {self.landlock} only (bubblewrap unavailable: {self.why}): scrubbed "
                f"environment, reads and writes limited, {net}; UDP and unix sockets are not restricted"
            )
        return f"sandbox: OFF ({self.why}): steps run with this process's files, network and environment"


def landlock_abi() -> int:
    """Return the running kernel's Landlock ABI (0 when it has none or landlockpy is missing)."""
    try:
        import landlockpy
    except ImportError:
        return 0
    try:
        return int(landlockpy.abi_version())
    except Exception:
        return 0


@cache
def _bwrap_works() -> tuple[str | None, str]:
    exe = shutil.which("bwrap")
    if exe is None:
        return None, "bwrap is not installed (apt-get install bubblewrap)"
    probe = [exe, "--unshare-user", "--unshare-net", "--unshare-ipc", "--ro-bind", "/", "/", "--", "true"]
    try:
        out = subprocess.run(probe, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"bwrap did not run: {exc}"
    if out.returncode != 0:
        return None, f"bwrap cannot create namespaces here: {out.stderr.strip()[:160]}"
    return exe, ""


def host_protection(requested: str = "auto") -> Protection:
    """Return the protection for ``requested`` (KILN_SANDBOX: auto, bwrap, landlock, off).

    ``bwrap`` and ``landlock`` insist: ENGINE_UNAVAILABLE when this host cannot give them.
    """
    if requested == "off":
        return Protection(None, 0, "KILN_SANDBOX=off")
    abi = landlock_abi()
    why_ll = "" if abi else "the kernel has no Landlock (Linux 5.13+) or landlockpy is not installed"
    if requested in ("auto", "bwrap"):
        exe, why = _bwrap_works()
        if exe is not None:
            return Protection(exe, abi, why_ll)
        if requested == "bwrap":
            raise EngineUnavailable(
                f"KILN_SANDBOX=bwrap, but {why}", hint="Install bubblewrap or set KILN_SANDBOX=auto."
            )
        if abi:
            return Protection(None, abi, why)
        return Protection(None, 0, f"{why}; {why_ll}")
    if not abi:
        raise EngineUnavailable(f"KILN_SANDBOX=landlock, but {why_ll}", hint="Set KILN_SANDBOX=auto.")
    return Protection(None, abi, "KILN_SANDBOX=landlock")
