"""Packing a step's sequences for the backbone: each job's sequences in rows of one common
length, several sequences per row with position ids restarting at 0 (transformers then builds a
block-causal mask), or every sequence in one row for the varlen attention (pack_flat).

A row never mixes jobs, so one job's NaN cannot reach another job through attention. The step's
[rows, length] comes from a few buckets (ShapeBuckets), so attention plans are reused.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainer.data import IGNORE, Example


@dataclass


class PackedBatch:
    """A step's rows: [R, L] ids, position ids, next-token targets; `row_offsets[i]` is job i's
    first row (rows of a job are contiguous, jobs in slot order)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    row_offsets: list[int]
    real_tokens: int
    # [R, L] int64: the step-wide index of the sequence each token belongs to (-1 on padding),
    # sequences numbered job by job in the order given to pack_step (per-sequence sums, DPO)
    seq_index: torch.Tensor | None = None
    # flat (varlen) batches: [1, T] holding every job's sequences one after another; job i's
    # tokens are token_offsets[i]..token_offsets[i + 1] and cu_seqlens bound every sequence
    # (the padding tail included), for an attention that never crosses them
    token_offsets: list[int] | None = None
    cu_seqlens: list[int] | None = None
    # on the device: the keyword arguments the varlen attention reads (bounds, longest)
    varlen: dict[str, Any] | None = None

    @property
    def job_tokens(self) -> list[int]:
        """Each job's first token in the flattened [R * L] order (and the end)."""
        if self.token_offsets is not None:
            return self.token_offsets
        return [r * self.input_ids.shape[1] for r in self.row_offsets]

    @property
    def padded_fraction(self) -> float:
        total = self.input_ids.numel()
        return 0.0 if total == 0 else 1.0 - self.real_tokens / total

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            self.input_ids.to(device), self.position_ids.to(device), self.targets.to(device),
            self.row_offsets, self.real_tokens,
            None if self.seq_index is None else self.seq_index.to(device),
            self.token_offsets, self.cu_seqlens,
        )


def _pack_order(lengths: Sequence[int], length: int) -> list[list[int]]:
    # First-fit decreasing of sequence positions into rows of `length`; stable for equal lengths.
    rows: list[list[int]] = []
    room: list[int] = []
    for k_seq in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        n = lengths[k_seq]
        for k, free in enumerate(room):
            if n <= free:
                rows[k].append(k_seq)
                room[k] -= n
                break
        else:
            rows.append([k_seq])
            room.append(length - n)
    return rows


def bucket_up(n: int, per_octave: int) -> int:
    """The smallest size >= n of the form m * 2^e with per_octave <= m < 2 * per_octave (every
    size up to 2 * per_octave is its own bucket): `per_octave` sizes per doubling, so rounding up
    adds less than 1 / per_octave (per_octave a power of two)."""
    step = max(1, (1 << (max(n, 1).bit_length() - 1)) // per_octave)
    return -(-n // step) * step


@dataclass(frozen=True)
class ShapeBuckets:
    """The sizes a packed step's [rows, length] may take, so attention (cuDNN plans are built
    per shape), autotuned kernels and the allocator see few distinct shapes over a run: lengths
    at least `min_length`, `length_per_octave` per doubling; rows `rows_per_octave` per doubling
    (rows of pure padding after the last job's fill a step up). The defaults: on the task_e2e
    study's steps (bench/task_e2e.py --pack-only) 18 training shapes instead of 84, at 39% padded
    cells instead of 35% (the padding is each job's rows padded to the step's length)."""

    length_per_octave: int = 2
    rows_per_octave: int = 8
    min_length: int = 32

    def length(self, n: int) -> int:
        return bucket_up(max(n, self.min_length), self.length_per_octave)

    def rows(self, n: int) -> int:
        return bucket_up(n, self.rows_per_octave)

    def lengths(self, longest: int, max_row_len: int) -> list[int]:
        """Candidate row lengths: the bucket of the longest sequence and the larger buckets up
        to max_row_len."""
        out = [self.length(longest)]
        while True:
            nxt = self.length(out[-1] + 1)
            if nxt > max_row_len:
                return out
            out.append(nxt)


def _choose_shape(job_lengths: Sequence[Sequence[int]], longest: int, multiple_of: int,
                  max_row_len: int, buckets: ShapeBuckets | None, max_cells: int | None,
                  ) -> tuple[int, int, list[list[list[int]]]]:
    """(rows, length, each job's rows) of the packing with the fewest cells (ties: the shorter
    rows, less attention work). Without buckets: the length among a few multiples of the longest
    sequence, rows as packed. With buckets: bucket lengths and rows, at most max_cells cells
    (rows as packed where the row bucket would exceed it; the fewest cells if nothing fits)."""
    if buckets is None:
        lengths = []
        for factor in (1.0, 1.25, 1.5, 2.0, 3.0, 4.0):
            cand = -(-max(longest, int(longest * factor)) // multiple_of) * multiple_of
            if cand > max(lengths[0] if lengths else cand, max_row_len):
                break
            lengths.append(cand)
    else:
        lengths = sorted({-(-n // multiple_of) * multiple_of for n in buckets.lengths(longest, max_row_len)})
    options = []  # (cells, length, rows, layout)
    for length in lengths:
        layout = [_pack_order(lens, length) for lens in job_lengths]
        packed = sum(len(r) for r in layout)
        rows = packed if buckets is None else buckets.rows(packed)
        if max_cells is not None and rows * length > max_cells:
            rows = packed  # the bucket would exceed the memory the step was admitted for
        options.append((rows * length, length, rows, layout))
    fitting = [o for o in options if max_cells is None or o[0] <= max_cells] or options
    _, length, rows, layout = min(fitting, key=lambda o: (o[0], o[1]))
    return rows, length, layout


def pack_step(
    per_job: Sequence[Sequence[Example]], pad_id: int, pack: bool = True, multiple_of: int = 1,
    max_row_len: int = 2048, buckets: ShapeBuckets | None = None, max_cells: int | None = None,
) -> PackedBatch:
    """Pack each job's examples into rows of one common length, several sequences per row (first
    fit decreasing), position ids restarting at 0 for each sequence; the length (and the row
    count) by `_choose_shape`. Rows added to reach a row bucket are pure padding and belong to
    the last job. With pack=False, one sequence per row padded to the longest, positions running
    on through the padding (a plain causal row, the unpacked reference)."""
    lens = [[len(e.input_ids) for e in seqs] for seqs in per_job]
    longest = max((n for job in lens for n in job), default=1)
    if pack:
        n_rows, length, layout = _choose_shape(lens, longest, multiple_of, max_row_len, buckets,
                                               max_cells)
    else:
        length = -(-longest // multiple_of) * multiple_of
        layout = [[[k] for k in range(len(job))] for job in lens]
        n_rows = sum(len(job) for job in lens)
    return _fill(per_job, layout, n_rows, length, pad_id, restart_padding=pack)


def _fill(per_job: Sequence[Sequence[Example]], layout: Sequence[Sequence[Sequence[int]]],
          n_rows: int, length: int, pad_id: int, restart_padding: bool) -> PackedBatch:
    """The batch tensors of a layout (each job's rows of its sequence numbers)."""
    placed: list[tuple[int, Example, int]] = []  # (start cell, sequence, step-wide index)
    fill: list[int] = []
    row_offsets, first, r = [0], 0, 0
    for j, job_rows in enumerate(layout):
        for row in job_rows:
            c = 0
            for k in row:
                ex = per_job[j][k]
                placed.append((r * length + c, ex, first + k))
                c += len(ex.input_ids)
            fill.append(c)
            r += 1
        row_offsets.append(r)
        first += len(per_job[j])
    row_offsets[-1] = n_rows  # rows that fill the row bucket up are the last job's (all padding)
    fill += [0] * (n_rows - r)
    ids, pos, tgt, seq = _write(placed, fill, n_rows, length, pad_id, restart_padding)
    return PackedBatch(ids, pos, tgt, row_offsets, sum(fill), seq)


def pack_flat(per_job: Sequence[Sequence[Example]], pad_id: int, per_octave: int = 16,
              max_cells: int | None = None, length: int | None = None, max_len: int | None = None
              ) -> PackedBatch:
    """Every job's sequences in ONE row [1, T], job after job, for an attention over variable-
    length sequences (cu_seqlens): no padding between sequences and none per job; T is the token
    count rounded up to `per_octave` sizes per doubling (at most max_cells unless the tokens
    alone exceed it), or `length` where given (>= the tokens), the tail padding sequences of at
    most `max_len` tokens each (one where max_len is None). Jobs are token ranges
    (token_offsets)."""
    placed: list[tuple[int, Example, int]] = []
    token_offsets, total = [0], 0
    for seqs in per_job:
        for ex in seqs:
            placed.append((total, ex, len(placed)))
            total += len(ex.input_ids)
        token_offsets.append(total)
    if length is None:
        length = flat_length(total, per_octave, max_cells)
    elif length < total:
        raise ValueError(f"a row of {length} tokens cannot hold {total}")
    token_offsets[-1] = length  # the padding tail is the last job's (nothing trained)
    piece = max_len or max(length - total, 1)
    cu = [start for start, _, _ in placed] + list(range(total, length, piece)) + [length]
    if length == total:
        cu = [start for start, _, _ in placed] + [total]
    ids, pos, tgt, seq = _write(placed, [total], 1, length, pad_id, True)
    return PackedBatch(ids, pos, tgt, [0] * len(per_job) + [1], total, seq, token_offsets, cu)


def flat_length(total: int, per_octave: int = 16, max_cells: int | None = None) -> int:
    """pack_flat's row length T for `total` tokens: rounded up to `per_octave` sizes per doubling, or the
    tokens alone where that exceeds max_cells."""
    length = max(bucket_up(total, per_octave), 1)
    return max(total, 1) if max_cells is not None and length > max_cells else length


def flat_sequences(n_seqs: int, total: int, length: int, max_len: int | None) -> int:
    """pack_flat's sequence count (len(cu_seqlens) - 1): the sequences, then the padding tail's pieces."""
    return n_seqs + len(range(total, length, max_len or max(length - total, 1)))


def _write(placed: Sequence[tuple[int, Example, int]], fill: Sequence[int], n_rows: int,
           length: int, pad_id: int, restart_padding: bool) -> tuple[torch.Tensor, ...]:
    """[rows, length] ids, positions, next-token targets and sequence index, each sequence
    written at its start cell, each row padded after `fill`: slice writes into host arrays (no
    per-token Python work, no parallel tensor ops on the host), viewed as tensors."""
    cells = n_rows * length
    ids = array("q", [pad_id]) * cells
    tgt = array("q", [IGNORE]) * cells
    seq = array("q", [-1]) * cells
    ramp = array("q", range(length))
    pos = ramp * n_rows  # unpacked rows: positions run on through the padding (plain causal)
    if restart_padding:
        # padding forms its own block (positions restart at 0), so it never joins a sequence
        for r, c in enumerate(fill):
            pos[r * length + c : (r + 1) * length] = ramp[: length - c]
    ignore = array("q", [IGNORE])
    for start, ex, k in placed:
        n = len(ex.input_ids)
        ids[start : start + n] = array("q", ex.input_ids)
        # next-token targets inside the sequence only; its last token predicts nothing
        tgt[start : start + n] = array("q", ex.labels[1:]) + ignore
        seq[start : start + n] = array("q", [k]) * n
        pos[start : start + n] = ramp[:n]
    return tuple(torch.frombuffer(a, dtype=torch.int64).view(n_rows, length) if cells else
                 torch.zeros((n_rows, length), dtype=torch.int64) for a in (ids, pos, tgt, seq))
