"""Atomic file writes: the one place stpipe turns "write a file" into "replace a file".

A file is written to a temporary file in the destination folder, flushed and fsynced,
given an ordinary file's mode, renamed over the destination, and the folder is fsynced:
a crash at any moment leaves the old file or the new one, never half of one.
"""
from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable, Union

__all__ = ["atomic_write", "fsync_folder"]


def fsync_folder(folder: str) -> None:
    """fsync a folder so a rename inside it is durable (a no-op where folders cannot be opened)."""
    try:  # make the rename durable; not every filesystem lets a folder be opened
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Union[str, os.PathLike], write: Callable[[BinaryIO], None]) -> None:
    """Create or replace ``path`` with what ``write(file)`` writes, atomically.

    Args:
        path: the destination file.
        write: called once with a binary file object open for writing.

    Raises:
        Whatever ``write`` or the filesystem raises; the temporary file is removed then and
        ``path`` is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it 0600; give it a normal file's mode
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_folder(folder)
