"""Atomic file replacement: readers see the old file or the whole new one, never a torn one.

Used by the rollout writer (:func:`megatron_pg_agg.data.rollout_files.write_rollouts`) and the trainer's
checkpoints (rank files and the ``latest`` marker).
"""
from __future__ import annotations

import os
import secrets
from typing import IO, Callable

__all__ = ["atomic_write", "fsync_directory"]


def atomic_write(path, write: Callable[[IO], None], *, text: bool = False) -> None:
    """``write(file)`` into a temporary file beside ``path`` (binary, or UTF-8 text with ``\\n``
    newlines when ``text``), flushed and fsynced, then moved over ``path`` with ``os.replace``
    and the directory fsynced. A failure anywhere (an exception from ``write``, a full disk)
    leaves ``path`` as it was and no temporary file behind. The new file gets the usual
    umask-derived permissions."""
    path = os.fspath(path)
    temp, fd = _open_temp_beside(path)
    try:
        try:
            opened = os.fdopen(fd, "w", encoding="utf-8", newline="\n") if text else os.fdopen(fd, "wb")
        except BaseException:
            os.close(fd)
            raise
        with opened as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    fsync_directory(os.path.dirname(os.path.abspath(path)))


def _open_temp_beside(path: str):
    """A new file in ``path``'s directory (so os.replace is atomic), created with the usual
    umask-derived permissions (mkstemp's 0600 would leak into the final file)."""
    directory, name = os.path.split(os.path.abspath(path))
    while True:
        temp = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return temp, os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue


def fsync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); platforms that cannot open a directory skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
