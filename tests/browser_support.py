"""Helpers for the dashboard's browser tests (no tests here): Debian's Chromium through Playwright.

Playwright's own browser download cannot work on these machines (it fetches from outside
the package registries), so the tests drive the system Chromium (`apt-get install
chromium`; .ci/run installs it when missing), or $KILN_CHROMIUM.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

__all__ = ["SCREENSHOTS", "chromium_path", "launch_chromium", "screenshot"]

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Where the tests write their screenshots: the README's (docs/dashboard) when
#: KILN_UPDATE_SCREENSHOTS=1, else a scratch folder, so `make test` leaves the checkout clean.
SCREENSHOTS = (
    REPO_ROOT / "docs" / "dashboard"
    if os.environ.get("KILN_UPDATE_SCREENSHOTS") == "1"
    else Path(tempfile.gettempdir()) / "kiln-dashboard-screenshots"
)


def chromium_path() -> str:
    path = os.environ.get("KILN_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail(
            f"no Chromium at {path}: install Debian's (apt-get install chromium; .ci/run does) or set KILN_CHROMIUM"
        )
    return path


@contextmanager
def launch_chromium() -> Iterator[Any]:
    """Yield a headless Chromium browser (Playwright's sync API)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield browser
        finally:
            browser.close()


def screenshot(page: Any, name: str) -> Path:
    """Save a full-page screenshot as <SCREENSHOTS>/<name>.png; return its path."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path
