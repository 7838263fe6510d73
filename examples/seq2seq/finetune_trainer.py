#!/usr/bin/env python
"""Fine-tune a seq2seq model (T5, BART, ...) with the Hugging Face Trainer plus ``hf_zero_offload``.

The command-line interface of the legacy transformers v4.2 ``examples/seq2seq/finetune_trainer.py`` (the one of the
HF blog post "Fit More and Train Faster With ZeRO via DeepSpeed and FairScale"), on transformers 5.x, with two
additions from ``hf_zero_offload``: ``--zero_offload ds_config.json`` (ZeRO-2 + CPU offload) and ``--sharded_ddp``.

    python examples/seq2seq/finetune_trainer.py --model_name_or_path t5-large --data_dir wmt_en_ro \\
        --task translation_en_to_ro --output_dir output_dir --do_train --do_eval --predict_with_generate \\
        --zero_offload configs/ds_config_1gpu.json ...

Offline and without pretrained weights: ``--config_name configs/models/t5-small.json`` builds a randomly initialised
model; with no ``--tokenizer_name``/``--model_name_or_path`` a T5-style SentencePiece tokenizer is trained on the
training text and saved with the model. See examples/seq2seq/README.md.

Mistakes in the arguments or the ds_config are found before any tokenizer, model or plan work and print one line
(exit status 2); ``--debug`` or ``HF_ZERO_OFFLOAD_DEBUG=1`` shows the traceback.
"""

import logging
import os
import signal
import sys
import threading
from typing import Dict, List, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Training on CPU, torch's OpenMP workers (libgomp) spin for up to 300,000 iterations (milliseconds) after
# each parallel op, on the very cores the optimizer step's threads need right after backward. A shorter spin,
# read by libgomp when torch loads it (so before `import torch`): 20M params, 2 cores, int8 moments, opt.step
# 17.2-18.0 -> 12.0-13.5 ms and the whole step 61.7-64.6 -> 57.4-61.8 ms (docs/LIMITATIONS.md).
# A GOMP_SPINCOUNT or OMP_WAIT_POLICY of the user's own is kept.


def shorten_openmp_spin(environ) -> None:
    if "OMP_WAIT_POLICY" not in environ:
        environ.setdefault("GOMP_SPINCOUNT", "10000")


shorten_openmp_spin(os.environ)


def _interrupted_while_loading(signum, frame):
    # a Ctrl-C while torch and transformers load printed a traceback through their imports: one line and 130, as
    # run_reporting says it later (nothing has been written yet; os._exit: a half-imported module has nothing to undo)
    sys.stderr.write(f"{os.path.basename(__file__)}: interrupted while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


# only where a Ctrl-C would raise KeyboardInterrupt (not where SIGINT is ignored, as for a shell's background job),
# and from the main thread (the only one that may set a handler)
_guard_start = (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
if _guard_start:
    signal.signal(signal.SIGINT, _interrupted_while_loading)

try:
    import torch  # noqa: E402
    import transformers  # noqa: E402
    from transformers import (  # noqa: E402
        AutoConfig,
        DataCollatorForSeq2Seq,
        set_seed,
    )
    from transformers.trainer_callback import PrinterCallback  # noqa: E402
    from transformers.trainer_pt_utils import LengthGroupedSampler  # noqa: E402
    from torch.utils.data import SequentialSampler  # noqa: E402

    from hf_zero_offload import ZeroOffloadSeq2SeqTrainer, resume  # noqa: E402
    from hf_zero_offload.launch_checks import check_world_size  # noqa: E402
    from hf_zero_offload.usage import run_reporting, take_debug_flag  # noqa: E402

    import seq2seq_model as sm  # noqa: E402
    import seq2seq_data as sd  # noqa: E402
    import seq2seq_utils as su  # noqa: E402
    from seq2seq_args import (  # noqa: E402,F401
        DataTrainingArguments, ModelArguments, check_local_paths, check_resume_target, check_values, check_zero_config,
        parse_args,
        repo_config_hint)
except ImportError as _missing:  # before run_reporting exists: its one line, not a traceback
    if not isinstance(_missing, ModuleNotFoundError) and (_missing.name or "").split(".")[0] != "hf_zero_offload":
        raise  # (a library's own broken import: its traceback)
    if "--debug" in sys.argv or os.environ.get("HF_ZERO_OFFLOAD_DEBUG", "").strip().lower() not in ("", "0", "false",
                                                                                                   "no"):
        raise
    _ours = (_missing.name or "").split(".")[0] == "hf_zero_offload"
    _where = os.path.dirname(getattr(sys.modules.get("hf_zero_offload"), "__file__", None) or "") or "nowhere"
    sys.stderr.write(f"{os.path.basename(__file__)}: error: {_missing}: " + (
        f"the hf_zero_offload installed at {_where} lacks it: older than this script? Reinstall it from this checkout "
        "(make install, or pip install '.[examples]')" if _ours else "install the example's dependencies (pip "
        "install '<the checkout>[examples]', or make install)") + " (traceback: --debug or HF_ZERO_OFFLOAD_DEBUG=1)\n")
    raise SystemExit(2)

if _guard_start:  # loaded: a Ctrl-C is a KeyboardInterrupt again, which run_reporting turns into its line
    signal.signal(signal.SIGINT, signal.default_int_handler)

logger = logging.getLogger("finetune_trainer")


class LegacySeq2SeqTrainer(ZeroOffloadSeq2SeqTrainer):
    """``ZeroOffloadSeq2SeqTrainer`` plus a working ``--sortish_sampler``.

    In transformers 5.x ``Seq2SeqTrainingArguments.sortish_sampler`` is still parsed but nothing reads it; here it
    selects ``LengthGroupedSampler`` (mega-batches of 50 batches sorted by length, longest first: the legacy
    SortishSampler's scheme) over the source lengths in characters, as the legacy sampler used.
    """

    def _get_train_sampler(self, train_dataset=None):
        ds = train_dataset if train_dataset is not None else self.train_dataset
        if getattr(self.args, "sortish_sampler", False) and isinstance(ds, sd.Seq2SeqTextDataset):
            return LengthGroupedSampler(
                self.args.train_batch_size * self.args.gradient_accumulation_steps, lengths=ds.src_lens
            )
        return super()._get_train_sampler(train_dataset)

    def _get_eval_sampler(self, eval_dataset):
        # Generations are scored against the split's texts by position and written in the split's order: evaluation
        # runs in dataset order (transformers groups it by length under --train_sampling_strategy group_by_length,
        # which scored BLEU against other examples' references: 5.56 for a perfect model)
        if eval_dataset is None or not hasattr(eval_dataset, "__len__"):
            return None
        return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None


def _load_texts(model_args, data_args, split: str, n_obs: int):
    if data_args.data_dir:
        return sd.read_split(data_args.data_dir, split, n_obs)
    return sd.load_hf_dataset_split(data_args.dataset_name, data_args.dataset_config_name, split,
                                    data_args.src_lang, data_args.tgt_lang, model_args.cache_dir, n_obs)


def main(argv: Optional[List[str]] = None) -> Dict[str, float]:
    model_args, data_args, training_args = parse_args(argv)
    _RUN["output_dir"] = training_args.output_dir

    # ---- checks and setup ---------------------------------------------------------------------------------------
    # torchrun on CPUs without --use_cpu: each process sees one, and the second one met the first one's run lock
    # ("another run is training in this output_dir") instead of the flag that fixes it
    check_world_size(training_args)
    if not (model_args.model_name_or_path or model_args.config_name):
        raise ValueError("give --model_name_or_path (pretrained) or --config_name (random initialisation)")
    check_local_paths(model_args)
    if bool(data_args.data_dir) == bool(data_args.dataset_name):
        raise ValueError("give exactly one of --data_dir (legacy layout) or --dataset_name")
    if data_args.data_dir:  # before the model's config, whose Hub lookup failed first offline (the blog's command)
        sd.check_data_dir(data_args.data_dir)
    problem = resume.output_dir_problem(training_args.output_dir, training=training_args.do_train)
    if problem:
        raise ValueError(problem)
    if (training_args.do_train and os.path.isdir(training_args.output_dir) and os.listdir(training_args.output_dir)
            and not data_args.overwrite_output_dir and not training_args.resume_from_checkpoint):
        last = resume.newest_whole(training_args.output_dir)
        go_on = (f"; or go on from its newest checkpoint with --resume_from_checkpoint true ({last})" if last else
                 " (it holds no complete checkpoint to go on from: a run stopped before its first save starts "
                 "again so)")
        raise ValueError(f"Output directory ({training_args.output_dir}) already exists and is not empty. "
                         f"Use --overwrite_output_dir to overcome{go_on}.")
    if training_args.generation_max_length is None:
        training_args.generation_max_length = data_args.val_max_target_length

    # the model's config file only (no weights), for the ds_config's "auto" bucket size: the whole config is
    # checked before any tokenizer, model or plan work
    name = model_args.config_name or model_args.model_name_or_path
    try:
        config = AutoConfig.from_pretrained(name, cache_dir=model_args.cache_dir)
    except OSError as e:  # a Hub id without the network: say which offline file builds the same architecture
        raise OSError(f"{e}{repo_config_hint(name)}") from e
    check_values(model_args, data_args, training_args, config)
    check_zero_config(training_args, config)
    resumed_from = check_resume_target(training_args)

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO if training_args.should_log else logging.WARNING,
    )
    logger.setLevel(logging.INFO if training_args.should_log else logging.WARNING)
    transformers.utils.logging.set_verbosity(training_args.get_process_log_level())
    a = training_args
    logger.warning("process rank %s (local %s), device %s, n_gpu %s, distributed %s, fp16 %s, bf16 %s, zero_offload "
                   "%s, sharded_ddp %s", a.process_index, a.local_process_index, a.device, a.n_gpu,
                   a.parallel_mode.value == "distributed", a.fp16, a.bf16, a.zero_offload, a.sharded_ddp)
    set_seed(training_args.seed)

    # ---- config, data text, tokenizer, model --------------------------------------------------------------------
    prefix = su.task_prefix(data_args.task, config)

    need_eval = training_args.do_eval or training_args.eval_strategy != "no"
    if need_eval and not training_args.predict_with_generate:
        logger.warning("evaluation without --predict_with_generate: validation loss only, no BLEU")
    texts = {}
    if training_args.do_train or not (model_args.tokenizer_name or model_args.model_name_or_path):
        texts["train"] = _load_texts(model_args, data_args, "train", data_args.n_train)
    if need_eval:
        texts["val"] = _load_texts(model_args, data_args, "val", data_args.n_val)
    if training_args.do_predict:
        texts["test"] = _load_texts(model_args, data_args, "test", data_args.n_test)

    used = {s: t for s, t in texts.items() if s != "train" or training_args.do_train}  # (examples, not only
    target_flag = {"train": "max_target_length", "val": "val_max_target_length",       # a tokenizer's text)
                   "test": "test_max_target_length"}
    lengths = {"max_source_length": data_args.max_source_length,
               **{target_flag[s]: getattr(data_args, target_flag[s]) for s in used}}

    def check(tok):  # before a tokenizer trained here is written into output_dir
        sd.check_room(tok, prefix, lengths)
        sd.check_tokenized_texts(tok, used, data_args.data_dir or data_args.dataset_name)

    tokenizer = sm.make_tokenizer(model_args, training_args, config, texts, prefix, resumed_from, check=check)
    for attr, value in (("src_lang", data_args.src_lang), ("tgt_lang", data_args.tgt_lang)):
        if value is not None and hasattr(tokenizer, attr):
            setattr(tokenizer, attr, value)
        elif value is not None and data_args.data_dir:  # (--dataset_name: they pick its translation columns)
            logger.warning("--%s %s has no effect: %s has no %s", attr, value, type(tokenizer).__name__, attr)
    model = sm.make_model(model_args, config, tokenizer, resumed_from)
    if model.config.decoder_start_token_id is None:
        raise ValueError("the model config needs decoder_start_token_id")
    gen_params = su.task_generation_params(data_args.task, config)  # legacy use_task_specific_params
    for k, v in gen_params.items():
        setattr(model.generation_config, k, v)

    if model_args.freeze_embeds:
        su.freeze_embeds(model)
    if model_args.freeze_encoder:
        su.freeze_encoder(model)
    n_total, n_trainable = su.count_params(model)
    logger.info("model: %.2fM parameters, %.2fM trainable; task %s, prefix %r",
                n_total / 1e6, n_trainable / 1e6, data_args.task, prefix)

    # ==== MEMORY-PLAN HOOK =======================================================================================
    # With --zero_offload / --sharded_ddp, hf_zero_offload.planner.print_plan prints the per-rank device and host
    # memory of each configuration (baseline, fp16, ZeRO-1/2, offload) for this model at this batch size, before
    # training starts. Older versions of the package lack the planner: then nothing is printed. A failing printout
    # must never stop a training run, hence the broad except around the call.
    if (training_args.zero_offload or training_args.sharded_ddp) and training_args.process_index == 0:
        try:
            from hf_zero_offload.planner import cuda_memory_gib, print_plan
        except ImportError:
            print_plan = None
        if print_plan is not None:
            try:
                cuda = torch.cuda.is_available() and not training_args.use_cpu
                plan_kwargs = dict(
                    gpus=max(1, training_args.world_size), dtype="bf16" if training_args.bf16 else "fp16",
                    run_dtype="fp16" if training_args.fp16 else "bf16" if training_args.bf16 else "fp32",
                    seq_len=data_args.max_source_length, tgt_len=data_args.max_target_length,
                    batch_size=training_args.per_device_train_batch_size,
                    gradient_accumulation_steps=training_args.gradient_accumulation_steps, cuda=cuda,
                    # --gradient_checkpointing (renamed --activation_checkpointing in Transformers 5)
                    gradient_checkpointing=bool(getattr(training_args, "activation_checkpointing", False)
                                                or getattr(training_args, "gradient_checkpointing", False)),
                )
                if cuda:  # this rank's card, under any per-process cap
                    plan_kwargs["gpu_mem_gib"] = cuda_memory_gib(training_args.device)
                # the run's own buckets and moments (the shipped configs' "auto" buckets: hidden_size**2), not the
                # planner's defaults
                from hf_zero_offload.config import check as read_ds_config
                from hf_zero_offload.config.training import DEFAULT_BUCKET_SIZE
                zero = (read_ds_config(training_args.zero_offload).cfg.get("zero_optimization", {})
                        if training_args.zero_offload is not None else {})
                bucket = zero.get("reduce_bucket_size", DEFAULT_BUCKET_SIZE)
                plan_kwargs["bucket_numel"] = bucket if bucket == "auto" else int(bucket)
                plan_kwargs["state_dtype"] = zero.get("offload_optimizer", {}).get("state_dtype", "fp32")
                print_plan(model, **plan_kwargs)
            except Exception as e:  # noqa: BLE001
                logger.warning("hf_zero_offload.planner.print_plan failed (training goes on): %s", e)
    # =============================================================================================================

    # ---- datasets and trainer -----------------------------------------------------------------------------------
    datasets = {split: sd.Seq2SeqTextDataset(tokenizer, src, tgt, data_args.max_source_length,
                                             lengths[target_flag[split]], prefix) for split, (src, tgt) in used.items()}
    collator = DataCollatorForSeq2Seq(
        tokenizer, model=model,
        label_pad_token_id=-100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id,
    )
    if sm.mean_loss_only(model):  # the Trainer then averages accumulated micro-batches (and ranks) itself
        model.accepts_loss_kwargs = False
    trainer = LegacySeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets.get("train"),
        eval_dataset=datasets.get("val"),
        data_collator=collator,
        processing_class=tokenizer,
        compute_metrics=(sd.build_compute_metrics(tokenizer, datasets["val"].targets)
                         if training_args.predict_with_generate and "val" in datasets else None),
        callbacks=[su.StepProgressCallback()] if training_args.disable_tqdm else None,
    )
    if training_args.disable_tqdm:  # our step lines carry the values the printer would repeat as a dict
        trainer.remove_callback(PrinterCallback)

    all_metrics: Dict[str, float] = {}
    is_main = trainer.is_world_process_zero()
    os.makedirs(training_args.output_dir, exist_ok=True)

    def handle_metrics(split: str, metrics: Dict[str, float]) -> None:
        all_metrics.update(metrics)
        if is_main:
            logger.info("***** %s metrics *****", split)
            for key in sorted(metrics):
                logger.info("  %s = %s", key, metrics[key])
            su.save_json(metrics, os.path.join(training_args.output_dir, f"{split}_results.json"))

    # ---- train --------------------------------------------------------------------------------------------------
    if training_args.do_train:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = dict(train_result.metrics)
        metrics["train_n_objs"] = len(datasets["train"])
        metrics["train_peak_device_mem_bytes"] = (
            int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
        )
        metrics["train_peak_host_rss_bytes"] = su.peak_host_rss_bytes()
        trainer.save_model()  # the model and, as processing_class, the tokenizer
        if is_main:
            trainer.state.save_to_json(os.path.join(training_args.output_dir, "trainer_state.json"))
        handle_metrics("train", metrics)

    # ---- evaluate -----------------------------------------------------------------------------------------------
    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        # generation_max_length: the evaluations during training generated to it (--val_max_target_length unless
        # given), the final one to --val_max_target_length: best-model selection and val_results disagreed
        metrics = trainer.evaluate(metric_key_prefix="val", max_length=training_args.generation_max_length,
                                   num_beams=training_args.generation_num_beams)
        metrics["val_n_objs"] = len(datasets["val"])
        handle_metrics("val", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        if training_args.predict_with_generate:
            trainer.compute_metrics = sd.build_compute_metrics(tokenizer, datasets["test"].targets)
        else:
            logger.warning("--do_predict without --predict_with_generate: test loss only, no test_generations.txt "
                           "and no BLEU")
        out = trainer.predict(datasets["test"], metric_key_prefix="test",
                              max_length=data_args.test_max_target_length,
                              num_beams=training_args.generation_num_beams)
        metrics = dict(out.metrics)
        metrics["test_n_objs"] = len(datasets["test"])
        handle_metrics("test", metrics)
        if is_main and training_args.predict_with_generate:
            preds = out.predictions[0] if isinstance(out.predictions, tuple) else out.predictions
            # (rows past the split's length: the repeats that pad the last batch on several processes)
            preds = [[t for t in row if t >= 0] for row in preds[:len(datasets["test"])].tolist()]
            lines = [s.strip() for s in tokenizer.batch_decode(preds, skip_special_tokens=True)]
            with open(os.path.join(training_args.output_dir, "test_generations.txt"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")

    if is_main:
        su.save_json(all_metrics, os.path.join(training_args.output_dir, "all_results.json"))
    return all_metrics


_RUN = {}  # what a Ctrl-C's one line names: this run's output_dir


def _where_to_go_on() -> Optional[str]:
    out = _RUN.get("output_dir")
    if out is None:
        return None
    last = resume.newest_whole(out)
    if last is None:
        return f"no complete checkpoint in {out}: run the command again with --overwrite_output_dir to start afresh"
    return f"the newest complete checkpoint is {last}: go on with --resume_from_checkpoint true (or {last})"


def _mp_fn(index):  # for xla_spawn (TPUs), as the legacy script had
    main()


def _release_process_group(metrics):
    """After a run launched by torchrun: the process group is destroyed while the interpreter is whole. Left to the
    interpreter's exit, a gloo rank now and then died there with SIGABRT ("terminate called without an active
    exception": gloo's workers still held work objects whose tensors need the GIL during finalization,
    pytorch/pytorch#190489): 3 of 25 two-process runs of tests/test_examples.py's command, 0 of 40 with this. On
    torch < 2.8 the group is left as before: its gloo destructor waited for its workers holding the GIL, a deadlock
    (pytorch/pytorch#56297, fixed by #154976 in 2.8)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 8):
        dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    _debug, _argv = take_debug_flag(sys.argv[1:], shared_with_trainer=True)
    run_reporting(os.path.basename(__file__), lambda: _release_process_group(main(_argv)), debug=_debug,
                  interrupted=_where_to_go_on)
