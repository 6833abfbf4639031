"""Which queued groups make the next batch: pure functions over (id, env_id, size).

These reproduce atroposlib 0.4.0's batch formation exactly (`api/utils.py`:
`grab_exact_from_heterogeneous_queue`, `grab_batch_with_minimum_allocations`,
`find_groups_summing_to_target`), so that a trainer gets the same batches from the
hub as from `run-api`. tests/test_atropos_upstream.py checks them against the
originals on random queues.

The rules, as atroposlib has them:

- Groups are never split. Let M be the largest group size in the queue. Groups of
  one size are taken in queue order M/size at a time ("packs" of M sequences); a
  size that does not divide M never packs. Packs are ordered by where their last
  group sits in the queue.
- A batch walks the packed groups in that order and stops at exactly batch_size
  sequences; overshooting, or running out first, means no batch.
- With minimum allocations (an env's share of each batch), packs are made per env;
  first each env with a minimum takes its packed groups until it has its share
  (scaled down when the shares add up to more than the batch), then packed groups
  of any env fill the rest first-fit in queue order. Groups of no env are never
  taken, and a minimum that cannot be met means no batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Item(NamedTuple):
    """A queued group, as batch formation sees it."""

    id: int
    env_id: int | None
    size: int


@dataclass(frozen=True, slots=True)
class EnvShare:
    """A registered env as minimum allocation sees it: `connected` is whether it
    counts (connected and heard from lately, app/atropos/presence.py)."""

    env_id: int
    connected: bool
    min_batch_allocation: float | None


def form_batches(
    queue: Sequence[Item], batch_size: int, envs: Sequence[EnvShare]
) -> list[list[Item]]:
    """Every batch that can be formed now, in the order formed: what atroposlib's
    GET /batch builds when it has no formed batch left (one formation after another
    until none succeeds)."""
    if batch_size < 1:
        return []
    # atroposlib switches to the minimum-allocation rule when any env has a minimum,
    # which itself falls back to the exact rule when no such env is connected.
    if any(env.connected and env.min_batch_allocation is not None for env in envs):
        return _repeat_with_minimums(list(queue), batch_size, envs)
    return _repeat_exact(list(queue), batch_size)


def take_exact(queue: Sequence[Item], batch_size: int) -> list[Item] | None:
    """One batch of exactly batch_size sequences from packed groups, or None."""
    if not queue or sum(item.size for item in queue) < batch_size:
        return None
    packs = _packs(queue, max(item.size for item in queue))
    return _walk([item for pack in packs for item in pack], batch_size)


def take_with_minimums(
    queue: Sequence[Item], batch_size: int, envs: Sequence[EnvShare]
) -> list[Item] | None:
    """One batch honouring each connected env's min_batch_allocation, or None."""
    if not queue:
        return None
    minimums = {
        env.env_id: env.min_batch_allocation
        for env in envs
        if env.connected and env.min_batch_allocation is not None
    }
    if not minimums:
        return take_exact(queue, batch_size)
    largest = max(item.size for item in queue)
    present: set[int] = set()
    by_env: dict[int, list[Item]] = {}
    for env_id, packs in _packs_per_env(queue, largest, present).items():
        by_env[env_id] = [item for pack in packs for item in pack]

    wanted: dict[int, int] = {}
    for env_id, share in minimums.items():
        need = int(batch_size * share)
        if need <= 0:
            continue
        if env_id not in present or not by_env.get(env_id):
            return None  # an env owed a share has nothing packed to give
        wanted[env_id] = need
    total_wanted = sum(wanted.values())
    if total_wanted > batch_size:
        scale = batch_size / total_wanted
        for env_id in wanted:
            smallest = min(item.size for item in by_env[env_id])
            wanted[env_id] = max(smallest, int(wanted[env_id] * scale))

    batch: list[Item] = []
    taken: set[int] = set()
    filled = 0
    for env_id, need in wanted.items():
        got = 0
        for item in by_env[env_id]:
            if got >= need:
                break
            if filled + item.size <= batch_size:
                batch.append(item)
                taken.add(item.id)
                got += item.size
                filled += item.size
    if filled < batch_size:
        packed = {item.id for items in by_env.values() for item in items}
        for item in queue:
            if item.id in taken or item.id not in packed:
                continue
            if filled + item.size <= batch_size:
                batch.append(item)
                filled += item.size
            if filled == batch_size:
                break
    return batch if filled == batch_size else None


def groups_summing_to(sizes: Sequence[int], target: int) -> list[int]:
    """Indices (ascending) of buffered groups whose sizes add up to target, or [].

    First-fit in arrival order; failing that, any subset (subset-sum), preferring
    the latest groups when walking back, as atroposlib's buffer does."""
    chosen: list[int] = []
    total = 0
    for index, size in enumerate(sizes):
        if total + size <= target:
            chosen.append(index)
            total += size
            if total == target:
                return chosen
    if not sizes:
        return []
    # reachable[i][t]: some subset of the first i groups sums to t.
    reachable = [[False] * (target + 1) for _ in range(len(sizes) + 1)]
    reachable[0][0] = True
    for i, size in enumerate(sizes, start=1):
        previous, row = reachable[i - 1], reachable[i]
        for t in range(target + 1):
            row[t] = previous[t] or (t >= size and previous[t - size])
    if not reachable[len(sizes)][target]:
        return []
    chosen = []
    remaining = target
    for i in range(len(sizes), 0, -1):
        size = sizes[i - 1]
        if remaining >= size and reachable[i - 1][remaining - size]:
            chosen.append(i - 1)
            remaining -= size
    return sorted(chosen)


# --- helpers ------------------------------------------------------------------------


def _packs(queue: Sequence[Item], largest: int) -> list[list[Item]]:
    """Groups of each size, M/size at a time in queue order, ordered by completion."""
    waiting: dict[int, list[Item]] = {}
    packs: list[list[Item]] = []
    for item in queue:
        bucket = waiting.setdefault(item.size, [])
        bucket.append(item)
        if len(bucket) * item.size == largest:
            packs.append(bucket)
            waiting[item.size] = []
    return packs


def _packs_per_env(
    queue: Sequence[Item], largest: int, present: set[int]
) -> dict[int, list[list[Item]]]:
    """`_packs` within each env; fills `present` with every env that has a group."""
    waiting: dict[tuple[int, int], list[Item]] = {}
    packs: dict[int, list[list[Item]]] = {}
    for item in queue:
        if item.env_id is None:
            continue
        present.add(item.env_id)
        env_packs = packs.setdefault(item.env_id, [])
        bucket = waiting.setdefault((item.env_id, item.size), [])
        bucket.append(item)
        if len(bucket) * item.size == largest:
            env_packs.append(bucket)
            waiting[(item.env_id, item.size)] = []
    return packs


def _walk(packed: Sequence[Item], batch_size: int) -> list[Item] | None:
    batch: list[Item] = []
    filled = 0
    for item in packed:
        batch.append(item)
        filled += item.size
        if filled == batch_size:
            return batch
        if filled > batch_size:
            return None
    return None


def _without(queue: list[Item], batch: list[Item]) -> list[Item]:
    gone = {item.id for item in batch}
    return [item for item in queue if item.id not in gone]


def _repeat_with_minimums(
    queue: list[Item], batch_size: int, envs: Sequence[EnvShare]
) -> list[list[Item]]:
    batches = []
    while (batch := take_with_minimums(queue, batch_size, envs)) is not None:
        batches.append(batch)
        queue = _without(queue, batch)
    return batches


def _repeat_exact(queue: list[Item], batch_size: int) -> list[list[Item]]:
    """`take_exact` until it fails, in O(queue) for the usual case.

    Taking whole packs from the front of the pack order leaves the remaining queue
    with the same packs minus those taken, as long as the largest size is still
    present. So the packs are computed once and walked on; only a batch that ends
    inside a pack, or that takes the last group of the largest size, makes the
    packs be computed again from the remaining queue.
    """
    batches: list[list[Item]] = []
    while queue:
        total = sum(item.size for item in queue)
        largest = max(item.size for item in queue)
        largest_left = sum(1 for item in queue if item.size == largest)
        packs = _packs(queue, largest)
        taken: set[int] = set()
        recompute = False
        p = 0
        while not recompute:
            if total < batch_size:
                return batches
            batch: list[Item] = []
            filled = 0
            while p < len(packs) and filled < batch_size:
                pack = packs[p]
                room = batch_size - filled
                if largest <= room:  # every pack holds exactly `largest` sequences
                    batch.extend(pack)
                    filled += largest
                    p += 1
                    continue
                # The batch ends inside this pack (or overshoots: no batch).
                partial = _walk(pack, room)
                if partial is None:
                    return batches
                batch.extend(partial)
                filled += room
                recompute = True
            if filled != batch_size:
                return batches
            batches.append(batch)
            taken.update(item.id for item in batch)
            largest_left -= sum(1 for item in batch if item.size == largest)
            total -= batch_size
            if largest_left == 0:
                recompute = True
        queue = [item for item in queue if item.id not in taken]
    return batches
