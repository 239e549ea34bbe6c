"""The converter graph, engines and the route planner."""

from services.graph.engines import ENGINES, Engine, engine, installed_engines, queue_name
from services.graph.planner import Plan, PlanStep, Route, plan_routes, reachable_formats
from services.graph.registry import Converter, Exporter, Registry, default_registry, load_entry

__all__ = [
    "ENGINES",
    "Converter",
    "Engine",
    "Exporter",
    "Plan",
    "PlanStep",
    "Registry",
    "Route",
    "default_registry",
    "engine",
    "installed_engines",
    "load_entry",
    "plan_routes",
    "queue_name",
    "reachable_formats",
]
