"""Per-row integers kept on the device and, where the loop knows them, on the host.

The loop reads the device once a step; what it learns there (accepted counts, stops) keeps a
host copy of the rows' numbers (lengths, what each cache has fed, limits) in step with the
device's, so planning the next step reads nothing. One `RowInts` holds both copies of one
number (as vLLM's `CpuGpuBuffer`), and the arithmetic here keeps them together: a result has a
host copy only when every operand had one.
"""
from __future__ import annotations

import torch


def to_device(values: list, device, dtype=torch.long) -> torch.Tensor:
    """A host list as a tensor on `device` without making the host wait: copied from pinned memory,
    non-blocking (a copy from pageable memory would first wait for the device's queued work)."""
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":     # (other accelerators: a plain copy)
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


class RowInts:
    """tensor [n] (long, on the device) and host: the same n ints as a list, or None (unknown)."""

    __slots__ = ("tensor", "host")

    def __init__(self, tensor: torch.Tensor, host: list[int] | None = None):
        self.tensor, self.host = tensor, host

    @classmethod
    def of(cls, host: list[int], device) -> "RowInts":
        """Both copies from host numbers (one non-blocking copy to the device)."""
        return cls(to_device(host, device), list(host))

    @classmethod
    def full(cls, n: int, value: int, device) -> "RowInts":
        return cls(torch.full((n,), value, dtype=torch.long, device=device), [value] * n)

    def __len__(self) -> int:
        return len(self.tensor)

    def tolist(self) -> list[int]:
        """The host copy, or a read of the device where there is none."""
        return self.host if self.host is not None else self.tensor.tolist()

    def max(self) -> int:
        return max(self.tolist(), default=0)

    def min(self) -> int:
        return min(self.tolist(), default=0)

    def __getitem__(self, index: "RowInts") -> "RowInts":
        """The entries at `index` (row indices, a RowInts)."""
        host = None if self.host is None or index.host is None else [self.host[i] for i in index.host]
        return RowInts(self.tensor[index.tensor], host)

    def __setitem__(self, index: "RowInts", values: "RowInts | int") -> None:
        values = values if isinstance(values, RowInts) else RowInts.full(len(index), values, self.tensor.device)
        self.tensor[index.tensor] = values.tensor.to(self.tensor.device)
        if self.host is not None and index.host is not None and values.host is not None:
            for i, value in zip(index.host, values.host):
                self.host[i] = value
        else:
            self.host = None

    def map(self, tensor_op, host_op, *others: "RowInts | int") -> "RowInts":
        """tensor_op(self, *others) on the device's copies, host_op per row on the host's (ints are
        broadcast): the host copy survives where every operand has one."""
        n = len(self)
        tensors = [o.tensor.to(self.tensor.device) if isinstance(o, RowInts) else o for o in others]
        hosts = [o.host if isinstance(o, RowInts) else [o] * n for o in others]
        host = None if self.host is None or any(h is None for h in hosts) else list(map(host_op, self.host, *hosts))
        return RowInts(tensor_op(self.tensor, *tensors), host)

    def __add__(self, other: "RowInts | int") -> "RowInts":
        return self.map(torch.add, int.__add__, other)

    def __sub__(self, other: "RowInts | int") -> "RowInts":
        return self.map(torch.sub, int.__sub__, other)

    def minimum(self, other: "RowInts | int") -> "RowInts":
        return self.map(lambda a, b: torch.clamp(a, max=b) if isinstance(b, int) else torch.minimum(a, b), min, other)

    def maximum(self, other: "RowInts") -> "RowInts":
        return self.map(torch.maximum, max, other)

    def clone(self) -> "RowInts":
        return RowInts(self.tensor.clone(), None if self.host is None else list(self.host))

    def cat(self, other: "RowInts") -> "RowInts":
        """These rows, then `other`'s."""
        host = None if self.host is None or other.host is None else self.host + other.host
        return RowInts(torch.cat([self.tensor, other.tensor.to(self.tensor.device)]), host)

    def __repr__(self):
        return f"RowInts({self.tolist() if self.host is not None else self.tensor})"
