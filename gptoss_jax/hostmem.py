"""Host memory of the process: fewer allocator arenas, so that loading keeps near one layer's size;
large blocks given back to the system when freed (`return_large_blocks`, for the server).

glibc's malloc gives each thread that allocates an arena of its own (up to 8 per core), and an arena
keeps what was freed in it. JAX's runtime and TensorStore run many threads, so while a checkpoint is
read in pieces the freed pieces pile up across arenas: on one NVIDIA H100 80GB host with 16 cores,
loading gpt-oss-20b with packed experts took 1.46 GiB of host memory at its peak, against 0.45 GiB
(one 0.44 GiB layer) with two arenas (docs/benchmarks.md). The command line sets two arenas as it starts;
library users can call `limit_allocator_arenas` before JAX starts its backend, or set the
environment variable MALLOC_ARENA_MAX=2 before starting Python.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_ARENA_MAX = -8  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def _mallopt(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(option, value))
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False


def limit_allocator_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas for threads that allocate from now on (True if set; False where the
    C library is not glibc). Threads JAX has already started keep theirs: call this first."""
    return _mallopt(_M_ARENA_MAX, arenas)


def return_large_blocks(least: int = 2**20) -> bool:
    """Have glibc's malloc map every block of at least `least` bytes on its own, so that freeing it gives
    the memory back to the system at once (True if set). By default glibc raises that threshold to
    the size of a large block once one is freed (up to 32 MiB), and blocks below it then stay in the
    heap when freed: a server that reads and writes bodies of 15 MB kept hundreds of MB it no longer
    used."""
    return _mallopt(_M_MMAP_THRESHOLD, least)
