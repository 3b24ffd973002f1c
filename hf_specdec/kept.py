"""What outlives one generate() call, for one target model: the static KV storages of the models
its calls ran (`cache_implementation="static"`: preallocated, and on an accelerator recorded by
CUDA graphs, so reused rather than made anew) and the "auto" policies its calls learned.

It lives on the target itself (`kept_for`), so `hf_specdec.disable` frees it at once for every
model the calls touched (no `gc.collect()` needed), and a deleted model takes it along. Nothing in
it is used by two calls at once: a call takes what it uses and gives it back when it ends, so a
concurrent call on the same model (two threads) finds nothing free and makes its own; whichever
call ends first gives its own back, the other's is dropped. Keys are the objects themselves
(weakly where they are models), never `id()`s, which a new object can inherit.
"""
from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable

ATTR = "_hf_specdec_kept"
_CREATE = threading.Lock()


class Lender:
    """Objects lent by key: `take` hands out the free one (or a new one from `make`), `give` takes
    it back (kept unless another is already free for that key)."""

    def __init__(self, table):
        self.table, self.lock = table, threading.Lock()

    def take(self, key, make: Callable):
        with self.lock:
            value = self.table.pop(key, None)
        return make() if value is None else value

    def give(self, key, value) -> None:
        with self.lock:
            self.table.setdefault(key, value)

    @contextlib.contextmanager
    def lent(self, key, make: Callable):
        """`take`n for the `with` block, given back after it (also when it raises)."""
        value = self.take(key, make)
        try:
            yield value
        finally:
            self.give(key, value)


class Kept:
    def __init__(self):
        self.storages = Lender(weakref.WeakKeyDictionary())   # model -> a free StaticSlots
        self.policies = Lender({})                            # drafters' identities -> a free "auto" policy

    def __reduce__(self):
        return Kept, ()        # a copied or pickled model keeps nothing yet (a copy shares no storage)


def kept_for(model) -> Kept:
    """The target's Kept, made on first use."""
    kept = model.__dict__.get(ATTR)
    if kept is None:
        with _CREATE:
            kept = model.__dict__.setdefault(ATTR, Kept())
    return kept


def forget(model) -> None:
    """Free everything kept for `model` (`hf_specdec.disable`)."""
    model.__dict__.pop(ATTR, None)
