"""Shared by the ``test_planner*`` files: T5 architectures, their parameter count from the architecture alone,
and the repo's config file of one (or the inline one written out)."""
from __future__ import annotations

import json
from pathlib import Path



ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"

_T5 = dict(model_type="t5", d_kv=64, relative_attention_num_buckets=32, relative_attention_max_distance=128,
           dropout_rate=0.1, layer_norm_epsilon=1e-6, feed_forward_proj="relu", tie_word_embeddings=True,
           is_encoder_decoder=True, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, vocab_size=32128)
T5_TINY = {**_T5, "d_model": 64, "d_ff": 128, "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
           "vocab_size": 1024}
T5_SMALL = {**_T5, "d_model": 512, "d_ff": 2048, "num_layers": 6, "num_decoder_layers": 6, "num_heads": 8}
T5_3B = {**_T5, "d_model": 1024, "d_ff": 16384, "d_kv": 128, "num_layers": 24, "num_decoder_layers": 24,
         "num_heads": 32}


def t5_params(c: dict) -> int:
    """T5 parameter count from the architecture (tied embedding once), independent of transformers."""
    d, inner, ff, h = c["d_model"], c["num_heads"] * c["d_kv"], c["d_ff"], c["num_heads"]
    attn = 4 * d * inner
    enc = c["num_layers"] * (attn + 2 * d * ff + 2 * d) + c["relative_attention_num_buckets"] * h + d
    dec = c["num_decoder_layers"] * (2 * attn + 2 * d * ff + 3 * d) + c["relative_attention_num_buckets"] * h + d
    head = 0 if c.get("tie_word_embeddings", True) else c["vocab_size"] * d
    return c["vocab_size"] * d + enc + dec + head


def config_file(name: str, inline: dict, tmp_path: Path) -> Path:
    """The repo's config when it exists, else the inline fixture written to tmp_path."""
    p = MODELS / f"{name}.json"
    if p.exists():
        return p
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(inline))
    return p
