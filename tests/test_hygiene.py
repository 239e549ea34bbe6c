"""The suite's own hygiene: settings refuse what they do not know, tests run from any checkout
and assert no wall-clock times (timings belong in benchmarks/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from services.repository.signing_keys import generate_signing_key
from services.settings import Environment, Settings

TESTS = Path(__file__).resolve().parent


def test_the_environment_setting_is_one_of_its_values() -> None:
    assert (
        Settings(
            environment="production",
            auth_enabled=True,
            database_url="postgresql://x/y",
            broker_url="redis://x",
            session_secret="s" * 32,
            signing_key=generate_signing_key().decode(),
        ).environment
        is Environment.PRODUCTION
    )
    with pytest.raises(ValidationError, match="'development' or 'production'"):
        Settings(environment="prod")  # a typo used to mean "development", unsafe defaults and all
    with pytest.raises(ValidationError, match="KILN_AUTH_ENABLED must be true"):
        Settings(environment="production")


def _sources() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(TESTS.glob("*.py")) if p.name != Path(__file__).name}


def test_no_test_names_a_path_of_this_checkout() -> None:
    """The virtualenv may live anywhere: tests use the interpreter running them (jobs_support.KILN_CMD)."""
    found = [name for name, text in _sources().items() if re.search(r"[\"'/]\.venv\b", text)]
    assert found == []


def test_no_test_asserts_how_long_a_job_took() -> None:
    pattern = re.compile(r"assert .*\[\"(server_)?seconds\"\]\s*[<>]")
    found = [f"{name}: {m.group(0)}" for name, text in _sources().items() for m in pattern.finditer(text)]
    assert found == []


#: Markdown links and images: [text](target) and ![alt](target).
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_the_docs_link_only_inside_the_repository() -> None:
    """README and docs speak from inside the repository: every relative link resolves to a file
    or folder of the checkout (the README once sent readers to ../shared/DESIGN.md, a page only
    the developers' machines have)."""
    root = TESTS.parent
    pages = [root / "README.md", root / "clients" / "python" / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor on the same page
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(root) or not path.exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    assert broken == []
