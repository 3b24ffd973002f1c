"""Serving under dynamic load: request streams and a latency-model simulator of the spec policies."""
from .simulator import RequestResult, SimResult, Simulator
from .workload import Request, load_trace, phased, poisson

__all__ = ["Request", "poisson", "phased", "load_trace", "Simulator", "SimResult", "RequestResult"]
