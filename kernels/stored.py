"""Packed weights kept on disk (`EngineConfig.packed_cache`): a start that packs a linear layer's weights writes the
packed copy to a file named by what it was packed from (the weights' bytes, shapes and types, the packing's options
and `LAYOUT`); a later start of the same weights maps that file instead of packing again. Its pages come from the
page cache, where fresh memory is slow to touch on some machines (docs/performance-notes.md, "A second start").

Files are written on a thread of their own once the engine has started and passed its check (`write_in_background`),
each under a temporary name first, so a file that exists is whole; `close` finishes them at the engine's exit (or
stops them, on an exit by an error). The directory keeps within `limit_bytes()`: before a start writes, the files used
longest ago make room (a start that maps a file marks it used).
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("jitney.stored")

LAYOUT = 1
"""The packed layouts' version, part of every key: raise it when a packing's output changes, so that no start maps a
file of an older layout."""

HEADER = 2**21
"""Bytes before a file's tensor: its type and shape as JSON, then a hole (no disk), so that the tensor starts on a
2 MiB boundary of the file and the page cache can hold all of it in 2 MiB folios, which a mapping maps as huge
pages (ext4 since Linux 6.16: decode steps read those faster)."""

SPARE = 2**30
"""Bytes of the disk left free: files that would leave less are not written."""

LIMIT_GIB = 32.0
"""GiB the directory's files may take, unless `$JITNEY_PACKED_GIB` says otherwise (`limit_bytes`): one 7B model's
packed bf16 copies and int8 draft (~20 GiB) and a few smaller models'."""

STALE_S = 3600
"""A half-written file untouched this long (seconds) was left by a process that died writing it."""

_PIECE = 4 * 2**20

MADV_POPULATE_READ = 22


def limit_bytes() -> int:
    """Bytes the packed weights' directory may take: `$JITNEY_PACKED_GIB` GiB, else `LIMIT_GIB`."""
    given = os.environ.get("JITNEY_PACKED_GIB")
    try:
        gib = float(given) if given else LIMIT_GIB
        if not gib >= 0:
            raise ValueError
    except ValueError:
        log.warning("JITNEY_PACKED_GIB=%r is not a number of GiB; keeping within %.0f", given, LIMIT_GIB)
        gib = LIMIT_GIB
    return int(gib * 2**30)


@functools.cache
def _hashers() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="jitney-hash")


os.register_at_fork(after_in_child=_hashers.cache_clear)  # (a forked child has none of its threads: a pool of its own)


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` (contiguous), without a copy."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def digest(t: torch.Tensor) -> bytes:
    """SHA-256 of the bytes of `t` a piece of 4 MiB at a time, the pieces' digests hashed together (pieces hashed
    side by side: hashlib lets go of the GIL)."""
    data = _bytes(t)
    pieces = [data[start : start + _PIECE] for start in range(0, len(data), _PIECE)]
    return hashlib.sha256(b"".join(_hashers().map(lambda p: hashlib.sha256(p).digest(), pieces))).digest()


class PackedStore:
    """Packed copies in `root`, one file each (see the module's docstring)."""

    def __init__(self, root: Path, limit: int | None = None):
        self.root = Path(root)
        self.limit = limit_bytes() if limit is None else limit
        """Bytes the directory's files may take (see `_prune`)."""
        self.mapped = 0
        """Bytes mapped from files."""
        self.used: set[str] = set()
        """The files mapped here (never removed to make room)."""
        self.pending: list[tuple[str, torch.Tensor]] = []
        """Packed copies made here and not yet written."""
        self.written = 0
        """Bytes of packed copies written."""
        self._stop = threading.Event()
        self._writer: threading.Thread | None = None

    def key(self, kind: str, weights: list[torch.Tensor], **options) -> str:
        """The name of what packing `weights` by `kind` with `options` gives."""
        h = hashlib.sha256(f"jitney packed {LAYOUT} {kind} {sorted(options.items())}".encode())
        for w in weights:
            h.update(f"{w.dtype} {tuple(w.shape)}".encode())
            h.update(digest(w))
        return h.hexdigest()[:40]

    @staticmethod
    def derived(key: str, kind: str) -> str:
        """The name of `kind` made from what `key` names (the speculative draft's int8 copy of a packed linear)."""
        return hashlib.sha256(f"jitney packed {LAYOUT} {kind} of {key}".encode()).hexdigest()[:40]

    def path(self, key: str) -> Path:
        return self.root / f"{key}.bin"

    def fetch(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The tensor `key` names, mapped from its file; where there is none (or it is not whole), `make()`, kept to
        be written."""
        tensor = self.load(key)
        if tensor is None:
            tensor = make()
            self.pending.append((key, tensor))
        return tensor

    def load(self, key: str) -> torch.Tensor | None:
        """The tensor in `key`'s file, mapped (copy on write: nothing written to it reaches the file), or None."""
        try:
            f = open(self.path(key), "rb")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            log.warning("%s: not read (%s); packing again", self.path(key), e)
            return None
        with f:
            try:
                header = json.loads(f.read(4096).rstrip(b"\0"))
                dtype, shape = getattr(torch, header["dtype"]), tuple(header["shape"])
            except (ValueError, KeyError, TypeError, AttributeError):
                log.warning("%s: not a packed weights file; packing again", self.path(key))
                return None
            count = 1
            for n in shape:
                count *= n
            nbytes = count * dtype.itemsize
            size = os.fstat(f.fileno()).st_size
            if size != HEADER + nbytes:
                log.warning("%s: %d bytes, not %d; packing again", self.path(key), size, HEADER + nbytes)
                return None
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            try:
                mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                log.warning("%s: not mapped (%s); packing again", self.path(key), e)
                return None
        try:  # its pages mapped now, not in the first steps (not `MAP_POPULATE`: on a writable mapping, it copies them)
            mapped.madvise(MADV_POPULATE_READ, HEADER)
        except OSError:  # (before Linux 5.14)
            pass
        self.mapped += nbytes
        self.used.add(self.path(key).name)
        try:  # (used now: the last to make room)
            os.utime(self.path(key))
        except OSError:
            pass
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=HEADER).view(shape)

    def write_in_background(self) -> None:
        """Write what is pending on a thread of its own, where the disk has room for it (else a log line says so)."""
        if not self.pending or self._writer is not None:
            return
        needed = sum(t.numel() * t.element_size() + 4096 for _, t in self.pending)  # (the headers' holes take none)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            held = self._prune(needed)  # (first: the room they held counts as free)
            free = shutil.disk_usage(self.root).free
        except OSError as e:
            log.warning("packed weights not written to %s: %s", self.root, e)
            self.pending = []
            return
        if held + needed > self.limit:
            log.warning("packed weights not written to %s: %.2f GiB more would take it past its limit of %.2f GiB "
                        "(JITNEY_PACKED_GIB; files kept there: %.2f GiB)", self.root, needed / 2**30,
                        self.limit / 2**30, held / 2**30)
            self.pending = []
            return
        if needed + SPARE > free:
            log.warning("packed weights not written to %s: %.1f GiB would leave less than %.0f GiB of its disk's "
                        "%.1f GiB free", self.root, needed / 2**30, SPARE / 2**30, free / 2**30)
            self.pending = []
            return
        self._writer = threading.Thread(target=self._write, args=(self.pending, needed), name="jitney-packed-writer",
                                        daemon=True)
        self.pending = []
        self._writer.start()

    def _prune(self, needed: int) -> int:
        """Remove files half written by a process that died writing them (untouched for `STALE_S`), then, where the
        files and `needed` bytes more would take more than `limit`, whole files, those used longest ago first (by
        their times: written, or mapped by a start), never one mapped here, and none where what is written would not
        fit beside those; the bytes the files then take on disk."""
        for partial in self.root.glob("*.part"):
            try:
                if time.time() - partial.stat().st_mtime > STALE_S:
                    partial.unlink()
            except OSError:  # (another process's, removed or renamed meanwhile)
                pass
        files = []
        for path in self.root.glob("*.bin"):
            try:
                st = path.stat()
            except OSError:  # (removed meanwhile)
                continue
            files.append((st.st_mtime, st.st_blocks * 512, path))  # (the header's hole takes no blocks)
        held = sum(size for _, size, _ in files)
        kept = sum(size for _, size, path in files if path.name in self.used)
        removed = freed = 0
        for _, size, path in sorted(files):
            if held + needed <= self.limit or kept + needed > self.limit:  # (nothing removed for what cannot fit)
                break
            if path.name in self.used:
                continue
            try:  # (a process that maps it keeps its pages; one that opens it next packs again)
                path.unlink()
            except OSError:
                continue
            held, freed, removed = held - size, freed + size, removed + 1
        if removed:
            log.info("removed %d packed weights files used longest ago from %s (%.1f GiB), keeping it within %.1f GiB",
                     removed, self.root, freed / 2**30, self.limit / 2**30)
        return held

    def _write(self, pending: list[tuple[str, torch.Tensor]], needed: int) -> None:
        try:
            for key, tensor in pending:
                if not self._write_one(key, tensor):
                    return  # (stopped)
                self.written += tensor.numel() * tensor.element_size()
            log.info("packed weights written to %s (%.2f GiB): a later start maps them", self.root, needed / 2**30)
        except OSError as e:
            log.warning("packed weights not written to %s: %s", self.root, e)

    def _write_one(self, key: str, tensor: torch.Tensor) -> bool:
        """Whether it wrote `tensor` to `key`'s file (or found it there) before `close` stopped it."""
        path = self.path(key)
        if path.exists():
            return True
        header = json.dumps({"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}).encode()
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            with open(partial, "wb") as f:
                f.write(header)
                f.truncate(HEADER)
                f.seek(HEADER)
                data = _bytes(tensor)
                for start in range(0, len(data), _PIECE):
                    if self._stop.is_set():
                        return False
                    f.write(data[start : start + _PIECE])
            os.replace(partial, path)  # (whole: closed first)
            return True
        finally:
            partial.unlink(missing_ok=True)  # (gone already where it was renamed)

    def close(self, finish: bool = False) -> None:
        """Stop writing (a file half written is removed; `finish`: not before what is pending is written) and let go
        of what was pending."""
        if finish and self._writer is not None and self._writer.is_alive():
            log.info("finishing the packed weights' files in %s", self.root)
        else:
            self._stop.set()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self.pending = []
