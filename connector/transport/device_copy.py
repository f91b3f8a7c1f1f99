"""Block-wise copies on the device that holds the memory: the gather (prefill) and the scatter (decode) of a staged
chunk (why: `connector.core.staging_ranges`).

A chunk is a list of `Rows`: equal-size rows of one region part, row k at `addr + blocks[k] * stride`. Each is one
kernel over a `[rows, row_bytes]` view of memory we do not own (no copy, no ownership), with an index of one entry
per block:
- gather: the block ids' rows into the packed chunk (`index_select` on a GPU, `numpy.take` on a CPU);
- scatter: the packed chunk copied into the block ids (`index_copy_` on a GPU, numpy's row assignment on a CPU).
Rows are viewed as the widest integer word their addresses, stride and length allow (8 bytes for every vLLM layout),
so an elementwise kernel moves words, not bytes.

On CUDA the kernels run on a dedicated copy stream, and the calling thread waits for an event recorded after them:
never a device-wide synchronize, so prefill's compute and vLLM's own streams never wait for a transfer. On a CPU
the copy runs on the calling thread (see `_run` for why not torch).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from connector.core.staging_ranges import Rows


def _word(*values: int) -> int:
    """The widest word (bytes) every address, stride and length is a multiple of."""
    return next(w for w in (8, 4, 2, 1) if not any(v % w for v in values))


_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}


def _interface(addr: int, nrows: int, row_bytes: int, stride: int, width: int) -> dict:
    """The array interface of `[nrows, row_bytes / width]` words at `addr`, rows `stride` bytes apart."""
    return {"shape": (nrows, row_bytes // width), "typestr": _TYPESTR[width], "data": (addr, False), "version": 3,
            "strides": (stride, width)}


class _HostMemory:
    """Raw host memory as numpy's array interface describes it (a view of memory we do not own)."""

    def __init__(self, *args: int) -> None:
        self.__array_interface__ = _interface(*args)


class _CudaMemory:
    """Raw device memory as the CUDA array interface describes it (how torch wraps a pointer it does not own). No
    `stream` key: the caller orders the access itself (the copy stream, after the events it waited for)."""

    def __init__(self, *args: int) -> None:
        self.__cuda_array_interface__ = _interface(*args)


class BlockCopier:
    """Gathers and scatters of staged chunks on one device. Thread-safe: each call waits only for its own kernels
    (call it from a worker thread, never the event loop)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    def gather(self, rows: Sequence[Rows], packed_addr: int) -> None:
        """Copy every row of `rows`, in order, back to back into memory at `packed_addr`; returns once they are there."""
        self._run(rows, packed_addr, gather=True)

    def scatter(self, rows: Sequence[Rows], packed_addr: int) -> None:
        """Copy the rows packed back to back at `packed_addr` to where `rows` says; returns once they are there.
        Destinations must not overlap each other (block ids of one Rows are distinct)."""
        self._run(rows, packed_addr, gather=False)

    def _run(self, rows: Sequence[Rows], packed_addr: int, gather: bool) -> None:
        rows = [r for r in rows if r.blocks.size]
        if not rows:
            return
        if self.cuda:
            self._run_cuda(rows, packed_addr, gather)
            return
        offset = 0
        for r in rows:
            width = _word(r.addr, r.stride, r.row_bytes, packed_addr + offset)
            n = int(r.blocks.size)
            packed = np.asarray(_HostMemory(packed_addr + offset, n, r.row_bytes, r.row_bytes, width))
            view = np.asarray(_HostMemory(r.addr, int(r.blocks.max()) + 1, r.row_bytes, r.stride, width))
            # numpy, not torch: torch's CPU index ops run on its OpenMP pool, whose threads spin at a barrier when
            # cores are busy (0.1-0.4 GB/s measured on a loaded 2-core box, against 3.5-4.6 here); numpy copies each
            # row with one memmove on this thread. "clip" skips a per-row bounds check the view makes moot: it
            # has exactly max(block) + 1 rows, and block ids were checked against the region before.
            if gather:
                np.take(view, r.blocks, axis=0, out=packed, mode="clip")
            else:
                view[r.blocks] = packed
            offset += n * r.row_bytes

    def _run_cuda(self, rows: Sequence[Rows], packed_addr: int, gather: bool) -> None:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            # One host-to-device copy for every row's block ids, then one kernel per Rows.
            ids = torch.from_numpy(np.concatenate([r.blocks for r in rows])).to(self.device, non_blocking=True)
            first = offset = 0
            for r in rows:
                n = int(r.blocks.size)
                width = _word(r.addr, r.stride, r.row_bytes, packed_addr + offset)
                packed = torch.as_tensor(_CudaMemory(packed_addr + offset, n, r.row_bytes, r.row_bytes, width),
                                         device=self.device)
                view = torch.as_tensor(_CudaMemory(r.addr, int(r.blocks.max()) + 1, r.row_bytes, r.stride, width),
                                       device=self.device)
                if gather:
                    torch.index_select(view, 0, ids[first:first + n], out=packed)
                else:
                    view.index_copy_(0, ids[first:first + n], packed)
                first += n
                offset += n * r.row_bytes
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()  # this thread waits for these kernels only

    def digests(self, parts: Sequence[Rows]) -> np.ndarray:
        """One uint64 per block of `parts` (the Rows of one route's parts, with the same blocks in the same order):
        each block's rows, part after part, read as little-endian int32 words (bytes if a row is not a multiple of
        4), summed with weights 1, 3, 5, ... by word position, modulo 2**64 (`kv_checksum`, connector.core.checksums).
        Any change of one word changes the sum (odd weights are invertible modulo 2**64), and the same bytes give the
        same digest on a CPU and a GPU, whatever their addresses. Not cryptographic: it catches corruption and
        misplaced blocks, not an attacker (who holds the token and can write anything anyway)."""
        parts = [r for r in parts if r.blocks.size]
        if not parts:
            return np.zeros(0, dtype=np.uint64)
        word = 4 if all(r.row_bytes % 4 == 0 for r in parts) else 1
        if self.cuda:
            return self._digests_cuda(parts, word)
        total = np.zeros(parts[0].blocks.size, dtype=np.int64)
        first_word = 0
        for r in parts:
            width = _word(r.addr, r.stride, r.row_bytes)
            view = np.asarray(_HostMemory(r.addr, int(r.blocks.max()) + 1, r.row_bytes, r.stride, width))
            words = r.row_bytes // word
            weights = 2 * (first_word + np.arange(words, dtype=np.int64)) + 1
            step = max(1, (8 << 20) // words)  # blocks per pass: temporaries of at most 64 MiB
            for b0 in range(0, r.blocks.size, step):
                rows = np.take(view, r.blocks[b0:b0 + step], axis=0, mode="clip")
                values = rows.view("<i4" if word == 4 else np.uint8)
                # One pass, products and sums in int64, which wraps: modulo 2**64 (5x faster than multiplying a
                # widened copy and summing it)
                total[b0:b0 + step] += np.einsum("ij,j->i", values, weights, dtype=np.int64, casting="unsafe")
            first_word += words
        return total.view(np.uint64)

    def _digests_cuda(self, parts: Sequence[Rows], word: int) -> np.ndarray:
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            total = torch.zeros(parts[0].blocks.size, dtype=torch.int64, device=self.device)
            first_word = 0
            for r in parts:
                width = _word(r.addr, r.stride, r.row_bytes)
                view = torch.as_tensor(_CudaMemory(r.addr, int(r.blocks.max()) + 1, r.row_bytes, r.stride, width),
                                       device=self.device)
                ids = torch.from_numpy(r.blocks).to(self.device, non_blocking=True)
                words = r.row_bytes // word
                weights = 2 * (first_word + torch.arange(words, dtype=torch.int64, device=self.device)) + 1
                rows = torch.index_select(view, 0, ids)
                values = rows.view(torch.int32 if word == 4 else torch.uint8).to(torch.int64)
                total += (values * weights).sum(dim=1)
                first_word += words
            out = total.cpu()  # on the copy stream: waits for these kernels only
        return out.numpy().view(np.uint64)
