"""θ and the outer momentum in memory-mapped files on local disk (``outer.state_dir``).

A host keeps the swarm's global state in host RAM: θ and the outer momentum, fp32, 8 bytes a
parameter (560 GB at 70B), beside the error-feedback residual. That state is touched once a
round, tensor by tensor (the outer step, the reset of the local copy, the pseudo-gradient), so
it need not stay resident: with ``outer.state_dir`` set each lives in one file there
(``theta.f32``, ``momentum.f32``), mapped shared into the process (``torch.from_file``). The
tensors are views of the mapping; the outer step runs on them unchanged (same kernels, same
bits), and the kernel pages them in as a step reads them and writes them back to the file as it
sees fit, so the host's anonymous memory no longer grows with the model: what is resident of
the files is page cache, which the kernel reclaims under pressure.

The files are scratch, not checkpoints: they are created afresh at every start (and filled from
the model's init, a checkpoint or a download), written in place every round, and a crash leaves
them torn. Checkpoints stay separate atomic files; the consistent copy of θ and the momentum a
checkpoint takes (under the worker's lock, written out after it) goes to an unlinked mapped
file here too (``copy_of``), not to RAM. A directory is one node's: a lock file keeps a second
node out.
"""

from __future__ import annotations

import fcntl
import math
import os

import torch

FILES = ("theta", "momentum")


class StateDirInUse(ValueError):
    """Another live process holds the directory's lock."""


class MappedState:
    """One node's memory-mapped outer state in ``directory``: ``vector(name, numel)`` gives a
    file-backed fp32 vector of zeros, its disk blocks reserved."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        try:
            os.makedirs(directory, exist_ok=True)
            self._lock = open(os.path.join(directory, "lock"), "a+")
        except OSError as e:
            raise ValueError(f"outer.state_dir: cannot use {directory}: {e.strerror or e}") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise StateDirInUse(f"outer.state_dir: {directory} is in use by another node") from None
        self._copies = 0

    def vector(self, name: str, numel: int) -> torch.Tensor:
        assert name in FILES and numel >= 0
        # Afresh: whatever a former run left there is not this state.
        return self._map(os.path.join(self.directory, f"{name}.f32"), numel, name, ValueError)

    def _map(self, path: str, numel: int, what: str, error: type[Exception]) -> torch.Tensor:
        """A shared mapping of a new file at ``path`` of ``numel`` fp32 zeros. Every block is
        reserved now: a disk that filled up later would kill the process (SIGBUS) at the first
        write to a page it has no block for; ``error`` names the setting instead."""
        with open(path, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(4, numel * 4))
            except OSError as e:
                raise error(f"outer.state_dir: no room for {numel * 4 / 1e9:.1f} GB of {what} in "
                            f"{self.directory}: {e.strerror or e}") from None
        return torch.from_file(path, shared=True, size=numel, dtype=torch.float32)

    def copy_of(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A copy of ``tensors`` in a mapped file of its own, unlinked at once (the mapping keeps
        it until the copy is dropped): a checkpoint's consistent copy of θ or the momentum,
        written out after the lock it was read under is released, without a copy in RAM."""
        out = views(self.scratch(sum(t.numel() for t in tensors)), [t.shape for t in tensors])
        for o, t in zip(out, tensors):
            o.copy_(t)
        return out

    def scratch(self, numel: int) -> torch.Tensor:
        """An fp32 vector of ``numel`` values in a mapped file of its own, unlinked at once: gone
        with the last reference to it (a copy for a checkpoint, a joiner's snapshot)."""
        self._copies += 1
        path = os.path.join(self.directory, f"copy{self._copies}.f32")
        try:
            return self._map(path, numel, "a copy", RuntimeError)
        finally:
            os.unlink(path)


def views(vector: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Consecutive views of ``vector`` with these shapes."""
    out, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(vector[at : at + n].view(shape))
        at += n
    assert at == vector.numel()
    return out


def mapped_like(state: MappedState, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of a new mapped vector shaped like ``tensors``, holding their values."""
    shapes = [t.shape for t in tensors]
    out = views(state.vector(name, sum(t.numel() for t in tensors)), shapes)
    for o, t in zip(out, tensors):
        o.copy_(t)
    return out
