"""Recipes: every shipped recipe validates; ≥ 15 bad recipes each give their own one-line error
and exit code 2 through the CLI; --set overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from trtspec.build.recipe import RecipeError, load_recipe
from trtspec.cli import main

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
GOOD = yaml.safe_load((ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml").read_text())


def variant(**changes) -> dict:
    """GOOD with dotted-path changes; a value of ... deletes the key."""
    data = yaml.safe_load(yaml.safe_dump(GOOD))
    for dotted, value in changes.items():
        node, *path, last = [data, *dotted.split("__")]
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key = int(last) if isinstance(node, list) else last
        if value is ...:
            del node[key]
        else:
            node[key] = value
    return data


BAD = {
    "unknown top-level key": (variant(targte={"model": "x"}),
                              "targte.model: unknown key (did you mean target.model?)"),
    "unknown method key": (variant(methods__1__max_m=3),
                           "methods.1.max_m: unknown key (did you mean methods.1.max_n?)"),
    "wrong type": (variant(limits__max_batch_size="eight"),
                   "limits.max_batch_size: Input should be a valid integer"),
    "draft_model without model": (variant(methods__0={"method": "draft_model"}),
                                  "methods.0.model: Field required (add it to the recipe)"),
    "D = 0": (variant(draft_lengths=[0, 2]),
              "draft_lengths.0: Input should be greater than or equal to 1"),
    "negative D": (variant(draft_lengths=[-3]), "draft_lengths.0: Input should be greater"),
    "tp×pp ≠ GPU count": (variant(target__tp_size=2),
                          "tp_size × target.pp_size = 2 but gpu.count = 1"),
    "medusa on pytorch": (variant(backend={"kind": "trtllm", "workflow": "pytorch"},
                                  methods=[{"method": "medusa", "heads": "h"}]),
                          "medusa runs only in the engine workflow"),
    "unknown GPU": (variant(gpu={"name": "RTX-9090"}), "gpu.name: unknown GPU 'RTX-9090'"),
    "unknown method": (variant(methods=[{"method": "lookahead"}]),
                       "methods.0: Input tag 'lookahead' found using 'method' does not match"),
    "layer_skip on trtllm": (variant(methods=[{"method": "layer_skip", "layers": 8}]),
                             "layer_skip is a torch-backend method"),
    "tensor parallel on torch": (variant(backend={"kind": "torch"}, target__tp_size=2,
                                         gpu={"name": "H200", "count": 2},
                                         methods=[{"method": "ngram"}]),
                                 "the torch backend runs on one device"),
    "input ≥ seq len": (variant(limits__max_input_len=20000),
                        "max_input_len (20000) must be < max_seq_len (10240)"),
    "EAGLE-3 on engine": (variant(methods=[{"method": "eagle", "model": "e", "version": 3}]),
                          "EAGLE-3 runs only in the pytorch workflow"),
    "no methods": (variant(methods=[]), "methods: List should have at least 1 item"),
    "negative temperature": (variant(sampling__temperature=-1),
                             "sampling.temperature: Input should be greater than or equal to 0"),
    "fp8 on A100": (variant(target__dtype="fp8", gpu={"name": "A100-80GB"}),
                    "fp8 needs an FP8 GPU (Ada/Hopper/Blackwell); A100-80GB has none"),
    "ngram min > max": (variant(methods__1={"method": "ngram", "min_n": 4, "max_n": 2}),
                        "min_n (4) must be ≤ max_n (2)"),
    "same method twice": (variant(methods=[{"method": "ngram"}, {"method": "ngram"}]),
                          "methods lists a method twice"),
    "bad backend kind": (variant(backend={"kind": "onnx"}),
                         "backend: Input tag 'onnx' found using 'kind' does not match"),
    "pipeline parallel on pytorch": (variant(target__pp_size=2, gpu={"name": "H200", "count": 2},
                                             backend={"kind": "trtllm", "workflow": "pytorch"}),
                                     "pipeline parallelism is not supported in the pytorch"),
    "float32 engines": (variant(target__dtype="float32"), "built in bfloat16/float16/fp8"),
    "bad recipe name": (variant(name="my recipe!"), "name: String should match pattern"),
    "adaptive misspelt": (variant(draft_lengths=[2, "adaptiv"]),
                          "draft_lengths.1: 'adaptiv' is not a draft length: give an integer "
                          "1..64 or adaptive"),
    "draft lengths a word": (variant(draft_lengths="fast"),
                             "draft_lengths: 'fast': write a list of draft lengths"),
    "adaptive on TensorRT-LLM": (variant(draft_lengths=[4, "adaptive"]),
                                 "draft_lengths: adaptive chooses D per round in trtspec's own "
                                 "executor (backend.kind: torch)"),
    "max_draft_len 0": (variant(max_draft_len=0),
                        "max_draft_len: Input should be greater than or equal to 1"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_recipe_gives_one_line_and_exit_2(name: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    data, expected = BAD[name]
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as exit_info:
        main(["build", str(path), "--dry-run", "--engines", str(tmp_path / "engines")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert expected in lines[0] and str(path) in lines[0] and "Traceback" not in err


def test_bad_recipe_errors_are_all_different() -> None:
    assert len(BAD) >= 15 and len({e for _, e in BAD.values()}) == len(BAD)


def test_not_yaml_missing_file_and_not_a_mapping(tmp_path: Path) -> None:
    (tmp_path / "x.yaml").write_text("target: [unclosed")
    with pytest.raises(RecipeError, match=r"x.yaml: not valid YAML \(line 1\)"):
        load_recipe(tmp_path / "x.yaml")
    with pytest.raises(RecipeError, match="no such recipe file"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "y.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(RecipeError, match="a recipe is a YAML mapping"):
        load_recipe(tmp_path / "y.yaml")


@pytest.mark.parametrize("path", RECIPES, ids=[p.stem for p in RECIPES])
def test_shipped_recipes_validate(path: Path) -> None:
    recipe = load_recipe(path)
    assert recipe.name == path.stem


def test_set_overrides_values_lists_and_reports_bad_paths() -> None:
    path = ROOT / "recipes" / "h200-llama31-8b-draft1b.yaml"
    recipe = load_recipe(path, ["limits.max_batch_size=16", "methods.1.max_n=5",
                                "draft_lengths=[1, 2]", "sampling.temperature=0.7"])
    assert recipe.limits.max_batch_size == 16 and recipe.methods[1].max_n == 5
    assert recipe.draft_lengths == [1, 2] and recipe.sampling.temperature == 0.7
    assert recipe.digest() != load_recipe(path).digest()
    with pytest.raises(RecipeError, match="'7' is not an index of methods"):
        load_recipe(path, ["methods.7.max_n=5"])
    with pytest.raises(RecipeError, match=r"write it as key\.path=value"):
        load_recipe(path, ["limits.max_batch_size"])
    with pytest.raises(RecipeError, match=r"limits\.max_batchsize: unknown key \(did you mean "
                                          r"limits\.max_batch_size\?\)"):
        load_recipe(path, ["limits.max_batchsize=4"])


CPU = ROOT / "recipes" / "cpu-smollm2.yaml"


@pytest.mark.parametrize(("overrides", "message"), [
    (["backend.kind=trtllm"], "backend: kind trtllm takes no device (a key of kind torch): "
                              "remove backend.device from the recipe"),
    (["methods.0.method=layer_skip"],
     "methods.0: method layer_skip takes no min_n, max_n (keys of method ngram): remove "
     "methods.0.min_n, methods.0.max_n from the recipe; layer_skip needs layers"),
    (["methods.1.min_n=2"], "methods.1: method layer_skip takes no min_n (a key of method "
                            "ngram): drop methods.1.min_n from --set"),
    (["methods.0={method: eagle, model: e, min_n: 1, heads: h}"],
     "methods.0: method eagle takes no min_n (method ngram), heads (method medusa): drop "
     "methods.0.min_n, methods.0.heads from --set"),
])
def test_keys_of_another_variant_name_it_and_say_to_drop_them(overrides: list[str],
                                                              message: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(CPU, overrides)
    assert str(info.value) == f"{CPU}: {message}"


def test_a_switched_kind_in_the_file_names_the_kind_too(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(CPU.read_text().replace("kind: torch", "kind: trtllm"))
    with pytest.raises(RecipeError, match=r"backend: kind trtllm takes no device \(a key of kind "
                                          r"torch\): remove backend\.device from the recipe$"):
        load_recipe(path)


@pytest.mark.parametrize(("key", "suggestion"), [
    ("backend.tp_size", "target.tp_size"),          # same last segment, another section
    ("targt.model", "target.model"),                # a misspelt section
    ("sampling.temprature", "sampling.temperature"),
    ("limits.max_batch", "limits.max_batch_size"),
    ("methods.0.max_m", "methods.0.max_n"),         # the user's index is kept
    ("evl.per_category", "eval.per_category"),
    ("device", "backend.device"),
    ("backend.workflo", "backend.workflow, a key of kind trtllm"),
])
def test_an_unknown_key_suggests_the_nearest_key_path(key: str, suggestion: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(CPU, [f"{key}=1"])
    assert f": {key}: unknown key" in str(info.value)
    assert f"(did you mean {suggestion}?)" in str(info.value)


@pytest.mark.parametrize(("key", "takes"), [
    ("limits.foo", "(limits takes max_batch_size, max_input_len, max_seq_len, max_num_tokens)"),
    ("backend.zzz", "(backend with kind torch takes kind, device, runner)"),
    ("qqq", "(a recipe takes name, description, target, methods, draft_lengths"),
])
def test_no_suggestion_when_nothing_is_close(key: str, takes: str) -> None:
    with pytest.raises(RecipeError) as info:
        load_recipe(CPU, [f"{key}=1"])
    assert "did you mean" not in str(info.value) and f"{key}: unknown key {takes}" in str(
        info.value)


def test_unknown_keys_in_the_file_get_suggestions_too(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(CPU.read_text().replace("max_tokens:", "max_token:")
                    .replace("target:", "targte:"))
    with pytest.raises(RecipeError, match=r"targte: unknown key \(did you mean target\?\)"):
        load_recipe(path)
    path.write_text(CPU.read_text().replace("max_tokens:", "max_token:"))
    with pytest.raises(RecipeError, match=r"sampling\.max_token: unknown key \(did you mean "
                                          r"sampling\.max_tokens\?\)$"):
        load_recipe(path)


def test_adaptive_draft_lengths_alone_or_in_the_list() -> None:
    alone = load_recipe(CPU, ["draft_lengths=adaptive"])
    assert alone.draft_lengths == ["adaptive"] and alone.adaptive and alone.adaptive_cap == 8
    assert alone.fixed_draft_lengths() == [] and alone.condition_draft_lengths([9]) == ["adaptive"]
    mixed = load_recipe(CPU, ["draft_lengths=[2, 12, adaptive]"])
    assert mixed.condition_draft_lengths([]) == [2, 12, "adaptive"]
    assert mixed.fixed_draft_lengths() == [2, 12] and mixed.adaptive_cap == 12
    assert load_recipe(CPU, ["draft_lengths=[2, adaptive]", "max_draft_len=5"]).adaptive_cap == 5
    plain = load_recipe(CPU)
    assert not plain.adaptive and plain.condition_draft_lengths([9]) == [2, 4]
    auto = load_recipe(CPU, ["draft_lengths=auto"])
    assert auto.condition_draft_lengths([2, 4, 10]) == [2, 4, 10] and auto.adaptive_cap == 8
    # max_draft_len at its default leaves the digest as older trtspec versions recorded it
    assert plain.digest() == load_recipe(CPU, ["max_draft_len=null"]).digest()
    assert load_recipe(CPU, ["max_draft_len=8"]).digest() != plain.digest()
