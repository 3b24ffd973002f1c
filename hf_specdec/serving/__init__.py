"""Serving under dynamic load: request streams and a latency-model simulator of a
continuous-batching schedule (the policies' testbed; `eval/bench_serving_sim.py`). Speculation in
Transformers' own continuous batching: `hf_specdec.continuous_batching`."""
from .simulator import MemoryModel, RelativeCosts, RequestResult, RunResult, RunStep, Simulator
from .workload import Request, load_trace, phased, poisson

__all__ = ["Request", "poisson", "phased", "load_trace", "Simulator", "MemoryModel", "RunResult", "RunStep",
           "RequestResult", "RelativeCosts"]
