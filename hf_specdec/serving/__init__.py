"""Serving under dynamic load: request streams, a continuous-batching engine on a real model, and
a latency-model simulator of the same schedule."""
from .engine import Engine
from .simulator import MemoryModel, RelativeCosts, RequestResult, RunResult, RunStep, Simulator
from .workload import Request, load_trace, phased, poisson

__all__ = ["Request", "poisson", "phased", "load_trace", "Engine", "Simulator", "MemoryModel", "RunResult", "RunStep",
           "RequestResult", "RelativeCosts"]
