"""A tensor-parallel rank other than 0: join the group, load this rank's shard, build the same engine as rank
0 (same KV pool, same attention backend), then run each step rank 0 broadcasts until it says stop.

Started by rank 0 only (``python -m batchjob.engine.parallel.follower SPEC``, SPEC a JSON object); it prints
one line and exits 1 if something fails, and dies with rank 0.
"""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    rank = spec["rank"]
    try:
        # Imported inside the try: a rank that cannot even import reports it in its one line to rank 0.
        from batchjob import faults
        from batchjob.engine.config import EngineConfig
        from batchjob.engine.engine import Engine
        from batchjob.engine.parallel import load_model
        from batchjob.engine.parallel.group import STOP, Group

        group = Group.join(spec)
        config = EngineConfig(**dict(spec["options"], device=spec["device"]))
        hf_model, tokenizer, resolved = load_model(spec["model"], config, spec["trust_remote_code"], group)
        group.ready()
        group.connect()
        engine_cls = Engine.engine_class(config.task)  # the same class as rank 0's
        engine = engine_cls(hf_model, tokenizer, config, model_id=resolved, tensor_parallel=group)
        steps = 0
        while True:
            kind, lay = group.receive_step()
            if kind == STOP:
                return 0
            steps += 1
            faults.point(f"tp_rank{rank}_step{steps}")  # a test stops (or kills) a rank mid-job here
            engine.runner.run_layout(kind, lay)
    except Exception as e:  # noqa: BLE001 - one line on stderr; rank 0 names this rank and stops the job
        print(f"batchjob: tensor-parallel rank {rank}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Out at once: a rank has nothing to save, and the interpreter's teardown of torch and transformers takes
    # seconds (while rank 0 waits for it in Engine.close()).
    os._exit(code)
