"""A rank that leaves the sharded engine's lockstep alone says so; a peer whose collective then fails names it.

The ranks of a ``ShardedAdam`` run the same collectives in the same order. A rank that stopped doing so alone (its
engine closed or replaced there only, a step or save that raised there only, a ``save_checkpoint()`` called there
only) left its peers in their next collective with gloo's words alone ("Connection closed by peer ... GLHF!", once
its process ended) or, while its process lived on, until the process group's timeout (30 minutes by default) with no
rank named (2 gloo ranks, tests/test_one_rank_engine.py). Now such a rank writes one line to the store the process
group shares (``say``: at close, replacement, a failed build, an error out of a collective method, and at the start
of a save/load, taken back at its end), and a rank whose collective fails reads its peers' lines and raises one error
naming the rank and what it did, chained to gloo's (``named``). Nothing per step: the lines are written when a rank
leaves the lockstep, and read only once a collective has failed.

Keys carry the engine's number on its group (each process counts the engines it builds there, so ranks that build
the same engines agree on it): a line about an engine closed on every rank is not read by the next one's failure.
A process's lines about earlier engines are deleted once every rank has agreed on a new build (``forget_older``):
the store holds no line per engine of a long run.
Only for the default process group (a subgroup's ranks are not the store's); with a ``file://`` store nothing is
written (its file would grow a line per write). The store's reads and deletes are bounded, and its keys scoped by
torchrun's attempt, by their owner, ``dist_store.GroupStore`` (the Trainer integration's lines go through it too).
"""
from __future__ import annotations

import contextlib
import socket

import torch
import torch.distributed as dist

from ...dist_store import GroupStore

# what gloo and NCCL say when a peer is gone or never came (torch raises some of them as a plain RuntimeError)
COLLECTIVE_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting",
                    "timeout caused pair closure", "gloo/transport", "NCCL", "ProcessGroup")
# what they say when this rank's own wait ran out (the peer may be alive): gloo's, NCCL's watchdog's
TIMEOUT_WORDS = ("Timed out waiting", "collective operation timeout")
# engine number on the default group, rank (scoped by torchrun's attempt: dist_store.GroupStore)
_KEY = "engine/{}/rank{}"
_ITS_OWN = ("raised in ", "was interrupted", "failed to build")  # a peer's line of its own error, not of its calls
_BUILT = [0]  # ShardedAdam engines this process began to build on the default group with several ranks


def collective_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective's failure (a peer gone or late), as opposed to a failure of this rank's own."""
    return isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and any(w in str(e) for w in
                                                                                   COLLECTIVE_WORDS))


def said(e: BaseException, cap: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:cap]}" if text else type(e).__name__


class PeerNotes:
    """One engine's lines in the store: what this rank did alone, and its peers' lines when a collective fails."""

    def __init__(self, process_group, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        # (reads and deletes bounded, keys scoped by torchrun's attempt: the store's owner, dist_store.py)
        self.store = GroupStore.of_default_group(process_group) if world_size > 1 else None
        if self.store is not None:
            _BUILT[0] += 1
        self.number = _BUILT[0]
        self._host = socket.gethostname()

    def key(self, rank: int) -> str:
        """The store key of rank ``rank``'s line about this engine."""
        return self.store.key(_KEY.format(self.number, rank))

    def say(self, text: str) -> None:
        """This rank's line: ``text`` says what it did ("closed its ShardedAdam after step 2")."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # (the store gone with its host: the error in flight is the one)
                self.store.set(_KEY.format(self.number, self.rank), f"{self._host}\n{text}",
                               tag=("engine", self.number))

    def unsay(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):  # (not answering: kept in the store's list, forget_older tries again)
                self.store.delete(_KEY.format(self.number, self.rank))

    def forget_older(self) -> None:
        """This process's lines about earlier engines, deleted: called once every rank has agreed on this engine's
        build, so no rank is in a collective of theirs (a close's line was left in the store for good, one per
        engine and rank of a long run)."""
        if self.store is not None:
            with contextlib.suppress(Exception):  # (not answering: the next build does not try them again)
                self.store.forget("engine", below=self.number)

    def named(self, e: BaseException, doing: str, mine: str | None = None) -> BaseException | None:
        """The error to raise in place of collective failure ``e`` met in ``doing``, naming the peers that said what
        they did (None: not a collective failure, or no peer said anything). ``mine``: the line this rank said on
        entering ``doing``; a peer that said the same is in the same call, not out of step (it was killed, or is
        stuck in it), and is named so, not blamed for the order of calls."""
        if self.store is None or not collective_failure(e) or getattr(e, "_hzo_named", False):
            return None
        names = {r: _KEY.format(self.number, r) for r in range(self.world_size) if r != self.rank}
        try:
            said_by = self.store.read(names.values())
        except Exception:  # noqa: BLE001 - the store gone with its host, or not answering: gloo's words are all
            return None
        lines, same = [], []
        for r, name in names.items():
            if name not in said_by:
                continue
            host, _, text = said_by[name].partition("\n")
            if mine is not None and text == mine:
                same.append(f"rank {r} (host {host})")
            else:
                lines.append((f"rank {r} (host {host}) {text}", text.startswith(_ITS_OWN)))
        timeout = any(w in str(e) for w in TIMEOUT_WORDS)
        if lines:
            waited = "until the collective timeout" if timeout else "until it was gone"
            advice = ("see that rank's error" if all(own for _, own in lines) else "every rank must make the same "
                      "ShardedAdam calls (build, step, close, save_checkpoint, load_checkpoint, flush) in the same "
                      "order")
            text = f"{'; '.join(t for t, _ in lines)}; this rank (rank {self.rank}) waited for it in {doing} {waited}: " \
                   f"{advice}"
        elif same:
            ended = ("did not get on (stuck, e.g. in a file write?) until this rank's collective timeout" if timeout
                     else "ended without a word (its process killed: out of memory, a signal?)")
            text = (f"{' and '.join(same)} {'was' if len(same) == 1 else 'were'} in {doing} too, as this rank (rank "
                    f"{self.rank}) was, and {'' if len(same) == 1 else 'one of them '}{ended}: see that rank's log")
        else:
            return None
        out = RuntimeError(f"{text} ({said(e, 200)})")
        out._hzo_named = True
        return out

    @contextlib.contextmanager
    def call(self, doing: str, entering: str | None = None):
        """``doing`` (a collective method) runs in this block: a collective failure in it is raised naming the peers'
        lines, and an error of this rank's own is said to them. ``entering``: a line said while it runs (a save, a
        load: a peer that never makes the call then learns this one was in it), taken back when it returns."""
        if entering is not None:
            self.say(entering)
        try:
            yield
        except Exception as e:
            named = self.named(e, doing, entering)
            if named is None and entering is not None and self.store is not None and collective_failure(e):
                named = RuntimeError(f"this rank (rank {self.rank}) was in {doing} and the other ranks did not come to "
                                     f"it (none said why): every rank must call {doing} ({said(e, 200)})")
            if named is not None:
                raise named from e
            if not collective_failure(e):
                self.say(f"raised in {doing}: {said(e)}")
            raise
        except BaseException as e:  # Ctrl-C (KeyboardInterrupt), SystemExit: the peers wait for this rank too
            self.say(f"was interrupted ({type(e).__name__}) in {doing}")
            raise
        if entering is not None:
            self.unsay()


class SaidToPeers:
    """Mixed into ``ShardedAdam`` (before ``AdamCore``): its collective methods run in ``PeerNotes.call``, and its end
    (``close()``, a replacement) is said, so that a peer still in the lockstep learns of it (``_peers``)."""
    _peers: PeerNotes | None = None

    @torch._disable_dynamo  # (as AdamCore.step: never traced)
    def step(self, closure=None):
        with self._said("step()"):
            return super().step(closure)

    def save_checkpoint(self, directory: str) -> str:
        with self._said("save_checkpoint()", f"was in save_checkpoint() (after its step {self.global_steps})"):
            return super().save_checkpoint(directory)

    def load_checkpoint(self, directory: str, *args, **kwargs) -> dict:
        with self._said("load_checkpoint()", f"was in load_checkpoint() (after its step {self.global_steps})"):
            return super().load_checkpoint(directory, *args, **kwargs)

    def load_state_dict(self, state: dict) -> None:
        with self._said("load_state_dict()", f"was in load_state_dict() (after its step {self.global_steps})"):
            return super().load_state_dict(state)

    def _said(self, doing: str, entering: str | None = None):
        # one process, no store, or an ended engine (its refusal: its end was said): nothing to say or to read
        if self._peers is None or self._peers.store is None or self._done_why is not None:
            return contextlib.nullcontext()
        return self._peers.call(doing, entering)

    def _end(self, why: str, *, drain: bool) -> None:
        if self._peers is not None and self._done_why is None:
            if why == "closed":
                self._peers.say(f"closed its ShardedAdam (close()) after its step {self.global_steps}")
            elif why.startswith("replaced"):
                self._said_replaced("replaced it by")
        super()._end(why, drain=drain)

    def _said_replaced(self, verb: str) -> None:
        if self._peers is not None and self._done_why is None:
            self._peers.say(f"{verb} a new engine on the parameters of its ShardedAdam after its step "
                            f"{self.global_steps} (another Trainer or ShardedAdam built on that rank alone?)")
