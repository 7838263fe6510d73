"""``hf-zero-offload consolidate CHECKPOINT_DIR OUTPUT_DIR``: fp32 weights from a training checkpoint.

The Trainer saves the model in the training dtype (16-bit with fp16/bf16); the exact fp32 weights
are the optimizer's masters under ``CHECKPOINT_DIR/zero_offload/``. This writes the checkpoint's
safetensors files again with every trainable tensor replaced by its fp32 master (frozen tensors and
buffers upcast), and copies the config files, so ``from_pretrained(OUTPUT_DIR)`` loads it. Tied
weights stay tied: the output holds exactly the keys the checkpoint held, and the master of a
tied parameter is found under any of its names. A PEFT adapter checkpoint (``adapter_config.json``) gives its
adapter's weights in fp32 (``PeftModel.from_pretrained(base, OUTPUT_DIR)``). Needs no transformers and no GPU.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shlex
import shutil

import torch

from .extras import require

require(__name__, "safetensors")  # the [trainer] extra, named if missing
from safetensors.torch import save_file  # noqa: E402

from . import peft_names, resume, torch_state
from .engine import checkpoint
from .engine.checkpoint.folder import check_save_id, check_sources, read_range, sources
from .resume.marker import MARKER, changed_files, load_marker, marker_problem, read_marker, recorded_save_id
from .saved_names import NAMES_FILE, read_json
from .usage import relative_path_hint
from .weight_files import open_weights


_EARLIER = peft_names.EARLIER  # (defined there: peft_names gives the same advice, and cannot import this module)


def full_masters(state_dir: str, expected_save_id: str | None = None) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master by name (all aliases), from all rank files. ``expected_save_id``:
    the save the checkpoint's marker records (``resume.recorded_save_id``); a state of another save is refused."""
    if not glob.glob(os.path.join(glob.escape(state_dir), "rank*_of_*.hzo")):
        raise FileNotFoundError(f"no optimizer state files (rank*_of_*.hzo) in {state_dir}")
    names_path = os.path.join(state_dir, NAMES_FILE)
    if not os.path.isfile(names_path):
        raise FileNotFoundError(f"{names_path} is missing: without it the masters cannot be matched to parameter "
                                "names (the checkpoint is incomplete: use another checkpoint-N of the run)")
    names = read_json(names_path)
    # a list per engine slot of that parameter's names; anything else would match masters to no tensor (or to
    # single letters of a name) and leave the 16-bit weights in place, silently
    if not (isinstance(names, list) and all(isinstance(a, list) and a and all(isinstance(n, str) for n in a)
                                            for a in names)):
        raise ValueError(f"{names_path} is damaged: expected a list of lists of parameter names (one list per "
                         "optimizer slot); use another checkpoint-N of the run")
    # a name in two slots: the later slot's master was written under it and the earlier one's dropped, so one weight
    # took another param's master (of the same shape) and the param it belongs to kept its 16-bit value, silently
    slot_of: dict[str, int] = {}
    for i, aliases in enumerate(names):
        for name in aliases:
            if slot_of.setdefault(name, i) != i:
                raise ValueError(f"{names_path} is damaged: {name} names optimizer slots {slot_of[name]} and {i} "
                                 "(each parameter has one slot); use another checkpoint-N of the run")
    # the engine's own reader: the partition map checked, each file's range checked against it
    srcs, meta = sources(state_dir)  # (every header checked: checkpoint.folder.check_header)
    check_save_id(meta, expected_save_id, state_dir)
    check_sources(srcs, meta.get("state_dtype", "fp32"), 0, meta["numel"])  # the bytes are there, before allocating
    flat = torch.empty(meta["numel"])
    read_range(srcs, 0, {"master": flat})
    slots = [s for g in meta["slots"] for s in g]
    if len(slots) != len(names):
        raise ValueError(f"{state_dir}: {len(slots)} parameters in the state but {len(names)} names")
    out = {}
    for (offset, numel, shape), aliases in zip(slots, names):
        t = flat[offset:offset + numel].view(shape)
        for name in aliases:
            out[name] = t
    return out


def _checkpoints_in(run_dir: str) -> list[str]:
    found = [d for d in os.listdir(run_dir) if d.startswith("checkpoint-") and d[11:].isdigit()
             and os.path.isdir(os.path.join(run_dir, d))]
    return sorted(found, key=lambda d: int(d[11:]))


def state_dir_of(checkpoint_dir: str) -> str:
    """``CHECKPOINT/zero_offload``, or an error that says what ``checkpoint_dir`` is instead."""
    if os.path.exists(checkpoint_dir) and not os.path.isdir(checkpoint_dir):
        raise NotADirectoryError(f"{checkpoint_dir} is a file, not a checkpoint folder: give the checkpoint-N "
                                 "folder that holds zero_offload/")
    if not os.path.isdir(checkpoint_dir):
        # `output/checkpoint-500` typed from another directory named no directory at all
        raise FileNotFoundError(f"{checkpoint_dir}: no such checkpoint folder{relative_path_hint(checkpoint_dir)}")
    state_dir = os.path.join(checkpoint_dir, "zero_offload")
    if os.path.isdir(state_dir):
        return state_dir
    inside = _checkpoints_in(checkpoint_dir)
    if inside:
        raise FileNotFoundError(f"{checkpoint_dir} is a run folder, not a checkpoint: pass one of the checkpoint "
                                f"folders inside it ({', '.join(inside)}), e.g. "
                                f"{os.path.join(checkpoint_dir, inside[-1])}")
    marker = read_marker(checkpoint_dir)
    if marker is not None and "engine" in marker and marker["engine"] is None:  # our save, without the state
        raise FileNotFoundError(f"{checkpoint_dir}: no zero_offload/ optimizer state here: this checkpoint was saved "
                                "without one (--save_only_model), so it holds no fp32 masters to consolidate; its "
                                "model weights are the folder itself (from_pretrained loads them)")
    raise FileNotFoundError(f"{checkpoint_dir}: no zero_offload/ optimizer state here (consolidate reads a "
                            "checkpoint-N folder of a run trained with --zero_offload or --sharded_ddp)")


def _check_output(output_dir: str, written: list[str]) -> None:
    """An existing output folder is written over file by file (a previous consolidate's output is replaced), so it
    must hold nothing that would be read with the new files as one model: weight files of another layout (a
    sharded output's shards and index beside a single new file, or the reverse), a completion marker, or a
    training checkpoint's own state."""
    if not os.path.isdir(output_dir):
        return
    present = set(os.listdir(output_dir))
    if "zero_offload" in present or "trainer_state.json" in present:
        raise ValueError(f"output {output_dir} is a training checkpoint (it holds "
                         f"{'zero_offload/' if 'zero_offload' in present else 'trainer_state.json'}): its weights "
                         "would be replaced; give another folder")
    stale = sorted(n for n in present if n not in written
                   and (n.endswith((".safetensors", ".safetensors.index.json", ".bin")) or n == MARKER))
    if stale:
        raise ValueError(f"output {output_dir} holds {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''}, which "
                         "this checkpoint does not write: from_pretrained would read them with the new weights; "
                         "remove them or give an empty folder")


def _model_side_file(name: str) -> bool:
    """A file of the checkpoint's folder that consolidate copies beside the weights: the model's JSON and
    tokenizer files, not the checkpoint's own (trainer state, optimizer, marker)."""
    return (name.endswith((".json", ".model")) and not name.startswith(("trainer_state", "optimizer"))
            and name != MARKER)


def _read_here(rel: str) -> bool:
    """What consolidate reads, by path in the checkpoint: its optimizer state, the weights, the side files (a PEFT
    adapter's in its subfolder too)."""
    if rel.count("/") == 1 and not rel.startswith("zero_offload/"):  # peft's files of an adapter not named default
        return rel.split("/")[1].startswith("adapter_")
    return rel.startswith("zero_offload/") or ("/" not in rel and (rel.endswith(".safetensors")
                                                                   or _model_side_file(rel)))


#: the Trainer's own files of a checkpoint, which ``--with-optimizer`` copies beside ``optimizer.pt`` (rng_state.pth
#: of one process, rng_state_{rank}.pth of several; scaler.pt of a plain run's GradScaler: never ours)
TRAINER_FILES = ("trainer_state.json", "scheduler.pt", "training_args.bin", "rng_state.pth")


def _trainer_file(name: str) -> bool:
    return name in TRAINER_FILES or (name.startswith("rng_state_") and name.endswith(".pth"))


def _block_schedule(checkpoint_dir: str) -> dict | None:
    """The checkpoint's scheduler.pt in the form torch's LambdaLR (every Trainer schedule) loads, when it is the
    position of a ds_config scheduler block (``schedulers._SavesPosition``: no ``lr_lambdas``, which LambdaLR pops,
    so the plain Trainer's resume failed with KeyError: 'lr_lambdas'); None when it is already the Trainer's."""
    path = os.path.join(checkpoint_dir, "scheduler.pt")
    if not os.path.isfile(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # (pickle and zip errors have no common base)
        raise ValueError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or "lr_lambdas" in state or not isinstance(state.get("base_lrs"), list):
        return None
    return {**state, "lr_lambdas": [None] * len(state["base_lrs"])}  # (no lambda state to restore: None, as torch's)


def _check_whole(checkpoint_dir: str, with_optimizer: bool) -> None:
    """The checkpoint as its save finished it, judged on the files consolidate reads, every one of them there (an
    output without the config, or a --with-optimizer output without trainer_state.json, was written and said to be
    resumable). With its marker damaged nothing proves it whole."""
    found = load_marker(checkpoint_dir)  # (read once: both checks judge one marker)
    problem = marker_problem(checkpoint_dir, found)
    if problem is not None:
        raise ValueError(f"{checkpoint_dir} is damaged ({problem}, nothing else proves it whole); {_EARLIER}")
    reads = lambda rel: _read_here(rel) or (with_optimizer and _trainer_file(rel))  # noqa: E731
    changed = changed_files(checkpoint_dir, read=reads, required=lambda rel: reads(rel) and rel != "training_args.bin",
                            marker_read=found)
    if changed:
        raise ValueError(f"{checkpoint_dir} is damaged: {'; '.join(changed)} (it no longer holds what its save "
                         f"wrote); {_EARLIER}")


def consolidate(checkpoint_dir: str, output_dir: str, with_optimizer: bool = False) -> list[str]:
    """Everything is read and checked before the first write; each file is written atomically. ``with_optimizer``:
    also torch AdamW's state (``optimizer.pt``, ``torch_state``) and the Trainer's own files, so that the output
    is a checkpoint the plain Trainer resumes."""
    state_dir = state_dir_of(checkpoint_dir)  # first: a run folder given (`consolidate . out`) is named as one
    out_real, ckpt_real = os.path.realpath(output_dir), os.path.realpath(checkpoint_dir)
    if out_real == ckpt_real:
        raise ValueError(f"output {output_dir} is the checkpoint itself: its weights would be replaced; "
                         "give another folder")
    if out_real.startswith(ckpt_real.rstrip(os.sep) + os.sep):  # (its zero_offload/ took model files beside the state)
        raise ValueError(f"output {output_dir} is inside the checkpoint {checkpoint_dir}: its files would mix with the "
                         "checkpoint's, and the Trainer's checkpoint rotation (save_total_limit) deletes them with it; "
                         "give a folder outside it")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise NotADirectoryError(f"output {output_dir} is a file, not a folder: give a folder (it is created "
                                 "when missing)")
    # a truncated weight file failed in safetensors' header parser; only the files consolidate reads count (the
    # optimizer state, the weights, the model's JSON and tokenizer files): a trainer state or RNG file of another
    # step changes nothing here
    _check_whole(checkpoint_dir, with_optimizer)
    if read_marker(checkpoint_dir) is None and any(_trainer_file(n) for n in os.listdir(checkpoint_dir)) \
            and resume.status(checkpoint_dir) == "incomplete":
        # a Trainer's save cut short (unmarked, as a resume tells): into a checkpoint-N written before, the weights of
        # one run beside the state of another. (Without the Trainer's files: a folder saved by hand.)
        raise ValueError(f"{checkpoint_dir} is incomplete (no {MARKER}: its save may have stopped before finishing "
                         f"it, e.g. killed during the save); {_EARLIER}")
    masters = full_masters(state_dir, recorded_save_id(checkpoint_dir))
    source, adapter = checkpoint_dir, peft_names.adapter_folders(checkpoint_dir)
    if adapter:  # the trained adapter's folder (a subfolder for one not named "default"), peft's tensor names
        source, masters = peft_names.adapter_source(checkpoint_dir, adapter, masters)
    weight_files = sorted(glob.glob(os.path.join(glob.escape(source), "*.safetensors")))
    if not weight_files:
        raise FileNotFoundError(f"no *.safetensors model weights in {source}")
    used = set()  # the masters (by tensor: tied aliases share one) that replace some tensor of the weight files
    for path in weight_files:  # a master must replace a tensor of its own shape (another model's file?)
        with open_weights(path, _EARLIER) as f:
            for key in f.keys():
                if key in masters:
                    used.add(id(masters[key]))
                shape = list(f.get_slice(key).get_shape())
                if key in masters and list(masters[key].shape) != shape:
                    raise ValueError(f"{path}: {key} has shape {shape} but its master in the optimizer state has "
                                     f"{list(masters[key].shape)}: the weights and the state are of different models")
    unused = sorted(k for k, t in masters.items() if id(t) not in used)
    if unused:  # its weights would be written as the checkpoint's 16-bit copy while claiming to be the masters
        raise ValueError(f"{checkpoint_dir}: the optimizer state has masters for {', '.join(unused[:5])}"
                         f"{' ...' if len(unused) > 5 else ''} but no weight file holds a tensor of that name: " + (
                             "a PEFT adapter checkpoint holds its adapter's weights only (a base param trained "
                             "beside the adapter is not saved at all), so its masters cannot be written here"
                             if adapter else
                             "the weights and the state (or zero_offload/param_names.json) are of different models"))
    # the side files are read (and their JSON checked) before the first write too: a damaged config.json must not
    # leave an output folder with weights and no config
    extras = []
    for extra in sorted(glob.glob(os.path.join(glob.escape(source), "*.json"))
                        + glob.glob(os.path.join(glob.escape(source), "*.model"))):
        name = os.path.basename(extra)
        if not _model_side_file(name):  # the checkpoint's, not the model's
            continue
        content = None
        if name == "config.json" or name.endswith(".index.json"):
            content = read_json(extra)
            if not isinstance(content, dict):
                raise ValueError(f"{extra} is damaged: expected a JSON object, got {type(content).__name__}")
        extras.append((extra, name, content))
    optimizer, trainer_files, schedule = None, [], None
    if with_optimizer:  # read (and decoded) before the first write, as the rest
        if os.path.isdir(output_dir) and os.listdir(output_dir):
            raise ValueError(f"output {output_dir} is not empty: --with-optimizer writes a checkpoint the plain "
                             "Trainer resumes, which must hold nothing else; give an empty or new folder")
        optimizer = torch_state.torch_optimizer_state(state_dir, recorded_save_id(checkpoint_dir))
        trainer_files = sorted(n for n in os.listdir(checkpoint_dir)
                               if _trainer_file(n) and os.path.isfile(os.path.join(checkpoint_dir, n)))
        schedule = _block_schedule(checkpoint_dir)
    _check_output(output_dir, [os.path.basename(p) for p in weight_files] + [name for _, name, _ in extras])
    # Written as one set (checkpoint.atomic_files), so that a stop part way (Ctrl-C, a full disk, a kill) leaves the
    # output whole or absent: config.json is staged last, so it appears last (from_pretrained needs it). Written
    # and renamed file by file, a stop after the weights left fp32 weights without a config, or a previous output
    # with half its files replaced.
    created = not os.path.isdir(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    written = [os.path.join(output_dir, os.path.basename(path)) for path in weight_files]
    try:
        with checkpoint.atomic_files(output_dir) as stage:
            weights = []
            for path, dst in zip(weight_files, written):
                tensors, taken = {}, set()
                with open_weights(path, _EARLIER) as f:
                    metadata = f.metadata()
                    for key in f.keys():
                        t = masters.get(key)
                        if t is not None and id(t) in taken:  # a tied weight the file holds under two names: two
                            t = t.clone()                       # copies, as it had (safetensors refuses shared memory)
                        elif t is not None:
                            taken.add(id(t))
                        t = t if t is not None else f.get_tensor(key)  # an int buffer (num_batches_tracked) stays
                        tensors[key] = (t.float() if t.is_floating_point() else t).contiguous()
                weights.append(stage(dst))
                save_file(tensors, weights[-1], metadata=metadata or {"format": "pt"})
                # safetensors >= 0.8 creates it 0600 whatever the umask: the team sharing the run could not read it
                with contextlib.suppress(PermissionError):  # (a file system that keeps its own modes)
                    os.chmod(weights[-1], 0o666 & ~_umask())
            if optimizer is not None:
                torch.save(optimizer, stage(os.path.join(output_dir, "optimizer.pt")))
            for name in trainer_files:
                if name == "scheduler.pt" and schedule is not None:
                    torch.save(schedule, stage(os.path.join(output_dir, name)))
                else:
                    shutil.copyfile(os.path.join(checkpoint_dir, name), stage(os.path.join(output_dir, name)))
            for extra, name, content in sorted(extras, key=lambda e: e[1] == "config.json"):
                if name == "config.json":
                    content["dtype"] = content["torch_dtype"] = "float32"
                elif name.endswith(".index.json"):
                    if not isinstance(content.get("metadata"), dict):
                        content["metadata"] = {}
                    content["metadata"]["total_size"] = sum(os.path.getsize(w) for w in weights)
                dst = stage(os.path.join(output_dir, name))
                if content is None:
                    shutil.copyfile(extra, dst)
                else:
                    with open(dst, "w") as f:
                        json.dump(content, f, indent=2)
    except BaseException:
        if created and not os.listdir(output_dir):
            os.rmdir(output_dir)  # absent, as before
        raise
    return written


def consolidate_main(args) -> int:
    with_optimizer = getattr(args, "with_optimizer", False)
    written = consolidate(args.checkpoint_dir, args.output_dir, with_optimizer)
    print(f"wrote fp32 weights: {', '.join(written)}")
    folders = peft_names.adapter_folders(args.checkpoint_dir)
    if len(folders) > 1:  # the one trained is written; the others were left out without a word (an outside probe)
        kept = {os.path.normpath(os.path.dirname(w)) for w in written}
        others = sorted(f"{n} ({f})" for n, f in folders.items() if os.path.normpath(os.path.join(
            args.output_dir, os.path.relpath(f, args.checkpoint_dir))) not in kept)
        if others:
            print(f"left out: the checkpoint's other adapter(s) {', '.join(others)}, which this run did not train "
                  "(their saved weights are theirs as they are: copy the folder if you need them)")
    if with_optimizer:
        print(f"wrote torch.optim.AdamW's state: {os.path.join(args.output_dir, 'optimizer.pt')}, with the "
              "checkpoint's trainer state, scheduler and RNG files: resume it with the plain Trainer "
              f"(--resume_from_checkpoint {shlex.quote(args.output_dir)}, an AdamW --optim, the same param groups and "
              "--weight_decay), or load optimizer.pt into torch.optim.AdamW")
        if _block_schedule(args.checkpoint_dir) is not None:
            print("scheduler.pt holds where the ds_config's scheduler block was, as the plain Trainer's schedules "
                  "save it: the plain Trainer goes on from that step with its own --lr_scheduler_type, not the "
                  "block's shape (give the type and --warmup_steps that match it)")
    return 0


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (consolidate is a library call too)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            return next(int(ln.split()[1], 8) for ln in f if ln.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)  # set and restored at once
        os.umask(mask)
        return mask
