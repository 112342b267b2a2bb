"""``trtspec distill``: train Medusa-1 or EAGLE-3 heads against a frozen target, on text the target
generated itself (:mod:`trtspec.train.data`), so the heads learn what this target will accept.

Why distillation from the target's distribution rather than next-token labels: a draft token is
accepted with probability min(1, p/q), so what matters is the target's distribution p at every
position, not the one token that happened to follow. The loss is KL(teacher ‖ draft) over the
teacher's top-K (K = 32, renormalised: full rows of V do not fit in memory for long), i.e. the
cross-entropy of the draft's log-probs under that distribution, minus its constant entropy.

Medusa: head k (0-based) at position t reads the target's normed last state h_t and is scored
against the teacher at t + k + 1 (it predicts token t + k + 2). EAGLE-3: step 1 at position t
reads (fuse(aux_t), embedding of s_{t+1}) and is scored against the teacher at t + 1 over the
draft vocabulary (teacher mass outside it dropped, the rest renormalised), plus 0.1 × SmoothL1 of
its output g_t against the next position's fused state fuse(aux_{t+1}) (detached): at inference
later steps read g instead of a fused state, so g must stay in that distribution. Step 2 is
unrolled too, exactly as the proposer runs it: (g_t, embedding of s_{t+2}) at RoPE position
t + 1, attending to the step-1 keys of positions ≤ t and to itself (a [T, 2T] mask), scored
against the teacher at t + 2, with the weight of step 1. Gradients flow through g into step 1
(as in EAGLE-3's training-time test).

Held-out metrics, teacher-forced, after every epoch (and before the first, epoch 0), over the
positions drafts are made from (the target's continuations, not the prompts: a chat template
repeated in every sequence is learnt by heart and flattered the metric 3× in a first run): per
step, the share of positions where the draft's argmax is the teacher's, conditional on the earlier
steps agreeing there (so α₁·α₂·… is the chance the first k drafts all match), and the expected
acceptance length of a chain of D = 4, AL = 1 + Σ_k Π_{i≤k} α_i. Medusa measures every head;
EAGLE measures steps 1 and 2 and uses step 2's α for steps 3 and 4 (said in ``al_note``). Under
sampling (T > 0) argmax agreement is a proxy for acceptance, not acceptance itself.

Resumable: ``OUT/.distill/`` keeps the generated sequences and, after every epoch and at a
budget stop, a checkpoint (weights, optimizer, epoch, batch, step, RNG, the data's digest).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trtspec.build.files import write_atomic
from trtspec.spec.sample.probs import SamplingParams
from trtspec.train.config import DistillConfig, DistillError
from trtspec.train.data import (
    Progress,
    Teacher,
    digest,
    generate,
    teacher_pass,
)
from trtspec.train.trainers import EagleTrainer, MedusaTrainer, Trainer

STATE = ".distill"  # OUT/.distill: checkpoint.pt, sequences.json


@dataclass
class DistillResult:
    out: Path
    method: str
    sequences: int
    heldout: int
    epoch_tokens: int  # training tokens in one epoch
    tokens: int  # training tokens seen, every run together
    seconds: float  # training seconds, every run together
    epochs: int  # epochs completed
    stopped: str  # epochs, minutes, tokens or interrupted
    history: list[dict[str, Any]]  # per epoch (0: before training): agreement, al, loss
    loss_curve: list[tuple[int, float]]  # (step, KL)
    draft_vocab: int | None
    info: dict[str, Any] = field(default_factory=dict)  # what distill.json says

    @property
    def agreement(self) -> float:
        """Held-out top-1 agreement of head 1 / step 1 after the last epoch."""
        return self.history[-1]["agreement"][0]


def distill(model: nn.Module, prompts: Sequence[Sequence[int]], out: str | Path,
            config: DistillConfig, *, target: str, recipe: str = "", prompts_spec: str = "",
            sampling: SamplingParams | None = None, eos_token_id: int | None = None,
            special_ids: Sequence[int] = (), resume: bool = False,
            say: Callable[[str], None] = print, progress: Progress | None = None
            ) -> DistillResult:
    """Generate, run the teacher, train, save ``out`` (save_eagle3 / save_medusa layout plus
    distill.json). ``prompts`` are token ids (with ``max_new_tokens`` 0: the sequences
    themselves). ``model`` is frozen for the duration (its requires_grad flags are restored)."""
    c = config
    c.check()
    out, began = Path(out), time.monotonic()
    state_dir = out / STATE
    sampling = sampling or SamplingParams(temperature=0.0)
    layers = len(model.get_decoder().layers)
    from trtspec.spec.propose.heads.eagle_model import default_aux_layers

    aux = default_aux_layers(layers) if c.method == "eagle" else None
    free = ("epochs", "lr", "minutes", "tokens", "depth", "gen_batch")  # may change on resume
    setup = {k: v for k, v in asdict(c).items() if k not in free}
    gen_key = digest({"target": target, "prompts": [list(map(int, p)) for p in prompts],
                      "sampling": sampling.model_dump(mode="json"),
                      **{k: setup[k] for k in ("max_new_tokens", "max_len", "seed")}})
    key = {"method": c.method, "recipe": recipe, "target": target,
           "data": digest({"gen": gen_key, "aux": aux, **setup})}
    ckpt = _load_checkpoint(state_dir, key) if resume else None
    if not resume and (state_dir / "checkpoint.pt").is_file():
        say(f"starting over: {state_dir} holds a checkpoint (--resume continues it)")

    sequences = _sequences(model, prompts, c, sampling, eos_token_id, gen_key, state_dir, say,
                           progress)
    starts = [min(len(p), c.max_len) if c.max_new_tokens else 0 for p in prompts]
    kept_starts = [st for s, st in zip(sequences, starts, strict=True) if len(s) >= 3]
    kept = [s for s in sequences if len(s) >= 3]
    if len(kept) < 2:
        raise DistillError(f"{len(kept)} usable sequences (of ≥ 3 tokens): give more prompts")
    order = list(range(len(kept)))
    random.Random(c.seed).shuffle(order)
    n_held = max(1, round(c.holdout * len(kept)))
    held, train = sorted(order[:n_held]), sorted(order[n_held:])
    teacher = teacher_pass(model, kept, aux, c.top_k, progress=progress)
    teacher.starts = kept_starts  # held-out agreement: continuation positions only
    data_seconds = time.monotonic() - began

    flags = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        trainer: Trainer = (
            EagleTrainer(model, teacher, c, aux, eos_token_id, special_ids, train)
            if c.method == "eagle" else MedusaTrainer(model, teacher, c))
        return _train(trainer, model, teacher, train, held, c, key, ckpt, out, state_dir,
                      say, progress, info={
                          "method": c.method, "target": target, "recipe": recipe,
                          "prompts": prompts_spec, "prompt_count": len(prompts),
                          "sequences": len(kept), "train_sequences": len(train),
                          "heldout_sequences": len(held), "temperature": sampling.temperature,
                          "heldout_positions": "continuation",
                          "data_seconds": round(data_seconds, 1), "config": asdict(c)})
    finally:
        for p, flag in zip(model.parameters(), flags, strict=True):
            p.requires_grad_(flag)


def _sequences(model: nn.Module, prompts: Sequence[Sequence[int]], c: DistillConfig,
               sampling: SamplingParams, eos: int | None, key: str, state_dir: Path,
               say: Callable[[str], None], progress: Progress | None) -> list[list[int]]:
    """The target's continuations, generated once per generation key (kept in
    OUT/.distill/sequences.json: deterministic given the key, and the slow part on a CPU)."""
    path = state_dir / "sequences.json"
    if path.is_file():
        with contextlib.suppress(ValueError, KeyError):
            saved = json.loads(path.read_text())
            if saved["key"] == key:
                say(f"reusing {len(saved['sequences'])} sequences generated earlier ({path})")
                return saved["sequences"]
    sequences = generate(model, prompts, c.max_new_tokens, c.max_len, sampling, c.gen_batch,
                         eos_token_id=eos, progress=progress)
    state_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"key": key, "sequences": sequences}))
    return sequences


def expected_al(alphas: Sequence[float], depth: int, method: str) -> tuple[float, str]:
    """AL = 1 + Σ_{k=1..D} Π_{i≤k} α_i for a chain of D drafts, and how the α were got."""
    if method == "medusa":
        depth = min(depth, len(alphas))  # no head drafts past the last
        note = f"heads 1–{depth} measured"
    else:
        note = "steps 1–2 measured; steps 3+ use step 2's α" if depth > 2 else "measured"
    al, run = 1.0, 1.0
    for k in range(depth):
        run *= alphas[min(k, len(alphas) - 1)]
        al += run
    return al, note


def _train(trainer: Trainer, model: nn.Module, teacher: Teacher, train: list[int],
           held: list[int], c: DistillConfig, key: dict[str, str], ckpt: dict[str, Any] | None,
           out: Path, state_dir: Path, say: Callable[[str], None], progress: Progress | None,
           info: dict[str, Any]) -> DistillResult:
    """The epochs: AdamW with a linear warm-up then cosine decay over every planned step; a
    checkpoint after each epoch and at a stop; the public folder and distill.json at the end."""
    draft = trainer.draft
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    total_steps = max(1, len(trainer.batches(train, 0)) * c.epochs)
    warmup = max(1, min(100, total_steps // 20))
    epoch_tokens = sum(len(teacher.tokens[b]) - 1 for b in train)
    state: dict[str, Any] = {"epoch": 0, "batch": 0, "step": 0, "tokens": 0, "seconds": 0.0,
                             "history": [], "loss_curve": [], "losses": []}
    def amp() -> contextlib.AbstractContextManager[Any]:
        """The draft trains in float32; under a bf16/fp16 target its matmuls with the target's
        tensors (embeddings, a shared LM head) run in the target's dtype."""
        dtype = trainer.device_dtype
        return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(
            next(draft.parameters()).device.type, dtype=dtype)

    if ckpt is not None:
        draft.load_state_dict(ckpt["draft"])
        optimizer.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        state = {k: ckpt[k] for k in state}
        state["history"] = [h for h in state["history"] if h["complete"]]
        say(f"resuming at epoch {state['epoch'] + 1}, batch {state['batch']} (step "
            f"{state['step']}, {state['tokens']} tokens trained)")
    else:
        torch.manual_seed(c.seed)
        with amp():
            state["history"].append(_evaluate(trainer, held, c, 0, None, True))
        say(_epoch_line(state["history"][-1], c))
    began, ran_tokens, stopped = time.monotonic(), 0, "epochs"
    prior = state["seconds"]

    def checkpoint() -> None:
        state["seconds"] = prior + time.monotonic() - began
        _save_checkpoint(state_dir, key, draft, optimizer, state)

    try:
        while state["epoch"] < c.epochs and stopped == "epochs":
            batches = trainer.batches(train, state["epoch"])
            losses = state["losses"]  # this epoch's, a stopped run's part included
            while state["batch"] < len(batches):
                if c.minutes is not None and time.monotonic() - began >= 60 * c.minutes:
                    stopped = "minutes"
                elif c.tokens is not None and ran_tokens >= c.tokens:
                    stopped = "tokens"
                if stopped != "epochs":
                    break
                lr = c.lr * min((state["step"] + 1) / warmup, 0.5 * (1 + math.cos(
                    math.pi * min(1.0, state["step"] / total_steps))))
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with amp():
                    loss, n = trainer.loss(batches[state["batch"]])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                value = float(loss.detach())
                losses.append(value)
                state["loss_curve"].append((state["step"], value))
                state["step"] += 1
                state["batch"] += 1
                ran_tokens += n
                state["tokens"] += n
                if progress:
                    progress("train", state["epoch"] * len(batches) + state["batch"],
                             c.epochs * len(batches), f"epoch {state['epoch'] + 1}/{c.epochs} "
                             f"loss {value:.3f}")
            complete = state["batch"] >= len(batches)
            if complete:
                state["epoch"], state["batch"], state["losses"] = state["epoch"] + 1, 0, []
            if complete or state["batch"]:
                number = state["epoch"] if complete else state["epoch"] + 1
                with amp():
                    state["history"].append(_evaluate(trainer, held, c, number, losses,
                                                      complete))
                say(_epoch_line(state["history"][-1], c))
            checkpoint()
    except KeyboardInterrupt:
        stopped = "interrupted"
        checkpoint()
        _finish(trainer, out, state, stopped, info, epoch_tokens)
        say(f"interrupted: {out} saved, {state_dir} checkpointed (--resume continues)")
        raise
    if stopped != "epochs":
        say(f"stopped at the --{stopped} budget after {state['epoch']} epochs and "
            f"{state['batch']} batches: --resume continues")
    return _finish(trainer, out, state, stopped, info, epoch_tokens)


def _evaluate(trainer: Trainer, held: list[int], c: DistillConfig, epoch: int,
              losses: list[float] | None, complete: bool) -> dict[str, Any]:
    alphas = trainer.agreement(held)
    al, note = expected_al(alphas, c.depth, c.method)
    return {"epoch": epoch, "complete": complete, "agreement": [round(a, 4) for a in alphas],
            f"al_d{c.depth}": round(al, 4), "al_note": note,
            "loss": round(sum(losses) / len(losses), 4) if losses else None}


def _epoch_line(h: dict[str, Any], c: DistillConfig) -> str:
    name = "head" if c.method == "medusa" else "step"
    rest = ", ".join(f"{name} {k + 1}: {a:.3f}" for k, a in enumerate(h["agreement"][1:], 1))
    loss = "" if h["loss"] is None else f"loss {h['loss']:.3f}, "
    part = "" if h["complete"] else " (partial)"
    return (f"epoch {h['epoch']}/{c.epochs}{part}: {loss}held-out top-1 agreement "
            f"{h['agreement'][0]:.3f}" + (f" ({rest})" if rest else "")
            + f", expected AL at D={c.depth}: {h[f'al_d{c.depth}']:.2f} ({h['al_note']})")


def _save_checkpoint(state_dir: Path, key: dict[str, str], draft: nn.Module,
                     optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / "checkpoint.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "draft": draft.state_dict(), "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                **state}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(state_dir: Path, key: dict[str, str]) -> dict[str, Any]:
    """The checkpoint to resume; DistillError (one line) when there is none or it belongs to
    another run."""
    path = state_dir / "checkpoint.pt"
    if not path.is_file():
        raise DistillError(f"--resume: no checkpoint in {state_dir} (drop --resume to start)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise DistillError(f"{path}: cannot read ({type(e).__name__}): drop --resume to start "
                           "over") from None
    for name in ("method", "recipe", "target", "data"):
        have, want = ckpt["key"].get(name), key[name]
        if have != want:
            what = "data or settings differ (prompts, generation, heads)" if name == "data" \
                else f"{name} {have!r}, not {want!r}"
            raise DistillError(f"--resume: {path} is another distill run ({what}): drop "
                               "--resume to start over, or use another --out")
    return ckpt


def _finish(trainer: Trainer, out: Path, state: dict[str, Any], stopped: str,
            info: dict[str, Any], epoch_tokens: int) -> DistillResult:
    """The public folder (save_eagle3 / save_medusa) and distill.json, what benchmarks quote."""
    trainer.save(out, info["target"])
    last = state["history"][-1]
    epochs = state["epoch"]
    data = {**info, "draft_vocab": trainer.vocab_size, "epoch_tokens": epoch_tokens,
            "training_tokens": state["tokens"], "seconds": round(state["seconds"], 1),
            "epochs": epochs, "stopped": stopped, "steps": state["step"],
            "agreement": last["agreement"][0], **{k: v for k, v in last.items()
                                                  if k.startswith("al_")},
            "history": state["history"]}
    write_atomic(out / "distill.json", json.dumps(data, indent=2) + "\n")
    return DistillResult(out, info["method"], info["sequences"], info["heldout_sequences"],
                         epoch_tokens, state["tokens"], state["seconds"], epochs, stopped,
                         state["history"], list(state["loss_curve"]), trainer.vocab_size, data)
