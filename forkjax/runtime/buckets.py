"""The static shapes the ModelRunner compiles: every batch is padded up to one of them.

Decode: batch sizes 4, 8, 16, ... up to max_batch_size (the hot path: little padding). None is
smaller than MIN_DECODE_ROWS (or max_batch_size, if that is smaller): XLA on a GPU runs a
one-row GEMM over a dynamic slice of the scanned layers' weights as a matrix-vector fusion
several times slower than four rows on cuBLAS (BENCHMARKS.md, Engine decode and prefill).
Extend: chunk tokens C in 16, 64, 256, ... and requests B in 1, 4, 16, ... with B·C within
max_prefill_tokens (each cap itself a bucket), so a whole prefill sweep is ~15 programs. A chunk
longer than `piece` tokens goes as consecutive pieces of at most `piece`, one row each
(scheduler.py): rows are padded to the step's longest, so two prompts of 600 and 300 tokens as
whole rows would cost 2 x 1,024 positions for 900 tokens, and as pieces of 256 the same step
carries the 900 and the first 1,000 of the prompts behind them. `piece` is the smallest chunk
bucket of at least an eighth of the budget whose rows still carry the whole budget.
Page tables: width W (pages) in 1024, 4096, ... up to the pages of max_model_len, by the batch's
longest request, so a step of short requests never carries (or, in the kernels that size their
work by W, computes over) the width of a 128k context; models up to 16k tokens have one width.
The reference path (the jnp attention a CPU runs) computes over all W pages of every row, so its
ladder starts at REFERENCE_MIN_WIDTH pages instead: a short chat with smollm2-135m (8k context)
attends over 1,024 positions a step, not 8,192, at the cost of a full warm-up compiling three
widths' programs (BENCHMARKS.md, Start-up).

Fixed (deterministic mode): one program per kind, so every step of a kind runs the same GEMM
shapes, kernel splits and reduction orders whatever the batch holds, and a row's arithmetic
depends only on its own inputs. Decode: max_batch_size rows. Extend: B rows of C tokens with
C = max_prefill_tokens / 4 (at least MIN_CHUNK) and B·C within max_prefill_tokens; a row is one
request's chunk, and a long prompt fills several rows with pieces of C tokens, so it takes as
many steps as by default. One page-table width.
"""

from __future__ import annotations

MIN_CHUNK = 16
MIN_DECODE_ROWS = 4
MIN_PAGE_WIDTH = 1024
REFERENCE_MIN_WIDTH = 64


def _ladder(cap: int, start: int, factor: int) -> list[int]:
    out, v = [], start
    while v < cap:
        out.append(v)
        v *= factor
    return out + [cap]


class Buckets:
    def __init__(self, max_batch_size: int, max_prefill_tokens: int, max_pages: int = MIN_PAGE_WIDTH,
                 *, fixed: bool = False, min_width: int = MIN_PAGE_WIDTH):
        if max_prefill_tokens < MIN_CHUNK:
            raise ValueError(f"max_prefill_tokens={max_prefill_tokens} must be >= {MIN_CHUNK}")
        if fixed:
            c = max(MIN_CHUNK, max_prefill_tokens // 4)
            self.decode_sizes, self.chunk_sizes, self.page_widths = [max_batch_size], [c], [max_pages]
            self.extend_sizes = {c: [max(1, min(max_batch_size, max_prefill_tokens // c))]}
            self.piece = c
            return
        self.decode_sizes = _ladder(max_batch_size, min(MIN_DECODE_ROWS, max_batch_size), 2)
        self.chunk_sizes = _ladder(max_prefill_tokens, MIN_CHUNK, 4)
        self.extend_sizes = {c: _ladder(max(1, min(max_batch_size, max_prefill_tokens // c)), 1, 4)
                             for c in self.chunk_sizes}
        self.page_widths = _ladder(max_pages, min_width, 4) if max_pages > min_width else [max_pages]
        # the last chunk bucket (the budget, one row) always qualifies
        self.piece = next(c for c in self.chunk_sizes if 8 * c >= max_prefill_tokens
                          and c * self.extend_sizes[c][-1] >= max_prefill_tokens)

    def width(self, pages: int) -> int:
        """Page-table width for a batch whose longest page table has `pages` entries."""
        return next(w for w in self.page_widths if w >= pages)

    def decode(self, n: int) -> int:
        return next(b for b in self.decode_sizes if b >= n)

    def extend(self, n: int, max_chunk: int) -> tuple[int, int] | None:
        """(B, C) for n requests whose longest chunk is max_chunk, or None if none fits."""
        c = next((c for c in self.chunk_sizes if c >= max_chunk), None)
        if c is None:
            return None
        b = next((b for b in self.extend_sizes[c] if b >= n), None)
        return None if b is None else (b, c)

    def sample_sizes(self) -> list[int]:
        """Every B of a step's sampled rows: the decode sizes and the extend steps' requests."""
        return sorted(set(self.decode_sizes).union(*self.extend_sizes.values()))

    def all(self) -> list[tuple[str, int, int, int]]:
        """Every (kind, requests, chunk, page-table width) program."""
        shapes = ([("decode", b, 1) for b in self.decode_sizes]
                  + [("extend", b, c) for c in self.chunk_sizes for b in self.extend_sizes[c]])
        return [(k, b, c, w) for w in self.page_widths for k, b, c in shapes]
