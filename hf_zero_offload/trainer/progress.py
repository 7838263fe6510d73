"""Where each rank of a Trainer run is, in the store its process group shares (the saves' agreement, saving.py, and
the naming of a peer's failure, peer_failure.py, both read it)."""
from __future__ import annotations

from ..dist_store import GroupStore
from .shared_dir import distributed

# Where each rank is, in the store every rank shares: "<g>:<n>:saving" or "<g>:<n>:passed", n counting the Trainer's
# log/evaluate/save points in this rank's g-th train() (the same on every rank: one after each step and each epoch;
# each train() starts again from 0, so a retry after an interrupt that caught the ranks at different points lines up
# again). The counts go on from this rank's own key when this module is (re)loaded: a module-level count, which
# %autoreload set back to 0 while the peers' keys held the old counts, had a save read them as gone on. The key is
# of this torchrun attempt (GroupStore): a restarted attempt counts from 0 on every rank, as a new launch does.
PROGRESS_KEY = "progress/rank{}"
_COUNT: dict = {}  # store key -> [g, n] of this rank, read from the store once per import


def parse_progress(seen: str) -> tuple[tuple[int, int], str]:
    g, n, state = seen.split(":")
    return (int(g), int(n)), state


def shared_store(world_size: int) -> GroupStore | None:
    """The store the ranks' process group shares, with several ranks (None: one process, or no store to be had)."""
    return GroupStore.of_default_group() if distributed(world_size) else None


def progress_count(store: GroupStore | None, rank: int) -> list | None:
    """[g, n] of ``rank`` (this process): its train() generation and its point in it (None: no ``store``). A store
    that does not answer raises (dist_store.StoreSilent)."""
    if store is None:
        return None
    name = PROGRESS_KEY.format(rank)
    key = store.key(name)
    if key not in _COUNT:
        seen = store.get(name)
        _COUNT[key] = list(parse_progress(seen)[0]) if seen is not None else [0, 0]
    return _COUNT[key]
