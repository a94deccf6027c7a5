"""Writing files that matter (checkpoints, keys, status) so a crash never leaves half of one.

The content goes to a temporary file in the same directory (created 0600),
which is flushed and fsynced, then moved into place in one step, and the
directory is fsynced so the move itself survives a power cut.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import BinaryIO, Callable


def atomic_write(path: str, write: Callable[[BinaryIO], None], *, overwrite: bool = True) -> None:
    """Write ``path`` through ``write(file)`` atomically. With ``overwrite=False`` an existing
    file is never replaced (FileExistsError), even one that appears meanwhile."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # unlike replace, fails if the name exists
            except FileExistsError:
                raise
            except OSError:  # filesystems without hard links
                if os.path.lexists(path):
                    raise FileExistsError(path) from None
                os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
