"""Calibration artifacts: ``oscar.safetensors`` (every tensor) + ``oscar.json`` (the manifest).

Loading reads a JSON file and a safetensors file and nothing else: no pickle, no code. Every
check names what did not match: a missing or corrupt file, an unknown format version, a model with
other shapes or other attention weights than the one calibrated.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..cache import LayerTransforms
from ..tensor_parallel import full_tensor
from .clipping import lower_medians

FORMAT_VERSION = 1
MANIFEST, TENSORS = "oscar.json", "oscar.safetensors"
_ATTENTION_NAME_PARTS = ("attn", "attention", "q_proj", "k_proj", "v_proj", "wq", "wk", "wv", "qkv")


class ArtifactError(ValueError):
    """The artifact is missing, corrupt, of an unknown version, or was made for another model."""


def attention_weights_hash(model: torch.nn.Module) -> str:
    """sha256 over the model's attention parameters (names containing attn/attention/q_proj/...,
    all parameters if none match), in name order, as float32 bytes."""
    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    chosen = [(n, p) for n, p in params if any(part in n.lower() for part in _ATTENTION_NAME_PARTS)] or params
    h = hashlib.sha256()
    for name, p in chosen:
        h.update(name.encode())
        h.update(full_tensor(p.detach()).float().cpu().contiguous().numpy().tobytes())  # whole, under TP too
    return h.hexdigest()


def model_fingerprint(model: torch.nn.Module, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    config = getattr(model, "config", None)
    arch = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    from ..hf import sliding_windows

    # sliding-window layers (as JSON: string keys), so a backend that never sees the model still bounds their storage
    windows = {str(k): v for k, v in sliding_windows(config).items()} if config is not None else {}
    return {"architecture": arch, "num_layers": num_layers, "num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
            "head_dim": head_dim, "attention_weights_sha256": attention_weights_hash(model), "sliding_windows": windows}


def heads_by_layer(pairs) -> dict[int, tuple[int, ...]]:
    """``[[layer, head], ...]`` (as an artifact records its retrieval heads) -> ``{layer: (head, ...)}``."""
    out: dict[int, tuple[int, ...]] = {}
    for layer, head in pairs:
        out[int(layer)] = out.get(int(layer), ()) + (int(head),)
    return out


@dataclass
class Artifacts:
    """Per-layer transforms and clip ratios for one model, with where they came from."""

    method: str
    layers: list[LayerTransforms]
    fingerprint: dict
    calibration: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))

    @property
    def sliding_windows(self) -> dict[int, int]:
        """``{layer: window}`` of the calibrated model's sliding-window layers (empty for older artifacts)."""
        return {int(k): int(v) for k, v in self.fingerprint.get("sliding_windows", {}).items()}

    @property
    def bf16_layers(self) -> tuple[int, ...]:
        """Layers the long-context check (:func:`~.check.check_layers`) marked to keep in BF16 (empty if unchecked)."""
        return tuple(int(i) for i in self.calibration.get("bf16_layers", ()))

    @property
    def retrieval_heads(self) -> dict[int, tuple[int, ...]]:
        """``{layer: KV heads}`` the induction score marked as retrieval heads (:mod:`.retrieval_heads`; what the
        backend's ``exact_heads="auto"`` keeps in BF16); empty where not measured."""
        return heads_by_layer(self.calibration.get("retrieval_heads", ()))

    @property
    def has_retrieval_heads(self) -> bool:
        """Whether the induction scores were measured (an older artifact has none: ``exact_heads="auto"`` is off)."""
        return "induction_scores" in self.calibration

    @property
    def token_key_layers(self) -> tuple[int, ...]:
        """Layers whose keys the long-context check measured as clearly better per token than per channel (the
        backend's ``layer_key_formats="auto"``; empty if unchecked or checked with per-token keys)."""
        return tuple(int(i) for i in self.calibration.get("token_key_layers", ()))

    @property
    def key_page_clips(self) -> dict[int, float]:
        """``{layer: ratio}``: each layer's page range ratio for per-channel keys, chosen by the long-context check
        (the backend's ``key_page_clips="auto"``); empty if unchecked or checked with per-token keys."""
        return {i: float(r) for i, r in enumerate(self.calibration.get("key_page_clips") or ()) if r is not None}

    @property
    def feedback_page_clips(self) -> dict[int, float]:
        """``{layer: ratio}``: the page range ratios the long-context check chose for keys rounded with error
        feedback (the backend's ``key_page_clips="auto"`` with ``key_feedback=True``); empty if not checked so."""
        return {i: float(r) for i, r in enumerate(self.calibration.get("feedback_page_clips") or ()) if r is not None}

    @property
    def has_key_feedback(self) -> bool:
        """Whether every layer carries its error-feedback factor (``LayerTransforms.key_feedback``; the backend's
        ``key_feedback`` option needs it): artifacts calibrated since 2026-12-06."""
        return all(t.key_feedback is not None for t in self.layers)

    @property
    def clip_ratios(self) -> list[tuple[float, float]]:
        return [(t.key_clip, t.value_clip) for t in self.layers]

    def layer_transforms(self, layer: int, num_kv_heads: int, head_dim: int, first_head: int | None = None) -> LayerTransforms:
        """Transforms of attention layer ``layer``; raises if the model does not match the artifact.

        ``first_head``: a tensor-parallel rank holds KV heads ``first_head .. first_head + num_kv_heads - 1``
        of the calibrated model (:func:`oscar_compile.tensor_parallel.first_kv_heads`); it gets their slice."""
        fp = self.fingerprint
        if not 0 <= layer < len(self.layers):
            raise ArtifactError(f"oscar: the model has an attention layer {layer}, but the artifact covers "
                                f"{len(self.layers)} layers ({fp.get('architecture')})")
        whole = (num_kv_heads, head_dim) == (fp["num_kv_heads"], fp["head_dim"])
        if first_head is not None and head_dim == fp["head_dim"] and 0 <= first_head \
                and first_head + num_kv_heads <= fp["num_kv_heads"]:
            return self.layers[layer].heads(first_head, first_head + num_kv_heads)
        if not whole or first_head not in (None, 0):
            shard = "" if first_head is None else f" (a tensor-parallel shard from KV head {first_head})"
            raise ArtifactError(f"oscar: layer {layer} has {num_kv_heads} KV heads of dim {head_dim}{shard}, the artifact "
                                f"was made for {fp['num_kv_heads']} of dim {fp['head_dim']} ({fp.get('architecture')})"
                                + ("" if first_head is not None or num_kv_heads >= fp["num_kv_heads"] else
                                   "; under tensor parallelism compile with oscar_compile.compile(model), which reads "
                                   "the KV heads each rank holds from the model"))
        return self.layers[layer]

    def validate(self, model: torch.nn.Module, check_weights: bool = True) -> None:
        """Raise :class:`ArtifactError` naming the mismatch if ``model`` is not the calibrated model."""
        fp = self.fingerprint
        config = getattr(model, "config", None)
        if config is not None:
            cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
            checks = {
                "num_layers": getattr(cfg, "num_hidden_layers", None),
                "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_attention_heads", None),
                "num_q_heads": getattr(cfg, "num_attention_heads", None),
            }
            for key, got in checks.items():
                if got is not None and got != fp[key]:
                    raise ArtifactError(f"oscar: the artifact was made for {fp[key]} {key.replace('_', ' ')}, the model has "
                                        f"{got} ({fp.get('architecture')} artifact)")
        if check_weights:
            got = attention_weights_hash(model)
            if got != fp["attention_weights_sha256"]:
                raise ArtifactError(
                    f"oscar: the model's attention weights differ from the calibrated model's (sha256 {got[:12]}... vs "
                    f"{fp['attention_weights_sha256'][:12]}...): recalibrate, or pass check_weights=False to use it anyway"
                )

    # ---------------------------------------------------------------- files
    def save(self, directory) -> Path:
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, tr in enumerate(self.layers):
            for name in tr._present_tensor_names():
                tensors[f"layers.{i}.{name}"] = getattr(tr, name).detach().float().cpu().contiguous()
        save_file(tensors, str(d / TENSORS))
        manifest = {
            "format_version": FORMAT_VERSION,
            "method": self.method,
            "model": self.fingerprint,
            "calibration": self.calibration,
            "options": self.options,
            "clip_ratios": [{"key": k, "value": v} for k, v in self.clip_ratios],
            "created": self.created,
            "oscar_compile_version": _version(),
            "tensors_sha256": hashlib.sha256((d / TENSORS).read_bytes()).hexdigest(),
        }
        (d / MANIFEST).write_text(json.dumps(manifest, indent=2))
        return d

    @classmethod
    def load(cls, directory) -> "Artifacts":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        d = Path(directory)
        for name in (MANIFEST, TENSORS):
            if not (d / name).is_file():
                raise ArtifactError(f"oscar: {d / name} is missing: is {d} an oscar artifact directory (oscar calibrate --out)?")
        try:
            manifest = json.loads((d / MANIFEST).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ArtifactError(f"oscar: {d / MANIFEST} is not valid JSON ({e})") from None
        version = manifest.get("format_version") if isinstance(manifest, dict) else None
        if version != FORMAT_VERSION:
            raise ArtifactError(f"oscar: {d / MANIFEST} has format version {version!r}; this oscar-compile reads "
                                f"version {FORMAT_VERSION}")
        digest = hashlib.sha256((d / TENSORS).read_bytes()).hexdigest()
        if manifest.get("tensors_sha256") not in (None, digest):
            raise ArtifactError(f"oscar: {d / TENSORS} does not match its manifest (sha256 {digest[:12]}...): corrupt or replaced")
        try:
            tensors = load_file(str(d / TENSORS))
        except (SafetensorError, OSError, ValueError) as e:
            raise ArtifactError(f"oscar: {d / TENSORS} is not a readable safetensors file ({e})") from None
        fp = manifest["model"]
        clips = manifest["clip_ratios"]
        layers = []
        for i in range(fp["num_layers"]):
            try:
                optional = {n: tensors[f"layers.{i}.{n}"] for n in LayerTransforms._optional_tensor_names()
                            if f"layers.{i}.{n}" in tensors}  # key_feedback: artifacts since 2026-12-06
                tr = LayerTransforms(**{n: tensors[f"layers.{i}.{n}"] for n in LayerTransforms._tensor_names()},
                                     key_clip=float(clips[i]["key"]), value_clip=float(clips[i]["value"]), **optional)
            except (KeyError, IndexError) as e:
                raise ArtifactError(f"oscar: {d} lacks layer {i} ({e})") from None
            tr.validate(fp["num_kv_heads"], fp["head_dim"])
            layers.append(tr)
        calibration = manifest.get("calibration", {})
        if manifest["method"].startswith("oscar") and "tokens" in calibration and "position_range" not in calibration:
            import warnings

            warnings.warn(f"oscar: {d} was calibrated before calibration spread its rows over the model's positions "
                          "(every row at position 0): its keys can lose accuracy at long contexts (Gemma 3 at 32K: "
                          "+21% perplexity against +2.7%). Recalibrate with this version.", stacklevel=2)
        return cls(manifest["method"], layers, fp, calibration, manifest.get("options", {}),
                   manifest.get("created", ""))

    def summary(self) -> str:
        fp, cal = self.fingerprint, self.calibration
        lines = [f"method {self.method}; {fp['architecture']}: {fp['num_layers']} layers, {fp['num_q_heads']} q / "
                 f"{fp['num_kv_heads']} kv heads, head_dim {fp['head_dim']}",
                 f"calibrated on {cal.get('tokens', '?')} tokens of {cal.get('data', '?')} "
                 f"({cal.get('heldout_tokens', '?')} held out for the clip search) in {cal.get('seconds', 0):.0f} s"]
        errors = cal.get("heldout_relative_error")
        if errors and len(errors) == len(self.clip_ratios):
            # a layer 4x above the lower median stands out (Qwen2.5-Coder-0.5B's layer 0 keys at 2K, per the probe:
            # 1.07 against 0.07; at the 512-token calibration length not yet: 0.40 against 0.28)
            med = lower_medians(errors)
            # keys per channel over pages (the backend's default format) beside the per-token error the clip search
            # minimized; artifacts calibrated before 2026-12-06 have only the latter
            channel = cal.get("heldout_channel_key_error")
            channel = channel if channel and len(channel) == len(errors) else None
            lines.append("layer  key clip  value clip  held-out error keys / values (relative RMS)"
                         + ("  keys per channel" if channel else ""))
            for i, ((k, v), (ek, ev)) in enumerate(zip(self.clip_ratios, errors)):
                flag = "  <- an outlier" if ek > 4 * med[0] or ev > 4 * med[1] else ""
                extra = f"  {channel[i]:16.3f}" if channel else ""
                lines.append(f"{i:>5}  {k:8.3f}  {v:10.3f}  {ek:8.3f} / {ev:.3f}{extra}{flag}")
        else:
            lines.append("layer  key clip  value clip")
            lines += [f"{i:>5}  {k:8.3f}  {v:10.3f}" for i, (k, v) in enumerate(self.clip_ratios)]
        centred = cal.get("value_centred")
        if centred and "vauto" in self.method:
            plain = [i for i, c in enumerate(centred) if not c]
            lines.append(f"values stored centred (v - mean) in {len(centred) - len(plain)} layers, as they are in "
                         f"{len(plain)}: {plain or 'none'} (+vauto: whichever had the smaller held-out error)")
        check = cal.get("check_relative_error")
        if check:
            worst = max((i for i, e in enumerate(check) if e), key=lambda i: max(check[i]))
            lines.append(f"long-context check on {cal.get('check_tokens')} tokens in sequences of "
                         f"{cal.get('check_seq_len')}: worst layer {worst} ({check[worst][0]:.3f} / {check[worst][1]:.3f}); "
                         f"kept in BF16: {list(self.bf16_layers) or 'none'}")
            plain, fed = cal.get("check_page_clip_key_error"), cal.get("check_feedback_key_error")
            pairs = [(a, b) for a, b in zip(plain or (), fed or ()) if a is not None and b is not None]
            if pairs:  # what key_feedback=True would store, against the default, on the check's tokens
                better = sum(b < a for a, b in pairs)
                lines.append(f"keys with error feedback (key_feedback=True): lower key error in {better} of "
                             f"{len(pairs)} layers, summed squares {sum(a * a for a, _ in pairs):.3f} -> "
                             f"{sum(b * b for _, b in pairs):.3f}")
        if self.has_retrieval_heads:
            heads = cal.get("retrieval_heads", [])
            lines.append(f"retrieval heads (induction score, kept in BF16 by exact_heads='auto'): "
                         + (", ".join(f"layer {a} head {b} ({cal['induction_scores'][a][b]:.2f})" for a, b in heads)
                            or "none"))
        return "\n".join(lines)


def _version() -> str:
    from .. import __version__

    return __version__


def load_artifacts(directory) -> Artifacts:
    """Load an artifact directory written by :meth:`Artifacts.save` / ``oscar calibrate``."""
    return Artifacts.load(directory)
