"""What every `kiln` command shares: the consoles, exit statuses and the one error handler.

Command modules import these from here, never from cli.main (which imports them all to
register their commands).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from functools import wraps
from typing import Any, TypeVar

import click
from rich.console import Console

from services.errors import KilnError

__all__ = [
    "EXIT_FAILED",
    "EXIT_INPUT",
    "EXIT_INTERNAL",
    "INPUT_CODES",
    "console",
    "exit_status",
    "handle_errors",
    "out",
    "print_error",
]

F = TypeVar("F", bound=Callable[..., Any])

# Outside a terminal rich assumes 80 columns, which folds the summary table; logs and CI
# are wider than that.
_WIDTH = None if sys.stdout.isatty() else int(os.environ.get("COLUMNS", "160"))
console = Console(stderr=True, width=_WIDTH)
out = Console(width=_WIDTH)

#: Exit statuses: 1 for a failed target, 2 for bad usage or input, 3 for internal errors.
EXIT_FAILED, EXIT_INPUT, EXIT_INTERNAL = 1, 2, 3
#: Error codes that mean the input was wrong (exit 2) rather than that a target failed (exit 1).
INPUT_CODES = frozenset(
    {
        "INVALID_SPEC",
        "UNSUPPORTED_FORMAT",
        "SOURCE_UNREADABLE",
        "UNSAFE_INPUT",
        "NO_ROUTE",
        "INVALID_SETTINGS",
        "SOURCE_NONFINITE",
        "INVALID_MODEL",
    }
)


def exit_status(codes: Iterable[str]) -> int:
    """Return the exit status for a run that failed with ``codes``: 2 when all are bad input, else 1."""
    found = set(codes)
    return EXIT_INPUT if found and found <= INPUT_CODES else EXIT_FAILED


def print_error(code: str, message: str, hint: str = "", tail: str | None = None) -> None:
    """Print an error as every command does: code and message, then the hint."""
    console.print(f"[bold red]error {code}[/]: {message}", soft_wrap=True)
    if hint:
        console.print(f"[yellow]hint[/]: {hint}", soft_wrap=True)
    if tail and os.environ.get("KILN_DEBUG"):
        console.print(tail)


def handle_errors(func: F) -> F:
    """Turn KilnError (Kiln's or kiln_client's) and anything unexpected into a message and an exit status."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except KilnError as err:
            print_error(err.code, err.message, err.hint, err.details.get("output_tail"))
            sys.exit(exit_status([err.code]))
        except click.exceptions.Exit:
            raise
        except Exception as exc:  # the last line of defence: no traceback for users
            client_error = _client_error(exc)
            if client_error is not None:
                print_error(client_error.code, client_error.message, client_error.hint)
                sys.exit(exit_status([client_error.code]))
            if os.environ.get("KILN_DEBUG"):
                raise
            console.print(f"[bold red]error INTERNAL[/]: {type(exc).__name__}: {exc}")
            console.print("[yellow]hint[/]: rerun with KILN_DEBUG=1 for a traceback and report it.")
            sys.exit(EXIT_INTERNAL)

    return wrapper  # type: ignore[return-value]


def _client_error(exc: Exception) -> Any:
    """Return ``exc`` when it is kiln_client's KilnError (the remote commands'), else None."""
    module = sys.modules.get("kiln_client")
    if module is not None and isinstance(exc, module.KilnError):
        return exc
    return None
