"""What the model given to the planner is refused for, in one line naming it: a config that parses but builds no model
that can be built or traced, and sequences longer than its learned positions (which meta tensors would not catch)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def model_errors(name: str, what: str, hint: str):
    """A config that parses but describes no model that can be built or run (a negative size, a key its model
    needs left out: AttributeError, RuntimeError, ...) is the config's fault: one ValueError naming it, the
    original chained (``--debug``)."""
    try:
        yield
    except (ValueError, OSError, ImportError):
        raise
    except Exception as e:  # noqa: BLE001
        message = " ".join(str(e).split())
        # (torch 2.6 says "Meta tensors", later ones "meta")
        if isinstance(e, NotImplementedError) and ("meta" in message.lower() or "data-dependent" in message):
            # an op whose output shape depends on the values (torch.nonzero: a mixture of experts routing tokens)
            # has no meta form: the config is fine, the tracer cannot run this model without weights
            hint = ("this model runs an op whose output shape depends on the values (a mixture of experts' routing, "
                    "torch.nonzero), which the meta device cannot run without weights: estimate cannot plan it; "
                    "measure a real step instead")
        elif "Expected inputs of BF16 type" in message:  # torch's grouped matmul (Mixtral's experts) is bf16 only
            hint = "this model's grouped expert matmul runs in bf16 only: plan it with --bf16"
        raise ValueError(f"{name}: cannot {what} ({type(e).__name__}: {message}); {hint}") from e


def check_positions(config, model, seq_len: int, tgt_len: int, name: str) -> None:
    """Learned absolute positions (GPT-2's wpe, BART's and BERT's position embeddings) cap the sequence length: a
    real step beyond them fails, but meta tensors index without bounds checks, so the trace would not. Rotary and
    relative models (Llama, T5) have no such table (no position-sized embedding besides the tokens') and no cap."""
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    rows = {m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    rows.discard(getattr(config, "vocab_size", None))
    if not rows & {limit, limit + 2}:  # BART's table has 2 extra rows (its offset); the usable length is the limit
        return
    lengths = [("--seq-len", seq_len)] + ([("--tgt-len", tgt_len)] if getattr(config, "is_encoder_decoder", False)
                                          else [])
    for flag, length in lengths:
        if length > limit:
            raise ValueError(f"{flag} {length} is longer than the {limit} positions of this model "
                             f"(max_position_embeddings in {name}): a real step would fail; give {flag} <= {limit}")
