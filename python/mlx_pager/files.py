"""Writing files so that a crash, a kill -9 or a full disk never destroys
the previous good copy.

``atomic_write(path, write)`` has ``write(tmp_path)`` fill a temporary file
in the same directory, fsyncs it, renames it over `path` (atomic on POSIX
file systems) and fsyncs the directory. If anything fails, the temporary
file is removed and `path` is left as it was; the error names the file and,
for a full disk, the bytes needed and free.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

from .budget import format_size


class SaveError(OSError):
    """A file could not be written; the message names it, and why."""

    def __str__(self):
        return self.strerror or super().__str__()


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return  # e.g. a directory that cannot be opened: nothing more to flush
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems (and directories on some systems) refuse fsync
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(path if path.is_dir() else path.parent).free


def _tmp_name(path: Path) -> Path:
    # The suffix stays last: MLX's writers append ".safetensors" otherwise.
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def _remove_orphans(path: Path) -> None:
    """Temporary files of `path` left by writers that were killed (their
    process is gone): a kill -9 mid-write leaves one behind."""
    for tmp in path.parent.glob(f".{path.stem}.*.tmp{path.suffix}"):
        try:
            pid = int(tmp.name[len(path.stem) + 2 :].split(".", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            continue  # its writer is alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, someone else's
        try:
            tmp.unlink()
        except OSError:
            pass


def atomic_write(
    path, write: Callable[[str], None], expected_bytes: Optional[int] = None, mode: Optional[int] = None
) -> Path:
    """Writes `path` through ``write(tmp)``, atomically (module docstring).
    `expected_bytes`: the size about to be written, checked against the
    free space first. `mode`: permissions of the new file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if expected_bytes is not None:
        free = free_bytes(path.parent)
        if expected_bytes > free:
            raise SaveError(
                errno.ENOSPC,
                f"cannot write {path}: it needs {format_size(expected_bytes)} and the disk "
                f"has {format_size(free)} free; free some space or choose another directory",
            )
    _remove_orphans(path)
    tmp = _tmp_name(path)
    try:
        write(str(tmp))
        if mode is not None:
            os.chmod(tmp, mode)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise SaveError(
                errno.ENOSPC,
                f"cannot write {path}: the disk is full ({format_size(free_bytes(path.parent))} "
                "free); the previous copy, if any, is intact",
            ) from None
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, SaveError):
            # MLX's writers raise RuntimeError("[write] Unable to write N bytes to file.")
            why = str(e)
            if "Unable to write" in why or isinstance(e, OSError):
                free = free_bytes(path.parent)
                raise SaveError(
                    errno.EIO,
                    f"cannot write {path}: {why} ({format_size(free)} free on its disk); "
                    "the previous copy, if any, is intact",
                ) from None
        raise
    _fsync_path(path.parent, directory=True)
    return path


def save_safetensors(path, arrays: dict, metadata: Optional[dict] = None) -> Path:
    """mx.save_safetensors, atomically."""
    import mlx.core as mx

    size = sum(a.nbytes for a in arrays.values()) + (64 << 10)  # + header
    mx.eval(list(arrays.values()))
    return atomic_write(path, lambda tmp: mx.save_safetensors(tmp, arrays, metadata=metadata), expected_bytes=size)


def save_json(path, obj, **dump_kwargs) -> Path:
    """A JSON file, atomically."""
    text = json.dumps(obj, **dump_kwargs)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text), expected_bytes=len(text) + 4096)
