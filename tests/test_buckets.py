"""Page-table widths: the kernels' ladder starts at MIN_PAGE_WIDTH pages, the reference path's
(whose attention computes over every page of the width) at REFERENCE_MIN_WIDTH."""

import forkjax
from forkjax.runtime.buckets import MIN_PAGE_WIDTH, REFERENCE_MIN_WIDTH, Buckets


def test_page_widths_climb_by_four_from_the_minimum_to_the_model_length():
    assert Buckets(64, 2048, max_pages=512).page_widths == [512]  # under MIN_PAGE_WIDTH: one width
    assert Buckets(64, 2048, max_pages=8192).page_widths == [MIN_PAGE_WIDTH, 4096, 8192]
    b = Buckets(64, 2048, max_pages=512, min_width=64)
    assert b.page_widths == [64, 256, 512]
    assert [b.width(p) for p in (1, 64, 65, 256, 257, 512)] == [64, 64, 256, 256, 512, 512]
    assert {w for *_, w in b.all()} == {64, 256, 512}


def test_the_reference_path_compiles_narrow_page_tables():
    kw = dict(warmup=False, max_model_len=4096, dtype="float32")  # 256 pages of 16 tokens
    reference = forkjax.Engine.from_pretrained("tiny-llama", use_pallas=False, **kw)
    assert reference.runner.buckets.page_widths == [REFERENCE_MIN_WIDTH, 256]
    reference.generate(["a short prompt"], max_new_tokens=3)  # its steps run at the narrowest width
    assert {shape[3] for shape in reference.runner._exes if shape[0] in ("decode", "extend")} == {64}
    kernels = forkjax.Engine.from_pretrained("tiny-llama", use_pallas=True, **kw)
    assert kernels.runner.buckets.page_widths == [256]
