"""Pack packaged models, texts, tokenizers and calibrated artifacts for the GPU machine, which reaches no registry.

A device call carries at most 64 MiB with the working tree (~9 MiB), so everything goes in folders of at most
``--cap`` MiB under ``build/stage``: each model's GGUF as a gzip stream in pieces (``NAME.gz.partNN``, what
``benchmarks/eval_gpu.sh`` reassembles), ``texts.tgz`` (the evaluation, calibration and haystack texts),
``tokenizers-<models>.tgz`` (tokenizers converted by this machine's transformers, which the GPU's older one gets wrong for
Gemma 3) and ``artifacts-<model>.tgz`` (the artifacts calibrated and checked here, so the GPU evaluates the same
rotations). Then, on a warm machine, one call per folder (a few seconds each):

    python3 benchmarks/pack_for_gpu.py gemma3-270m smollm2-135m
    # run(command="bash benchmarks/eval_gpu.sh stage build/stage/00", carry=["build/stage/00"]), then 01, ...
"""

from __future__ import annotations

import argparse
import gzip
import io
import shutil
import tarfile
from pathlib import Path

from oscar_compile.assets import MODELS, cache_dir, gguf_path, model_dir

MIB = 2**20


def gzip_pieces(src: Path, out: Path, piece: int) -> list[Path]:
    """``src`` as one gzip stream cut into pieces of ``piece`` bytes: ``out/<name>.gz.partNN``."""
    buf = io.BytesIO()
    with open(src, "rb") as f, gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        shutil.copyfileobj(f, gz, 16 * MIB)
    data = buf.getvalue()
    paths = []
    for i in range(0, len(data), piece):
        p = out / f"{src.name}.gz.part{i // piece:02d}"
        p.write_bytes(data[i:i + piece])
        paths.append(p)
    return paths


def tar_gz(dest: Path, members: dict[str, Path]) -> Path:
    """A ``.tgz`` of ``{name in the archive: path}``."""
    with tarfile.open(dest, "w:gz") as tar:
        for name, path in members.items():
            tar.add(path, arcname=name)
    return dest


def pack(models: list[str], out: Path, cap_mib: float) -> list[Path]:
    cache = cache_dir()
    work = out / "files"
    work.mkdir(parents=True, exist_ok=True)
    piece = int((cap_mib - 1) * MIB)
    files = []
    for m in models:
        files += gzip_pieces(gguf_path(m), work, piece)
        arts = sorted(p for p in (cache / "artifacts").glob(f"{m}-*") if (p / "oscar.json").exists())
        # an artifact checked at long context ("<parent>-c<len>x...") is what the eval loads; its parent stays here
        arts = [p for p in arts if not any(q.name.startswith(f"{p.name}-c") for q in arts)]
        if arts:
            files.append(tar_gz(work / f"artifacts-{m}.tgz", {p.name: p for p in arts}))
        else:
            print(f"{m}: no calibrated artifacts in {cache / 'artifacts'} (the GPU will calibrate)")
    files.append(tar_gz(work / "texts.tgz", {p.name: p for p in sorted((cache / "text").glob("*.txt"))}))
    toks = {}
    for m in models:
        d = model_dir(m)  # converted here: its tokenizer is the one the package's fingerprints were taken with
        for f in d.glob("tokenizer*"):
            toks[f"{m}/{f.name}"] = f
    # named by its models: two packs staged on one machine (build/stage and build/stage15 on 2026-12-06) would
    # otherwise overwrite each other's tokenizers in /tmp/stage (texts.tgz holds the same texts in every pack)
    files.append(tar_gz(work / f"tokenizers-{'+'.join(models)}.tgz", toks))
    # first-fit decreasing into folders of at most cap_mib
    bins: list[list[Path]] = []
    sizes: list[int] = []
    for f in sorted(files, key=lambda p: p.stat().st_size, reverse=True):
        n = f.stat().st_size
        if n > cap_mib * MIB:
            raise SystemExit(f"{f.name} ({n / MIB:.1f} MiB) is larger than a folder ({cap_mib} MiB)")
        i = next((i for i, s in enumerate(sizes) if s + n <= cap_mib * MIB), None)
        if i is None:
            bins.append([])
            sizes.append(0)
            i = len(bins) - 1
        bins[i].append(f)
        sizes[i] += n
    folders = []
    for i, group in enumerate(bins):
        d = out / f"{i:02d}"
        d.mkdir(exist_ok=True)
        for f in group:
            f.replace(d / f.name)
        folders.append(d)
    work.rmdir()
    return folders


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", choices=sorted(MODELS))
    ap.add_argument("--out", default="build/stage", help="folder of the numbered staging folders (emptied first)")
    ap.add_argument("--cap", type=float, default=54.0, help="MiB a folder (the call's 64 MiB less the tree's, ~9 MiB since 2026-12-06)")
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    for d in pack(args.models, out, args.cap):
        size = sum(f.stat().st_size for f in d.iterdir()) / MIB
        print(f'{size:5.1f} MiB  run(command="bash benchmarks/eval_gpu.sh stage {d}", carry=["{d}"])  '
              f'{" ".join(sorted(f.name for f in d.iterdir()))}')


if __name__ == "__main__":
    main()
