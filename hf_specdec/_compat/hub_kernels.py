"""Transformers' hub kernels (`transformers.integrations.hub_kernels`): from 5.25, with the `kernels`
package installed (a dependency of Transformers 5.25), every class that `use_kernelized_func` lists
functions for (attention, Mamba-2 mixers, ...) routes them through `kernels`' context variable
`_ACTIVE_KERNEL_FUNCS`, set and reset around each forward.

That variable is a process-wide global whenever `torch.compiler.is_compiling()` is True, and that
flag is process-wide during a compilation: a forward in another thread, eager, then writes the
global. The compiling thread guards on a dict it cannot guard on (dynamo: "Unexpected type dict"),
or a thread resets it to a `contextvars.Token` ("'Token' object is not iterable"). Our compiled
forwards compile while other threads decode (`compiled.py`), so `thread_safe_kernel_funcs` makes
the variable a global only where dynamo traces this thread (`torch.compiler.is_dynamo_compiling`,
folded to True in a traced frame, False in eager code whatever another thread does).
"""
from __future__ import annotations

import contextvars

import torch


def thread_safe_kernel_funcs() -> None:
    """Make `kernels`' `_ACTIVE_KERNEL_FUNCS` per thread in eager code (idempotent; nothing without `kernels`)."""
    try:
        from kernels._internals.layer import layer
    except ImportError:
        return
    variable = getattr(layer, "_ACTIVE_KERNEL_FUNCS", None)
    base = getattr(layer, "CompileableContextVar", None)
    if variable is None or base is None or type(variable) is not base:
        return                       # already ours, or a `kernels` we do not know: leave it

    class PerThreadKernelFuncs(base):
        def get(self):
            return self.global_var if torch.compiler.is_dynamo_compiling() else self.context_var.get()

        def set(self, value):
            if torch.compiler.is_dynamo_compiling():
                previous, self.global_var = self.global_var, value
                return previous
            return self.context_var.set(value)

        def reset(self, token):
            if isinstance(token, contextvars.Token):
                self.context_var.reset(token)
            else:
                self.global_var = token

    variable.uses_global_var = False
    variable.__class__ = PerThreadKernelFuncs
