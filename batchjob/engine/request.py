"""A request: prompt and output token ids, and one counter catching up with them.

There are no prefill and decode phases. A request is behind by ``num_tokens - num_computed_tokens``: a new
prompt is far behind, a decoding request is one token behind, and a preempted request is reset to zero and
recomputes everything (its generated tokens included) the next time it is scheduled.

The core state comes first; then each request feature's state in a slot of its own, None when the request
does not use the feature. The slots' types live in leaf modules that import nothing of the engine
(constraints.py, ngram.py, stop_strings.py, tasks/state.py), so this module imports no feature: the features
import it.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchjob.sampling import SamplingParams

if TYPE_CHECKING:
    from batchjob.engine.constraints import Constraint
    from batchjob.engine.ngram import SpecState
    from batchjob.engine.stop_strings import StopScan
    from batchjob.engine.tasks.state import TaskState
    from batchjob.engine.vision.state import Images


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request; finished states sort last, so ``status >= FINISHED_STOPPED`` means done."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ERROR = 4

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


INTERNAL = "\x00"  # in the ids of the requests the engine runs for others (helpers); never in a caller's


def helper_id(owner_id: str, what: str) -> str:
    """The id of a request a feature runs for ``owner_id``: apart from every id a caller may give."""
    return f"{owner_id}{INTERNAL}{what}"


def request_key(request_id: str) -> int:
    """A stable 31-bit integer for a request id: the sampler mixes it with the seed and the position."""
    return int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little") & 0x7FFFFFFF


@dataclass
class LogprobState:
    """A request that asked for its tokens' top-K log-probabilities (logprobs.py)."""

    top: list[list[tuple[int, float]]] = field(default_factory=list)  # per generated token, K + its own
    # A resumed request's tokens, replayed one per step (instead of drawn) so that their log-probabilities
    # are computed again; None once replayed.
    replay: list[int] | None = None


@dataclass
class RequestState:
    """What a checkpoint needs to resume an unfinished request: no KV, it is recomputed."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    sample_index: int = 0  # pass it back to add_request when params.n > 1
    continuation_ids: list[int] | None = None  # score: the scored continuation (pass it back likewise)
    token_logprobs: bool = False  # score: the per-token list was asked for
    adapter: str | None = None  # its LoRA adapter's name (None: the base model); pass it back likewise


@dataclass(eq=False)
class Request:
    """Core state first (ids, counters, blocks, times); then each optional feature's state as one small
    object, None when the request does not use the feature."""

    request_id: str
    token_ids: list[int]  # prompt ids followed by generated ids (and, during a step, drafts)
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float  # time.monotonic() when added
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_draft_tokens: int = 0  # speculative drafts at the end of token_ids, during a step only
    block_ids: list[int] = field(default_factory=list)
    block_digests: list[bytes] = field(default_factory=list)  # prefix-cache digests of its full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    key: int = 0  # request_key(request_id), cached: the sampler's per-request stream
    error: str | None = None
    first_scheduled_time: float | None = None  # monotonic seconds: first admitted to a step
    first_token_time: float | None = None
    finish_time: float | None = None
    # A prompt sampled n > 1 times: one request per sample, sharing the prompt's KV blocks.
    group_id: str = ""  # the caller's id; request_id adds "#k" when the prompt is sampled n > 1 times
    sample_index: int = 0
    wait_for: Request | None = None  # not admitted before this one has computed its prompt (shares its KV)
    priority: bool = False  # admitted before the other waiting requests (preempted, helper requests)
    # A helper request a feature queued for another one when it finished (feature.py): run at the front, its
    # sampled token dropped, never checkpointed, aborted with its owner, which is reported once the last
    # of its helpers has run.
    owner: Request | None = None
    pending_helpers: int = 0  # the owner's count of its helpers still to run
    # Feature state (feature.py):
    constraint: Constraint | None = None  # constraints.py; rebuilt from the output ids on resume
    logprobs: LogprobState | None = None  # logprobs.py: top-K log-probabilities asked for
    spec: SpecState | None = None  # speculative.py: prompt-lookup state, from its first draft on
    score_node: int | None = None  # choices.py: a helper scoring this node of its owner's choice trie
    stop: StopScan | None = None  # output.py: the incremental text its stop strings are looked for in
    task: TaskState | None = None  # tasks.py: a prefill-only request (embed, classify, score), never samples
    adapter: int = 0  # lora/: the LoRA adapter it runs under (0: the base model); roots its block digests
    images: Images | None = None  # vision/: its images (pixels, image-token positions, features once encoded)
    long_rope: bool = False  # rope.py: its tokens take a longrope model's long set; roots its block digests
    penalty: float | None = None  # penalties.py: its repetition penalty (None: none)

    def __post_init__(self) -> None:
        self.key = request_key(self.request_id)
        self.group_id = self.group_id or self.request_id

    @property
    def held(self) -> bool:
        """True while the request it waits for has not computed its prompt yet."""
        lead = self.wait_for
        if lead is None:
            return False
        if lead.num_computed_tokens >= lead.num_prompt_tokens or lead.is_finished:
            self.wait_for = None
            return False
        return True

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
