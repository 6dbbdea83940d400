"""``pages.release``: a converting load gives back the checkpoint pages it copied, and no value changes."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hfpatch_core.authoring import SizedConcatenate
from hfpatch_core.authoring._pages import release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pagemap is Linux's")

_FLOATS = 1 << 20  # 4 MiB of float32 per tensor: many whole pages


def _resident_pages(tensor: torch.Tensor) -> int:
    """How many pages of ``tensor``'s bytes are mapped into this process now."""
    start = tensor.data_ptr()
    first, last = start // mmap.PAGESIZE, (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        entries = memoryview(os.pread(fd, (last - first) * 8, first * 8)).cast("Q")
    finally:
        os.close(fd)
    return sum(1 for entry in entries if entry >> 63)


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({name: torch.randn(_FLOATS) for name in ("q", "k", "v")}, str(path))
    handle = safe_open(str(path), "pt")
    return {name: handle.get_slice(name)[...] for name in ("q", "k", "v")}  # views of the file, as the loader has


def test_release_unmaps_file_pages_and_keeps_values(checkpoint):
    q = checkpoint["q"]
    expected = q.clone()
    assert _resident_pages(q) > 250  # the clone read every page

    released = release([q])

    assert released >= (_FLOATS * 4) - 2 * mmap.PAGESIZE  # every whole page, edges excepted
    assert _resident_pages(q) <= 2
    assert torch.equal(q, expected)  # read again from the file


def test_release_of_a_share_gives_back_what_reading_it_mapped_of_its_whole_tensor(tmp_path):
    """A per-rank share (rows of a checkpoint tensor, as tensor parallelism reads it) is a view of the
    whole tensor: the pages around it that reading mapped are given back with it, and none changes."""
    path = tmp_path / "model.safetensors"
    save_file({"q": torch.randn(64, _FLOATS // 64)}, str(path))
    share = safe_open(str(path), "pt").get_slice("q")[32:64]  # rank 1 of 2
    whole = torch.as_strided(share, (64, _FLOATS // 64), share.stride(), 0)  # the same storage, from its start
    expected = whole.clone()  # maps every page of the tensor, the other rank's rows included
    assert share.untyped_storage().nbytes() == _FLOATS * 4 and _resident_pages(whole) > 250

    release([share])

    assert _resident_pages(whole) <= 2  # rank 0's rows too
    assert torch.equal(whole, expected)


def test_release_never_touches_anonymous_memory():
    tensor = torch.randn(_FLOATS)
    expected = tensor.clone()

    assert release([tensor]) == 0
    assert torch.equal(tensor, expected)
    assert _resident_pages(tensor) > 250


def test_release_keeps_pages_the_process_wrote(checkpoint):
    q = checkpoint["q"]
    middle = _FLOATS // 2
    q[middle] = 12345.0  # copy-on-write: this page no longer holds the file's bytes

    released = release([q])

    assert released < (_FLOATS * 4) - 2 * mmap.PAGESIZE
    assert float(q[middle]) == 12345.0


def test_release_skips_what_it_cannot_place():
    strided = torch.randn(64, 64).t()
    assert release([strided, torch.empty(0), torch.randn(3, device="meta")]) == 0


def test_sized_concatenate_releases_its_sources(checkpoint):
    parts = {name: checkpoint[name] for name in ("q", "k", "v")}
    copies = {name: tensor.clone() for name, tensor in parts.items()}
    op = SizedConcatenate(dim=0, sizes=(_FLOATS,) * 3)

    fused = op.convert(dict(parts), ["q", "k", "v"], ["qkv"])["qkv"]

    assert torch.equal(fused, torch.cat([copies["q"], copies["k"], copies["v"]]))
    assert all(_resident_pages(tensor) <= 2 for tensor in parts.values())


def _resident_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) // 1024


def test_trim_heap_gives_back_what_freed_temporaries_left_in_the_heap() -> None:
    from hfpatch_core.authoring._pages import trim_heap

    first = torch.ones(1 << 20, dtype=torch.uint8)
    del first  # freeing a 1 MiB block raises glibc's threshold: blocks of that size now come from the heap
    kept, freed = [], []
    for index in range(200):  # the temporaries of a gathered load: 1 MiB each, every other one freed
        block = torch.ones((1 << 20) - 4096 * (index % 7), dtype=torch.uint8)
        (kept if index % 2 else freed).append(block)
    del freed
    before = _resident_mib()
    assert trim_heap()
    assert before - _resident_mib() >= 50  # of the ~100 MiB freed
    assert all(int(block[0]) == 1 and int(block[-1]) == 1 for block in kept)
