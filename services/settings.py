"""Kiln's settings: one pydantic-settings class shared by the CLI, the API and the workers.

Read through :func:`get_settings` (cached, overridable in tests), never as an import-time
global. Every field is documented here and settable as ``KILN_<FIELD>`` in the environment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]


def _default_cache() -> Path:
    return Path.home() / ".cache" / "kiln"


class Settings(BaseSettings):
    """Configuration from ``KILN_*`` environment variables (and an optional .env file)."""

    model_config = SettingsConfigDict(env_prefix="KILN_", env_file=".env", extra="ignore")

    environment: str = Field(default="development", description="development | production; production refuses unsafe defaults.")
    cache_dir: Path = Field(default_factory=_default_cache, description="Local scratch and artifact cache.")
    repository: str = Field(default="./model-repository", description="Model repository: a directory or s3://bucket/prefix.")
    artifact_store: str = Field(default="", description="Artifact store: a directory or s3://bucket/prefix; default <cache_dir>/store.")


@lru_cache
def get_settings() -> Settings:
    """Return the process's settings (tests call ``get_settings.cache_clear()`` to swap them)."""
    return Settings()
