"""Heads vs lookup vs layer skip on SmolLM2-135M-Instruct (CPU): eagle, medusa, ngram and
layer_skip at one D on the built-in workload, measured the way users measure: ``trtspec build``,
``trtspec eval``, ``trtspec audit`` and ``trtspec decide`` on a copy of the CPU recipe that
lists the four methods, with the heads ``make heads`` distilled.

Per category of the built-in workload (8 categories; the records carry the recipe's two groups,
the request id the category): AL (tokens emitted per verification round), acceptance (accepted /
proposed drafts), and the speedup vs plain decoding (geometric mean over paired requests of
baseline TPOT / spec TPOT, the recipe's primary metric). c (a draft step's cost over a target
step) and α come from decide's cost model; the verdicts (per group, with CIs) are decide's own
table. Training time and tokens come from each head's distill.json.

Writes reports/bench-heads.md. Needs ``make heads`` first (about 20 minutes); the eval itself
takes 15-25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
HEADS = {"eagle": ROOT / "heads" / "smollm2-135m-eagle3",
         "medusa": ROOT / "heads" / "smollm2-135m-medusa"}
TRTSPEC = str(Path(sys.executable).with_name("trtspec"))
METHODS = ("eagle", "medusa", "ngram", "layer_skip")


def recipe_file(out: Path, draft_len: int) -> Path:
    """The CPU recipe with the four methods at one D, written next to the report."""
    recipe = yaml.safe_load((ROOT / "recipes" / "cpu-smollm2.yaml").read_text())
    medusa = json.loads((HEADS["medusa"] / "config.json").read_text())
    recipe["name"] = "cpu-smollm2-heads"
    recipe["methods"] = [
        {"method": "eagle", "model": str(HEADS["eagle"])},
        {"method": "medusa", "heads": str(HEADS["medusa"]),
         "num_heads": min(int(medusa.get("medusa_num_heads", 4)), draft_len)},
        {"method": "ngram", "min_n": 1, "max_n": 3},
        {"method": "layer_skip", "layers": 24},
    ]
    recipe["draft_lengths"] = [draft_len]
    out.mkdir(parents=True, exist_ok=True)
    path = out / "cpu-smollm2-heads.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def run(argv: list[str], ok: tuple[int, ...] = (0,)) -> None:
    print("$", " ".join(argv), flush=True)
    code = subprocess.call(argv, cwd=ROOT)
    if code not in ok:
        sys.exit(f"bench-heads: {' '.join(argv[:2])} exited {code}")


def per_category(records: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """(method, category) → AL, acceptance, speedup (geomean of paired TPOT ratios), n."""
    arms: dict[tuple[str, str, str], dict[str, dict]] = defaultdict(dict)
    for r in records:
        key = (r["condition"], r["request_id"], str(r.get("block", "")))
        arms[key][r["arm"]] = r
    out: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (_, request_id, _), pair in arms.items():
        if "baseline" not in pair or "spec" not in pair:
            continue
        base, spec = pair["baseline"], pair["spec"]
        cell = out[(spec["method"], request_id.rsplit("-", 1)[0])]
        cell["proposed"].append(spec["proposed_tokens"])
        cell["accepted"].append(spec["accepted_draft_tokens"])
        cell["emitted"].append(spec["emitted_tokens"])
        cell["rounds"].append(spec["verification_rounds"])
        tb, ts = tpot(base), tpot(spec)
        if tb and ts:
            cell["log_ratio"].append(math.log(tb / ts))
    table = {}
    for key, cell in out.items():
        n = len(cell["log_ratio"])
        table[key] = {
            "al": sum(cell["emitted"]) / max(1, sum(cell["rounds"])),
            "acceptance": sum(cell["accepted"]) / max(1, sum(cell["proposed"])),
            "speedup": math.exp(sum(cell["log_ratio"]) / n) if n else float("nan"),
            "n": n}
    return table


def tpot(r: dict) -> float | None:
    """Seconds per output token after the first (the records' decode time over the rest)."""
    n = r["output_tokens"] - 1
    return r["decode_s"] / n if n > 0 and r["decode_s"] > 0 else None


def eval_agreement(records: list[dict]) -> dict[str, float]:
    """Teacher-forced top-1 agreement of each head's first draft with the target, over the
    eval's own baseline continuations (the positions drafts are made from at run time): what
    acceptance rests on, measured on the eval's text rather than distill's held-out split."""
    import torch

    from trtspec.eval.workloads import builtin
    from trtspec.runtime.hf import layer_outputs
    from trtspec.runtime.models import encode, load
    from trtspec.spec.propose.heads.eagle import load_eagle3
    from trtspec.spec.propose.heads.medusa import load_medusa

    lm = load("smollm2-135m-instruct", device="cpu")
    model, norm = lm.model, lm.model.get_decoder().norm
    prompts = {r.id: encode(lm.tokenizer, r.chat()) for r in builtin()}
    eagle, medusa = load_eagle3(HEADS["eagle"], model), load_medusa(HEADS["medusa"], model)
    seen: set[str] = set()
    hits = {"eagle": [], "medusa": []}
    for r in records:
        if r["arm"] != "baseline" or r["request_id"] in seen:
            continue
        seen.add(r["request_id"])
        prompt = prompts[r["request_id"]]
        seq = torch.tensor([prompt + r["output_token_ids"]])  # [1, T]
        t, start = seq.shape[1], len(prompt)
        with torch.inference_mode(), layer_outputs(model, [*eagle.aux_layers, -1]) as kept:
            best = model(seq).logits[0].argmax(-1)  # [T]: the target's next token at each t
            states = [k[0] for k in kept]
            head1 = medusa(norm(states[-1]))[:, 0].argmax(-1)  # at t: the token at t + 2
            pairs = eagle.fuse(torch.cat(states[:-1], -1)[: t - 1])[None]  # (H_t, s_{t+1})
            _, logits = eagle(model.get_input_embeddings()(seq[:, 1:]), pairs,
                              torch.arange(t - 1)[None])
            step1 = eagle.target_logits(logits[0]).argmax(-1)  # pair t: the token at t + 2
        drafted = slice(start - 1, t - 1)  # states whose next token is the target's own
        hits["medusa"] += (head1[:-1][drafted] == best[1:][drafted]).tolist()
        hits["eagle"] += (step1[drafted] == best[1:][drafted]).tolist()
    return {m: sum(h) / max(1, len(h)) for m, h in hits.items()}


def write_report(folder: Path, draft_len: int, seconds: float | None, path: Path) -> None:
    records = [json.loads(line) for line in (folder / "records.jsonl").read_text().splitlines()
               if line.strip()]
    on_eval = eval_agreement(records)
    requests = len({r["request_id"] for r in records})
    decision = json.loads((folder / "decision.json").read_text())
    table = per_category(records)
    categories = sorted({c for _, c in table})
    lines = [f"# Heads vs lookup vs layer skip — SmolLM2-135M-Instruct, CPU, D = {draft_len}", "",
             f"`python benchmarks/bench_heads.py` (eval `{folder.name}`"
             + (f", {seconds / 60:.0f} min for build + eval + audit + decide" if seconds else
                ", written again from its records")
             + "). Greedy (the CPU recipe's temperature 0), "
             f"concurrency 1, {requests} requests of the built-in workload (its 8 categories, "
             "judged as the recipe's two groups).", "",
             "## The heads (`make heads`)", "",
             "Held-out top-1 and expected AL are distill's (teacher-forced, its held-out "
             "sequences); *on the eval* is the same first-draft agreement over this eval's own "
             "continuations (the positions drafts are made from).", "",
             "| head | trained on | training tokens | data time | training time | epochs | "
             "held-out top-1 | expected AL (D = 4) | top-1 on the eval |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for method in ("eagle", "medusa"):
        info_path = HEADS[method] / "distill.json"
        info = json.loads(info_path.read_text()) if info_path.is_file() else {}
        last = (info.get("history") or [{}])[-1]
        top1 = (last.get("agreement") or [None])[0]
        where = "" if info.get("heldout_positions") == "continuation" else \
            " (over every position, chat template included: a distill before the fix)"
        lines.append(f"| {method} | {info.get('prompts', '?')} prompts "
                     f"({info.get('sequences', '?')} sequences, "
                     f"{info.get('heldout_sequences', '?')} held out) | "
                     f"{info.get('training_tokens', '?')} | "
                     f"{float(info.get('data_seconds', 0)) / 60:.1f} min | "
                     f"{float(info.get('seconds', 0)) / 60:.1f} min | {info.get('epochs', '?')} "
                     f"({info.get('stopped', '?')}) | {_num(top1)}{where} | "
                     f"{_num(last.get('al_d4'))} | {_num(on_eval[method])} |")
    lines += ["", "## Per category", "",
              "Speedup = geometric mean over paired requests of baseline TPOT / spec TPOT.", "",
              "| category | " + " | ".join(f"{m} AL | {m} acc. | {m} speedup" for m in METHODS)
              + " |", "|---|" + "---:|" * (3 * len(METHODS))]
    for c in categories:
        cells = []
        for m in METHODS:
            t = table.get((m, c))
            cells += ([f"{t['al']:.2f}", f"{t['acceptance']:.0%}", f"{t['speedup']:.2f}×"]
                      if t else ["—"] * 3)
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "## Cost model (decide's: α per draft, c = draft step / target step)", "",
              "| condition | α | c | measured speedup |", "|---|---:|---:|---:|"]
    for condition, row in (decision.get("cost_model") or {}).items():
        lines.append(f"| {condition} | {_num(row.get('alpha'))} | {_num(row.get('c'))} | "
                     f"{_num(row.get('measured_speedup'))}× |")
    lines += ["", "## Decision (trtspec decide, per group of categories)", "",
              "| condition | group | verdict | speedup | 95 % CI | requests |",
              "|---|---|---|---:|---|---:|"]
    for v in decision["verdicts"]:
        ci = v.get("ci")
        lines.append(f"| {v['condition']} | {v['category']} | {v['verdict']} | "
                     f"{_num(v.get('speedup'))}× | "
                     f"{f'{ci[0]:.2f}–{ci[1]:.2f}×' if ci else '—'} | {v.get('requests')} |")
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def _num(x: object) -> str:
    return f"{x:.2f}" if isinstance(x, int | float) and not math.isnan(x) else "—"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--per-category", type=int, default=24, help="requests per group (the "
                    "recipe judges the 8 categories as two groups; 24: all 48 built-in requests)")
    ap.add_argument("--eval-id", default=None, help="reuse this eval folder (report only)")
    args = ap.parse_args()
    missing = [str(p) for p in HEADS.values() if not (p / "config.json").is_file()]
    if missing:
        sys.exit(f"bench-heads: no heads at {', '.join(missing)}: run `make heads` first")
    began = time.perf_counter()
    if args.eval_id is None:
        eval_id = time.strftime("bench-heads-%Y%m%d-%H%M%S")
        recipe = str(recipe_file(ROOT / "reports", args.draft_len))
        run([TRTSPEC, "build", recipe])
        run([TRTSPEC, "eval", recipe, "--eval-id", eval_id, "--per-category",
             str(args.per_category)])
        run([TRTSPEC, "audit", f"reports/{eval_id}"], ok=(0, 1))
        run([TRTSPEC, "decide", f"reports/{eval_id}"], ok=(0, 1))
    else:
        eval_id, began = args.eval_id, None
    write_report(ROOT / "reports" / eval_id, args.draft_len,
                 None if began is None else time.perf_counter() - began,
                 ROOT / "reports" / "bench-heads.md")


if __name__ == "__main__":
    main()
