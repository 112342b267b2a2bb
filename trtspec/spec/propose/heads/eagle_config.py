"""An EAGLE-3 head's config.json, read and checked (:class:`Eagle3Config`), the target layers it
reads by default, and the check that a target is one the heads can read (Medusa's too).

Why checked here, key by key: a config.json from a hub download or a hand edit can hold
``null``, a string or a scalar where a number or a list belongs; each must fail at build as one
line naming the file and the key (HeadsError, exit 2), not as a TypeError deep in a constructor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtspec.spec.propose.heads import HeadsError

UNSUPPORTED = ("norm_before_fc", "fc_norm", "eh_proj_before_attn", "return_hidden_post_norm")
AUX_KEY = "eagle_aux_hidden_state_layer_ids"


def default_aux_layers(num_layers: int) -> list[int]:
    """The target layers EAGLE-3 reads, [1, L/2 − 1, L − 4], clamped into 0 … L − 1."""
    return [min(max(i, 0), num_layers - 1) for i in (1, num_layers // 2 - 1, num_layers - 4)]


def integer(config: Mapping[str, Any], key: str, where: Path, default: int | None = None,
            least: int = 1) -> int:
    """``config[key]`` as an integer ≥ ``least``; absent or null gives ``default`` when there is
    one. HeadsError naming the file and key otherwise."""
    value = config.get(key)
    if value is None and default is not None:
        return default
    if key not in config:
        raise HeadsError(f"{where}: no {key}")
    if type(value) is not int or value < least:
        raise HeadsError(f"{where}: {key} must be an integer ≥ {least}, got {value!r}")
    return value


def positive(config: Mapping[str, Any], key: str, where: Path, default: float) -> float:
    """``config[key]`` as a positive number; absent or null gives ``default``."""
    value = config.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not value > 0:
        raise HeadsError(f"{where}: {key} must be a positive number, got {value!r}")
    return float(value)


def mapping(config: Mapping[str, Any], key: str, where: Path) -> dict[str, Any]:
    """``config[key]`` as a dict; absent or null gives {}."""
    value = config.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise HeadsError(f"{where}: {key} must be an object, got {value!r}")
    return dict(value)


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layers: list[int]  # target layers fused, 0-based, low → high
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    extra: dict[str, Any] = field(default_factory=dict)  # other keys, written back as read

    def to_json(self) -> dict[str, Any]:
        out = dict(self.extra)
        out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama",
                   hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads,
                   num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                   rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
                   rope_scaling=self.rope_scaling,
                   max_position_embeddings=self.max_position_embeddings, num_hidden_layers=1,
                   hidden_act="silu", vocab_size=self.vocab_size,
                   draft_vocab_size=self.draft_vocab_size, tie_word_embeddings=False)
        eagle = dict(out.get("eagle_config") or {})
        eagle[AUX_KEY] = list(self.aux_layers)
        out["eagle_config"] = eagle
        return out

    @classmethod
    def from_json(cls, config: dict[str, Any], where: Path, target_layers: int) -> Eagle3Config:
        """Checked: one line naming the file and key when something is missing, mistyped or
        not supported."""
        eagle = mapping(config, "eagle_config", where)
        for key in UNSUPPORTED:
            if eagle.get(key) or config.get(key):
                raise HeadsError(f"{where}: {key} is not supported (a plain EAGLE-3 head is)")
        if eagle.get("use_aux_hidden_state") is False:
            raise HeadsError(f"{where}: use_aux_hidden_state false (an EAGLE-1/2 head) is not "
                             "supported")
        if config.get("num_hidden_layers", 1) != 1:
            raise HeadsError(f"{where}: num_hidden_layers {config['num_hidden_layers']!r}: only "
                             "one-layer EAGLE-3 heads are supported")
        if config.get("hidden_act", "silu") != "silu" or config.get("attention_bias"):
            raise HeadsError(f"{where}: only SiLU MLPs without attention biases are supported")
        hidden = integer(config, "hidden_size", where)
        heads = integer(config, "num_attention_heads", where)
        kv_heads = integer(config, "num_key_value_heads", where, heads)
        if heads % kv_heads:
            raise HeadsError(f"{where}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        if config.get("target_hidden_size") not in (None, hidden):
            raise HeadsError(f"{where}: target_hidden_size {config['target_hidden_size']!r} ≠ "
                             f"hidden_size {hidden} is not supported")
        vocab = integer(config, "vocab_size", where)
        aux = eagle.get(AUX_KEY)
        if aux is None or aux == []:
            aux = default_aux_layers(target_layers)
        if not isinstance(aux, list) or len(aux) != 3 or \
                not all(type(i) is int and 0 <= i < target_layers for i in aux):
            raise HeadsError(f"{where}: eagle_config.{AUX_KEY} {aux!r} are not 3 layers of the "
                             f"target's {target_layers}")
        rope = mapping(config, "rope_parameters", where)  # transformers ≥ 5 writes this
        theta = positive(config, "rope_theta", where,
                         positive(rope, "rope_theta", where, 10000.0))
        rope.pop("rope_theta", None)
        scaling = mapping(config, "rope_scaling", where) or (
            rope if rope.get("rope_type", "default") != "default" else {})
        known = set(cls.__dataclass_fields__) - {"extra", "aux_layers"} | {
            "architectures", "model_type", "num_hidden_layers", "hidden_act",
            "tie_word_embeddings", "rope_parameters", "eagle_config", "torch_dtype", "dtype"}
        extra = {k: v for k, v in config.items() if k not in known}
        rest = {k: v for k, v in eagle.items() if k != AUX_KEY}
        if rest:
            extra["eagle_config"] = rest
        head_dim = integer(config, "head_dim", where, hidden // heads)
        if head_dim < 1:
            raise HeadsError(f"{where}: hidden_size {hidden} over {heads} attention heads leaves "
                             "no head_dim")
        return cls(hidden, integer(config, "intermediate_size", where), heads, kv_heads,
                   head_dim, vocab,
                   integer(config, "draft_vocab_size", where, vocab), list(aux),
                   positive(config, "rms_norm_eps", where, 1e-6), theta, scaling or None,
                   integer(config, "max_position_embeddings", where, 2048), extra)
