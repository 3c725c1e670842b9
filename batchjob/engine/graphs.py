"""Decode steps replayed from CUDA graphs, one graph per bucket of rows and context length.

A step without prompt chunks (every request decodes one token, or verifies drafts: each row is then a single
query over its own request's keys) is a list of rows, each with a token, a position, a KV slot to write, a
block table and a context length. Padded to a bucket (rows rounded up to one of :data:`ROW_BUCKETS`, blocks
to a power of two), such a step has fixed shapes, so the whole forward can be captured once as a CUDA graph
and replayed: the host then launches one graph instead of the forward's few thousand kernels, which is what
bounds a small decode step on a GPU.

Everything a step varies lives in one flat int64 buffer per graph, filled by one host-to-device copy.
Padding rows write their key and value into a scratch block that no request owns and attend to that one
slot, so they can neither disturb a request nor produce NaNs; their logits are dropped. Graphs are captured
lazily, the first time a bucket is needed, into one shared memory pool, and all leave their logits in one
shared output tensor.

On the CPU there is nothing to capture: the same padded buffers run eagerly (``cuda_graphs=True`` on a CPU
engine), which is how the tests check the padding and the buffers against Hugging Face ``generate``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from batchjob.engine import attention

log = logging.getLogger(__name__)

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)


@dataclass
class _Graph:
    rows: int
    blocks: int
    host: torch.Tensor  # [4 * rows + rows * blocks] int64, pinned on CUDA: ids, positions, slots, lens, table
    device_buf: torch.Tensor  # the same on the device; the views below read from it
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Graph buckets of one :class:`~batchjob.engine.model_runner.ModelRunner`; the KV caches, the device,
    the attention path and the model call are the runner's own (read, never copied)."""

    def __init__(self, runner, scratch_block: int, max_rows: int, max_blocks: int) -> None:
        self.runner = runner
        self.scratch_block = scratch_block
        self.max_rows = max(b for b in ROW_BUCKETS if b <= max(1, max_rows))
        self.max_blocks = max(1, max_blocks)
        self.capture = runner.device.type == "cuda"
        self.enabled = True  # turned off for good if a capture fails
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._too_large: set[tuple[int, int]] = set()  # buckets whose capture ran out of memory
        self._pool = None
        self._out: torch.Tensor | None = None  # [max_rows, V] where every replay leaves its logits
        self.replays = 0  # steps run through a bucket (replayed on CUDA, eager on the CPU)

    def bucket(self, rows: int, blocks: int) -> tuple[int, int] | None:
        """The (rows, blocks) bucket a step fits, or None when it is too large for any."""
        if not self.enabled or rows > self.max_rows or blocks > self.max_blocks:
            return None
        r = next(b for b in ROW_BUCKETS if b >= rows)
        return r, min(1 << max(0, blocks - 1).bit_length(), self.max_blocks)

    def run(
        self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, tables: np.ndarray
    ) -> torch.Tensor | None:
        """Logits [len(ids), V] of one decode step: row i is token ``ids[i]`` at ``positions[i]``, written to
        ``slots[i]``, attending to the keys at positions ``<= positions[i]`` through block table
        ``tables[i]``. None when the step fits no bucket (the caller runs it eagerly). On CUDA the logits
        are a view of the graphs' shared output: valid until the next step."""
        n = len(ids)
        blocks = int((positions.max() // self.runner.block_size) + 1)
        key = self.bucket(n, blocks)
        if key is None or key in self._too_large:
            return None
        g = self._graphs.get(key)
        if g is None:
            g = self._build(*key)
            if g is None:
                return None
        self._fill(g, ids, positions, slots, tables)
        g.device_buf.copy_(g.host, non_blocking=True)
        if g.graph is not None:
            g.graph.replay()
            logits = self._out[: g.rows]
        else:
            logits = self._forward(g)
        self.replays += 1
        return logits[:n]

    # -- building ---------------------------------------------------------------------------------------

    def _fill(self, g: _Graph, ids, positions, slots, tables) -> None:
        """Write a step into the graph's host buffer; rows past the step are padding."""
        r, mb = g.rows, g.blocks
        h = g.host.numpy()
        n = len(ids)
        h[0:n] = ids
        h[n:r] = 0
        h[r : r + n] = positions
        h[r + n : 2 * r] = 0
        h[2 * r : 2 * r + n] = slots
        h[2 * r + n : 3 * r] = self.scratch_block * self.runner.block_size
        h[3 * r : 3 * r + n] = positions + 1
        h[3 * r + n : 4 * r] = 1
        table = h[4 * r :].reshape(r, mb)
        w = min(tables.shape[1], mb)
        table[:n, :w] = tables[:, :w]
        table[:n, w:] = self.scratch_block
        table[n:] = self.scratch_block

    def _views(self, g: _Graph):
        r = g.rows
        b = g.device_buf
        return b[0:r], b[r : 2 * r], b[2 * r : 3 * r], b[3 * r : 4 * r], b[4 * r :].view(r, g.blocks)

    def _forward(self, g: _Graph) -> torch.Tensor:
        ids, positions, slots, lens, table = self._views(g)
        runner = self.runner
        meta = runner.decode_meta(slots, table, lens)
        out = runner.call_model(
            input_ids=ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=0,
            **{attention.META_KWARG: meta},
        )
        return out.logits[0]

    def _build(self, rows: int, blocks: int) -> _Graph | None:
        size = 4 * rows + rows * blocks
        host = torch.zeros(size, dtype=torch.int64, pin_memory=self.capture)
        g = _Graph(rows, blocks, host, torch.zeros(size, dtype=torch.int64, device=self.runner.device))
        if self.capture:
            try:
                self._capture(g)
            except torch.cuda.OutOfMemoryError:
                # Too large beside the KV pool: this bucket's steps run eagerly, the others keep their graphs.
                log.warning(
                    "no memory for a CUDA graph of %d rows x %d blocks: they run eagerly", rows, blocks
                )
                self._too_large.add((rows, blocks))
                torch.cuda.synchronize(self.runner.device)
                return None
            except Exception as e:  # noqa: BLE001 - any failure leaves the eager path, which always works
                log.warning(
                    "CUDA graph capture failed (%s: %s); decode steps run eagerly", type(e).__name__, e
                )
                torch.cuda.synchronize(self.runner.device)
                self._turn_off()
                return None
        self._graphs[(rows, blocks)] = g
        return g

    def _turn_off(self) -> None:
        self.enabled = False
        self._graphs.clear()  # their pool and output go with them
        self._pool = self._out = None

    def _capture(self, g: _Graph) -> None:
        # All rows padding: the warm-up and the capture write only the scratch block.
        self._fill(
            g, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 1), np.int64)
        )
        g.device_buf.copy_(g.host)
        torch.cuda.synchronize(self.runner.device)
        side = torch.cuda.Stream(self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            logits = self._forward(g)  # lazy initialisation and allocator warm-up happen outside the capture
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        if self._out is None:
            # One output for every graph, outside their pool: each graph's own logits are then temporaries
            # of the pool, whose memory the next capture reuses, instead of one [rows, V] tensor per bucket.
            self._out = torch.empty(
                (self.max_rows, logits.shape[-1]), dtype=logits.dtype, device=self.runner.device
            )
        del logits
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._out[: g.rows].copy_(self._forward(g))
        if self._pool is None:
            self._pool = graph.pool()
        g.graph = graph
