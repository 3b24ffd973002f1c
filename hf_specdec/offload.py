"""Draft offload to host memory and reload, through accelerate hooks (Nightjar §6.1).

At high load the length policy switches speculation off, yet the draft's weights and KV cache
still hold accelerator memory that the target's KV cache could use. `DraftOffload` moves them out
when speculation has been off and free memory low for a while, and brings the weights back when
load has dropped and the memory is there again:

    resident --(k = 0 and free < low_free_bytes, persist_steps in a row)--> offloaded
    offloaded --(batch <= reload_batch_size and free > draft bytes + low_free_bytes,
                 persist_steps in a row)--> reloading --(copy complete)--> resident

Both directions need their condition for `persist_steps` consecutive steps (hysteresis), and the
reload condition asks for the draft's size on top of the threshold, so a probe that wobbles
around the threshold never makes the draft thrash. Speculation is held at k = 0 until the copy
has landed; the draft's cache is rebuilt by its usual catch-up (the switching cost the length
policy already accounts for through `StepContext.max_lag`).

The mechanism is a `DraftResidencyHook` (an accelerate `ModelHook`) on each draft model's top
module, appended after any hooks accelerate put there (`device_map` dispatch). It keeps a host
copy of every parameter and buffer (pinned on CUDA, made once), so offloading is dropping the
device tensors and reloading is a copy on a side stream, not a re-load from disk. A forward while
offloaded reloads synchronously: slow, never wrong.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch
from accelerate.hooks import ModelHook, SequentialHook, add_hook_to_module, remove_hook_from_module

from . import timing
from .policies.base import StepContext, non_negative_int

logger = logging.getLogger(__name__)

RESIDENT, OFFLOADED, RELOADING = "resident", "offloaded", "reloading"


def cuda_free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on `device`: the driver's free memory plus what
    PyTorch's caching allocator holds but does not use."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _tensor_slots(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, str, bool]]:
    """name -> (owning module, attribute, is_parameter) for every parameter and buffer that holds
    memory (tied weights once; accelerate's meta placeholders are left to accelerate)."""
    slots = {}
    seen = set()
    for prefix, module in model.named_modules():
        for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None or tensor.device.type == "meta" or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            slots[f"{prefix}.{attr}" if prefix else attr] = (module, attr, attr in module._parameters)
    return slots


class DraftResidencyHook(ModelHook):
    """Moves a model's tensors between their devices and a host copy; `state` says where they are."""

    def __init__(self):
        self.state = RESIDENT
        self.slots: dict[str, tuple[torch.nn.Module, str, bool]] = {}
        self.devices: dict[str, torch.device] = {}
        self.host: dict[str, torch.Tensor] | None = None
        self._incoming: tuple[torch.cuda.Event | None, dict[str, torch.Tensor]] | None = None
        self.execution_device: torch.device | None = None   # read by CachedModel while offloaded
        self.nbytes = 0

    def init_hook(self, module):
        self.slots = _tensor_slots(module)
        self.devices = {name: self._get(name).device for name in self.slots}
        self.execution_device = next(iter(self.devices.values()), torch.device("cpu"))
        self.nbytes = sum(t.numel() * t.element_size() for t in map(self._get, self.slots))   # when resident
        return module

    def pre_forward(self, module, *args, **kwargs):
        if self.state != RESIDENT:
            logger.warning("draft %s ran while %s: reloading synchronously", type(module).__name__, self.state)
            self.reload(wait=True)
        return args, kwargs

    def detach_hook(self, module):
        self.reload(wait=True)
        return module

    def _get(self, name: str) -> torch.Tensor:
        module, attr, _ = self.slots[name]
        return getattr(module, attr)

    def _put(self, name: str, tensor: torch.Tensor) -> None:
        module, attr, is_param = self.slots[name]
        if is_param:
            module._parameters[attr].data = tensor      # the same Parameter object: ties survive
        else:
            module._buffers[attr] = tensor

    def offload(self) -> None:
        """Point every tensor at its host copy; the device memory is freed."""
        if self.state == RELOADING:
            self.reload(wait=True)
        if self.state == OFFLOADED:
            return
        if self.host is None:        # weights do not change during generation: copy them once
            pin = any(d.type == "cuda" for d in self.devices.values())
            self.host = {}
            for name in self.slots:
                src = self._get(name).detach()
                self.host[name] = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
                self.host[name].copy_(src)
        for name in self.slots:
            self._put(name, self.host[name])
        self.state = OFFLOADED
        if torch.cuda.is_available():
            torch.cuda.empty_cache()   # give the freed blocks back, so the memory probe sees them

    def start_reload(self) -> None:
        """Copy the host tensors to their devices; on CUDA without blocking, on a side stream."""
        if self.state != OFFLOADED:
            return
        event, incoming = None, {}
        cuda = [d for d in self.devices.values() if d.type == "cuda"]
        if cuda:
            stream = torch.cuda.Stream(cuda[0])
            with torch.cuda.stream(stream):    # (tensors that live on the CPU anyway: copied too)
                incoming = {n: self.host[n].to(self.devices[n], non_blocking=True, copy=True) for n in self.slots}
            event = torch.cuda.Event()
            event.record(stream)
        else:
            incoming = {n: self.host[n].to(self.devices[n], copy=True) for n in self.slots}
        self._incoming = (event, incoming)
        self.state = RELOADING

    def poll(self) -> bool:
        """Finish a reload whose copy has completed; True when resident."""
        if self.state == RELOADING and (self._incoming[0] is None or self._incoming[0].query()):
            self._install()
        return self.state == RESIDENT

    def reload(self, wait: bool) -> None:
        self.start_reload()
        if self.state == RELOADING and wait:
            if self._incoming[0] is not None:
                self._incoming[0].synchronize()
            self._install()

    def _install(self) -> None:
        event, incoming = self._incoming
        for device in {t.device for t in incoming.values() if t.is_cuda}:
            torch.cuda.current_stream(device).wait_event(event)
        for name, tensor in incoming.items():
            if tensor.is_cuda:       # made on the side stream, used on the current one from now on
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
            self._put(name, tensor)
        self._incoming = None
        self.state = RESIDENT


def _hooks_of(module) -> list[ModelHook]:
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(hook.hooks) if isinstance(hook, SequentialHook) else [hook]


def residency_hook(model: torch.nn.Module) -> DraftResidencyHook | None:
    return next((h for h in _hooks_of(model) if isinstance(h, DraftResidencyHook)), None)


def attach_residency_hook(model: torch.nn.Module) -> DraftResidencyHook:
    """The model's residency hook, added after any hook already on its top module."""
    hook = residency_hook(model)
    if hook is None:
        hook = DraftResidencyHook()
        add_hook_to_module(model, hook, append=True)
    return hook


def detach_residency_hook(model: torch.nn.Module) -> None:
    """Reload the model if needed and remove only our hook (accelerate's stay in place)."""
    hook = residency_hook(model)
    if hook is None:
        return
    others = [h for h in _hooks_of(model) if h is not hook]
    if not others:
        remove_hook_from_module(model)
        return
    hook.detach_hook(model)
    # the patched forward reads `module._hf_hook` on every call: swapping it is enough
    model._hf_hook = others[0] if len(others) == 1 else SequentialHook(*others)


@dataclass
class OffloadEvent:
    step: int              # offload manager's step counter (across generate() calls)
    action: str            # "offload", "reload-start", "resident"
    free_bytes: int
    batch_size: int
    seconds: float         # wall time of the action on the decoding path


def as_offload(value) -> "DraftOffload | None":
    """The `draft_offload` argument: a DraftOffload, True (one with its defaults) or None/False."""
    if value is True:
        return DraftOffload()
    if value not in (None, False) and not isinstance(value, DraftOffload):
        raise TypeError(f"draft_offload must be a hf_specdec.DraftOffload, True or None, got {type(value).__name__}")
    return value or None


@dataclass
class DraftOffload:
    """Offload the draft models when speculation is off and memory is tight; reload when load drops.

    low_free_bytes: the free-memory threshold (tau_low); persist_steps: consecutive steps a
    condition must hold before acting; reload_batch_size: reload only when the active batch is at
    most this (None: smaller than when the draft was offloaded); probe: () -> free accelerator
    bytes (default: `cuda_free_bytes` of the draft's device; without CUDA and without a probe
    nothing is ever offloaded)."""

    low_free_bytes: int = 1 << 30
    persist_steps: int = 8
    reload_batch_size: int | None = None
    probe: Callable[[], int] | None = None
    events: list[OffloadEvent] = field(default_factory=list, repr=False)

    def __post_init__(self):
        non_negative_int(self.low_free_bytes, "DraftOffload(low_free_bytes)")
        if non_negative_int(self.persist_steps, "DraftOffload(persist_steps)") < 1:
            raise ValueError(f"DraftOffload(persist_steps) must be >= 1, got {self.persist_steps}")
        if self.reload_batch_size is not None and non_negative_int(
                self.reload_batch_size, "DraftOffload(reload_batch_size)") < 1:
            raise ValueError(f"DraftOffload(reload_batch_size) must be >= 1 or None, got {self.reload_batch_size}")
        if self.probe is not None and not callable(self.probe):
            raise TypeError(f"DraftOffload(probe) must be a callable returning free bytes, got {type(self.probe).__name__}")
        self.hooks: dict[int, DraftResidencyHook] = {}     # id(model) -> its hook
        self.models: list[torch.nn.Module] = []
        self.drafters, self.batch = [], None
        self.steps = self._streak = 0
        self.offloaded_at_batch: int | None = None

    @property
    def state(self) -> str:
        states = {h.state for h in self.hooks.values()}
        return states.pop() if len(states) == 1 else (RESIDENT if not states else RELOADING)

    def begin(self, drafters, batch) -> None:
        """A generate() call starts with these drafters: hook every model they run."""
        self.drafters, self.batch = drafters, batch
        for model in (m for d in drafters for m in d.models()):
            if id(model) not in self.hooks:
                self.hooks[id(model)] = attach_residency_hook(model)
                self.models.append(model)

    def attach(self, residency, probe: Callable[[], int]) -> None:
        """Manage `residency` (what a `DraftResidencyHook` offers: state, nbytes, offload,
        start_reload, poll) with `probe` for free bytes, instead of hooks on drafter models: the
        serving simulator's simulated draft and memory."""
        self.hooks, self.drafters, self.probe = {id(residency): residency}, [], probe

    def _free_bytes(self) -> int | None:
        if self.probe is not None:
            return int(self.probe())
        device = next((h.execution_device for h in self.hooks.values()), None)
        return cuda_free_bytes(device) if device is not None and device.type == "cuda" else None

    def step(self, ctx: StepContext, length: int) -> bool:
        """Called by the loop before each step with the policy's draft length (0: speculation off,
        the moment to offload under memory pressure); True if drafts may run."""
        if not self.hooks:
            return True
        self.steps += 1
        if self.state == RELOADING and all(h.poll() for h in self.hooks.values()):
            self._log("resident", 0, ctx, 0.0)
        free = self._free_bytes()
        if free is None:
            return self.state == RESIDENT
        if self.state == RESIDENT:
            wanted = length == 0 and free < self.low_free_bytes
        elif self.state == OFFLOADED:
            small = self.reload_batch_size or max(1, self.offloaded_at_batch - 1)
            draft = sum(h.nbytes for h in self.hooks.values())
            wanted = ctx.batch_size <= small and free > draft + self.low_free_bytes
        else:
            wanted = False
        self._streak = self._streak + 1 if wanted else 0
        if self._streak >= self.persist_steps:
            self._streak = 0
            t = timing.now()
            if self.state == RESIDENT:
                for drafter in self.drafters:     # their caches are on the device too: drop them
                    drafter.release(self.batch)
                for hook in self.hooks.values():
                    hook.offload()
                self.offloaded_at_batch = ctx.batch_size
                self._log("offload", free, ctx, timing.now() - t)
            else:
                for hook in self.hooks.values():
                    hook.start_reload()
                self._log("reload-start", free, ctx, timing.now() - t)
        return self.state == RESIDENT

    def _log(self, action: str, free: int, ctx: StepContext, seconds: float) -> None:
        self.events.append(OffloadEvent(self.steps, action, free, ctx.batch_size, seconds))
        logger.info("draft %s at step %d (batch %d, free %.2f GiB)", action, self.steps, ctx.batch_size, free / 2**30)

    def disable(self) -> None:
        """Bring every draft back and remove the hooks (accelerate's own hooks stay)."""
        for model in self.models:
            detach_residency_hook(model)
        self.hooks.clear()
        self.models.clear()
        self._streak = 0
