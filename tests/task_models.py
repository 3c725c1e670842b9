"""Tiny random models for the prefill-only tasks (embed, classify), saved the normal way: encoders (BERT,
XLM-RoBERTa) and a decoder embedder (Qwen3), each with its sentence-transformers files written by
sentence-transformers itself; sequence classifiers (BERT, XLM-RoBERTa, Qwen2); ModernBERT for both; an EmbeddingGemma-shaped Gemma-3. No downloads: the tokenizer
is :func:`tests.tiny_models.make_tokenizer`'s, without a chat template (sentence-transformers 6 would
otherwise format each text as a chat message)."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny_models import make_tokenizer

WIDTH = 64
MAX_LEN = 96  # the sentence-transformers max_seq_length of the embedders


def _tokenizer(folder: Path, chat: bool = False):
    tok = make_tokenizer(folder, 512)
    if chat:  # sentence-transformers 6 then renders each text as a chat message
        return tok
    tok.chat_template = None
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok.save_pretrained(str(folder))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return tok


def _config(family: str, tok, **extra):
    from transformers import BertConfig, Qwen2Config, Qwen3Config, XLMRobertaConfig

    common = dict(
        vocab_size=len(tok),
        hidden_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        pad_token_id=tok.pad_token_id,
        **extra,
    )
    if family == "bert":
        return BertConfig(max_position_embeddings=128, **common)
    if family == "xlm-roberta":  # positions count from pad_token_id + 1
        return XLMRobertaConfig(max_position_embeddings=128 + tok.pad_token_id + 1, **common)
    if family == "distilbert":  # its own names: dim, n_layers, n_heads, hidden_dim
        from transformers import DistilBertConfig

        return DistilBertConfig(
            vocab_size=len(tok),
            dim=WIDTH,
            n_layers=2,
            n_heads=4,
            hidden_dim=128,
            max_position_embeddings=128,
            pad_token_id=tok.pad_token_id,
            **extra,
        )
    if family == "qwen3":
        return Qwen3Config(num_key_value_heads=2, head_dim=16, max_position_embeddings=512, **common)
    if family == "qwen2":
        return Qwen2Config(num_key_value_heads=2, max_position_embeddings=512, **common)
    if family == "modernbert":  # layers 0 and 3 global, 1 and 2 local: keys within 4 positions either way
        from transformers import ModernBertConfig

        ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
        ids |= dict(cls_token_id=tok.bos_token_id, sep_token_id=tok.eos_token_id)  # (its own default ids)
        common["num_hidden_layers"] = 4
        return ModernBertConfig(
            max_position_embeddings=512, global_attn_every_n_layers=3, local_attention=8, **ids, **common
        )
    if family == "gemma3":  # EmbeddingGemma's shape: windowed layers attend both ways, one global layer
        from transformers import Gemma3TextConfig

        common["num_hidden_layers"] = 4
        layers = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        return Gemma3TextConfig(
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            use_bidirectional_attention=True,
            sliding_window=4,
            layer_types=layers,
            **common,
        )
    raise ValueError(family)


def make_embedder(
    folder: Path,
    family: str,
    pooling: str,
    normalize: bool = True,
    seed: int = 0,
    *,
    chat: bool = False,
    include_prompt: bool = True,
    **st: object,
) -> Path:
    """A sentence-transformers model folder: ``family``'s body, then Pooling(``pooling``: cls | mean |
    lasttoken, ``include_prompt``), then Normalize when ``normalize``; ``chat``: the tokenizer keeps its chat
    template; ``st``: more of ``SentenceTransformer``'s arguments (``prompts``, ``default_prompt_name``)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModel

    folder = Path(folder)
    body = folder / "body"
    body.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(body, chat)
    torch.manual_seed(seed)
    AutoModel.from_config(_config(family, tok)).save_pretrained(str(body))
    modules = [
        models.Transformer(str(body), max_seq_length=MAX_LEN),
        models.Pooling(WIDTH, pooling_mode=pooling, include_prompt=include_prompt),
    ]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu", **st).save(str(folder))  # type: ignore[arg-type]
    if not chat:
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def make_classifier(
    folder: Path, family: str, num_labels: int, seed: int = 0, *, chat: bool = False, **config
) -> Path:
    """A sequence-classification model folder with ``num_labels`` outputs (labels named ``L0``, ...);
    ``chat``: the tokenizer keeps its chat template (a reward model's); ``config``: more of the family's
    config (ModernBERT's ``classifier_pooling``)."""
    from transformers import AutoModelForSequenceClassification

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(folder, chat)
    labels = {i: f"L{i}" for i in range(num_labels)}
    cfg = _config(
        family,
        tok,
        num_labels=num_labels,
        id2label=labels,
        label2id={v: k for k, v in labels.items()},
        **config,
    )
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(cfg)
    with torch.no_grad():  # a decisive head, so the label is not a near-tie
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] == num_labels:
                p.mul_(8.0)
    model.save_pretrained(str(folder))
    return folder
