"""Constrained decoding: which tokens a request may take next, as one bitmask row per constrained request.

Two kinds of constraint, both a pure function of the request's generated tokens (so a preempted or resumed
request rebuilds its state by replaying ``output_ids``):

- ``ChoiceConstraint``: the answer is exactly one of a few strings. A trie over each choice's token sequence
  allows, at each step, the children of the current node (and a stop token where a choice ends but a longer
  one continues). Every trie node's log-probabilities are recorded when its logits are seen, so each
  choice's log-probability under the model can be summed at the end.
- ``GrammarConstraint``: a JSON schema or a regular expression, compiled by llguidance (picked over xgrammar
  by measurement: BENCHMARKS.md) into a matcher per request.

``fill_bitmask`` computes the masks of a whole batch in one call (llguidance fills grammar rows on its own
threads without the GIL, so the engine runs it beside the forward). ``apply_bitmask`` in the sampler
turns the int32 bitmask into -inf logits, vectorized.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from batchjob.errors import ConfigError
from batchjob.sampling import SamplingParams


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, all bits clear: bit ``t % 32`` of word ``t // 32`` allows token t."""
    return torch.zeros(rows, (vocab + 31) // 32, dtype=torch.int32)


def set_allowed(bitmask_row: torch.Tensor, tokens: list[int]) -> None:
    """Allow exactly ``tokens`` in one bitmask row (a view of the CPU bitmask)."""
    words = bitmask_row.numpy().view(np.uint32)
    words[:] = 0
    toks = np.asarray(tokens, dtype=np.int64)
    np.bitwise_or.at(words, toks >> 5, (np.uint32(1) << (toks & 31).astype(np.uint32)))


# -- label sets --------------------------------------------------------------------------------------


@dataclass
class _Node:
    children: dict[int, int] = field(default_factory=dict)  # token -> child node index
    choice: int | None = None  # index of the choice that ends here
    prefix: tuple[int, ...] = ()


class ChoiceTrie:
    """The token sequences of a label set as a trie; built once per (engine, label set)."""

    def __init__(self, choices: list[str], token_ids: list[list[int]]) -> None:
        self.choices = choices
        self.token_ids = token_ids
        self.nodes = [_Node()]
        for i, toks in enumerate(token_ids):
            if not toks:
                raise ConfigError(f"choice {choices[i]!r} has no tokens")
            node = 0
            for t in toks:
                nxt = self.nodes[node].children.get(t)
                if nxt is None:
                    nxt = len(self.nodes)
                    self.nodes.append(_Node(prefix=self.nodes[node].prefix + (t,)))
                    self.nodes[node].children[t] = nxt
                node = nxt
            if self.nodes[node].choice is not None:
                other = choices[self.nodes[node].choice]
                raise ConfigError(f"choices {other!r} and {choices[i]!r} have the same tokens")
            self.nodes[node].choice = i

    @property
    def inner_nodes(self) -> list[int]:
        """Nodes with children: the ones whose next-token log-probabilities a choice's score needs."""
        return [i for i, n in enumerate(self.nodes) if n.children]


class ChoiceConstraint:
    """One request's walk down a ``ChoiceTrie``, and the log-probabilities seen at each inner node."""

    def __init__(self, trie: ChoiceTrie, stop_ids: list[int]) -> None:
        self.trie = trie
        self.stop_ids = stop_ids
        self.node = 0
        self.done = False
        self.node_logprobs: dict[int, dict[int, float]] = {}  # node -> {child token: log-prob}

    def allowed(self) -> list[int]:
        node = self.trie.nodes[self.node]
        toks = list(node.children)
        if node.choice is not None:  # a choice ends here and a longer one goes on: stopping is allowed
            toks += self.stop_ids
        return toks

    def advance(self, token: int) -> bool:
        """Take ``token``; False if the trie does not allow it. Sets ``done`` when the answer is complete."""
        node = self.trie.nodes[self.node]
        if token in node.children:
            self.node = node.children[token]
            self.done = not self.trie.nodes[self.node].children
            return True
        if node.choice is not None and token in self.stop_ids:
            self.done = True
            return True
        return False

    def record(self, logprobs_row: torch.Tensor, node: int | None = None) -> None:
        """Keep the children's log-probabilities at ``node`` (default: the current one) from the model's
        distribution there (``logprobs_row``: [V] log-softmax)."""
        node = self.node if node is None else node
        children = list(self.trie.nodes[node].children)
        if children and node not in self.node_logprobs:
            values = logprobs_row[children].tolist()
            self.node_logprobs[node] = dict(zip(children, values, strict=True))

    @property
    def missing_nodes(self) -> list[int]:
        """Inner nodes whose log-probabilities were not seen on the decoded path (to be probed)."""
        return [i for i in self.trie.inner_nodes if i not in self.node_logprobs]

    @property
    def choice(self) -> int | None:
        return self.trie.nodes[self.node].choice if self.done else None

    def choice_logprobs(self) -> dict[str, float]:
        out = {}
        for name, toks in zip(self.trie.choices, self.trie.token_ids, strict=True):
            total, node = 0.0, 0
            for t in toks:
                total += self.node_logprobs.get(node, {}).get(t, math.nan)
                node = self.trie.nodes[node].children[t]
            out[name] = total
        return out


# -- grammars ----------------------------------------------------------------------------------------


class GrammarConstraint:
    """A request's llguidance matcher; ``done`` once the grammar has taken a stop token or can take nothing."""

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def advance(self, token: int) -> bool:
        return bool(self.matcher.consume_token(token)) and not self.matcher.is_error()

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())


class GrammarCompiler:
    """Compiles JSON schemas and regexes for one tokenizer with llguidance, each once (cached by its text).

    JSON is compact (no free whitespace), so a model cannot spend its token budget on blanks.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask_par
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._templates: dict[tuple[str, str], object] = {}  # (kind, text) -> a fresh matcher to copy

    def _template(self, params: SamplingParams):
        if params.json_schema is not None:
            key = ("json_schema", params.json_schema)
        else:
            assert params.regex is not None
            key = ("regex", params.regex)
        template = self._templates.get(key)
        if template is None:
            M = self._llg.LLMatcher
            kind, text = key
            try:
                if kind == "json_schema":
                    grammar = M.grammar_from_json_schema(text, defaults={"whitespace_flexible": False})
                else:
                    grammar = M.grammar_from_regex(text)
                template = M(self._tokenizer, grammar, log_level=0)
            except (ValueError, RuntimeError) as e:
                raise ConfigError(f"{kind} could not be compiled: {e}; got {text[:200]!r}") from e
            if template.is_error():
                raise ConfigError(f"{kind} could not be compiled: {template.get_error()}; got {text[:200]!r}")
            self._templates[key] = template
        return template

    def new(self, params: SamplingParams) -> GrammarConstraint:
        return GrammarConstraint(self._template(params).deep_copy())

    def fill(self, constraints: list[GrammarConstraint], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fill ``bitmask[rows[i]]`` for ``constraints[i]``: the whole batch in one call, on llguidance's
        own threads, without the GIL."""
        if constraints:
            self._fill(
                self._executor, [(c.matcher, r) for c, r in zip(constraints, rows, strict=True)], bitmask
            )


Constraint = ChoiceConstraint | GrammarConstraint


def fill_bitmask(
    constraints: list[Constraint | None], vocab: int, grammars: GrammarCompiler | None
) -> tuple[torch.Tensor, list[int]] | None:
    """The bitmask of every constrained row of a batch: ([C, W] int32 on CPU, the rows it belongs to)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    bitmask = allocate_bitmask(len(rows), vocab)
    grammar_cs, grammar_rows = [], []
    for j, i in enumerate(rows):
        c = constraints[i]
        if isinstance(c, ChoiceConstraint):
            set_allowed(bitmask[j], c.allowed())
        else:
            grammar_cs.append(c)
            grammar_rows.append(j)
    if grammar_cs:
        assert grammars is not None
        grammars.fill(grammar_cs, bitmask, grammar_rows)
    return bitmask, rows


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
