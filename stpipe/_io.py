"""Files: the one place stpipe turns "write a file" into "replace a file", and reads a
``.npy`` header.

A file is written to a temporary file in the destination folder, flushed and fsynced,
given an ordinary file's mode, renamed over the destination, and the folder is fsynced:
a crash at any moment leaves the old file or the new one, never half of one.

:func:`read_npy_header` parses a ``.npy`` header without unpickling anything, for
:class:`stpipe.host.HostTable`'s loads, checkpoints and the compat layer's messages;
each says in its own words what it expected.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, BinaryIO, Callable, Tuple, Union

import numpy as np

__all__ = ["NpyHeaderError", "atomic_write", "fsync_folder", "read_npy_header"]


class NpyHeaderError(ValueError):
    """A ``.npy`` header stpipe cannot read; ``kind`` says why: ``"magic"`` (not a
    ``.npy`` file at all), ``"version"`` (a format other than 1.0 and 2.0) or
    ``"header"`` (a header that does not parse)."""

    def __init__(self, msg: str, kind: str) -> None:
        super().__init__(msg)
        self.kind = kind


def read_npy_header(f: BinaryIO) -> Tuple[Tuple[int, ...], bool, np.dtype, int]:
    """Read a ``.npy`` header (format 1.0 or 2.0) from the start of ``f``.

    Returns:
        ``(shape, fortran_order, dtype, data_offset)``; ``f`` is left at the data.

    Raises:
        NpyHeaderError: no ``.npy`` magic string, another format version, or a header
            that does not parse (numpy versions differ in what they raise for it).
    """
    fmt: Any = np.lib.format
    try:
        version = fmt.read_magic(f)
    except Exception as exc:
        raise NpyHeaderError(str(exc) or type(exc).__name__, "magic") from None
    read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(version)
    if read is None:
        raise NpyHeaderError(f"format version {version} not supported; expected 1.0 or 2.0", "version")
    try:
        shape, fortran, dtype = read(f)
    except Exception as exc:
        raise NpyHeaderError(f"{type(exc).__name__}: {exc}", "header") from None
    return tuple(int(s) for s in shape), bool(fortran), dtype, f.tell()


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
