"""Which transformers class ``estimate`` plans for a config: a language-model head, whose labels are token ids and
whose output is the vocabulary's logits (often the largest activation of a step).

The config's ``architectures`` decides when it names such a head (BERT's ``BertForMaskedLM``, GPT-2's
``GPT2LMHeadModel``; an encoder-decoder config's only when it is a seq2seq head); a bare base model (BART's
``BartModel``), a pretraining head (``BertForPreTraining``), another model type's LM head, a name transformers does
not know, or none falls back to the model type's seq2seq head (encoder-decoder configs), else its causal head, else
its masked one (DistilBERT has no causal head). A named head of another kind (sequence classification, question
answering, ...) is refused by name: planned as an LM head, its logits (a vocabulary's, not a few labels') made the
plan wrong without a word.
"""
from __future__ import annotations

from ..extras import require


def _names(table: dict, model_type) -> tuple[str, ...]:
    names = table.get(model_type, ())
    return (names,) if isinstance(names, str) else tuple(names)


def _class(transformers, name: str):
    """transformers' class ``name``, or None: a lazy import of a model whose optional backend is missing raises
    something else than AttributeError."""
    try:
        return getattr(transformers, name, None)
    except Exception:  # noqa: BLE001
        return None


def model_class(config) -> type:
    require("hf_zero_offload.planner", "transformers")  # the [trainer] extra, named if missing
    import transformers
    from transformers.models.auto import modeling_auto as auto

    model_type = getattr(config, "model_type", None)
    encoder_decoder = getattr(config, "is_encoder_decoder", False)
    seq2seq = _names(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, model_type)
    causal = _names(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, model_type)
    masked = _names(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, model_type)
    # an encoder-decoder config plans a seq2seq head only: the traced batch has its labels on the decoder's side
    heads = seq2seq if encoder_decoder else seq2seq + causal + masked
    listed = getattr(config, "architectures", None) or []
    if not isinstance(listed, (list, tuple)) or not all(isinstance(n, str) for n in listed):
        raise ValueError(f"the config's architectures is {listed!r}: a list of transformers class names (e.g. "
                         "[\"GPT2LMHeadModel\"]) is expected")
    for named in listed:  # the first LM head listed (several: a model saved with more than one head)
        if named in heads and _class(transformers, named) is not None:
            return _class(transformers, named)
    named = listed[0] if listed else None
    tables = (auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES, auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
              auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES, auto.MODEL_FOR_PRETRAINING_MAPPING_NAMES,
              auto.MODEL_MAPPING_NAMES)
    # LM heads of any type, pretraining heads (an LM head and another: BertForPreTraining) and base models fall back
    lm_or_base = {n for table in tables for key in table for n in _names(table, key)}
    if isinstance(named, str) and named not in lm_or_base and _class(transformers, named) is not None:
        raise ValueError(f"the config's architectures names {named}, which is not a language-model head: estimate "
                         "plans causal, masked and seq2seq LM heads (labels are token ids, the output a vocabulary's "
                         "logits); classification, question-answering and other heads are not planned")
    for name in (seq2seq if encoder_decoder else ()) + causal + (() if encoder_decoder else masked):
        if _class(transformers, name) is not None:
            return _class(transformers, name)
    kind = "seq2seq" if encoder_decoder else "causal or masked"
    raise ValueError(f"estimate plans text models with a language-model head; a {type(config).__name__} (model_type "
                     f"{model_type!r}) has no {kind} one (vision, audio and classification models are not planned)")
