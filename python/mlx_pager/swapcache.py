"""The swap cache: what lives in ``ssd_cache_dir``, and who may touch it.

    ssd_cache_dir/                      0700
      sources/<model id>.json           0600  digests of a model's files
      <key>/                            0700  one entry: a model's swap file
        prepare.lock                    flock EX while the swap file is written
        use.lock                        flock SH while a run reads the entry
        pages.swap                      0600  written as .pages.<pid>.tmp.swap, renamed
        manifest.json                   0600  written last: pages, offsets, checksums

Keys are content, not dates. Each model file's XXH3 digest (and the digest
of each tensor in it, for in-place page checksums) is taken once and kept in
``sources/`` with the file's stat identity (size, mtime, ctime, inode,
device). At start a file whose identity is unchanged keeps its digests; any
write changes its ctime, which ``touch -r`` cannot restore, so a same-size,
same-mtime change is re-hashed, and the entry key (digests + page layout +
MLX and mlx-lm versions) changes only if the content did.

Concurrency: a run takes ``prepare.lock`` exclusively to check or write its
entry, so a second run started meanwhile waits for the first's swap file and
then reuses it; the swap file is written under a temporary name and renamed,
so a reader never sees a partial or rewritten file (a run reading the old
inode keeps it). ``use.lock`` is held shared for as long as a run pages from
the entry; cleanup only removes an entry it can lock exclusively: older keys
of the same model, entries a killed run left unfinished, and, past the size
cap, the least recently used others.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from .budget import format_size

FORMAT = 2  # bump when the entry layout changes
_KEY = re.compile("[0-9a-f]{20}")  # an entry's directory name
DEFAULT_CAP_BYTES = 64 << 30  # the cache's size cap when none is given
_CAP_ENV = "MLX_PAGER_CACHE_MAX_BYTES"


class CacheDirError(OSError):
    """The cache directory cannot be used; the message names it and the fix."""

    def __str__(self):
        return self.strerror or super().__str__()


class ModelFileError(ValueError):
    """A model file is corrupt, truncated or changed; the message names it."""


def _private_dir(path: Path, what: str = "--ssd-cache-dir") -> Path:
    """Creates `path` (0700) or checks it is a writable directory; one clear
    error otherwise."""
    try:
        if path.exists() and not path.is_dir():
            raise CacheDirError(
                errno.ENOTDIR,
                f"{what} {path} is a file, not a directory: choose a directory (it is created if missing)",
            )
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        probe = path / f".probe.{os.getpid()}"
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        os.close(fd)
        os.unlink(probe)
    except CacheDirError:
        raise
    except NotADirectoryError:
        raise CacheDirError(
            errno.ENOTDIR, f"{what} {path}: a part of the path is a file, not a directory: choose a directory"
        ) from None
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else str(e)
        raise CacheDirError(
            e.errno or errno.EACCES, f"{what} {path} is not writable ({why}): choose a writable directory"
        ) from None
    try:
        if path.stat().st_uid == os.getuid():
            os.chmod(path, 0o700)
    except OSError:
        pass
    return path


def _flock(path: Path, how: int) -> int | None:
    """An fd holding flock `how` on `path` (created 0600); None when `how`
    has LOCK_NB and the lock is held elsewhere."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _unlock(fd: int | None) -> None:
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def release(fd: int | None) -> None:
    """Ends a run's use of an entry (the fd SwapCache.entry returned)."""
    try:
        _unlock(fd)
    except OSError:
        pass


def _stat_identity(st: os.stat_result) -> list:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _write_json(path: Path, obj) -> None:
    from .files import atomic_write

    text = json.dumps(obj)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text), mode=0o600)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _dir_bytes(d: Path) -> int:
    n = 0
    for f in d.iterdir():
        try:
            n += f.stat().st_blocks * 512 if f.is_file() else 0
        except OSError:
            pass
    return n


def hash_model_file(path: str, ranges: list[tuple[int, int]]):
    """(file digest, [range digests]) of a model file, naming the file when
    it cannot be read or is shorter than its tensors."""
    from ._core import hash_file

    try:
        digest, digests, _ = hash_file(path, ranges)
    except RuntimeError as e:
        if "truncated" in str(e):
            raise ModelFileError(
                f"{path} is truncated: its tensors end past the end of the file; "
                "the model file is incomplete, download or copy it again"
            ) from None
        raise ModelFileError(f"cannot read {path}: {e}") from None
    return digest, digests


class SwapCache:
    """One ``ssd_cache_dir`` (module docstring). `cap_bytes`: the most the
    cache's entries may take together (default: $MLX_PAGER_CACHE_MAX_BYTES
    or 64 GiB); the entry in use is never removed, whatever its size."""

    def __init__(self, root, cap_bytes: int | None = None):
        self.root = _private_dir(Path(root))
        if cap_bytes is None:
            cap_bytes = int(os.environ.get(_CAP_ENV, DEFAULT_CAP_BYTES))
        self.cap_bytes = cap_bytes

    # -------------------------------------------------------------- sources --
    def source_digests(self, model_path: Path, files: dict[str, dict[str, tuple[int, int]]]) -> dict[str, dict]:
        """{file: {"digest": d, "tensors": {name: d}}} for `files` ({path:
        {tensor: (offset, nbytes)}}), from the record in sources/ where a
        file's stat identity is unchanged, else by hashing it (one pass)."""
        model_path = Path(model_path).resolve()
        sources = _private_dir(self.root / "sources")
        rec_path = sources / (hashlib.sha256(str(model_path).encode()).hexdigest()[:20] + ".json")
        rec = _read_json(rec_path) or {}
        known = rec.get("files", {}) if rec.get("path") == str(model_path) else {}
        out, changed = {}, False
        for f, tensors in sorted(files.items()):
            name = Path(f).name
            ident = _stat_identity(os.stat(f))
            r = known.get(name)
            if r is None or r.get("stat") != ident or set(r.get("tensors", {})) != set(tensors):
                names = sorted(tensors)
                digest, digests = hash_model_file(f, [tuple(tensors[n]) for n in names])
                r = {"stat": ident, "digest": digest, "tensors": dict(zip(names, digests))}
                changed = True
            out[f] = r
        if changed or set(known) != {Path(f).name for f in out}:
            _write_json(rec_path, {"path": str(model_path), "files": {Path(f).name: r for f, r in out.items()}})
        return out

    # -------------------------------------------------------------- entries --
    def entry(self, key: str, model_path: Path, write: Callable[[str], dict], total_bytes: int):
        """The entry `key` of the model at `model_path`, ready to read:
        returns (swap path, manifest, use-lock fd). `write(tmp_path)` writes
        the swap file when the entry is not complete, and returns the
        manifest's "pages"; `total_bytes` is its size, checked against the
        free space first. The caller keeps the fd (closing it releases the
        entry) while it reads the swap file."""
        for _ in range(10):
            d = _private_dir(self.root / key)
            use = _flock(d / "use.lock", fcntl.LOCK_SH)
            if os.fstat(use).st_nlink > 0:
                break
            _unlock(use)  # cleanup removed the entry while we waited: again
        swap, manifest_path = d / "pages.swap", d / "manifest.json"
        try:
            prep = _flock(d / "prepare.lock", fcntl.LOCK_EX)  # waits for a run writing it
            try:
                manifest = self._complete(manifest_path, swap)
                if manifest is None:
                    for tmp in d.glob(".pages.*.tmp.swap"):  # left by killed writers
                        tmp.unlink(missing_ok=True)
                    free = shutil.disk_usage(d).free
                    if total_bytes > free:
                        raise CacheDirError(errno.ENOSPC, self._full(swap, total_bytes, free))
                    tmp = d / f".pages.{os.getpid()}.tmp.swap"
                    try:
                        pages = write(str(tmp))
                        os.chmod(tmp, 0o600)
                        os.replace(tmp, swap)
                    except BaseException as e:
                        tmp.unlink(missing_ok=True)
                        if _is_enospc(e):
                            raise CacheDirError(
                                errno.ENOSPC, self._full(swap, total_bytes, shutil.disk_usage(d).free)
                            ) from None
                        raise
                    manifest = {
                        "format": FORMAT,
                        "complete": True,
                        "model": str(Path(model_path).resolve()),
                        "pages": pages,
                        "bytes": swap.stat().st_size,
                    }
                    try:
                        _write_json(manifest_path, manifest)
                    except OSError:
                        swap.unlink(missing_ok=True)
                        raise
            finally:
                _unlock(prep)
            os.utime(d / "use.lock")  # last use, for the size cap
            self.clean(keep=key, model_path=model_path)
            return swap, manifest, use
        except BaseException:
            _unlock(use)
            raise

    @staticmethod
    def _full(swap: Path, need: int, free: int) -> str:
        return (
            f"cannot write the swap file {swap}: it needs {format_size(need)} and its disk has "
            f"{format_size(free)} free; free some space or choose another --ssd-cache-dir"
        )

    @staticmethod
    def _complete(manifest_path: Path, swap: Path) -> dict | None:
        m = _read_json(manifest_path)
        if not m or m.get("complete") is not True or m.get("format") != FORMAT:
            return None
        try:
            if swap.stat().st_size != m.get("bytes"):
                return None
        except OSError:
            return None
        return m

    def clean(self, keep: str, model_path: Path | None = None) -> list[str]:
        """Removes entries nobody uses: other keys of `model_path`, entries
        left unfinished, then the least recently used ones while the cache is
        over its cap. Returns the keys removed."""
        model = str(Path(model_path).resolve()) if model_path is not None else None
        entries = []
        for d in self.root.iterdir():
            # Only entries (20 hex digits; those of earlier versions too): the
            # directory may hold other things.
            if d.name == keep or not d.is_dir() or not _KEY.fullmatch(d.name):
                continue
            m = self._complete(d / "manifest.json", d / "pages.swap")
            try:
                used = (d / "use.lock").stat().st_mtime
            except OSError:
                used = 0.0
            entries.append((d, m, used))
        removed = []
        total = _dir_bytes(self.root / keep) if (self.root / keep).exists() else 0
        survivors = []
        for d, m, used in entries:
            if m is None or (model is not None and m.get("model") == model):
                if self._remove(d):
                    removed.append(d.name)
                    continue
            survivors.append((d, used))
            total += _dir_bytes(d)
        for d, _ in sorted(survivors, key=lambda t: t[1]):
            if total <= self.cap_bytes:
                break
            size = _dir_bytes(d)
            if self._remove(d):
                removed.append(d.name)
                total -= size
        return removed

    @staticmethod
    def _remove(d: Path) -> bool:
        """Removes entry `d` if no run uses or prepares it."""
        use = _flock(d / "use.lock", fcntl.LOCK_EX | fcntl.LOCK_NB)
        if use is None:
            return False
        prep = _flock(d / "prepare.lock", fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            if prep is None:
                return False
            for f in d.iterdir():
                if f.name not in ("use.lock", "prepare.lock"):
                    f.unlink(missing_ok=True)
            # The lock files go last: a run that opens one now finds the
            # entry empty (incomplete) and rebuilds it.
            for f in ("prepare.lock", "use.lock"):
                (d / f).unlink(missing_ok=True)
            try:
                d.rmdir()
            except OSError:
                pass
            return True
        finally:
            _unlock(prep)
            _unlock(use)


def read_index(path) -> dict:
    """{name: (dtype, shape, offset, nbytes)} of a safetensors file; a file
    that is not one (bytes flipped, truncated) is a ModelFileError naming it."""
    from ._core import read_safetensors_index

    try:
        tensors, _, _ = read_safetensors_index(str(path))
    except (RuntimeError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        why = str(e).replace(f"[read_safetensors_index] {path}: ", "")
        raise ModelFileError(
            f"{path} is not a valid safetensors file ({why}): the model file is corrupt or "
            "truncated; download or copy it again"
        ) from None
    return tensors


def check_model_files(model_path) -> None:
    """Reads the header of every model*.safetensors file of `model_path`:
    a corrupt or truncated one is a ModelFileError naming it, before MLX's
    loader (whose errors name no file) sees it."""
    from pathlib import Path as _P

    for f in sorted(_P(model_path).glob("model*.safetensors")):
        read_index(f)


def tensor_ranges(index: dict[str, tuple]) -> dict[str, dict[str, tuple[int, int]]]:
    """{file: {tensor: (offset, nbytes)}} of store._safetensors_index's index."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for name, (path, _, _, offset, nbytes) in index.items():
        out.setdefault(path, {})[name] = (offset, nbytes)
    return out


def _is_enospc(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    return isinstance(e, RuntimeError) and "No space left on device" in str(e)


def entry_key(model_path: Path, digests: dict[str, dict], layout: list[tuple[str, list[str]]], params) -> str:
    """The entry key of a model's swap pages: its files' content, the pages'
    tensors (names, dtypes, shapes) and the versions that compute them."""
    import mlx.core as mx

    try:
        import mlx_lm

        lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        lm_version = "?"
    h = hashlib.sha256(f"mlx-pager swap {FORMAT} mlx {mx.__version__} mlx-lm {lm_version}\n".encode())
    h.update(str(Path(model_path).resolve()).encode())
    for f, r in sorted(digests.items()):
        h.update(f"{Path(f).name}:{r['digest']}\n".encode())
    for page_name, names in layout:
        h.update(page_name.encode())
        for n in names:
            h.update(f"{n}:{params[n].dtype}:{params[n].shape}".encode())
    return h.hexdigest()[:20]
