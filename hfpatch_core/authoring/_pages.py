"""Giving back the checkpoint pages a conversion has read.

transformers memory-maps a safetensors checkpoint and hands converters views of it.
A weight that loads as it is stays such a view and is read from the file when it is
used, but a converted weight (a fused ``qkv_proj``) is a new tensor: reading the
sources maps their file pages into the process, and they stay counted in its resident
memory until the checkpoint is unmapped, next to the new tensor.  A converting load
would so need twice the bytes it converts.  ``release`` unmaps those pages once they
have been copied; the file stays mapped, and a later read maps them again.

Only pages that still hold the file's own bytes are released (``/proc/self/pagemap``
says so per page): a page the process wrote to (a trained weight of a private mapping)
or anonymous memory is never touched, so no value can change.  Elsewhere than on
Linux, or where the pagemap cannot be read, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4
_PRESENT = 1 << 63
#: a page of a file (or shared memory), not an anonymous or copied-on-write one
_FILE_PAGE = 1 << 61


@functools.cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = libc.madvise
    except (OSError, AttributeError):  # pragma: no cover - no usable libc
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def _ranges(tensors: Iterable[Any]) -> Iterator[tuple[int, int]]:
    """The whole pages of the storage behind each contiguous CPU tensor, as ``(first page, end page)``.

    The storage, not only the tensor's own bytes: a per-rank share (tensor parallelism,
    FSDP2) is a view of the whole checkpoint tensor it was read from, and reading the
    share maps more of that tensor than the share (the kernel's fault-around and
    readahead), pages that no one else reads.  Releasing a clean file page changes no value
    whoever uses it: a later read maps it again.
    """
    for tensor in tensors:
        if getattr(tensor, "device", None) is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        first, last = -(-start // _PAGE), end // _PAGE
        if last > first:
            yield first, last


def _file_pages(pagemap: int, first: int, last: int) -> Iterator[tuple[int, int]]:
    """Runs ``(first, end)`` of pages between ``first`` and ``last`` that are present and hold file bytes."""
    entries = memoryview(os.pread(pagemap, (last - first) * 8, first * 8)).cast("Q")
    run = None
    for index, entry in enumerate(entries):
        if entry & _PRESENT and entry & _FILE_PAGE:
            run = run if run is not None else first + index
        elif run is not None:
            yield run, first + index
            run = None
    if run is not None:
        yield run, first + len(entries)


def release(tensors: Iterable[Any]) -> int:
    """Unmap the file pages that ``tensors`` (views of a memory-mapped checkpoint) occupy.

    Called by a conversion once it has copied its sources into the tensor it returns,
    and only then: the sources stay valid (a read maps the page again), but their
    pages no longer count in the process's resident memory.

    Returns:
        The number of bytes released (0 where nothing was file-backed, or off Linux).
    """
    madvise = _madvise()
    ranges = list(_ranges(tensors))
    if madvise is None or not ranges:
        return 0
    try:
        pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return 0
    released = 0
    try:
        for first, last in ranges:
            for start, end in _file_pages(pagemap, first, last):
                if madvise(start * _PAGE, (end - start) * _PAGE, _MADV_DONTNEED) == 0:
                    released += (end - start) * _PAGE
    finally:
        os.close(pagemap)
    return released


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(ctypes.util.find_library("c") or None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    return function


def trim_heap() -> bool:
    """Give the C heap's free memory back to the system (glibc's ``malloc_trim``).

    A conversion that builds each result through temporaries of a few MiB (an FSDP2
    load gathers each part whole to keep this rank's cut of the fused tensor) frees
    them at once, but glibc keeps freed blocks of that size in its heaps, in the
    process's resident memory, and the next ones rarely fit the holes: without this,
    the freed temporaries add up over the layers.  Only free memory is returned; no
    tensor is touched.

    Returns:
        Whether memory was returned (``False`` off glibc, or when there was none).
    """
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
