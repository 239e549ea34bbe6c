"""Take a confined step's output folder back without following anything the step planted in it.

A step writes its artifact in its own folder, which it controls: it could leave a symbolic
link to ``/etc/shadow`` (the trusted side would copy the file into the artifact a user
downloads), a link named like the descriptor (writing it would overwrite the target), or a
device node. The folder is first moved out of the step's reach (a rename: the step's
Landlock rules are by path, so it cannot write there any more), then walked without
following links: a link whose target leaves the folder, or anything but files, folders and
such inner links, is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from services.errors import ConversionFailed

__all__ = ["claim_output"]


def claim_output(out_dir: Path, dest: Path, step_id: str) -> Path:
    """Move ``out_dir`` to ``dest`` (outside the step's reach) and check it; return ``dest``."""
    st = os.lstat(out_dir)
    if not stat.S_ISDIR(st.st_mode):
        raise ConversionFailed(f"step {step_id} replaced its output folder with something else", step=step_id)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(out_dir, dest)
    root = dest.resolve()
    for folder, dirs, files in os.walk(dest):
        for name in (*dirs, *files):
            path = Path(folder) / name
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                target = (path.parent / os.readlink(path)).resolve()
                if target != root and root not in target.parents:
                    raise ConversionFailed(
                        f"step {step_id} left a link in its output that points outside it ({path.name})",
                        step=step_id,
                    )
            elif not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise ConversionFailed(f"step {step_id} left a special file in its output ({path.name})", step=step_id)
    return dest
