"""oscar-compile: 2-bit KV-cache quantization with OSCAR rotations and a torch.compile backend."""

from . import ops  # registers torch.ops.oscar.*
from .backend import OscarBackend, UnsupportedGraphError, compile, oscar_backend
from .cache import CacheCapacityError, LayerTransforms, MemoryReport, PagedInt2KVCache
from .quant import dequantize_int2, hadamard_matrix, identity_matrix, quantize_int2

__version__ = "0.1.0"

__all__ = [
    "PagedInt2KVCache",
    "LayerTransforms",
    "MemoryReport",
    "CacheCapacityError",
    "quantize_int2",
    "dequantize_int2",
    "hadamard_matrix",
    "identity_matrix",
    "oscar_backend",
    "OscarBackend",
    "UnsupportedGraphError",
    "compile",
    "OscarCache",
    "explain",
    "calibrate",
    "check_layers",
    "load_artifacts",
    "Artifacts",
]


def __getattr__(name):  # transformers-dependent pieces load on first use
    if name == "OscarCache":
        from .hf import OscarCache

        return OscarCache
    if name in ("calibrate", "check_layers", "load_artifacts", "Artifacts", "token_batches"):
        from . import calibration

        return getattr(calibration, name)
    if name == "explain":
        from .explainer import explain

        return explain
    raise AttributeError(f"module 'oscar_compile' has no attribute {name!r}")
