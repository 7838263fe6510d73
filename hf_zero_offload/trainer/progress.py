"""Where each rank of a Trainer run is, in the store its process group shares (the saves' agreement, saving.py, and
the naming of a peer's failure, peer_failure.py, both read it)."""
from __future__ import annotations

from ..engine.sharded.peers import default_store
from .shared_dir import distributed

# Where each rank is, in the store every rank shares: "<g>:<n>:saving" or "<g>:<n>:passed", n counting the Trainer's
# log/evaluate/save points in this rank's g-th train() (the same on every rank: one after each step and each epoch;
# each train() starts again from 0, so a retry after an interrupt that caught the ranks at different points lines up
# again). The counts go on from this rank's own key when this module is (re)loaded: a module-level count, which
# %autoreload set back to 0 while the peers' keys held the old counts, had a save read them as gone on.
PROGRESS_KEY = "hf_zero_offload/progress/rank{}"
_COUNT: dict = {}  # key -> [g, n] of this rank, read from the store once per import


def parse_progress(seen: str) -> tuple[tuple[int, int], str]:
    g, n, state = seen.split(":")
    return (int(g), int(n)), state


def shared_store(world_size: int):
    """The store the ranks' process group shares, with several ranks (None: one process, or no store to be had)."""
    return default_store() if distributed(world_size) else None


def progress_count(store, rank: int) -> list | None:
    """[g, n] of ``rank`` (this process): its train() generation and its point in it (None: no ``store``)."""
    if store is None:
        return None
    key = PROGRESS_KEY.format(rank)
    if key not in _COUNT:
        _COUNT[key] = list(parse_progress(store.get(key).decode())[0]) if store.check([key]) else [0, 0]
    return _COUNT[key]
