"""The two kinds of heads ``trtspec distill`` trains (see :mod:`trtspec.train.distill` for the
losses and metrics): per method, the draft to train, its batches, its loss against the cached
teacher and its held-out agreement. Shapes next to tensors; N flat positions, K teacher ids."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trtspec.train.config import DistillConfig
from trtspec.train.data import Teacher, draft_vocab

MAX_LOGITS = 1 << 26  # logits elements per training batch (256 MB in fp32), whatever V is


class Trainer:
    """What differs between the methods: the draft, batches, loss and held-out agreement. The
    draft trains in float32 and is saved in the target's dtype (``device_dtype``)."""

    draft: nn.Module
    device_dtype: torch.dtype = torch.float32
    vocab_size: int | None = None

    def batches(self, rows: Sequence[int], epoch: int) -> list[Any]:
        raise NotImplementedError

    def loss(self, batch: Any) -> tuple[torch.Tensor, int]:
        """(scalar loss with grad, training tokens in the batch)."""
        raise NotImplementedError

    def agreement(self, rows: Sequence[int]) -> list[float]:
        """Per step, the conditional held-out top-1 agreement (see the module docstring)."""
        raise NotImplementedError

    def save(self, out: Path, target: str) -> None:
        raise NotImplementedError


@contextlib.contextmanager
def _cast(module: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``module`` in ``dtype`` within the block (to save it as the target's), float32 after."""
    module.to(dtype)
    try:
        yield
    finally:
        module.float()


def soft_kl(logits: torch.Tensor, probs: torch.Tensor, ids: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(teacher ‖ draft) per position: logits [.., Vd], teacher probs/ids [.., K] (ids in the
    draft's vocabulary, −1 where it lacks one). Returns (kl [..], usable [..] bool)."""
    p = probs.float() * (ids >= 0)
    mass = p.sum(-1)
    p = p / mass.clamp(min=1e-9)[..., None]
    logq = torch.log_softmax(logits.float(), -1).gather(-1, ids.clamp(min=0))
    kl = (p * (torch.log(p.clamp(min=1e-9)) - logq)).sum(-1)
    return kl, mass > 0


def chain(agree: list[torch.Tensor], valid: list[torch.Tensor]) -> list[float]:
    """α_k = P(step k agrees | steps < k agree), from per-step agree/valid masks [N]."""
    alphas, before = [], torch.ones_like(agree[0])
    for a, v in zip(agree, valid, strict=True):
        asked = before & v
        alphas.append(float((a & asked).sum() / asked.sum()) if asked.any() else 0.0)
        before = before & a & v
    return alphas


class MedusaTrainer(Trainer):
    """Medusa-1 heads on the cached normed last-layer states; batches are random flat
    positions (a head reads one position, so no sequence structure is needed)."""

    def __init__(self, model: nn.Module, teacher: Teacher, c: DistillConfig) -> None:
        from trtspec.spec.propose.heads.medusa import MedusaHeads

        self.c, self.teacher = c, teacher
        head = model.get_output_embeddings()
        self.device_dtype = head.weight.dtype
        if c.shared_head:
            self.draft = MedusaHeads(head.weight.shape[1], head.weight.shape[0], c.num_heads,
                                     c.head_layers, head, [True] * c.num_heads)
            for p in self.draft.parameters():
                nn.init.zeros_(p)  # residual blocks start as the identity, as in Medusa
        else:
            self.draft = MedusaHeads.from_target(model, c.num_heads, c.head_layers)
        self.device = head.weight.device
        self.draft = self.draft.float().to(self.device)
        lengths = torch.tensor([len(t) for t in teacher.tokens])
        self.start = torch.cumsum(lengths, 0) - lengths  # [S] first flat index of each row
        self.states = torch.cat(teacher.states)  # [N, H] normed last-layer states
        self.probs, self.ids = torch.cat(teacher.probs), torch.cat(teacher.ids).long()
        self.left = torch.cat([n - 1 - torch.arange(n) for n in lengths.tolist()])  # tokens after
        self.drafted = torch.cat([teacher.drafted(b, torch.arange(n))
                                  for b, n in enumerate(lengths.tolist())])  # [N] bool
        self.n = max(1, min(c.batch_tokens, MAX_LOGITS // (c.num_heads * head.weight.shape[0])))

    def _flat(self, rows: Sequence[int]) -> torch.Tensor:
        """Flat positions of ``rows`` that some head has a target for (all but each last)."""
        return torch.cat([self.start[b] + torch.arange(len(self.teacher.tokens[b]) - 1)
                          for b in rows])

    def batches(self, rows: Sequence[int], epoch: int) -> list[torch.Tensor]:
        index = self._flat(rows)
        gen = torch.Generator().manual_seed(self.c.seed * 1009 + epoch)
        index = index[torch.randperm(len(index), generator=gen)]
        return list(index.split(self.n))

    def _heads(self, index: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        """Logits [n, K, V] at flat positions ``index`` and per head (teacher probs, ids,
        valid) at position + k + 1."""
        device = self.device
        logits = self.draft(self.states[index].to(device).float())  # [n, K, V]
        targets = []
        for k in range(self.c.num_heads):
            valid = self.left[index] > k  # position + k + 1 is in the row
            at = (index + k + 1).clamp(max=len(self.states) - 1)
            targets.append((self.probs[at].to(device), self.ids[at].to(device),
                            valid.to(device)))
        return logits, targets

    def loss(self, index: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits, targets = self._heads(index)
        total = logits.new_zeros(())
        for k, (p, ids, valid) in enumerate(targets):
            kl, ok = soft_kl(logits[:, k], p, ids)
            ok = ok & valid
            total = total + (kl * ok).sum() / ok.sum().clamp(min=1)
        return total / self.c.num_heads, len(index)

    @torch.no_grad()
    def agreement(self, rows: Sequence[int]) -> list[float]:
        agree: list[list[torch.Tensor]] = [[] for _ in range(self.c.num_heads)]
        valid: list[list[torch.Tensor]] = [[] for _ in range(self.c.num_heads)]
        for index in self._flat(rows).split(self.n):
            logits, targets = self._heads(index)
            drafted = self.drafted[index]
            for k, (_, ids, ok) in enumerate(targets):
                agree[k].append((logits[:, k].argmax(-1) == ids[:, 0]).cpu())
                valid[k].append(ok.cpu() & drafted)
        return chain([torch.cat(a) for a in agree], [torch.cat(v) for v in valid])

    def save(self, out: Path, target: str) -> None:
        from trtspec.spec.propose.heads.medusa import save_medusa

        with _cast(self.draft, self.device_dtype):
            save_medusa(self.draft, out, target, keep_shared=self.c.shared_head)


class EagleTrainer(Trainer):
    """An EAGLE-3 head over the cached aux states, steps 1 and 2 unrolled; batches are whole
    sequences (the draft attends over its own earlier pairs)."""

    def __init__(self, model: nn.Module, teacher: Teacher, c: DistillConfig,
                 aux: list[int] | None, eos: int | None, special: Sequence[int],
                 rows: Sequence[int]) -> None:
        from trtspec.spec.propose.heads.eagle_model import Eagle3Draft

        self.c, self.teacher = c, teacher
        self.embed = model.get_input_embeddings()
        self.device_dtype = self.embed.weight.dtype
        vocab = self.embed.weight.shape[0]
        always = [*([] if eos is None else [eos]), *special]
        self.keep = draft_vocab(teacher, rows, c.draft_vocab, vocab, always)  # [Vd] sorted
        self.vocab_size = len(self.keep)
        self.draft = Eagle3Draft.from_target(model, aux, self.keep).float()
        self.device = self.draft.lm_head.weight.device
        self.tmap = torch.full((vocab,), -1, dtype=torch.long)  # target id → draft id
        self.tmap[self.keep] = torch.arange(len(self.keep))
        self.budget = max(8, min(c.batch_tokens, MAX_LOGITS // (2 * len(self.keep))))

    def batches(self, rows: Sequence[int], epoch: int) -> list[list[int]]:
        """Rows of similar length together (little padding), in a seeded order per epoch."""
        rng = random.Random(self.c.seed * 1009 + epoch)
        rows = list(rows)
        rng.shuffle(rows)
        rows.sort(key=lambda b: len(self.teacher.tokens[b]) // 32)
        out: list[list[int]] = [[]]
        for b in rows:
            width = max([len(self.teacher.tokens[r]) for r in out[-1]] + [
                len(self.teacher.tokens[b])])
            if out[-1] and width * (len(out[-1]) + 1) > self.budget:
                out.append([])
            out[-1].append(b)
        rng.shuffle(out)
        return out

    def _pad(self, rows: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Right-padded tokens [B, L], aux [B, L, 3H], probs [B, L, K], draft ids [B, L, K],
        lengths [B] (causal attention keeps padding out of every real position)."""
        t = self.teacher
        width = max(len(t.tokens[b]) for b in rows)

        def pad(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.stack([F.pad(x, (0, 0) * (x.dim() - 1) + (0, width - len(x)))
                                for x in xs]).to(self.device)

        ids = [self.tmap[t.ids[b].long()] for b in rows]
        return (pad([t.tokens[b] for b in rows]), pad([t.states[b].float() for b in rows]),
                pad([t.probs[b].float() for b in rows]), pad(ids),
                torch.tensor([len(t.tokens[b]) for b in rows], device=self.device))

    def _run(self, rows: Sequence[int]) -> dict[str, torch.Tensor]:
        """Steps 1 and 2 over a padded batch (T = L − 1 pairs): logits, hidden loss, masks."""
        tokens, aux, probs, ids, lengths = self._pad(rows)
        d = self.draft
        b, length = tokens.shape
        t = length - 1
        fused = d.fuse(aux)  # [B, L, H]
        e1 = self.embed(tokens[:, 1:]).float()  # [B, T, H] embedding of s_{t+1}
        pos = torch.arange(t, device=self.device)[None].expand(b, t)  # [B, T]
        g, logits1 = d(e1, fused[:, :-1], pos)  # [B, T, H], [B, T, Vd]
        kl1, ok1 = soft_kl(logits1, probs[:, 1:], ids[:, 1:])
        ok1 = ok1 & (pos + 1 < lengths[:, None])
        reg = F.smooth_l1_loss(g, fused[:, 1:].detach(), reduction="none").mean(-1)  # [B, T]
        res = {"kl1": kl1, "ok1": ok1, "reg": reg, "logits1": logits1, "ids1": ids[:, 1:, 0]}
        if t >= 2:
            e2 = self.embed(tokens[:, 2:]).float()  # [B, T − 1, H] embedding of s_{t+2}
            logits2 = eagle_step2(d, e1, fused[:, :-1], e2, g[:, :-1])
            kl2, ok2 = soft_kl(logits2, probs[:, 2:], ids[:, 2:])  # [B, T − 1]
            res |= {"kl2": kl2, "ok2": ok2 & (pos[:, :-1] + 2 < lengths[:, None]),
                    "logits2": logits2, "ids2": ids[:, 2:, 0]}
        return res

    def loss(self, rows: list[int]) -> tuple[torch.Tensor, int]:
        r = self._run(rows)

        def mean(x: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
            return (x * ok).sum() / ok.sum().clamp(min=1)

        loss = mean(r["kl1"], r["ok1"]) + self.c.hidden_weight * mean(r["reg"], r["ok1"])
        if "kl2" in r:
            loss = loss + mean(r["kl2"], r["ok2"])
        return loss, int(r["ok1"].sum())

    @torch.no_grad()
    def agreement(self, rows: Sequence[int]) -> list[float]:
        agree: list[list[torch.Tensor]] = [[], []]
        valid: list[list[torch.Tensor]] = [[], []]
        for batch in self.batches(rows, 0):
            r = self._run(batch)
            if "kl2" not in r:
                continue
            a1 = (r["logits1"].argmax(-1) == r["ids1"]) & (r["ids1"] >= 0)  # [B, T]
            a2 = (r["logits2"].argmax(-1) == r["ids2"]) & (r["ids2"] >= 0)  # [B, T − 1]
            t = torch.arange(a2.shape[1])
            drafted = torch.stack([self.teacher.drafted(b, t) for b in batch])  # [B, T − 1]
            agree[0].append(a1[:, :-1].flatten().cpu())  # step 1 at t, then step 2 at t
            valid[0].append((r["ok1"][:, :-1].cpu() & drafted).flatten())
            agree[1].append(a2.flatten().cpu())
            valid[1].append((r["ok2"].cpu() & drafted).flatten())
        return chain([torch.cat(a) for a in agree], [torch.cat(v) for v in valid])

    def save(self, out: Path, target: str) -> None:
        from trtspec.spec.propose.heads.eagle_model import save_eagle3

        with _cast(self.draft, self.device_dtype):
            save_eagle3(self.draft, out)


def eagle_step2(d: nn.Module, e1: torch.Tensor, h1: torch.Tensor, e2: torch.Tensor,
                g: torch.Tensor) -> torch.Tensor:
    """Draft step 2 for every t at once, as the proposer runs it: the pair (g_t [B, T', H],
    e2_t [B, T', H]) at RoPE position t + 1 attends to the step-1 pairs (h1, e1) [B, T, H] at
    positions ≤ t and to itself. Returns draft logits [B, T', Vd] (T' = T − 1). Written with
    Eagle3Draft's own modules; a test checks it against the draft's cached decoding."""
    from trtspec.spec.propose.heads.eagle_model import rope

    m, a = d.midlayer, d.midlayer.self_attn
    b, t1, _ = e1.shape
    t2 = e2.shape[1]

    def qkv(e: torch.Tensor, h: torch.Tensor, start: int) -> tuple[torch.Tensor, ...]:
        n = e.shape[1]
        x = torch.cat([m.input_layernorm(e), m.hidden_norm(h)], dim=-1)  # [B, n, 2H]
        pos = torch.arange(start, start + n, device=e.device)[None].expand(b, n)
        cos, sin = d.rotary_emb(x, pos)
        q = rope(a.q_proj(x).view(b, n, a.hq, a.d).transpose(1, 2), cos[:, None], sin[:, None])
        k = rope(a.k_proj(x).view(b, n, a.hkv, a.d).transpose(1, 2), cos[:, None], sin[:, None])
        return q, k, a.v_proj(x).view(b, n, a.hkv, a.d).transpose(1, 2)

    _, k1, v1 = qkv(e1, h1, 0)  # [B, Hkv, T, d]
    q2, k2, v2 = qkv(e2, g, 1)  # [B, Hq|Hkv, T', d]
    i = torch.arange(t2, device=e1.device)
    mask = torch.cat([torch.arange(t1, device=e1.device)[None, :] <= i[:, None],
                      i[None, :] == i[:, None]], dim=1)  # [T', T + T']
    out = F.scaled_dot_product_attention(q2, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2),
                                         attn_mask=mask[None, None], enable_gqa=a.hq != a.hkv)
    h = g + a.o_proj(out.transpose(1, 2).reshape(b, t2, a.hq * a.d))
    return d.lm_head(d.norm(h + m.mlp(m.post_attention_layernorm(h))))
