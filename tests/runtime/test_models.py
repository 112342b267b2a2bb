"""Offline model resolution: built-in GGUF (cached by sha256), local dirs, hub cache, errors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from trtspec.runtime.models import ModelNotFound, encode, resolve


def test_builtin_resolves_to_a_cached_safetensors_dir(smollm2) -> None:
    path = resolve("smollm2-135m-instruct")
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    assert path.name.startswith("gguf-") and path == smollm2.path
    t0 = time.perf_counter()
    assert resolve("smollm2-135m-instruct") == path  # cached: hashing only, no conversion
    assert time.perf_counter() - t0 < 10


def test_local_directory_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve(str(tmp_path / "m")) == tmp_path / "m"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match=r"without config\.json"):
        resolve(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFound, match="GGUF file not found"):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelNotFound, match="is not a built-in"):
        resolve("no-such-model")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFound) as err:
        resolve("meta-llama/Llama-3.1-8B-Instruct")
    assert str(err.value) == (
        "model 'meta-llama/Llama-3.1-8B-Instruct' is not in the local Hugging Face cache and "
        "trtspec never downloads at run time: run `hf download meta-llama/Llama-3.1-8B-Instruct` "
        "on a machine with hub access, or pass a local directory or .gguf file")


def test_chat_template_is_used_for_messages_and_chat_text(smollm2) -> None:
    tok = smollm2.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.decode(encode(tok, messages))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.decode(encode(tok, "Hi")).endswith("<|im_start|>user\nHi<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    assert encode(tok, "Hi", chat=False) == list(tok("Hi")["input_ids"])
