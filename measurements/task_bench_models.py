"""Write the random-weight models `batchjob bench --task embed` measures, at two real embedders' shapes:

- ``minilm-shape/``: all-MiniLM-L6-v2's (BERT, 6 layers, 384 wide, 12 heads, 1536 intermediate, 512
  positions; sentence-transformers mean pooling and Normalize);
- ``qwen3-embedding-shape/``: Qwen3-Embedding-0.6B's (Qwen3, 28 layers, 1024 wide, 16 query and 8 KV heads
  of 128, 3072 intermediate, tied embeddings; last-token pooling and Normalize);
- ``minilm-classifier/``: the MiniLM shape with a 2-label sequence-classification head (``--task classify``);
- ``modernbert-shape/``: gte-modernbert-base's (ModernBERT, 22 layers, 768 wide, 12 heads, 1152
  intermediate, every third layer global, the others a 128-token window both ways; mean pooling).

Random weights: the speed of a forward does not depend on them. No downloads: every model takes the
tokenizer of batchjob's embedded default model (SmolLM2's byte-level BPE, 49,152 tokens; the vocabulary
is widened to fit it), without its chat template (sentence-transformers 6 would format texts as chat
messages). Run:

    python measurements/task_bench_models.py /tmp/task-models            # all four
    python measurements/task_bench_models.py /tmp/task-models modernbert-shape   # only the ones named
    batchjob bench --task embed --model /tmp/task-models/minilm-shape --num-requests 256
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def tokenizer():
    from transformers import AutoTokenizer

    from batchjob.models import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tok.chat_template = None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def save_embedder(folder: Path, config, pooling: str) -> None:
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModel

    body = folder / "body"
    tok = tokenizer()
    tok.save_pretrained(str(body))
    (body / "chat_template.jinja").unlink(missing_ok=True)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(str(body))
    limit = min(512, config.max_position_embeddings)
    modules = [
        models.Transformer(str(body), max_seq_length=limit),
        models.Pooling(config.hidden_size, pooling_mode=pooling),
        models.Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    print(f"wrote {folder}")


def main(out: Path, only: list[str]) -> None:
    from transformers import AutoModelForSequenceClassification, BertConfig, ModernBertConfig, Qwen3Config

    def wanted(name: str) -> bool:
        return not only or name in only

    vocab = len(tokenizer())
    minilm = dict(
        vocab_size=vocab,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        pad_token_id=tokenizer().pad_token_id,
    )
    if wanted("minilm-shape"):
        save_embedder(out / "minilm-shape", BertConfig(**minilm), "mean")
    if wanted("modernbert-shape"):
        tok = tokenizer()
        modernbert = ModernBertConfig(
            vocab_size=vocab,
            hidden_size=768,
            num_hidden_layers=22,
            num_attention_heads=12,
            intermediate_size=1152,
            global_attn_every_n_layers=3,
            local_attention=128,
            max_position_embeddings=8192,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            cls_token_id=tok.bos_token_id,
            sep_token_id=tok.eos_token_id,
        )
        save_embedder(out / "modernbert-shape", modernbert, "mean")
    qwen3 = Qwen3Config(
        vocab_size=vocab,
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        max_position_embeddings=32768,
        rope_theta=1_000_000,
        tie_word_embeddings=True,
        pad_token_id=tokenizer().pad_token_id,
    )
    if wanted("qwen3-embedding-shape"):
        save_embedder(out / "qwen3-embedding-shape", qwen3, "lasttoken")
    if not wanted("minilm-classifier"):
        return
    folder = out / "minilm-classifier"
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(BertConfig(num_labels=2, **minilm)).save_pretrained(
        str(folder)
    )
    tok = tokenizer()
    tok.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    print(f"wrote {folder}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?", default="task-models", help="the folder to write into (task-models)")
    ap.add_argument("only", nargs="*", help="the models to write (default: all four)")
    args = ap.parse_args()
    main(Path(args.out), args.only)
