import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

import hf_specdec
from hf_specdec.policies import LengthPolicy


def spec(model, drafters, policy="fixed:4", **kwargs):
    """model.generate through the custom_generate hook (no enable needed)."""
    return model.generate(custom_generate=hf_specdec.generate, assistant_models=drafters,
                          spec_policy=policy, **kwargs)


def greedy_against_plain(target, draft, ids, mask, ks=(1, 3, 6), max_new_tokens=24):
    """{k: our generate()'s output with FixedLength(k)} for greedy calls whose sequences are asserted
    identical to plain generate()'s, row by row."""
    plain = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    outs = {}
    for k in ks:
        outs[k] = spec(target, [draft], hf_specdec.FixedLength(k), input_ids=ids, attention_mask=mask,
                       max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        assert_same(outs[k].sequences, plain)
    return outs


def assert_same(a, b):
    assert a.shape == b.shape, f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}"
    bad = (a != b).any(1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} differ:\n{a[bad]}\n{b[bad]}"


class ForwardClock:
    """The host clock of `hf_specdec.timing` (every step time a policy reads), moved only by our
    models' forwards: a forward of `model` over rows x width tokens takes
    seconds(model) * (1 + per_token * (rows * width - 1)), seconds(model) its parameter count in
    millions unless `costs[model]` says otherwise (decoding reads every weight once: a small draft
    is cheap). Timing-driven policies then choose the same on a busy machine as on an idle one.
    conftest.py installs one for every test (the `forward_clock` fixture)."""

    def __init__(self, per_token: float = 0.02):
        self.time, self.per_token, self.costs = 0.0, per_token, weakref.WeakKeyDictionary()

    def now(self) -> float:
        return self.time

    def cost(self, model, tokens: int) -> float:
        base = self.costs.get(model)
        if base is None:
            base = self.costs[model] = sum(p.numel() for p in model.parameters()) / 1e6
        return base * (1 + self.per_token * (tokens - 1))

    def install(self, monkeypatch) -> None:
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

        from hf_specdec import cached_model, timing
        from hf_specdec._compat import cb
        forward, plain_step, speculating_step = cached_model.CachedModel.forward, \
            ContinuousBatchProcessor._generation_step, cb.forward

        def timed(runner, tokens, real, counts=None, *, keep):
            self.time += self.cost(runner.model, tokens.numel())
            return forward(runner, tokens, real, counts, keep=keep)

        def packed_cost(processor, model):   # continuous batching's forward of every scheduled token
            self.time += self.cost(model, processor.inputs_and_outputs.num_q_tokens)
        monkeypatch.setattr(cached_model.CachedModel, "forward", timed)
        monkeypatch.setattr(ContinuousBatchProcessor, "_generation_step",
                            lambda processor, model: (packed_cost(processor, model), plain_step(processor, model))[1])
        monkeypatch.setattr(cb, "forward", lambda processor, model, rows, pick:
                            (packed_cost(processor, model), speculating_step(processor, model, rows, pick))[1])
        monkeypatch.setattr(timing, "now", self.now)


def cpu_compile_config(**kwargs):
    """A CompileConfig that compiles on a CPU (Transformers' own switch) with dynamo's "eager"
    backend: the same graphs, guards and recompilations as inductor, without its code generation."""
    from transformers import CompileConfig
    config = CompileConfig(**{"fullgraph": True, "backend": "eager", **kwargs})
    config._compile_all_devices = True
    return config


class Scripted(LengthPolicy):
    """k = ks(step) for the step-th step of each generate() call."""

    def __init__(self, ks):
        self.ks, self.contexts = ks, []       # every StepContext seen

    def choose(self, ctx):
        self.contexts.append(ctx)
        return self.ks(ctx.step)


def step_record(batch_size, drafters, k, proposed, accepted, emitted, draft_s=0.0, verify_s=0.0, rows=None,
                drafter_s=None, gammas=None, **kw):
    """A StepRecord from the positional shorthand the policy tests use."""
    from hf_specdec.stats import StepRecord
    return StepRecord(batch_size=batch_size, drafters=drafters, k=k, proposed=proposed, accepted=accepted,
                      emitted=emitted, draft_s=draft_s, verify_s=verify_s, rows=rows or [],
                      drafter_s=drafter_s or {}, gammas=gammas, **kw)


class HostReads(TorchFunctionMode):
    """Counts what would be host syncs on a GPU, on any device: reads of a tensor's values into
    Python (item, tolist, bool/int/float, `.cpu()`), ops whose output shape depends on values
    (nonzero, unique, masked_select, boolean indexing) and blocking copies of host tensors to the
    device (`torch.tensor(..., device=...)`, `.to` without non_blocking=True). A tensor made from
    Python values or that came from `.cpu()` is a host tensor, and so is whatever is computed from
    it: reading those costs no sync. Only hf_specdec's own
    reads count (not those inside the model's forward, which plain generate() makes too)."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "equal",
             "nonzero", "argwhere", "unique", "masked_select"}

    def __init__(self):
        super().__init__()
        self.count = 0
        self._host = {}                   # id -> weak reference of the host tensors

    def _is_host(self, value):
        if isinstance(value, (list, tuple)):
            return any(self._is_host(v) for v in value)
        return isinstance(value, torch.Tensor) and id(value) in self._host and self._host[id(value)]() is value

    def _mark(self, value):
        if isinstance(value, (list, tuple)):
            for v in value:
                self._mark(v)
        elif isinstance(value, torch.Tensor):
            self._host[id(value)] = weakref.ref(value)

    @staticmethod
    def _caller_is_hf_specdec() -> bool:
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_name == "__torch_function__"
                                     or frame.f_globals.get("__name__", "").startswith("torch")):
            frame = frame.f_back
        return frame is not None and frame.f_globals.get("__name__", "").startswith("hf_specdec")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self._caller_is_hf_specdec():
            return func(*args, **kwargs)
        on_host = self._is_host(list(args)) or self._is_host(list(kwargs.values()))
        if name in ("__getitem__", "__setitem__") and not on_host:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            self.count += any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        elif name == "tensor":
            self.count += "device" in kwargs            # a host list copied to the device
        elif name in ("to", "cuda"):
            self.count += on_host and not kwargs.get("non_blocking", False)
        elif name in self.READS and not on_host:
            self.count += 1
        out = func(*args, **kwargs)
        if on_host and name not in ("to", "cuda") or name == "cpu" or name == "tensor" and "device" not in kwargs:
            self._mark(out)
        elif name in ("to", "cuda") and isinstance(out, torch.Tensor):
            self._host.pop(id(out), None)        # on the device now (on a CPU `.to` returns the tensor itself)
        return out
