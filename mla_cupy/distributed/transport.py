"""How key blocks move between ranks: point-to-point ring sends and all-gathers over a
``torch.distributed`` process group, or, for tests on one device, between W threads of one
process that step through the same schedule as W ranks would."""
from __future__ import annotations

import threading
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["TorchTransport", "ThreadTransport", "simulate"]


class TorchTransport:
    """Ring and all-gather over a ``torch.distributed`` process group (NCCL, gloo, ...).

    Parameters
    ----------
    group : ProcessGroup, optional
        Default: the world group. Ring neighbours are group ranks ``r - 1`` and ``r + 1``.
    """

    def __init__(self, group: Any = None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call torch.distributed.init_process_group)")
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        g = group if group is not None else dist.group.WORLD
        self._next = dist.get_global_rank(g, (self.rank + 1) % self.world_size)
        self._prev = dist.get_global_rank(g, (self.rank - 1) % self.world_size)

    def start_ring(self, send, recv) -> List[Any]:
        """Post ``send`` to the next rank and ``recv`` from the previous one; returns the pending works."""
        d = self._dist
        return d.batch_isend_irecv([d.P2POp(d.isend, send, self._next, self.group),
                                    d.P2POp(d.irecv, recv, self._prev, self.group)])

    def start_all_gather(self, outs: Sequence[Any], inp) -> List[Any]:
        """Post an all-gather of every rank's ``inp`` into ``outs`` (one tensor per rank)."""
        return [self._dist.all_gather(list(outs), inp, group=self.group, async_op=True)]

    def wait(self, pending: List[Any]) -> None:
        """Order the current stream after the posted transfers (and on the CPU, wait for them)."""
        for work in pending:
            work.wait()


class _Shared:
    """State the threads of :func:`simulate` share: one posted tensor per rank and a barrier."""

    def __init__(self, world_size: int, timeout: float):
        self.posted: List[Any] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=timeout)


class ThreadTransport:
    """The transport of one of the W threads of :func:`simulate`: the same calls as
    :class:`TorchTransport`, done as copies between the threads' tensors at :meth:`wait`."""

    def __init__(self, rank: int, world_size: int, shared: _Shared):
        self.rank, self.world_size, self._shared = rank, world_size, shared

    def start_ring(self, send, recv):
        self._shared.posted[self.rank] = send
        return ("ring", recv)

    def start_all_gather(self, outs, inp):
        self._shared.posted[self.rank] = inp
        return ("all_gather", outs)

    def wait(self, pending) -> None:
        kind, dst = pending
        sh = self._shared
        sh.barrier.wait()  # every rank has posted
        if kind == "ring":
            dst.copy_(sh.posted[(self.rank - 1) % self.world_size])
        else:
            for out, src in zip(dst, sh.posted):
                out.copy_(src)
        sh.barrier.wait()  # every copy is done before any rank reuses its posted tensor


def simulate(world_size: int, fn: Callable[[ThreadTransport], Any], timeout: float = 600.0) -> List[Any]:
    """Run ``fn(transport)`` for ``world_size`` ranks in threads of this process; return the results
    by rank. An exception in any rank breaks the barrier of the others and is raised here."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    shared = _Shared(world_size, timeout)
    results: List[Any] = [None] * world_size
    errors: List[Optional[BaseException]] = [None] * world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadTransport(rank, world_size, shared))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc
            shared.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
