"""Free the dense KV buffers a model owns once the rewrite has made them dead.

A hand-written (gpt-fast style) decoder allocates its own ``k_cache``/``v_cache`` buffers; after the
rewrite no graph reads or writes them (oscar keeps the tokens in its INT2 pages), but they still hold
``batch x heads x max_len x d`` BF16 elements each. :class:`ReleasedBuffers` resizes such a buffer's
storage to zero bytes (as FSDP2 does with sharded parameters: the tensor keeps its shape, strides and
identity, so Dynamo's guards and CUDA-graph static inputs are unaffected) and remembers it, so that
any later graph that still uses it is refused at compile time. Eager use of a released buffer would
read freed memory; :func:`oscar_compile.compile` installs a forward pre-hook that refuses eager calls
once something was released (see ``OscarBackend.attach``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import fx

from .fx_utils import source_name
from .matcher import _METADATA_READS


@dataclass
class Released:
    name: str  # where the buffer came from (a Dynamo source path)
    nbytes: int
    ref: weakref.ref


def _placeholders(gm: fx.GraphModule, example_inputs) -> list[tuple[fx.Node, object]]:
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return list(zip(nodes, example_inputs)) if len(nodes) == len(example_inputs) else []


def _live_users(node: fx.Node) -> list[fx.Node]:
    """Uses that read or write the tensor's data (its shape, or handing it back as an output, do not)."""
    return [u for u in node.users if u.op != "output"
            and not (u.op == "call_method" and u.target in _METADATA_READS)]


class ReleasedBuffers:
    """The model-owned buffers this backend freed, with the checks that keep them unused."""

    def __init__(self):
        self._released: dict[int, Released] = {}

    def __bool__(self) -> bool:
        return any(r.ref() is not None for r in self._released.values())

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self._released.values() if r.ref() is not None)

    def names(self) -> list[str]:
        return [r.name for r in self._released.values() if r.ref() is not None]

    def is_released(self, x) -> bool:
        r = self._released.get(id(x))
        return r is not None and r.ref() is x

    def release_dead(self, gm: fx.GraphModule, example_inputs, candidates: set[fx.Node],
                     owned: set[int]) -> list[Released]:
        """Free every candidate placeholder that is now dead in ``gm`` and whose tensor is in ``owned``
        (ids of the model's registered buffers). Returns what was freed now."""
        freed = []
        for node, x in _placeholders(gm, example_inputs):
            if node not in candidates or not isinstance(x, torch.Tensor) or id(x) not in owned:
                continue
            if _live_users(node) or self.is_released(x):
                continue
            storage = x.untyped_storage()
            if storage.nbytes() < x.numel() * x.element_size():  # a stub (one element seen as many) or already freed
                continue
            rec = Released(source_name(node) or node.name, storage.nbytes(), weakref.ref(x))
            storage.resize_(0)
            self._released[id(x)] = rec
            freed.append(rec)
        return freed

    def uses(self, gm: fx.GraphModule, example_inputs) -> list[str]:
        """Descriptions of the uses ``gm`` still makes of released buffers (each one would read freed memory)."""
        bad = []
        for node, x in _placeholders(gm, example_inputs):
            if self.is_released(x):
                bad += [f"{self._released[id(x)].name} is used by {u.name} ({u.op} {u.target})" for u in _live_users(node)]
        return bad
