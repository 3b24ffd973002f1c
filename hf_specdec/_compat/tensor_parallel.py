"""Transformers' tensor parallelism (`from_pretrained(..., tp_plan=...)`): the process group and the
output head's layout."""
from __future__ import annotations


import torch

def tensor_parallel_group(model: torch.nn.Module):
    """The process group that Transformers' tensor parallelism shards `model` over
    (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan=...))`), or None: the model is
    whole on this process."""
    if (getattr(model, "tp_size", None) or 1) <= 1:
        return None
    mesh = model._device_mesh
    return mesh["tp"].get_group() if "tp" in (mesh.mesh_dim_names or ()) else mesh.get_group()


def shards_logits(model: torch.nn.Module) -> bool:
    """Whether `model`'s tensor-parallel plan leaves each rank part of the vocabulary's logits
    (e.g. "colwise" on the output head) instead of all of them ("colwise_gather_output")."""
    from torch.distributed.tensor import Shard
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None)
    style = (getattr(model, "_tp_plan", None) or {}).get(name)
    layout = getattr(ALL_PARALLEL_STYLES.get(style), "output_layouts", None) if style else None
    return any(isinstance(one, Shard) for one in (layout if isinstance(layout, (tuple, list)) else [layout]))
