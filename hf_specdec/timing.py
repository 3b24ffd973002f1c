"""Phase times of a step, for the policies that read them, without synchronising the device.

On a CUDA device a mark is an event recorded in the stream, and the time between two marks is
read once the later one has completed: the caller reads it after a host read that follows the mark
(the decoding loop: one step later, `DecodingLoop.observe_late`), so timing costs no device sync.
Elsewhere the host clock is the device's: `now`, which tests replace with a clock of their own (the
policies then see the same costs on a busy machine as on an idle one).
"""
from __future__ import annotations

import time

import torch


def now() -> float:
    """Seconds on the host clock every step time is read from."""
    return time.perf_counter()


class PhaseClock:
    """device: where the models run: on CUDA a mark is an event; elsewhere a host time."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"

    def mark(self):
        if not self.events:
            return now()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        """Seconds between two marks. With events, waits on the device only if `end` has not
        completed yet (at the end of a call; never within the steps, see the module docstring)."""
        if not self.events:
            return end - start
        if not end.query():
            end.synchronize()
        return start.elapsed_time(end) / 1000.0
