"""The machinery every step shares: what a step receives, the host gate, the source memo, the reference read back.

It sits below the runners, converters, passes and exporters that use it, and above the
planner's types and the stores it names; it imports none of the roles.
"""

from services.steps.context import StepContext
from services.steps.reference import ReferenceData, load_reference

__all__ = ["ReferenceData", "StepContext", "load_reference"]
