"""One ``output_dir`` for the whole job: a checkpoint is one directory holding every rank's optimizer shard, so on
several nodes it must be a file system they all share. Two checks that say so when it is not, instead of training
on: at a resume, every rank chose the same checkpoint; at a save, the checkpoint holds every rank's state file
before its marker declares it complete, and a rank whose part of the save failed tells the others.

An outside probe (two nodes, each with its own local ``output_dir``): the ranks resumed different checkpoints (one
rank at step 4, the other at step 2, or two runs' checkpoint-4) and trained on in lockstep, 5.4e-3 from the right
resume; and each save marked complete a checkpoint holding rank 0's shard alone (the other rank's in the other
node's folder), which every later resume refused naming a "missing" file. The agreements are collectives: every
rank calls them at the same point, and all raise alike (the save's file check is local, said through the save's).
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

from .. import resume
from ..engine.checkpoint import rank_file

_NOT_SHARED = ("output_dir must be one directory that every node sees (a shared file system): a checkpoint holds "
               "every rank's optimizer shard")


def distributed(world_size: int) -> bool:
    """Several ranks in a process group (the Trainer's collectives and the store are there to be had)."""
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def ranks_named(ranks: list[int]) -> str:
    """"rank 1" or "ranks 0, 2", for the messages that name the ranks that differed or failed."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _gather(mine, world_size: int) -> list:
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return every


def agreed_target(target, output_dir: str, world_size: int):
    """``resume.target`` on every rank, then the same outcome on all: one rank's refusal is every rank's (the others
    waited in the next collective, then died on a closed connection), and ranks that chose different checkpoints
    (node-local output_dirs) are refused, naming each rank's choice. Called on every rank of several, ``target``
    None where none was given (``None, None, []`` back): a resume given on some ranks only (a script reading it from
    a per-node file) paired this gather with the peers' next one, and each rank failed unpacking the other's
    ("ValueError: not enough values to unpack (expected 5, got 2)"), or would have resumed alone."""
    if not distributed(world_size):
        return resume.target(target, output_dir)
    try:
        chosen, error = (resume.target(target, output_dir) if target is not None else None), None
    except Exception as e:  # (any: a rank that skipped the gather below left the others waiting in it)
        chosen, error = None, e
    path = chosen[0] if chosen else None
    mine = (socket.gethostname(), None if error is None else f"{type(error).__name__}: {error}",
            path and os.path.abspath(path), path and resume.recorded_step(path),
            path and (resume.recorded_save_id(path) or _written(path)))
    every = _gather(("resume_from_checkpoint", target is not None, *mine), world_size)
    if len({given for _, given, *_ in every}) > 1:
        given = [r for r, (_, g, *_) in enumerate(every) if g]
        not_given = [r for r, (_, g, *_) in enumerate(every) if not g]
        raise ValueError(f"resume_from_checkpoint was given on rank(s) {', '.join(map(str, given))} and not on rank(s) "
                         f"{', '.join(map(str, not_given))}: every rank must resume from the same checkpoint, or none "
                         "(the same train() call on every rank)")
    every = [rest for _, _, *rest in every]
    if target is None:
        return None, None, []
    failed = [(r, host, why) for r, (host, why, *_) in enumerate(every) if why is not None]
    if failed:
        if error is not None:
            raise error
        r, host, why = failed[0]
        raise ValueError(f"resume_from_checkpoint: rank {r} (host {host}) refused it: {why}")
    # one save: its id, the same wherever its files are read from (or, without one, its trainer_state.json's size and
    # time: node-local folders at one absolute path hold different files, a symlinked one the same)
    if len({(step, save) for *_, step, save in every}) > 1:
        seen = "; ".join(f"rank {r} (host {host}): {p} (step {step})" for r, (host, _, p, step, _) in enumerate(every))
        raise ValueError(f"resume_from_checkpoint: the ranks chose different checkpoints ({seen}), each from its "
                         f"own node's output_dir: {_NOT_SHARED}; put output_dir on a shared file system (or pass every "
                         "rank the same checkpoint there)")
    return chosen


def _first_said(mine: str | None, world_size: int) -> tuple[int, str, str] | None:
    """Every rank's ``mine`` (a problem in words, or None), gathered: (rank, host, words) of the first rank that said
    one, the same on every rank; None when none did."""
    every = _gather((socket.gethostname(), mine), world_size)
    return next(((r, host, why) for r, (host, why) in enumerate(every) if why is not None), None)


def first_problem(problem: str | None, world_size: int) -> str | None:
    """A check each rank made of its own output_dir: the first rank's problem, on every rank (node-local folders can
    differ: a rank that raised alone left the others waiting in the run lock's broadcast)."""
    if not distributed(world_size):
        return problem
    said = _first_said(problem, world_size)
    return None if said is None else said[2] if said[0] == 0 else f"rank {said[0]} (host {said[1]}): {said[2]}"


def failed_elsewhere(failed: BaseException | None, world_size: int) -> str | None:
    """After each rank's part of a save (in place of a barrier): the first rank's failure, in words, or None."""
    said = _first_said(None if failed is None else str(failed), world_size)
    return None if said is None else f"rank {said[0]} (host {said[1]}): {said[2]}"


def _written(checkpoint: str) -> str:
    """A save without an id (a plain Trainer's, --save_only_model): its trainer_state.json's size and time."""
    try:
        st = os.stat(os.path.join(checkpoint, resume.TRAINER_STATE))
    except OSError:
        return "-"
    return f"{st.st_size}:{st.st_mtime_ns}"


def missing_rank_files(checkpoint: str, state_dir: str, world_size: int, each_node: bool = False) -> str | None:
    """The rank files this process's copy of ``checkpoint`` lacks, in words (None: none). No collective: the engine's
    save returns once every rank's file is written, and the caller's agreement on the save's outcome says it to all."""
    folder = os.path.join(checkpoint, state_dir)
    if not os.path.isdir(folder):  # (no state_dir: --save_only_model)
        return None
    missing = [os.path.basename(rank_file(folder, r, world_size)) for r in range(world_size)
               if not os.path.isfile(rank_file(folder, r, world_size))]
    if not missing:
        return None
    each = (" --save_on_each_node makes each node save a copy of its own, holding its own ranks' shards: drop it."
            if each_node else "")
    return (f"{os.path.abspath(checkpoint)} on host {socket.gethostname()} lacks {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''}, which the other ranks wrote into their own node's output_dir: "
            f"{_NOT_SHARED}.{each} It is not marked complete")
