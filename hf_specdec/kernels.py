"""How a pair's linear layers compute on this CPU, and which way is chosen by measuring it.

Kernels (each a way to load a model, `KERNELS`):
  bf16         bfloat16 weights: fast with bf16 matrix instructions (AMX, AVX-512 BF16), emulated without
  bf16-packed  bf16 with the linear layers' weights packed once in oneDNN's layout (`use_packed_linears`):
               ATen's bf16 linear has oneDNN reorder the weight at every call of several rows
  onednn       float32 with the linear layers on oneDNN (`use_onednn_linears`)
  fp32-packed  float32 with packed weights, as bf16-packed (with AVX2 only, one-token forwards dearer)
  int8         int8 weights, activations quantised per call (`use_int8_linears(model, "dynamic")`): a row's
               numbers depend on the rows beside it, so for a draft only
  bf16w        float32 arithmetic on weights stored in bf16 (`weight_only.use_bf16w_linears`, our AVX2
               kernel): half the bytes without bf16 arithmetic; each row's numbers its own at any width
  int4         4-bit weights, bf16 activations (`weight_only.use_int4_linears`): for a draft only

A kernel is probed before it is timed (`unavailable`): a small linear layer built and run with it at
widths 1 and K + 1. One that cannot run on this CPU or torch build (oneDNN's bf16 path needs
AVX-512 BW/VL/DQ or AVX-NE-CONVERT) is left out of the choice, which goes on with the rest and says
so in its `why`.

Roles differ in what a choice may change. The target's kernels decide its numbers (bf16 and float32
differ at near-ties), so its choice must never move with a timing: it is the flag rule's
(`rule_target`) unless the other kernel's modelled speed beats it by `TARGET_MARGIN`, and the choice
is cached per machine (CPU, torch threads, versions). The draft's kernels change only what is
proposed, never what is accepted: the fastest modelled draft wins.

The model (Leviathan et al. 2023): with a per-token acceptance a, a step with k drafts emits
E(k) = (1 - a^(k+1)) / (1 - a) tokens a row, for k one-token draft forwards and one target forward of
k + 1 tokens (k = 0: a plain step). A pair's tokens/s at batch B is the best over k = 0..K of
B E(k) / (k t_draft(B, 1) + t_target(B, k + 1)), with t_target linear in the width between the
measured widths 1 and K + 1; its score is the geometric mean over `BATCHES`.
"""
from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import logging
import math
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

# name -> load_model arguments (dtype by name: the arguments are cached as JSON)
KERNELS = {"bf16": {"dtype": "bfloat16"}, "bf16-packed": {"dtype": "bfloat16", "packed": True},
           "onednn": {"onednn": True}, "fp32-packed": {"dtype": "float32", "packed": True},
           "int8": {"int8": "dynamic"}, "bf16w": {"bf16w": True}, "int4": {"int4": True},
           "fp32": {"dtype": "float32"}}     # Transformers' own float32 layers: a baseline, not a candidate
ROLES = {"target": ("bf16", "bf16-packed", "onednn", "fp32-packed", "bf16w"),
         "draft": ("bf16", "bf16-packed", "onednn", "fp32-packed", "int8", "bf16w", "int4")}
BATCHES = (1, 8)          # a lone request and a small batch: where speculation pays and where it stops
K = 5                     # the drafts a step the model is timed for (target width K + 1); k <= K are interpolated
ACCEPTANCE = 0.8          # the prior per-token acceptance (the real pair at k = 5: MAT 4.3-4.4, a ~ 0.85)
TARGET_MARGIN = 1.25      # the target leaves the flag rule's kernel only for a modelled gain this large
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# environment variables that limit the instruction sets oneDNN and ATen use: part of a cached choice's key
ISA_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", *BF16_FLAGS, "amx_int8", "amx_tile")

# (role, kernel, batch, width) -> milliseconds of one forward of that model with `batch` rows of `width` tokens
Timer = Callable[[str, str, int, int], float]
# kernel -> why it cannot run here, None where it runs
Probe = Callable[[str], "str | None"]


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The flags of /proc/cpuinfo (`cpuinfo`: that file's text, for tests); [] where it cannot tell."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return []
    return next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])


def cpu_bf16_matmul(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX or AVX-512 BF16 in its flags)."""
    return any(f in cpu_flags(cpuinfo) for f in BF16_FLAGS)


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU's kind as results name it: "amx", "avx512-bf16", "avx512", "avx2" or "other"."""
    flags = cpu_flags(cpuinfo)
    kinds = (("amx", "amx_bf16"), ("avx512-bf16", "avx512_bf16"), ("avx512", "avx512f"), ("avx2", "avx2"))
    return next((kind for kind, flag in kinds if flag in flags), "other")


def rule_target(cpuinfo: str | None = None, probe: Probe | None = None) -> str:
    """The flag rule for the target: bf16 with bf16 matrix instructions, its weights packed for
    oneDNN (measured on an AVX-512 BF16 EPYC: the real 1.5B's one-token forward 1.26x faster than
    unpacked bf16, its 6-token one 1.56x); else float32 through oneDNN (bf16 is emulated there:
    verifying a few tokens would cost several one-token steps). Not packed float32: with AVX2
    only, its one-token forward was 1.27x dearer than oneDNN's unpacked one (emulated AVX2, so
    measured again where it runs: the margin rule takes it when it pays).
    probe (`unavailable` where given): the first of those, then the other targets, that runs here."""
    rule = ("bf16-packed", "onednn") if cpu_bf16_matmul(cpuinfo) else ("onednn",)
    if probe is None:
        return rule[0]
    order = [*rule, *(k for k in ROLES["target"] if k not in rule)]
    runs = next((k for k in order if probe(k) is None), None)
    if runs is None:
        raise RuntimeError("no target kernel runs on this CPU: "
                           + "; ".join(f"{k}: {probe(k)}" for k in order))
    return runs


def load_arguments(kernel: str) -> dict:
    """`embedded.load_model` arguments of `kernel` (a KERNELS name, else a ValueError)."""
    import torch
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {sorted(KERNELS)}, got {kernel!r}")
    return {k: getattr(torch, v) if k == "dtype" else v for k, v in KERNELS[kernel].items()}


def layer_arguments(arguments: dict) -> dict:
    """`swap_linears` keywords of `load_model` arguments (all but the dtype)."""
    return {k: v for k, v in arguments.items() if k != "dtype"}


@functools.cache
def unavailable(kernel: str) -> str | None:
    """Why `kernel` cannot run on this CPU and torch build, or None where it runs: a 64 x 64 linear
    layer is built with it (`swap_linears`, as a model's are) and run at widths 1 and K + 1. Cached
    per process (`unavailable.cache_clear()` to probe again)."""
    import torch
    arguments = load_arguments(kernel)
    try:
        with torch.random.fork_rng(devices=[]):        # (the layer's init draws: the caller's RNG stays as it was)
            layer = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(arguments.get("dtype", torch.float32))
        swap_linears(layer, **layer_arguments(arguments))
        with torch.inference_mode():
            for width in (1, K + 1):
                layer(torch.ones(1, width, 64, dtype=arguments.get("dtype", torch.float32)))
    except Exception as err:          # noqa: BLE001 (whatever the kernel raises, it does not run here)
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        logger.info("CPU kernel %s cannot run here: %s", kernel, reason)
        return reason
    return None


@dataclass(frozen=True)
class CpuKernels:
    """The pair's kernels on this CPU, with the measurements behind the choice."""
    target_kernel: str                 # a KERNELS name
    draft_kernel: str
    why: str                           # the choice in words, with its numbers
    timings: dict = field(default_factory=dict)    # role -> kernel -> "BxW" -> ms (empty: not measured)
    skipped: dict = field(default_factory=dict)    # kernel -> why it cannot run here (not timed)
    scores: dict = field(default_factory=dict)     # "target+draft" -> modelled tokens/s per batch

    @property
    def target(self) -> dict:
        """`load_model` arguments of the target."""
        return load_arguments(self.target_kernel)

    @property
    def draft(self) -> dict:
        return load_arguments(self.draft_kernel)


def modelled_speed(timings: dict, target: str, draft: str, batch: int, acceptance: float = ACCEPTANCE) -> float:
    """Tokens/s of the pair (target, draft) at `batch` rows by the module's model, best k in 0..K."""
    one, wide = timings["target"][target][f"{batch}x1"], timings["target"][target][f"{batch}x{K + 1}"]
    drafting = timings["draft"][draft][f"{batch}x1"]
    best = 0.0
    for k in range(K + 1):
        emitted = (1 - acceptance ** (k + 1)) / (1 - acceptance)
        verify_ms = one + (wide - one) * k / K
        best = max(best, 1e3 * batch * emitted / (k * drafting + verify_ms))
    return best


def choose(timings: dict, rule: str, acceptance: float = ACCEPTANCE, skipped: dict | None = None) -> CpuKernels:
    """The pair with the best modelled score among the kernels in `timings`; the target stays `rule`
    unless beaten by TARGET_MARGIN. skipped: kernel -> why it was not timed (`measure`), for `why`."""
    targets, drafts = list(timings["target"]), list(timings["draft"])
    speeds = {(t, d): [modelled_speed(timings, t, d, b, acceptance) for b in BATCHES] for t in targets for d in drafts}
    score = {pair: math.exp(statistics.fmean(math.log(s) for s in per)) for pair, per in speeds.items()}
    best_draft = {t: max(drafts, key=lambda d: score[t, d]) for t in targets}
    best = {t: score[t, best_draft[t]] for t in targets}
    rival = max((t for t in targets if t != rule), key=best.get, default=rule)
    target = rival if best[rival] > TARGET_MARGIN * best[rule] else rule
    draft = best_draft[target]
    plain = [1e3 * b / timings["target"][target][f"{b}x1"] for b in BATCHES]
    modelled = ", ".join(f"batch {b}: {s:.2f} tokens/s (plain {p:.2f})"
                         for b, s, p in zip(BATCHES, speeds[target, draft], plain))
    draft_ms = ", ".join(f"{d} {timings['draft'][d]['1x1']:.0f}" for d in drafts)
    target_ms = ", ".join(f"{t} {timings['target'][t]['1x1']:.0f}/{timings['target'][t][f'1x{K + 1}']:.0f}"
                          for t in targets)
    kept = ("the flag rule's" if target == rule
            else f"not the flag rule's {rule}: {best[target] / best[rule]:.2f}x its score")
    why = (f"measured: target {target} ({kept}), draft {draft}; modelled at acceptance {acceptance}: {modelled}; "
           f"ms a forward at batch 1: target 1/{K + 1} tokens {target_ms}; draft {draft_ms}")
    skipped = skipped or {}
    if skipped:
        why += "; not run on this CPU: " + "; ".join(f"{k} ({reason})" for k, reason in skipped.items())
    return CpuKernels(target_kernel=target, draft_kernel=draft, why=why, timings=timings, skipped=skipped,
                      scores={f"{t}+{d}": [round(s, 3) for s in per] for (t, d), per in speeds.items()})


def unrunnable(probe: Probe = unavailable) -> dict:
    """kernel -> why it cannot run here, for the candidates of ROLES that `probe` refuses."""
    reasons = {kernel: probe(kernel) for kernel in dict.fromkeys(k for ks in ROLES.values() for k in ks)}
    return {kernel: why for kernel, why in reasons.items() if why is not None}


def measure(timer: Timer, skipped=()) -> dict:
    """role -> kernel -> "BxW" -> ms: the target at widths 1 and K + 1, the draft at 1, at BATCHES,
    for each candidate kernel not in `skipped` (`unrunnable`)."""
    widths = {"target": (1, K + 1), "draft": (1,)}
    return {role: {kernel: {f"{b}x{w}": round(timer(role, kernel, b, w), 3) for b in BATCHES for w in widths[role]}
                   for kernel in kernels if kernel not in skipped}
            for role, kernels in ROLES.items()}


def machine_key(cpuinfo: str | None = None, versions: dict | None = None) -> dict:
    """What a cached choice holds for: the CPU's model and ISA flags, the variables that limit the
    ISA (ISA_VARIABLES), torch's threads, the versions, the candidate kernels and whether the bf16w
    kernel can be built (a compiler installed later changes the answer)."""
    import os

    import torch

    from .weight_only import cannot_build
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    flags = [f for f in ISA_FLAGS if f in cpu_flags(cpuinfo)]
    if versions is None:
        versions = {p: importlib.metadata.version(p) for p in ("torch", "transformers", "hf-specdec")}
    return {"cpu": f"{name} ({' '.join(flags) or 'no listed ISA flags'})", "threads": torch.get_num_threads(),
            "isa_variables": {v: os.environ[v] for v in ISA_VARIABLES if v in os.environ},
            "versions": versions, "candidates": {role: list(kernels) for role, kernels in ROLES.items()},
            "bf16w_build": cannot_build() or "possible"}


def cached_choice(path: Path, make_timer: Callable[[], Timer], cpuinfo: str | None = None,
                  versions: dict | None = None, probe: Probe = unavailable) -> CpuKernels:
    """The choice cached at `path` for this machine, else measured (with `make_timer()`, over the
    kernels `probe` lets run) and cached."""
    key = machine_key(cpuinfo, versions)
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            choice = CpuKernels(**saved["choice"])
            logger.info("CPU kernels from %s: %s", path, choice.why)
            return choice
        logger.info("CPU kernels: %s holds another machine or versions (%s); measuring again",
                    path, saved.get("key"))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start = time.perf_counter()
    skipped = unrunnable(probe)
    choice = choose(measure(make_timer(), skipped), rule_target(cpuinfo, probe), skipped=skipped)
    logger.info("CPU kernels measured in %.0f s: %s", time.perf_counter() - start, choice.why)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as out:
        json.dump({"key": key, "choice": asdict(choice)}, out, indent=1)
    Path(out.name).replace(path)         # whole or not at all: another process may read it meanwhile
    return choice


class ForwardTimer:
    """Times forwards of the real architectures, built from their configs with constant weights (a
    kernel's speed depends on shapes, not values) at `depth` decoder layers: the decoder and the
    head timed apart, the decoder's time scaled to the full depth. No cache: the linear layers are
    what the kernels change. Each time is the least of `repeats` after one warm-up (the least is
    the one a busy machine disturbs least).

    configs: role -> a transformers config of the full model; clock: seconds (injectable)."""

    def __init__(self, configs: dict, depth: int = 2, repeats: int = 2, clock: Callable[[], float] = time.perf_counter):
        self.configs, self.depth, self.repeats, self.clock = configs, depth, repeats, clock
        self._meta: dict = {}                      # role -> the model at `depth` layers on the meta device
        self._built: tuple | None = None           # ((role, kernel), that model with the kernel)

    def __call__(self, role: str, kernel: str, batch: int, width: int) -> float:
        import torch
        model = self._model(role, kernel)
        ids = torch.zeros(batch, width, dtype=torch.long)
        with torch.inference_mode():
            hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
            decoder = self._least(lambda: model.model(input_ids=ids, use_cache=False))
            head = self._least(lambda: model.lm_head(hidden))
        return 1e3 * (head + decoder * self.configs[role].num_hidden_layers / self.depth)

    def _least(self, forward) -> float:
        forward()
        times = []
        for _ in range(self.repeats):
            start = self.clock()
            forward()
            times.append(self.clock() - start)
        return min(times)

    def _model(self, role: str, kernel: str):
        import torch
        from transformers import AutoModelForCausalLM
        if self._built is not None and self._built[0] == (role, kernel):
            return self._built[1]
        self._built = None                         # free the last one first: a 1.5B's head alone is 0.9 GB
        if role not in self._meta:                 # built once, without memory or an init pass
            config = copy.deepcopy(self.configs[role])
            config.num_hidden_layers = self.depth
            with torch.device("meta"):
                self._meta[role] = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        model = copy.deepcopy(self._meta[role]).to_empty(device="cpu")
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.is_floating_point():
                tensor.data.fill_(0.01)            # dense kernels take as long whatever the values
        arguments = load_arguments(kernel)
        model.to(arguments.get("dtype", torch.float32))
        swap_linears(model, **layer_arguments(arguments))
        self._built = ((role, kernel), model)
        return model


def swap_linears(model, *, onednn: bool = False, int8: str | None = None, packed: bool = False,
                 bf16w: bool = False, int4: bool = False) -> None:
    """`model`'s linear layers as a kernel (`load_arguments`) runs them, in place: on oneDNN
    (`use_onednn_linears`), int8 (`use_int8_linears`), packed (`use_packed_linears`), bf16 weights
    (`use_bf16w_linears`) or int4 weights (`use_int4_linears`); else unchanged."""
    from . import weight_only
    if onednn:
        use_onednn_linears(model)
    if int8:
        use_int8_linears(model, int8)
    if packed:
        from .packed_linear import use_packed_linears
        use_packed_linears(model)
    if bf16w:
        weight_only.use_bf16w_linears(model)
    if int4:
        weight_only.use_int4_linears(model)


def use_int8_linears(model, kind: str) -> None:
    """Int8 weights for every float32 `torch.nn.Linear` of `model`, in place, activations quantised
    at each call:
      "dynamic": torch's own dynamic quantisation (fbgemm), one activation scale per call: a row's
          numbers depend on the other rows of its forward, so use it for a draft model only (a
          target's output would change with the batch and the draft length);
      "per-token": torchao's `Int8DynamicActivationInt8WeightConfig` (optional dependency
          `torchao`), one scale per token: int8 products add up exactly in int32, so each row's
          result is its own, whatever computes beside it.
    """
    import torch
    if kind == "dynamic":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")       # torch deprecates the quantized-tensor API, not this use
            torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        return
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError as err:
        raise ImportError("int8='per-token' needs torchao: pip install -c scripts/constraints.txt torchao") from err
    quantize_(model, Int8DynamicActivationInt8WeightConfig())


def use_onednn_linears(model) -> int:
    """Run every float32 `torch.nn.Linear` of `model` (on the CPU) through oneDNN, in place; returns
    how many were swapped. Outputs agree with `nn.Linear`'s to float32 rounding.

    On CPUs where MKL computes a product of a few rows at matrix-vector speed (an AVX2 AMD EPYC:
    eval/cpu_matmul.py), verifying k tokens costs about k decode steps; oneDNN reads the weights once
    for all rows. The swapped layers hold their weight in oneDNN's layout: they are not
    `nn.Linear`s any more, so make copies of the model (e.g. `self_draft(model, "int8")`) first.
    """
    import torch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # it is a TorchScript module
        from torch.utils.mkldnn import MkldnnLinear
        swapped = 0
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32 \
                        and child.weight.device.type == "cpu":
                    setattr(module, name, MkldnnLinear(child, torch.float32))
                    swapped += 1
    return swapped
