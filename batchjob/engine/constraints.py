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

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from batchjob.engine.grammar import grammar_of
from batchjob.engine.sampler import ranked_top
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
        self.max_tokens = max((len(t) for t in token_ids), default=0)  # of the longest choice
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


def choice_trie(tokenizer, choices: list[str]) -> ChoiceTrie:
    """A label set's trie, each label tokenized alone without special tokens. ``ConfigError`` where the
    tokenizer gives two labels the same ids (an uncased one: 'Yes' and 'yes'; unknown characters) or a label
    none (characters it drops): the engine could not answer with one and not the other."""
    ids = [tokenizer(c, add_special_tokens=False).input_ids for c in choices]
    return ChoiceTrie(list(choices), ids)


class ChoiceConstraint:
    """One request's walk down a ``ChoiceTrie``, and the log-probabilities seen at each inner node."""

    def __init__(self, trie: ChoiceTrie, stop_ids: list[int]) -> None:
        self.trie = trie
        self.stop_ids = stop_ids
        self.node = 0
        self.done = False
        self.node_logprobs: dict[int, dict[int, float]] = {}  # node -> {child token: log-prob}
        # node where a choice ends and a longer one goes on -> log P(the model does not go on into a child)
        self.node_rest: dict[int, float] = {}
        self.node_tops: dict[int, list[tuple[int, float]]] = {}  # with logprobs=K: node -> its top K
        # The trie bounds the answer (``max_new_tokens`` does not cut it): its longest choice and a stop.
        self.output_limit: int | None = trie.max_tokens + 1

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

    def record(self, logprobs_row: torch.Tensor, node: int | None = None, top_k: int | None = None) -> None:
        """Keep the children's log-probabilities at ``node`` (default: the current one) from the model's
        distribution there (``logprobs_row``: [V] log-softmax), and its ``top_k`` tokens when the request
        asked for log-probabilities (the answer's own, along its path: :meth:`path_logprobs`)."""
        node = self.node if node is None else node
        children = list(self.trie.nodes[node].children)
        if children and node not in self.node_logprobs:
            values = logprobs_row[children].tolist()
            self.node_logprobs[node] = dict(zip(children, values, strict=True))
            if top_k is not None:
                self.node_tops[node] = ranked_top(logprobs_row[None], [top_k])[0]  # ties by token id
            if self.trie.nodes[node].choice is not None:
                # Summed in log space over the other tokens: 1 - P(children) rounds to 0 (and the choice's
                # log-probability to -inf) once the children hold all but ~1e-16 of the mass.
                rest = logprobs_row.clone()
                rest[children] = -math.inf
                self.node_rest[node] = torch.logsumexp(rest.double(), 0).item()

    def path_logprobs(self, choice: int) -> list[list[tuple[int, float]]]:
        """Per token of choice ``choice``: the top K at its node, best first, then the token's own when it is
        not among them (as ``sampler.top_logprobs`` gives a sampled token's); needs ``top_k`` recorded."""
        out, node = [], 0
        for t in self.trie.token_ids[choice]:
            top = list(self.node_tops[node])
            if all(u != t for u, _ in top):
                top.append((t, self.node_logprobs[node][t]))
            out.append(top)
            node = self.trie.nodes[node].children[t]
        return out

    @property
    def missing_nodes(self) -> list[int]:
        """Inner nodes whose log-probabilities were not seen on the decoded path (to be scored)."""
        return [i for i in self.trie.inner_nodes if i not in self.node_logprobs]

    @property
    def choice(self) -> int | None:
        return self.trie.nodes[self.node].choice if self.done else None

    def choice_logprobs(self) -> dict[str, float]:
        """log P(choice | prompt) for each choice, under the model (not renormalised over the choices). A
        choice that a longer one goes on from ('yes' of 'yes!') is the answer only where the model does not
        go on: its probability leaves out the longer choices' next tokens there (else it would hold theirs,
        and always win over them)."""
        out = {}
        for name, toks in zip(self.trie.choices, self.trie.token_ids, strict=True):
            total, node = 0.0, 0
            for t in toks:
                total += self.node_logprobs.get(node, {}).get(t, math.nan)
                node = self.trie.nodes[node].children[t]
            if self.trie.nodes[node].children:  # not scored: NaN, as a token's missing log-probability above
                total += self.node_rest.get(node, math.nan)
            out[name] = total
        return out


# -- grammars ----------------------------------------------------------------------------------------


class GrammarConstraint:
    """A request's llguidance matcher; ``done`` once the grammar has taken a stop token or can take nothing.

    JSON answers must also close within their ``budget``: ``max_new_tokens``, or the tokens the prompt leaves
    before the context ends where fewer, since a model (a small one above all) can wander in a string or a
    number for ever. So once the tokens left are no more than ``reserve`` (what closing the
    schema's shortest answer takes, and half again, plus a margin), the row is ``finishing``: among the
    tokens the grammar allows, it prefers a stop token, then closing brackets, then a closing quote inside a
    string (or separators outside one), and only then the longest allowed tokens (a forced key). Whether the answer is inside a string is
    tracked from the tokens' bytes, so it too is a function of the output ids.
    """

    output_limit: int | None = None  # no bound of its own on the answer's length: max_new_tokens is it

    def __init__(
        self,
        matcher,
        tables: _Tables | None = None,
        budget: int = 0,
        reserve: int = 0,
        room: int | None = None,
    ) -> None:
        self.matcher = matcher
        self.tables = tables  # JSON only
        self.budget = budget
        self.reserve = reserve
        self.room = room  # output tokens before the context ends (None: not known): says which limit cut it
        self.num_tokens = 0
        self.in_string = False
        self.escaped = False
        self.steered = False  # finishing took away a token the grammar allowed: the engine closed the answer

    def advance(self, token: int) -> bool:
        ok = bool(self.matcher.consume_token(token)) and not self.matcher.is_error()
        self.num_tokens += 1
        if self.tables is not None and ok:
            for b in self.tables.token_bytes[token]:
                if self.escaped:
                    self.escaped = False
                elif self.in_string and b == 0x5C:  # backslash
                    self.escaped = True
                elif b == 0x22:  # quote
                    self.in_string = not self.in_string
        return ok

    @property
    def done(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def finishing(self) -> bool:
        return self.tables is not None and self.budget - self.num_tokens <= self.reserve

    def narrow(self, words: np.ndarray) -> None:
        """Keep, in place, only the best tier of the allowed tokens (``words``: one bitmask row as uint32);
        when no tier is allowed (a key or a literal the grammar forces), the longest allowed tokens. Sets
        ``steered`` when that takes a token away (the answer is then the engine's doing, not the model's)."""
        t = self.tables
        assert t is not None
        before = words.copy()
        for tier in t.in_string if self.in_string else t.outside:
            kept = words & tier
            if kept.any():
                words[:] = kept
                break
        else:
            allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: len(t.lengths)].astype(bool)
            if allowed.any():
                longest = allowed & (t.lengths == t.lengths[allowed].max())
                packed = np.packbits(longest, bitorder="little")
                words[:] = 0
                words.view(np.uint8)[: len(packed)] = packed
        self.steered |= not np.array_equal(before, words)


class _Tables:
    """Per-vocabulary bitmasks of the token classes that close a JSON answer."""

    def __init__(self, token_bytes: list[bytes], stop_ids: list[int], vocab: int) -> None:
        self.token_bytes = token_bytes
        self.lengths = np.array([len(b) for b in token_bytes])

        def mask(pred) -> np.ndarray:
            words = np.zeros((vocab + 31) // 32, dtype=np.uint32)
            toks = np.array([t for t, b in enumerate(token_bytes) if pred(t, b)], dtype=np.int64)
            if len(toks):
                np.bitwise_or.at(words, toks >> 5, np.uint32(1) << (toks & 31).astype(np.uint32))
            return words

        stop = set(stop_ids)

        def only(chars: bytes):
            return lambda t, b: t not in stop and b != b"" and set(b) <= set(chars)

        stops = mask(lambda t, b: t in stop)
        closers = mask(only(b"]}"))
        self.outside = [stops, closers, mask(only(b'"]},:'))]

        def closing_quote(chars: bytes):
            return lambda t, b: t not in stop and b[:1] == b'"' and set(b[1:]) <= set(chars)

        self.in_string = [mask(closing_quote(b"]}")), mask(closing_quote(b"]},:"))]


class GrammarCompiler:
    """Compiles JSON schemas and regexes for one tokenizer with llguidance, each once (cached by its text).

    JSON is compact (no free whitespace), so a model cannot spend its token budget on blanks.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        # llguidance is optional and heavy: loaded when a row first asks for a grammar
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask_par
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=stop_ids)
        self._executor = llguidance.LLExecutor(num_threads=2)
        self._templates: dict[tuple[str, str], object] = {}  # (kind, text) -> a fresh matcher to copy
        self._vocab = vocab_size
        self._tables: _Tables | None = None
        self._stop_ids = stop_ids
        self._reserve: dict[str, int] = {}  # json schema -> tokens its shortest answer takes

    @property
    def tables(self) -> _Tables:
        if self._tables is None:
            token_bytes = [self._tokenizer.decode_bytes([t]) for t in range(self._vocab)]
            self._tables = _Tables(token_bytes, self._stop_ids, self._vocab)
        return self._tables

    def _template(self, params: SamplingParams):
        key = (
            ("json_schema", params.json_schema) if params.json_schema is not None else ("regex", params.regex)
        )
        template = self._templates.get(key)  # type: ignore[arg-type]
        if template is None:
            kind, text, grammar = grammar_of(params.json_schema, params.regex)
            template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0)
            if template.is_error():
                raise ConfigError(f"{kind} could not be compiled: {template.get_error()}; got {text[:200]!r}")
            self._templates[(kind, text)] = template
        return template

    def new(self, params: SamplingParams, room: int) -> GrammarConstraint:
        """A request's constraint; ``room``: the output tokens its prompt leaves before the context ends. A
        JSON answer is steered to close before whichever comes first, that or ``max_new_tokens`` (steering
        by ``max_new_tokens`` alone would never start where the context ends first, and leave a cut answer)."""
        matcher = self._template(params).deep_copy()
        if params.json_schema is None:
            return GrammarConstraint(matcher, room=room)
        reserve = self._reserve.get(params.json_schema)
        if reserve is None:
            shortest = self._shortest(params)
            reserve = self._reserve[params.json_schema] = shortest + shortest // 2 + 8
        return GrammarConstraint(matcher, self.tables, min(params.max_new_tokens, room), reserve, room)

    def _shortest(self, params: SamplingParams, limit: int = 1000) -> int:
        """Tokens a finishing answer takes from the start (the longest token of the best tier each step)."""
        c = GrammarConstraint(self._template(params).deep_copy(), self.tables, 0, 0)
        bitmask = allocate_bitmask(1, self._vocab)
        lengths = self.tables.lengths
        for n in range(limit):
            if c.done:
                return n
            self._fill(self._executor, [(c.matcher, 0)], bitmask)
            words = bitmask[0].numpy().view(np.uint32)
            c.narrow(words)
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: self._vocab])
            if not len(allowed):
                return n
            if not c.advance(int(allowed[np.argmax(lengths[allowed])])):
                return n
        return limit

    def replay_steering(self, c: GrammarConstraint) -> None:
        """A resumed answer's token where it was finishing: whether narrowing took a token away there
        (``steered``), as in the run that wrote it."""
        bitmask = allocate_bitmask(1, self._vocab)
        self.fill([c], bitmask, [0])
        c.narrow(bitmask[0].numpy().view(np.uint32))

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
        for c, j in zip(grammar_cs, grammar_rows, strict=True):
            if c.finishing:
                c.narrow(bitmask[j].numpy().view(np.uint32))
    return bitmask, rows


def normalize_choices(logprobs: dict[str, float]) -> dict[str, float] | None:
    """The choices' probabilities renormalised over the choices alone (they sum to 1): a confidence a user
    can read. Raw log-probabilities of labels are tiny when the model would rather say something else."""
    finite = [v for v in logprobs.values() if math.isfinite(v)]
    if not finite:
        return None
    top = max(finite)
    weights = {k: math.exp(v - top) if math.isfinite(v) else 0.0 for k, v in logprobs.items()}
    total = sum(weights.values())
    return {k: w / total for k, w in weights.items()}
