"""Tensor parallelism (transformers' ``tp_plan``, DTensor): which KV heads each rank holds.

Under tensor parallelism every rank runs attention for its own query and KV heads, so ``oscar::store``
and ``oscar::attention`` need no communication: the compiled graph on a rank simply holds fewer heads.
What changes is which per-head transforms of the artifact a rank must use. That is read from the model
itself: the first KV head of a rank is the global row offset of its ``k_proj`` weight shard (a DTensor's
placements say it) divided by ``head_dim``; nothing is inferred from the rank number. Calibration runs
in one process on the whole model (no tensor parallelism); every rank then loads the same artifact.
"""

from __future__ import annotations

import re

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def tensor_parallel_size(model) -> int:
    """Ranks a transformers model's attention heads are split over (``from_pretrained(..., tp_plan=...)``), else 1."""
    if model is None:
        return 1
    return int(getattr(model, "_tp_size", None) or getattr(model, "tp_size", None) or 1)


def local_kv_heads(heads: int, tp_size: int) -> int:
    """KV heads one rank holds when ``heads`` are split over ``tp_size`` ranks."""
    if heads % tp_size:
        raise ValueError(f"oscar: {heads} KV heads cannot be split evenly over {tp_size} tensor-parallel ranks")
    return heads // tp_size


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a DTensor (a collective: every rank must call it), else ``t`` itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def first_kv_heads(model, head_dim: int) -> dict[int, int]:
    """``{layer: first KV head this rank holds}`` for every layer whose ``k_proj`` weight is a DTensor
    sharded by rows (colwise); empty when the model is not tensor parallel."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    first = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        layer = _LAYER.search(name)
        if not (name.endswith("k_proj") and layer and isinstance(weight, DTensor)):
            continue
        if not any(isinstance(p, Shard) and p.dim == 0 for p in weight.placements):
            raise ValueError(f"oscar: {name}.weight is split as {weight.placements}, not by output rows (colwise): "
                             "oscar cannot tell which KV heads this rank holds")
        shape, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        if offset[0] % head_dim or shape[0] % head_dim:
            raise ValueError(f"oscar: {name}.weight's shard (rows {offset[0]}..{offset[0] + shape[0] - 1}) does not "
                             f"hold whole heads of dim {head_dim}")
        first[int(layer.group(1))] = offset[0] // head_dim
    return first
