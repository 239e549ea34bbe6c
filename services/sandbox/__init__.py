"""Confine the steps that load or run a user's model: bubblewrap namespaces, Landlock per step, no secrets.

- :mod:`~services.sandbox.protection`: what this host allows and the one line that says so;
- :mod:`~services.sandbox.view`: what a confined step may read and write, and its environment;
- :mod:`~services.sandbox.launcher`: the interpreter wrapper that starts the step forkserver
  inside bubblewrap (or with a scrubbed environment only);
- :mod:`~services.sandbox.confine`: the Landlock ruleset each step process applies to itself;
- :mod:`~services.sandbox.outputs`: taking a confined step's output back without following its links;
- :mod:`~services.sandbox.redact`: configured secret values cut out of whatever a step prints.

The design and what it does not stop are in docs/security.md ("The sandbox").
"""

from services.sandbox.protection import Protection, host_protection
from services.sandbox.redact import Redactor
from services.sandbox.view import GPU_DEVICE_PATTERNS, SandboxView, gpu_devices, sandbox_view

__all__ = [
    "GPU_DEVICE_PATTERNS",
    "Protection",
    "Redactor",
    "SandboxView",
    "gpu_devices",
    "host_protection",
    "sandbox_view",
]
