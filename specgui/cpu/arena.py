"""A CPU model's weights in one buffer: every tensor 64-byte aligned, on 2 MiB pages where the kernel allows them.

Why: `from_pretrained` maps safetensors files into memory and hands out views of them, and a tensor of such a file
begins wherever the file's header ended. In the embedded model's converted file every weight matrix begins 40 bytes
past a 64-byte line, so half of the skinny kernels' 32-byte loads (every 64-byte load of the AVX-512 form) straddle two
cache lines, and the weights sit on the page cache's 4 KiB pages, one TLB entry per 4 KiB streamed. Copied here, once
at load, the same numbers in the same order (outputs bit for bit equal, tested) cost less at every row count.
Intel Xeon, two threads, the embedded model over 128 cached tokens, three copies of the model loaded in one process
and timed in turns (25 rounds, medians), forward ms as mapped / 64-byte aligned / aligned on 2 MiB pages:
AVX2 form (`SPECGUI_SIMD=avx2`) one row 26.7 / 24.5 / 22.2, 16 rows 41.8 / 41.0 / 39.2; AVX-512 form one row
21.8 / 20.2 / 19.0, 16 rows 38.7 / 37.1 / 36.3. What it costs, once a load: the copy 0.16-0.18 s there, the huge pages'
first faults 0.4-1.2 s more (the most in a fresh process of that VM, whose host backs the pages on first touch); a
process's resident memory after a first decode is no larger (0.97 GB against 1.12), the weights anonymous memory
instead of the file's pages.

Huge pages are asked for with `madvise` (Linux; where transparent huge pages are off, or on another OS, the buffer
keeps 4 KiB pages and only the alignment is gained). Models that are not plain parameters on the CPU (a GPU, a
`device_map` spread, bitsandbytes' quantized parameters) are left as they are.
"""

from __future__ import annotations

import ctypes
import sys

import torch
from torch import nn

LINE = 64  # bytes: where every tensor of the buffer begins
PAGE = 2 << 20  # bytes: a huge page, where the buffer's first tensor begins
MADV_HUGEPAGE = 14  # Linux's <sys/mman.h>


def gather(model: nn.Module) -> int:
    """Move every parameter of a CPU model into one new buffer (each tensor 64-byte aligned, the buffer on huge pages
    where the kernel gives them); return the bytes moved, 0 where the model is left as it was. Tied parameters stay
    tied (`parameters()` yields a shared one once); values, shapes, dtypes and `requires_grad` are unchanged."""
    params = list(model.parameters())
    if not params or any(type(p) is not nn.Parameter or p.device.type != "cpu" for p in params):
        return 0
    sizes = [-(-p.numel() * p.element_size() // LINE) * LINE for p in params]
    total = sum(sizes)
    buffer = torch.empty(total + PAGE, dtype=torch.uint8)  # untouched pages: none is resident before its copy
    offset = -buffer.data_ptr() % PAGE
    _huge_pages(buffer.data_ptr() + offset, total)
    with torch.no_grad():
        for p, size in zip(params, sizes):
            nbytes = p.numel() * p.element_size()
            view = buffer[offset : offset + nbytes].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
            offset += size
    return total


def _huge_pages(address: int, length: int) -> None:
    """Ask Linux for transparent huge pages over the whole 2 MiB pages of [address, address + length): advice only."""
    if not sys.platform.startswith("linux") or length < PAGE:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length // PAGE * PAGE), ctypes.c_int(MADV_HUGEPAGE))
    except (OSError, AttributeError):
        pass  # no madvise to call: 4 KiB pages, alignment still gained
