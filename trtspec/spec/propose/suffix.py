"""Suffix decoding: draft from suffix tries over the request's own text and earlier outputs.

No model runs: a draft is the most frequent continuation of the longest matching suffix of the
context, a point mass (``probs=None``) that verify accepts with p(x), as for ngram. How many
tokens are drafted follows the match length and the continuation's frequency; ``draft_len[b]``
only caps it.

* text          a token sequence put into a trie: a request's prompt + output, or a finished
                request's output (each its own text: no substring spans two)
* trie          every substring of length ≤ ``max_depth`` of its texts is a path from the root;
                a node's count is how often that substring occurs (a child's count ≤ its
                parent's; the root counts every token). Appending a token to a text counts it
                after the root and after each *active node* (the text's suffixes of length
                1 … max_depth − 1): O(max_depth)
* match         the longest suffix of the context (≤ max_depth − 1 tokens) whose node has a
                child: it occurred before with something after it; ``match_len`` its length
* walk          from the match, step to the most frequent child (ties: the smaller id) while
                the running probability, the product of child / parent counts along the walk,
                stays ≥ ``min_token_prob``; at most min(draft_len[b], max(1, ⌈max_spec_factor
                × match_len⌉)) tokens. At depth max_depth it goes on from the node of the path's
                last max_depth − 1 tokens
* score         the sum of the drafted tokens' running probabilities: the expected number
                accepted if the trie's frequencies were the target's
* request trie  one per row, over its prompt + output, synced from the ``tokens`` that
                ``propose`` gets: committed tokens, so only new ones are inserted, never undone
* scope         where drafts may come from. ``request``: the request trie only, so nothing
                of one request reaches another's drafts (nor, through how many are accepted,
                its latency). ``server``: also the global trie, shared by every request in
                the process
* global trie   (scope server) over finished requests' outputs. Not prompts: a prompt is in
                its own request trie already, other users' prompts rarely predict this output,
                and long prompts would crowd outputs out of the budget. It holds at most
                ``global_tokens`` tokens: over budget, the oldest outputs go first (FIFO),
                inserted again with count −1, nodes that reach 0 deleted, which leaves the trie
                of the remaining outputs. Memory: at most max_depth nodes per token held

With scope server both tries propose; the higher score wins (the request trie on a tie). An
output reaches the global trie when its row is released or a new ``start`` replaces the batch,
as far as ``propose`` saw it (a request's last round is never shown to a proposer). So a seeded
sampled output depends on earlier requests (they change the drafts, hence the uniforms a round
draws); its distribution does not, nor does a greedy output. With scope request a request's
drafts depend on its own tokens only.
"""

from __future__ import annotations

import collections
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from trtspec.spec.propose.proposer import Draft
from trtspec.spec.sample.probs import SamplingParams

Scope = Literal["request", "server"]
SCOPES: tuple[Scope, ...] = ("request", "server")


class SuffixTrie:
    """The counts of every substring of length ≤ max_depth of its texts (see the module
    docstring). ``extend`` streams one growing text; ``add`` inserts or removes a whole one.

    Nodes are ints, 0 the root; node i occurs ``count[i]`` times. Most nodes of a deep trie have
    one child, kept inline (token ``first_token[i]``, -1 for none, node ``first_child[i]``); any
    further ones are in ``more[i]`` (token → node). Arrays, not objects: ~30 bytes a node, and
    nothing for the garbage collector to scan.
    """

    def __init__(self, max_depth: int = 24) -> None:
        self.max_depth = max_depth
        self.count, self.first_token, self.first_child = (array("q", [x]) for x in (0, -1, 0))
        self.more: dict[int, dict[int, int]] = {}
        self.free: list[int] = []  # deleted nodes, reused first
        self.active: list[int] = []  # the streamed text's suffixes, active[i] of length i + 1

    @property
    def nodes(self) -> int:  # the root included
        return len(self.count) - len(self.free)

    def child(self, node: int, token: int) -> int | None:
        if self.first_token[node] == token:
            return self.first_child[node]
        return self.more.get(node, {}).get(token)

    def children(self, node: int) -> list[tuple[int, int]]:  # (token, child) pairs
        if self.first_token[node] < 0:
            return []
        return [(self.first_token[node], self.first_child[node]), *self.more.get(node, {}).items()]

    def _new_child(self, parent: int, token: int) -> int:
        if self.free:
            node = self.free.pop()
            self.count[node], self.first_token[node] = 0, -1
        else:
            node = len(self.count)
            self.count.append(0), self.first_token.append(-1), self.first_child.append(0)
        if self.first_token[parent] < 0:
            self.first_token[parent], self.first_child[parent] = token, node
        else:
            self.more.setdefault(parent, {})[token] = node
        return node

    def _unlink(self, parent: int, token: int) -> None:
        more = self.more.get(parent, {})
        if self.first_token[parent] != token:
            del more[token]
        elif more:  # another child moves inline
            self.first_token[parent], self.first_child[parent] = more.popitem()
        else:
            self.first_token[parent] = -1
        if parent in self.more and not more:
            del self.more[parent]

    def _step(self, active: list[int], token: int, delta: int) -> list[int]:
        """Count ``token`` (delta ±1) after the root and each active node; the new active."""
        self.count[0] += delta
        reached = []
        for parent in (0, *active):
            node = self.child(parent, token)
            if node is None:
                if delta < 0:
                    raise ValueError("removing a text that was not inserted")
                node = self._new_child(parent, token)
            self.count[node] += delta
            if self.count[node] == 0:  # its subtree reaches 0 later in this same pass
                self._unlink(parent, token)
                self.free.append(node)
            reached.append(node)
        return reached[: self.max_depth - 1]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the streamed text."""
        for token in tokens:
            self.active = self._step(self.active, token, 1)

    def add(self, text: Sequence[int], delta: int = 1) -> None:
        """Insert a text of its own (delta 1), or remove one inserted before (delta −1)."""
        active: list[int] = []
        for token in text:
            active = self._step(active, token, delta)

    def find(self, path: Sequence[int]) -> int | None:
        node: int | None = 0
        for token in path:
            if (node := self.child(node, token)) is None:
                return None
        return node

    def match(self, context: Sequence[int], suffixes: Sequence[int] | None = None
              ) -> tuple[int, int]:
        """(node, match_len) of the longest suffix of context with a continuation, (0, 0) if
        none; ``suffixes`` are the nodes of context's suffixes by length when known (the
        streamed text's ``active``), else they are looked up."""
        best = (0, 0)
        for length in range(1, min(len(context), self.max_depth - 1) + 1):
            node = suffixes[length - 1] if suffixes is not None else self.find(context[-length:])
            if node is None:  # a longer suffix contains this one: no path either
                break
            if self.first_token[node] >= 0:
                best = (node, length)
        return best

    def speculate(self, context: Sequence[int], draft_len: int, max_spec_factor: float,
                  min_token_prob: float, suffixes: Sequence[int] | None = None
                  ) -> tuple[list[int], float]:
        """The walk's tokens and their score (see the module docstring)."""
        node, match_len = self.match(context, suffixes)
        limit = min(draft_len, max(1, math.ceil(max_spec_factor * match_len)))
        path, drafted = list(context[len(context) - match_len:]), []
        prob, score = 1.0, 0.0
        while match_len and len(drafted) < limit and self.first_token[node] >= 0:
            token, child = max(self.children(node), key=lambda kv: (self.count[kv[1]], -kv[0]))
            prob *= self.count[child] / self.count[node]
            if prob < min_token_prob:
                break
            drafted.append(token)
            score += prob
            path.append(token)
            node = child
            if len(path) == self.max_depth:  # the trie ends here: go on from the shorter path
                path = path[1:]
                node = self.find(path)
                assert node is not None  # a substring of an inserted text
        return drafted, score


@dataclass
class _Row:
    prompt_len: int
    trie: SuffixTrie
    tokens: list[int] = field(default_factory=list)  # what ``trie`` holds: prompt + output


class SuffixProposer:
    """Point-mass drafts from a request trie per row and, with scope server, one global trie of
    finished outputs (``global_trie`` is None with scope request: nothing outlives a request)."""

    def __init__(self, max_depth: int = 24, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, global_tokens: int = 65536,
                 scope: Scope = "server") -> None:
        if max_depth < 2 or max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 \
                or global_tokens < 0 or scope not in SCOPES:
            raise ValueError("suffix needs max_depth ≥ 2, max_spec_factor > 0, 0 ≤ min_token_prob "
                             "≤ 1, global_tokens ≥ 0 and scope request or server; got "
                             f"{max_depth}, {max_spec_factor}, {min_token_prob}, "
                             f"{global_tokens}, {scope!r}")
        self.max_depth, self.max_spec_factor = max_depth, max_spec_factor
        self.min_token_prob, self.global_tokens, self.scope = min_token_prob, global_tokens, scope
        self.global_trie = SuffixTrie(max_depth) if scope == "server" else None
        self.finished: collections.deque[list[int]] = collections.deque()  # in it, oldest first
        self.global_size = 0  # tokens in the global trie: the sum of len(finished)
        self.rows: list[_Row | None] = []

    def describe(self) -> str:
        """One line for an operator (``serve`` prints it at start-up): whether one client's
        text can shape another's drafts, and how much the shared trie may hold."""
        if self.global_trie is None:
            return "suffix tree: per request (no text is shared across requests)"
        if self.global_tokens == 0:
            return "suffix tree: per request (scope server with global_tokens 0 keeps nothing)"
        return (f"suffix tree: server-wide, ≤ {self.global_tokens} tokens of finished outputs, "
                "shared across clients")

    def start(self, prompts: Sequence[Sequence[int]]) -> None:
        for row in range(len(self.rows)):
            self.release(row)
        self.rows = [_Row(len(p), SuffixTrie(self.max_depth)) for p in prompts]

    def admit(self, row: int, prompt: Sequence[int], kept: int = 0) -> None:
        self.release(row)  # a per-request trie: a kept prompt changes nothing here
        self.rows += [None] * (row + 1 - len(self.rows))
        self.rows[row] = _Row(len(prompt), SuffixTrie(self.max_depth))

    def release(self, row: int, keep: int = 0) -> None:
        held = self.rows[row] if row < len(self.rows) else None
        if held is not None:
            self.rows[row] = None
            self.remember(held.tokens[held.prompt_len:])

    def remember(self, output: Sequence[int]) -> None:
        """Put a finished output (its last global_tokens tokens) into the global trie, then
        evict the oldest outputs until it holds at most global_tokens tokens. Scope request
        keeps nothing."""
        if self.global_trie is None:
            return
        output = list(output[len(output) - self.global_tokens:])
        if not output:
            return
        self.global_trie.add(output)
        self.finished.append(output)
        self.global_size += len(output)
        while self.global_size > self.global_tokens:
            old = self.finished.popleft()
            self.global_trie.add(old, -1)
            self.global_size -= len(old)

    @property
    def draft_runner(self) -> None:
        return None  # no model drafts: a draft step costs no forward

    def forget(self) -> None:
        """Drop every row and every finished output: what a warm-up generated must not be
        drafted from in what is measured after it."""
        self.global_trie = SuffixTrie(self.max_depth) if self.scope == "server" else None
        self.finished.clear()
        self.global_size, self.rows = 0, []

    def propose(self, tokens: Sequence[Sequence[int]], draft_len: Sequence[int],
                params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> Draft:
        found = [self._draft(b, list(t), n) if n else []
                 for b, (t, n) in enumerate(zip(tokens, draft_len, strict=True))]
        width = max((len(f) for f in found), default=0)
        ids = torch.full((len(tokens), width), -1, dtype=torch.long)
        for b, f in enumerate(found):
            ids[b, : len(f)] = torch.as_tensor(f, dtype=torch.long)
        return Draft(ids, torch.tensor([len(f) for f in found], dtype=torch.long), None)

    def _draft(self, b: int, context: list[int], n: int) -> list[int]:
        row = self.rows[b] if b < len(self.rows) else None
        if row is None or len(context) < len(row.tokens):  # not started here: begin anew
            self.rows += [None] * (b + 1 - len(self.rows))
            row = self.rows[b] = _Row(len(context) if row is None else row.prompt_len,
                                      SuffixTrie(self.max_depth))
        row.trie.extend(context[len(row.tokens):])  # only what is new since the last call
        row.tokens = context
        knobs = (n, self.max_spec_factor, self.min_token_prob)
        mine, my_score = row.trie.speculate(context, *knobs, suffixes=row.trie.active)
        if self.global_trie is None or not self.finished:
            return mine
        theirs, their_score = self.global_trie.speculate(context, *knobs)
        return mine if my_score >= their_score else theirs

    def observe(self, num_accepted: Sequence[int]) -> None:
        pass  # drafts leave no state: the next propose syncs the committed tokens

    def undo(self) -> None:
        pass  # the same: a failed round committed nothing to sync
