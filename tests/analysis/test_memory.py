"""memory: parameters, KV per token and the concurrency that fits, against a hand-computed case
with round numbers."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from trtspec.analysis.memory import config_params, markdown_lines, memory_cost, safetensors_params
from trtspec.spec.methods import DraftModel, LayerSkip, Ngram

TARGET = {"hidden_size": 1024, "num_hidden_layers": 10, "num_attention_heads": 8,
          "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 4096,
          "vocab_size": 32000, "tie_word_embeddings": False}
DRAFT = {"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1024,
         "vocab_size": 32000, "tie_word_embeddings": True}


def test_params_by_hand() -> None:
    # per layer: attention 1024·(8 + 2·2)·128 + 8·128·1024 = 1,572,864 + 1,048,576 = 2,621,440;
    # MLP 3·1024·4096 = 12,582,912; norms 2·1024 → 15,206,400; × 10 layers = 152,064,000;
    # embeddings untied 2·32000·1024 = 65,536,000; final norm 1024 → 217,601,024
    assert config_params(TARGET) == 217_601_024
    # draft: per layer 256·12·64 + 4·64·256 + 3·256·1024 + 512 = 1,049,088; × 2 = 2,098,176;
    # tied embeddings 32000·256 = 8,192,000; final norm 256 → 10,290,432
    assert config_params(DRAFT) == 10_290_432


def _folder(path: Path, cfg: dict) -> str:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def _recipe(gpu: str = "H100") -> SimpleNamespace:
    return SimpleNamespace(
        gpu=SimpleNamespace(name=gpu, count=1), target=SimpleNamespace(dtype="bfloat16"),
        limits=SimpleNamespace(max_seq_len=4096),
        decide=SimpleNamespace(min_gpu_memory_headroom=0.10),
        methods=[DraftModel(method="draft_model", model="d"), Ngram(method="ngram"),
                 LayerSkip(method="layer_skip", layers=4)])


def _manifest(tmp_path: Path) -> dict:
    return {"build_inputs": {"target": {"dtype": "bfloat16"}},
            "artifacts": [{"name": "target", "role": "target",
                           "path": _folder(tmp_path / "t", TARGET)},
                          {"name": "draft", "role": "draft",
                           "path": _folder(tmp_path / "d", DRAFT)}]}


def test_fits_by_hand(tmp_path: Path) -> None:
    mem = memory_cost(_manifest(tmp_path), _recipe(), {"draft_model": 4, "ngram": 4,
                                                        "layer_skip": 2})
    # bf16: weights 2 B, KV 2 B. Target KV/token = 2·10 layers·2 heads·128·2 B = 10,240 B
    assert mem["target"]["kv_bytes_per_token"] == 10_240
    assert mem["target"]["weight_bytes"] == 2 * 217_601_024
    # usable = 80 GiB · 0.9 = 77,309,411,328 B
    assert mem["gpu_bytes"] * 0.9 == pytest.approx(77_309_411_328)
    rows = {m["method"]: m for m in mem["methods"]}
    # plain: 4096 · 10,240 + 32000 · 4 = 42,071,040 B per sequence;
    # (77,309,411,328 − 435,202,048) / 42,071,040 = 1827.3 → 1827
    dm = rows["draft_model"]
    assert dm["per_sequence_baseline"] == 42_071_040 and dm["fits_baseline"] == 1827
    # draft KV/token 2·2·4·64·2 = 2048 B; D = 4: (4096 + 4)·(10,240 + 2048) + 5·32000·4
    # = 51,020,800 B; weights 2·(217,601,024 + 10,290,432) = 455,782,912 B;
    # (77,309,411,328 − 455,782,912) / 51,020,800 = 1506.3 → 1506
    assert dm["draft"]["kv_bytes_per_token"] == 2048
    assert dm["per_sequence_spec"] == 51_020_800 and dm["fits_spec"] == 1506
    # n-gram: no draft, only the 4 extra positions and 5 logits rows:
    # 4100 · 10,240 + 5 · 128,000 = 42,624,000 B
    assert rows["ngram"]["draft"] is None and rows["ngram"]["per_sequence_spec"] == 42_624_000
    # layer skip shares the target's weights and KV: 4098 · 10,240 + 3 · 128,000
    assert rows["layer_skip"]["per_sequence_spec"] == 4098 * 10_240 + 3 * 128_000
    assert rows["layer_skip"]["fits_spec"] == (77_309_411_328 - 435_202_048) \
        // (4098 * 10_240 + 384_000)
    text = "\n".join(markdown_lines(mem, {}))
    assert "## Memory cost" in text and "| draft_model | 4 |" in text and "| 321 |" in text
    assert "draft_model: not measured (spec at c = 1506, baseline at c = 1827)" in text


def test_no_gpu_profile_shows_bytes(tmp_path: Path) -> None:
    recipe = _recipe("auto")
    mem = memory_cost(_manifest(tmp_path), recipe, {"draft_model": 4})
    assert mem["note"] == "no GPU profile: memory section shows bytes only"
    assert all(m["fits_spec"] is None for m in mem["methods"])
    text = "\n".join(markdown_lines(mem, None))
    assert "no GPU profile: memory section shows bytes only" in text
    assert "Throughput at equal memory" not in text
    missing = memory_cost({"artifacts": []}, recipe, {})
    assert "error" in missing and markdown_lines(missing, None)[-1].endswith("computed.")


def test_equal_memory_uses_measured_levels(tmp_path: Path) -> None:
    recipe = _recipe()
    recipe.limits.max_seq_len = 2 ** 20  # so few fit that the levels are measurable
    mem = memory_cost(_manifest(tmp_path), recipe, {"draft_model": 4})
    dm = next(m for m in mem["methods"] if m["method"] == "draft_model")
    fb, fs = dm["fits_baseline"], dm["fits_spec"]
    assert fs < fb
    throughput = {f"draft_model/D4/c{fs}": {"spec": {"tokens_per_s": 300.0}},
                  f"draft_model/D4/c{fb}": {"baseline": {"tokens_per_s": 250.0}}}
    text = "\n".join(markdown_lines(mem, throughput))
    assert f"spec 300.0 tokens/s at c = {fs} vs baseline 250.0 tokens/s at c = {fb} (1.20×)" \
        in text


def test_safetensors_header_count(tmp_path: Path) -> None:
    header = {"a": {"dtype": "BF16", "shape": [10, 20], "data_offsets": [0, 400]},
              "b": {"dtype": "BF16", "shape": [7], "data_offsets": [400, 414]},
              "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw
                                                 + b"\0" * 414)
    assert safetensors_params(tmp_path) == 207
    (tmp_path / "none").mkdir()
    assert safetensors_params(tmp_path / "none") is None


def test_decide_sizes_the_memory_section_for_the_gpu_asked(tmp_path: Path, capsys) -> None:
    """`trtspec decide --gpu H100` on a CPU eval: the memory section counts the sequences that
    fit in an H100's memory; an unknown GPU is one line, exit 2."""
    import shutil

    from test_decide import paired

    from trtspec.cli import main

    out = tmp_path / "e"
    out.mkdir()
    shutil.copyfile(Path(__file__).resolve().parents[2] / "recipes" / "cpu-smollm2.yaml",
                    out / "recipe.yaml")
    rows = paired("ngram/D4/c1", 0.050, 0.025, n=10)
    (out / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target = _folder(tmp_path / "target", TARGET)
    (out / "manifest.json").write_text(json.dumps({
        "build_inputs": {"target": {"dtype": "bfloat16"}},
        "artifacts": [{"role": "target", "path": target, "name": "target"}]}))
    with pytest.raises(SystemExit) as done:
        main(["decide", str(out), "--no-mlflow", "--gpu", "H100"])
    assert done.value.code == 1  # in-process, unaudited: INCONCLUSIVE
    section = (out / "report.md").read_text().split("## Memory cost")[1].split("\n## ")[0]
    assert "(H100, 80.0 GiB with 10 % kept free)" in section and "| ngram | 4 |" in section
    with pytest.raises(SystemExit) as done:
        main(["decide", str(out), "--no-mlflow", "--gpu", "H201"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err == [
        "error: unknown GPU 'H201': use one of A100-80GB, A100-40GB, L4, L40S, H100, H200, B200"]
