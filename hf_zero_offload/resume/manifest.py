"""What a checkpoint held when its save finished: every file's size, and the SHA-256 of each small one, recorded in
its completion marker (``marker.write_marker``) and compared before a resume loads anything.

The marker proved a save finished, but not that the folder still held what it wrote. Found by an outside probe:
- a checkpoint mixing files of two saves was resumed without a word: ``trainer_state.json`` of step 6 in
  checkpoint-3 ran 3 steps with the optimizer and schedule of step 3; ``scheduler.pt`` of step 6 ran the schedule
  3 steps ahead; ``rng_state.pth`` of step 6 gave another dropout and data order;
- a deleted ``rng_state.pth`` resumed "complete" (transformers only logs "Didn't find an RNG file" at INFO), and
  the run then differed from the uninterrupted one (loss 4.000 instead of 3.933 at the next step);
- a truncated ``model.safetensors``, ``rng_state.pth``, tokenizer or ``config.json`` failed inside the loader that
  read it (a safetensors header error, "[Errno 22] Invalid argument" after the model and optimizer state were
  loaded, a JSON error naming no file), and a truncated or deleted optimizer shard named no earlier checkpoint.

Large files (model weights, optimizer shards) are recorded by size only: hashing gigabytes at every save and resume
would cost seconds, and the shards carry their own CRC-32. Files a resume does without by design may be missing
(``scheduler.pt``: the schedule restarts, with a warning; the tokenizer: the example trains it again; files transformers
only writes for reference); those a resume needs may not (``REQUIRED``). A file added since is not a problem.
"""
from __future__ import annotations

import hashlib
import os

HASHED_UP_TO = 16 << 20  # bytes: files this small get a SHA-256 (trainer state, scheduler, RNG, tokenizer, config)
# the files whose absence changes what a resume does, without an error of its own
# (trainer_state.json too: without it transformers' resume fails after the checkpoint was chosen, where a resume to the
# newest whole checkpoint should have passed over it, as over any other file missing)
REQUIRED = ("rng_state", "model.safetensors", "pytorch_model.bin", "adapter_model", "zero_offload/",
            "trainer_state.json", "optimizer.pt", "optimizer.bin")  # (optimizer.*: a run without zero_offload's; its
# deletion resumed with a fresh optimizer without a word, an outside probe)


def build(checkpoint: str, skip: tuple[str, ...] = ()) -> dict:
    """{relative path: {"size": bytes[, "sha256": hex]}} of every file under ``checkpoint`` except ``skip``."""
    out = {}
    for root, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, checkpoint).replace(os.sep, "/")
            if rel in skip or os.path.islink(path):
                continue
            size = os.path.getsize(path)
            out[rel] = {"size": size, **({"sha256": _sha256(path)} if size <= HASHED_UP_TO else {})}
    return out


# what transformers' resume never reads (it is written for reference): another run's copy there changes nothing
NOT_READ_BY_RESUME = ("training_args.bin",)


def problems(checkpoint: str, recorded, read=None, required=None) -> list[str]:
    """What differs from ``recorded`` (``build``'s dict; anything else, as in markers written before manifests:
    nothing to compare), one phrase per file. ``read(rel)``: whether the operation reads the file (default: all but
    ``NOT_READ_BY_RESUME``); a file it does not read cannot change what it does, and is not held against it.
    ``required(rel)``: whether the operation needs the file there (default: a resume's ``REQUIRED``); another file
    the save wrote may be missing."""
    if not isinstance(recorded, dict):
        return []
    read = read or (lambda rel: rel not in NOT_READ_BY_RESUME)
    required = required or (lambda rel: any(rel.startswith(r) for r in REQUIRED))
    found = []
    for rel, want in sorted(recorded.items()):
        if not read(rel):
            continue
        if entry_problem(want):  # (said as such, not as a file of "757" bytes where it has 757)
            found.append(f"its entry in the marker is damaged ({rel}: {want!r}, not {ENTRY})")
            continue
        path = os.path.join(checkpoint, *rel.split("/"))
        if not os.path.isfile(path):
            if required(rel):
                found.append(f"{rel} is missing")
            continue
        size = os.path.getsize(path)
        if size != want.get("size"):
            found.append(f"{rel} has {size} bytes where its save wrote {want.get('size')} (truncated or replaced)")
        elif "sha256" in want and _sha256(path) != want["sha256"]:
            found.append(f"{rel} is not the file its save wrote (damaged, or copied from another save)")
    return found


ENTRY = '{"size": bytes[, "sha256": hex digest]}'  # a "files" entry, as build writes it


def is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def entry_problem(want) -> bool:
    """Whether a "files" entry is not what ``build`` writes (a size, and a SHA-256 for a small file)."""
    return not (isinstance(want, dict) and is_count(want.get("size"))
                and isinstance(want.get("sha256", ""), str))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
