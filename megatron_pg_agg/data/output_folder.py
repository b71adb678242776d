"""Output folders this project owns: refused at start-up when occupied, replaced atomically, and
never a user's file deleted.

A folder the project writes whole (``--save-hf DIR``) carries a marker file, :data:`MARKER`, that
lists every file the project put there. Only a folder whose marker names exactly its contents is
the project's own earlier output, and only such a folder is ever replaced. Everything else at
``DIR`` is the user's: a non-empty folder without the marker, a folder holding a file the marker
does not list, a regular file, a link. It is refused at start-up (:func:`output_folder_problem`,
before any training) and again at the moment of the write (:func:`replace_output_folder`), since
the user may have put something there during the run.

Replacing an earlier output: the new folder is written in full beside ``DIR`` (a hidden temporary
name), the old one is moved aside, the new one takes the name (``os.rename``: atomic), and the old
one's listed files are unlinked one by one and its folder removed with ``rmdir``, which fails rather
than deletes anything that was not listed. Nothing is removed recursively.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from typing import Mapping, Optional

from .atomic_files import fsync_directory

__all__ = ["MARKER", "HF_KIND", "TINY_HF_KIND", "OutputFolderError", "new_output_folder", "output_folder_problem",
           "overlap_problem", "replace_output_folder"]

MARKER = ".megatron_pg_agg_output.json"
"""The marker file of an output folder: ``{"written_by": "megatron_pg_agg", "kind": ..., "files": [...]}``."""


HF_KIND = "hf"
"""The kind of a ``--save-hf`` folder (an HF checkpoint: config, safetensors, tokenizer files)."""
TINY_HF_KIND = "tiny_hf"
"""The kind of a folder made by :mod:`megatron_pg_agg.integrations.bridge.tiny_hf`."""


class OutputFolderError(RuntimeError):
    """An output folder cannot be written without touching something that is not the project's."""


def _listed_files(folder: str, kind: str) -> Optional[list]:
    """The files the marker of ``folder`` lists when it is this project's output of ``kind``."""
    try:
        with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("written_by") != "megatron_pg_agg" or marker.get("kind") != kind:
        return None
    files = marker.get("files")
    return files if isinstance(files, list) and all(isinstance(n, str) for n in files) else None


def _occupied(path: str, flag: str, kind: str) -> Optional[str]:
    """Why ``path`` may not be replaced by an output of ``kind`` (None: free or our own output)."""
    if os.path.islink(path):
        return f"{flag} {path} is a symbolic link; give the folder itself (nothing was written)"
    if not os.path.lexists(path):
        return None
    if not os.path.isdir(path):
        return f"{flag} {path} is a file, not a folder; give a new or empty folder (nothing was written)"
    present = sorted(os.listdir(path))
    if not present:
        return None
    listed = _listed_files(path, kind)
    if listed is None:
        shown = ", ".join(present[:5]) + (f" and {len(present) - 5} more" if len(present) > 5 else "")
        return (f"{flag} {path} is a folder that is not empty ({shown}) and is not an earlier {flag} output of "
                f"megatron_pg_agg (by its {MARKER}); give a new or empty folder, nothing there is replaced")
    foreign = sorted(set(present) - set(listed) - {MARKER})
    if foreign:
        return (f"{flag} {path} is an earlier {flag} output, but it now also holds {', '.join(foreign)}, which "
                f"megatron_pg_agg did not write; move them out or give another folder")
    return None


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def overlap_problem(path: str, flag: str, others: Mapping[str, Optional[str]]) -> list:
    """Each of ``others`` (``{flag: path}``; None skipped) that ``path`` equals, lies inside or
    contains: writing ``path`` would replace it or be replaced with it."""
    mine = os.path.realpath(path)
    problems = []
    for other_flag, other in others.items():
        if not other:
            continue
        theirs = os.path.realpath(other)
        if mine == theirs:
            how = "is"
        elif _inside(mine, theirs):
            how = "is inside"
        elif _inside(theirs, mine):
            how = "contains"
        else:
            continue
        problems.append(f"{flag} {path} {how} {other_flag} {other}: the output would replace it; give a "
                        f"folder of its own")
    return problems


def output_folder_problem(path: str, flag: str, *, kind: str,
                          others: Optional[Mapping[str, Optional[str]]] = None) -> list:
    """Start-up: every reason the output folder ``path`` (given as ``flag``) may not be written:
    occupied by anything but an earlier output of ``kind``, or the same as, inside or around one of
    ``others`` (the run's inputs and other outputs). Empty when it may be written."""
    problems = overlap_problem(path, flag, others or {})
    occupied = _occupied(os.path.abspath(path), flag, kind)
    if occupied is not None:
        problems.append(occupied)
    return problems


def new_output_folder(out_dir: str) -> str:
    """A new hidden folder beside ``out_dir`` (same file system, so the final rename is atomic)."""
    out_dir = os.path.abspath(out_dir)
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    while True:
        temp = os.path.join(parent, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            os.mkdir(temp)
            return temp
        except FileExistsError:
            continue


def replace_output_folder(temp: str, out_dir: str, *, kind: str, flag: str) -> None:
    """Move the finished folder ``temp`` (beside ``out_dir``) to ``out_dir``, writing its marker
    first. An earlier output of ``kind`` there is replaced; anything else there raises
    :class:`OutputFolderError` and is left untouched (``temp``, this project's own, is removed)."""
    files = sorted(os.listdir(temp))
    with open(os.path.join(temp, MARKER), "w", encoding="utf-8") as f:
        json.dump({"written_by": "megatron_pg_agg", "kind": kind, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    problem = _occupied(out_dir, flag, kind)
    if problem is not None:
        shutil.rmtree(temp, ignore_errors=True)  # the hidden folder made by new_output_folder, nothing else
        raise OutputFolderError(problem)
    old = None
    if os.path.isdir(out_dir):
        old = f"{temp}.old"
        os.rename(out_dir, old)
    os.rename(temp, out_dir)
    fsync_directory(os.path.dirname(out_dir))
    if old is not None:
        _remove_own_folder(old, kind)


def _remove_own_folder(folder: str, kind: str) -> None:
    """Unlink the files the marker lists, the marker, then ``rmdir``: a file that appeared in the
    folder since the check stays (the folder with it), never deleted."""
    for name in [*(_listed_files(folder, kind) or []), MARKER]:
        try:
            os.unlink(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(folder)
    except OSError as error:
        raise OutputFolderError(f"the previous output was replaced, but {folder} still holds files megatron_pg_agg "
                                f"did not write ({', '.join(sorted(os.listdir(folder)))}); they were kept "
                                f"there") from error
