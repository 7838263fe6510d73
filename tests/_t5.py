"""A tiny random-initialised T5 and a synthetic seq2seq dataset for Trainer tests (no hub access)."""
from __future__ import annotations

import torch
from transformers import T5Config, T5ForConditionalGeneration

TINY = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
            eos_token_id=1, tie_word_embeddings=True, feed_forward_proj="relu")


def tiny_t5(seed: int = 0) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(T5Config(**TINY))


class ToyDataset(torch.utils.data.Dataset):
    """Reverse-the-sequence task on random tokens: learnable, deterministic."""

    def __init__(self, n: int = 32, length: int = 8, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.src = torch.randint(2, TINY["vocab_size"], (n, length), generator=g)

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return {"input_ids": self.src[i], "attention_mask": torch.ones_like(self.src[i]),
                "labels": self.src[i].flip(0)}


class WithDecoderInputs(ToyDataset):
    """label_smoothing_factor takes the labels away from the model: the decoder inputs come with the batch."""

    def __getitem__(self, i):
        d = super().__getitem__(i)
        d["decoder_input_ids"] = torch.cat([torch.zeros(1, dtype=torch.long), d["labels"][:-1]])
        return d


#: the shortest ds_config that turns the engine on: ZeRO-2 with the optimizer offloaded to the CPU
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def logged(trainer, key: str) -> list:
    """``key``'s values in the Trainer's log history, one per logging step (the final summary left out)."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]



def best_eval_step(state) -> int:
    """The step of the highest eval_loss in ``state.log_history`` (the tests' greater_is_better, so that the best
    checkpoint is an early one), checked to be no run's last evaluation: which one it is depends on the
    transformers version's loss curve (4 of 6 at 5.3, 2 at 5.25), which a hard-coded checkpoint-2 assumed."""
    evals = [(h["step"], h["eval_loss"]) for h in state.log_history if "eval_loss" in h]
    step = max(evals, key=lambda e: e[1])[0]
    assert step != evals[-1][0], evals
    return step
