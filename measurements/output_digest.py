"""One mixed workload (free, stop strings, choices, logprobs, n samples, JSON schema, seeded sampling) on the
embedded model, a digest of every output field printed per output: run it under two checkouts and diff.

    python measurements/output_digest.py > after.txt
    python measurements/output_digest.py /tmp/before > before.txt      (another checkout of this repository)
    diff before.txt after.txt
"""

import argparse
import hashlib
import json
import sys

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("checkout", nargs="?", help="another checkout of this repository to run (default: the installed one)")
args = ap.parse_args()
if args.checkout:  # the batchjob of that checkout, not the installed one
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
    sys.path.insert(0, args.checkout)
import batchjob  # noqa: E402
from batchjob import Engine, SamplingParams  # noqa: E402

print(batchjob.__file__, file=sys.stderr)
eng = Engine.from_pretrained(device="cpu", max_num_seqs=8, num_blocks=64, block_size=16)
tok = eng.tokenizer
texts = [
    "Do you want tea?",
    "The capital of France is",
    "List three colors:",
    "Write a haiku about rain.",
    "Is this review positive? 'Great phone, bad battery.'",
    "1, 2, 3,",
    "def fib(n):",
]
prompts = [
    tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts
]
prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
params = [
    SamplingParams(max_new_tokens=40, temperature=0),
    SamplingParams(max_new_tokens=40, temperature=0, stop=[",", "\n\n"]),
    SamplingParams(max_new_tokens=40, temperature=0.8, seed=3, stop=["rain"]),
    SamplingParams(choices=["positive", "negative", "neutral", "mixed", "not sure"], temperature=0),
    SamplingParams(max_new_tokens=30, temperature=0.7, seed=1, n=3, logprobs=2),
    SamplingParams(
        max_new_tokens=30,
        seed=7,
        json_schema=json.dumps(
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
        ),
    ),
    SamplingParams(choices=["yes", "yes please", "no", "no thanks", "maybe"], temperature=1.0, seed=9),
]
outs = eng.generate(prompts * 3, params * 3)
for o in outs:
    d = (
        o.request_id,
        o.sample_index,
        o.token_ids,
        o.text,
        o.finish_reason,
        o.error,
        o.choice_logprobs,
        o.logprobs,
    )
    print(
        o.request_id,
        o.sample_index,
        o.finish_reason,
        repr(o.text[:40]),
        hashlib.sha1(repr(d).encode()).hexdigest()[:12],
    )
print("stats", {k: v for k, v in eng.stats.as_dict().items() if "seconds" not in k})
