"""The kernel process's malloc settings: big output buffers are reused, not handed back.

A long print passes through the kernel as a stream of buffers of 0.25 to a few MiB (the
frames it reads, the lines it joins, the messages it publishes), each freed soon after.
glibc's defaults give such a buffer fresh pages from the system each time: blocks past the
(adaptive) mmap threshold are mapped and unmapped, and free memory at the top of the heap
goes back once it passes the (adaptive) trim threshold. Every fresh page is a page fault:
about 12,000 of them per 20 MiB printed. With these settings blocks under MMAP_THRESHOLD
come from the heap and up to TRIM_THRESHOLD of free memory stays there for the next one:
the faults are gone (the kernel's CPU for that print: 306 -> 271 ms, side by side) and the
kernel keeps up to that much free memory per malloc heap (glibc makes one per thread that
allocates at the same time as another), for the next long output.

Only the kernel's own process is tuned: the variables glibc reads at start-up
(MALLOC_*_THRESHOLD_) would be inherited by whatever the kernel starts.
"""

from __future__ import annotations

import ctypes
import platform

MMAP_THRESHOLD = 4 * 1024 * 1024
TRIM_THRESHOLD = 16 * 1024 * 1024
# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def reuse_large_buffers() -> bool:
    """Apply the settings above; False (and nothing changed) where libc is not glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # mallopt answers 1 on success.
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
