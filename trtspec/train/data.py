"""What ``trtspec distill`` trains on: prompts, the target's own continuations of them, and the
teacher's states and next-token distributions at every position.

Why the target's own text: heads are judged by whether the target accepts their drafts, i.e. by
how well they predict what *this* target generates at *this* sampling temperature. Text the
target wrote itself (self-distillation) matches that distribution; a public corpus would teach
the heads someone else's next tokens. The teacher's next-token distribution itself is the
target's raw one (temperature 1, no top-k/top-p): the heads' q passes through the request's own
``logits_to_probs`` at run time, as the target's p does, so one set of heads serves every
sampling setting.

Why a training prompt set of its own (``train``): an eval on the built-in workload should not
measure heads on the prompts they were trained on. :func:`training_prompts` is written from
templates and topic lists that share no prompt with :func:`trtspec.eval.workloads.builtin`
(a test checks: no shared prompt, no shared run of eight words), in the same eight categories
(copy-heavy and open-ended), so the heads see both kinds of text.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trtspec.eval.workloads import builtin
from trtspec.eval.workloads.request import WorkloadError, WorkloadRequest, load_jsonl
from trtspec.spec.sample.probs import SamplingParams
from trtspec.train.config import TOP_K, DistillError

Progress = Callable[[str, int, int, str], None]  # (phase, done, total, note)


# ---- the built-in training prompts --------------------------------------------------------

_ACTIVITIES = ["planting a vegetable garden", "running a first half marathon", "moving to a new "
               "city", "learning to play the guitar", "adopting a rescue dog", "starting a "
               "podcast", "repainting a bedroom", "planning a budget wedding", "camping in the "
               "rain", "teaching a child to swim", "switching careers at forty", "keeping a "
               "sourdough starter alive", "organising a neighbourhood clean-up", "buying a used "
               "car", "writing a cover letter", "travelling alone for the first time"]
_PLACES = ["a mountain village", "a busy train station", "a university campus", "an old "
           "fishing town", "a desert oasis", "a quiet suburb", "a floating market"]
_BUSINESSES = ["coffee cart", "bike repair shop", "second-hand bookshop", "yoga studio",
               "food truck selling dumplings", "pottery workshop", "plant nursery"]
_CHARACTERS = ["a retired astronaut", "a shy dragon", "a librarian with a secret", "two rival "
               "chefs", "a lighthouse cat", "a time-travelling postman", "an inventor's "
               "apprentice", "a grandmother who builds robots", "a lost penguin", "a street "
               "musician", "a detective who is afraid of the dark", "a talking umbrella"]
_GOALS = ["wants to see the ocean", "must return a borrowed map", "finds a door in a tree",
          "tries to win a baking contest", "loses their voice before a big show", "discovers "
          "a hidden garden", "has to cross a frozen river", "builds a boat from old doors"]
_THEMES = ["the first snow of winter", "an empty playground at dusk", "leaving home", "a "
           "thunderstorm over the sea", "a forgotten letter", "the smell of bread"]
_CONCEPTS = ["photosynthesis", "how vaccines train the immune system", "what inflation is",
             "how a refrigerator keeps food cold", "why the sky is blue", "how GPS finds your "
             "position", "what a binary search does", "how tides work", "what an API is",
             "why leaves change colour in autumn", "how a jet engine works", "what DNA does",
             "how recursion works in programming", "what causes earthquakes", "how a credit "
             "score is calculated", "what entropy means", "how noise-cancelling headphones "
             "work", "what a neural network is"]
_AUDIENCES = ["a curious eight-year-old", "a high-school student", "a busy manager", "someone "
              "who has never studied science", "a software engineer"]
_NAMES = ["Amira", "Jonas", "Mei", "Tomás", "Grace", "Olu", "Sven", "Leila", "Ravi", "Hana"]
_ITEMS = ["notebooks", "lamps", "tickets", "bags of rice", "plant pots", "scarves", "batteries"]
_ORGS = ["the community pool", "the city museum", "Greenway Primary School", "the Elm Street "
         "clinic", "the public library's east branch", "the farmers' market", "the sports "
         "centre"]
_EVENTS = ["open day", "annual fundraiser", "spring fair", "board meeting", "volunteer "
           "training", "book swap", "charity run"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_VERBS = ["count", "collect", "filter", "merge", "score", "group", "clean"]
_NOUNS = ["orders", "readings", "users", "scores", "words", "invoices", "events"]


def _notice(rng: random.Random) -> str:
    org, event, day = rng.choice(_ORGS), rng.choice(_EVENTS), rng.choice(_DAYS)
    hour, fee, name = rng.randint(8, 18), rng.randint(2, 30), rng.choice(_NAMES)
    room = rng.choice(["in the main hall", "in room 12", "in the garden", "on the second floor"])
    return (f"The {event} at {org} will take place on {day} from {hour}:00 {room}. "
            f"Entry costs {fee} euros for adults and is free for children under twelve. "
            f"Parking is limited, so visitors are asked to come by bus or bicycle. "
            f"Questions can be sent to {name} at the front desk before {rng.choice(_DAYS)}.")


def _product(rng: random.Random) -> str:
    item = rng.choice(["backpack", "desk lamp", "kettle", "pair of running shoes", "tent",
                       "coffee grinder"])
    weight, price, years = rng.randint(1, 9) / 2, rng.randint(19, 249), rng.randint(1, 5)
    colour = rng.choice(["forest green", "slate grey", "sunset orange", "navy blue"])
    return (f"This {item} weighs {weight} kg and comes in {colour}. It is made from recycled "
            f"materials and is covered by a {years}-year warranty. The price is {price} euros, "
            f"with free delivery on orders over 50 euros. Reviewers praise its build quality "
            f"but say the instructions could be clearer.")


def _meeting(rng: random.Random) -> str:
    a, b, c = rng.sample(_NAMES, 3)
    pct, day = rng.randint(3, 40), rng.choice(_DAYS)
    topic = rng.choice(["the website redesign", "the new warehouse", "the summer campaign",
                        "the customer survey", "the hiring plan"])
    return (f"Meeting notes. Present: {a}, {b} and {c}. The team discussed {topic}. {a} "
            f"reported that costs are {pct} percent above plan. {b} will draft a revised "
            f"schedule by {day}. {c} asked for a clearer owner for each task. The next meeting "
            f"is in two weeks; decisions will be shared by email.")


def _code(rng: random.Random) -> str:
    verb, noun = rng.choice(_VERBS), rng.choice(_NOUNS)
    limit = rng.randint(2, 50)
    return (f"def {verb}_{noun}(items):\n    result = []\n    for i in range(len(items)):\n"
            f"        if items[i] is not None and items[i] > {limit}:\n"
            f"            result.append(items[i])\n    return result\n\n\n"
            f"def {verb}_{noun}_total(items):\n    total = 0\n"
            f"    for x in {verb}_{noun}(items):\n        total = total + x\n    return total\n")


def _task(rng: random.Random, texts: dict[str, Callable[[random.Random], str]],
          asks: list[str]) -> str:
    """One of ``asks`` about a freshly generated text of a random kind."""
    kind = rng.choice(list(texts))
    n = rng.choice(["one sentence", "two sentences", "three sentences"])
    return rng.choice(asks).format(kind=kind, n=n) + texts[kind](rng)


def training_prompts(seed: int = 0) -> list[WorkloadRequest]:
    """The built-in training set: 8 categories × 60 prompts from seeded templates, none equal
    to an eval prompt of :func:`~trtspec.eval.workloads.builtin` (so an eval on it stays
    out-of-distribution)."""
    rng = random.Random(seed)
    texts = {"notice": _notice, "product description": _product, "meeting note": _meeting}
    makers: dict[str, Callable[[], str]] = {
        "chat": lambda: rng.choice([
            f"What should I know before {rng.choice(_ACTIVITIES)}?",
            f"Give me five practical tips for {rng.choice(_ACTIVITIES)}.",
            f"Suggest a name and a slogan for a {rng.choice(_BUSINESSES)} in "
            f"{rng.choice(_PLACES)}.",
            f"My friend {rng.choice(_NAMES)} is {rng.choice(_ACTIVITIES)}. How can I help?"]),
        "story": lambda: rng.choice([
            f"Write a short story about {rng.choice(_CHARACTERS)} who {rng.choice(_GOALS)}.",
            f"Write a poem about {rng.choice(_THEMES)}.",
            f"Tell a story set in {rng.choice(_PLACES)} about {rng.choice(_CHARACTERS)}.",
            f"Write a diary entry by {rng.choice(_CHARACTERS)} about {rng.choice(_THEMES)}."]),
        "reasoning": lambda: rng.choice([
            f"{rng.choice(_NAMES)} buys {rng.randint(3, 12)} {rng.choice(_ITEMS)} at "
            f"{rng.randint(2, 19)}.{rng.choice(['00', '25', '50'])} each and pays with "
            f"{rng.choice([50, 100, 200])}. How much change is left? Show each step.",
            f"A cyclist rides {rng.randint(12, 90)} km in {rng.randint(2, 6)} hours. What is "
            f"the average speed? Explain the calculation.",
            f"If {rng.randint(2, 9)} machines make {rng.randint(20, 400)} parts in an hour, "
            f"how many parts do {rng.randint(2, 15)} machines make in {rng.randint(2, 8)} "
            f"hours? Reason step by step.",
            f"Is {rng.randint(100, 999)} divisible by {rng.choice([3, 7, 11, 13])}? Work it "
            f"out and explain."]),
        "explain": lambda: rng.choice([
            f"Explain {rng.choice(_CONCEPTS)} to {rng.choice(_AUDIENCES)}.",
            f"In a few paragraphs, describe {rng.choice(_CONCEPTS)}.",
            f"What are common misconceptions about {rng.choice(_CONCEPTS)}?"]),
        "summarise": lambda: _task(rng, texts, [
            "Summarise this {kind} in {n}:\n\n", "Give the key points of this {kind} as a "
            "bulleted list:\n\n", "Write a headline and a short summary for this {kind}:\n\n"]),
        "edit": lambda: _task(rng, texts, [
            "Rewrite this {kind} in a formal tone without changing any fact:\n\n", "Rewrite "
            "this {kind} for a text message, keeping the numbers:\n\n", "Correct any awkward "
            "phrasing in this {kind} and return the full text:\n\n"]),
        "answer_from_text": lambda: rng.choice([
            f"Using only the notice below, say when and where the event is.\n\n{_notice(rng)}",
            f"How much does the item cost, and what does the warranty cover? Quote the text."
            f"\n\n{_product(rng)}",
            f"Who will draft the revised schedule, and by when? Answer from the notes.\n\n"
            f"{_meeting(rng)}"]),
        "code_refactor": lambda: rng.choice([
            "Refactor this code to use a list comprehension and sum(), keeping the function "
            "names:\n\n",
            "Add type hints and a docstring to each function below:\n\n",
            "Rewrite these functions to iterate directly over the items instead of indices:"
            "\n\n"]) + _code(rng),
    }
    taken = {r.prompt for r in builtin()}
    out: list[WorkloadRequest] = []
    for category, make in makers.items():
        seen: set[str] = set()
        for _ in range(2000):  # plenty of draws for 60 distinct prompts
            text = make()
            if text not in seen and text not in taken:
                seen.add(text)
                out.append(WorkloadRequest(id=f"train-{category}-{len(seen) - 1}",
                                           category=category, prompt=text, source="train"))
            if len(seen) == 60:
                break
    return out


def load_prompts(spec: str, speed_bench_dir: str | Path = "data/speed-bench"
                 ) -> tuple[list[WorkloadRequest], str | None]:
    """``train`` (the built-in training set), ``builtin`` (the eval's workload: allowed, with a
    warning), ``speed-bench[:DIR|:CONFIG]`` or a JSONL path → (requests, warning or None)."""
    if spec == "train":
        return training_prompts(), None
    if spec == "builtin":
        return builtin(), ("warning: training on the built-in eval workload: an eval on "
                           "`builtin` then measures the heads in-distribution")
    if spec == "speed-bench" or spec.startswith("speed-bench:"):
        from trtspec.eval.workloads import speed_bench

        rest = spec.partition(":")[2]
        config, directory = ("qualitative", rest or speed_bench_dir)
        if rest in speed_bench.CONFIGS:
            config, directory = rest, speed_bench_dir
        requests = speed_bench.load(speed_bench.find_file(directory, config), config)
        return requests, ("warning: training on SPEED-Bench: an eval on SPEED-Bench then "
                          "measures the heads in-distribution")
    if not Path(spec).is_file():
        raise DistillError(f"--prompts {spec}: not train, builtin, speed-bench[:DIR] or a "
                           "JSONL file")
    try:
        return load_jsonl(spec), None
    except WorkloadError as e:
        raise DistillError(f"--prompts: {e}") from None


# ---- the target's own continuations ---------------------------------------------------------

def generate(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             max_len: int, sampling: SamplingParams, batch: int = 8,
             eos_token_id: int | None = None, progress: Progress | None = None
             ) -> list[list[int]]:
    """Each prompt followed by the target's own continuation (plain decoding through
    :class:`~trtspec.spec.executor.SpecExecutor`, the eval's baseline code path, so greedy at T =
    0), cut to ``max_len`` tokens. Prompt i is sampled with seed ``sampling.seed + i``: a prompt's
    text does not depend on the batch it ran in. With ``max_new_tokens`` 0 the prompts are the
    sequences."""
    from trtspec.runtime.compiled import CompiledRunner, unsupported
    from trtspec.runtime.hf import HFRunner
    from trtspec.spec.executor import SpecExecutor

    clipped = [list(p)[:max_len] for p in prompts]
    if max_new_tokens == 0:
        return clipped
    runner = (HFRunner(model, eos_token_id=eos_token_id) if unsupported(model)
              else CompiledRunner(model, eos_token_id=eos_token_id, compile=False))
    executor = SpecExecutor(runner)
    todo = [i for i, p in enumerate(clipped) if len(p) < max_len]
    todo.sort(key=lambda i: len(clipped[i]))  # similar lengths together: less padding
    out = {i: clipped[i] for i in range(len(clipped))}
    for start in range(0, len(todo), batch):
        if progress:
            progress("generate", start, len(todo), "")
        rows = todo[start: start + batch]
        params = [sampling.model_copy(update={
            "max_tokens": min(max_new_tokens, max_len - len(clipped[i])),
            "seed": (sampling.seed or 0) + i}) for i in rows]
        for i, c in zip(rows, executor.generate([clipped[i] for i in rows], params),
                        strict=True):
            out[i] = clipped[i] + c.token_ids
    if progress:
        progress("generate", len(todo), len(todo), "")
    return [out[i] for i in range(len(clipped))]


# ---- the teacher pass -----------------------------------------------------------------------

@dataclass
class Teacher:
    """The frozen target's view of each sequence, cached so epochs never re-run it.

    ``states[b]`` [L_b, S] (bfloat16): EAGLE: the aux layers' outputs concatenated (S = 3H);
    Medusa: the last layer's output after the final norm (S = H). ``probs[b]`` [L_b, K]
    (float16) and ``ids[b]`` [L_b, K] (int32): the target's top-K next-token distribution at
    each position (renormalised over the K), most likely first. ``starts[b]``: where the
    target's own continuation begins (0: all of it is text to draft from, as with
    ``max_new_tokens`` 0): held-out agreement counts only positions a draft is made from."""

    tokens: list[torch.Tensor]  # [L_b] long
    states: list[torch.Tensor]
    probs: list[torch.Tensor]
    ids: list[torch.Tensor]
    starts: list[int] = field(default_factory=list)

    def drafted(self, b: int, positions: torch.Tensor) -> torch.Tensor:
        """Which ``positions`` of sequence b drafts are made from at run time: the state at t
        drafts once the token at t + 1 is the target's own (t ≥ start − 1); a prompt's
        positions (a chat template repeated in every sequence) would flatter the metric."""
        start = self.starts[b] if self.starts else 0
        return positions >= start - 1

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@torch.no_grad()
def teacher_pass(model: nn.Module, sequences: Sequence[Sequence[int]],
                 aux_layers: Sequence[int] | None, top_k: int = TOP_K, batch_tokens: int = 4096,
                 progress: Progress | None = None) -> Teacher:
    """One target forward per batch of sequences (right-padded; causal attention keeps padding
    out of every real position). ``aux_layers`` None: Medusa's normed last-layer state; else
    those layers' outputs (EAGLE-3), captured by :func:`~trtspec.runtime.hf.layer_outputs`,
    the hooks the runners use at inference, so the heads train on the states they will see."""
    from trtspec.runtime.hf import layer_outputs

    decoder, head = model.get_decoder(), model.get_output_embeddings()
    device = next(model.parameters()).device
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    batches: list[list[int]] = [[]]
    for i in order:  # lengths ascend: the batch's width is its last sequence's
        if batches[-1] and (len(batches[-1]) + 1) * len(sequences[i]) > batch_tokens:
            batches.append([])
        batches[-1].append(i)
    found: dict[int, tuple[torch.Tensor, ...]] = {}
    for n, rows in enumerate(batches):
        if progress:
            progress("teacher", n, len(batches), "")
        width = max(len(sequences[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
        for r, i in enumerate(rows):
            ids[r, : len(sequences[i])] = torch.tensor(list(sequences[i]))
        ids = ids.to(device)
        with layer_outputs(model, aux_layers or []) as kept:
            normed = decoder(input_ids=ids).last_hidden_state  # [B, T, H] after the final norm
        states = torch.cat(kept, dim=-1) if aux_layers else normed  # [B, T, S]
        for r, i in enumerate(rows):
            length = len(sequences[i])
            logits = head(normed[r, :length]).float()  # [L, V], one sequence at a time
            p, top = torch.softmax(logits, -1).topk(min(top_k, logits.shape[-1]), dim=-1)
            found[i] = (ids[r, :length].cpu(), states[r, :length].to(torch.bfloat16).cpu(),
                        (p / p.sum(-1, keepdim=True)).half().cpu(), top.int().cpu())
    if progress:
        progress("teacher", len(batches), len(batches), "")
    parts = [found[i] for i in range(len(sequences))]
    return Teacher(*(list(x) for x in zip(*parts, strict=True)))


def draft_vocab(teacher: Teacher, rows: Sequence[int], size: int, vocab: int,
                always: Sequence[int] = ()) -> torch.Tensor:
    """The EAGLE-3 draft vocabulary: the ``size`` (capped at ``vocab``) target ids seen most
    often among the ``rows``' tokens and teacher top-1s, then by teacher top-K mass, then by
    id, plus ``always`` (EOS and special ids: a draft must be able to end a reply). Sorted
    LongTensor. Why frequency: the draft's LM head is its largest matmul, and the few thousand
    commonest ids carry nearly all of a target's accepted tokens."""
    size = min(size, vocab)
    counts = torch.zeros(vocab, dtype=torch.float64)
    mass = torch.zeros(vocab, dtype=torch.float64)
    for b in rows:
        counts += torch.bincount(teacher.tokens[b], minlength=vocab)[:vocab].double()
        counts += torch.bincount(teacher.ids[b][:, 0].long(), minlength=vocab)[:vocab].double()
        mass.index_add_(0, teacher.ids[b].flatten().long(), teacher.probs[b].flatten().double())
    score = counts + mass / (mass.max() + 1.0)  # mass only breaks ties between equal counts
    keep = [i for i in dict.fromkeys(always) if 0 <= i < vocab][:size]
    chosen = set(keep)
    for i in torch.sort(score, descending=True, stable=True).indices.tolist():
        if len(keep) == size:
            break
        if i not in chosen:
            keep.append(i)
            chosen.add(i)
    return torch.tensor(sorted(keep), dtype=torch.long)


def digest(data: Any) -> str:
    """sha256 of canonical JSON: what a checkpoint was trained on, to refuse a mismatched
    resume."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()
