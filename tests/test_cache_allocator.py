import numpy as np
import pytest

from forkjax.cache import PageAllocator


def test_alloc_hands_out_distinct_pages_never_the_sink():
    a = PageAllocator(6)
    pages = a.alloc(5)
    assert sorted(pages.tolist()) == [1, 2, 3, 4, 5]
    assert np.all(a.refcount[pages] == 1) and a.refcount[0] == 0
    assert a.num_free == 0 and a.num_used == 5 == a.num_usable
    a.check()


def test_alloc_is_all_or_nothing():
    a = PageAllocator(4)
    assert a.alloc(4) is None  # only 3 usable
    assert a.num_free == 3
    assert len(a.alloc(3)) == 3 and a.alloc(1) is None


def test_dec_ref_frees_at_zero_and_pages_are_reused():
    a = PageAllocator(4)
    p = a.alloc(2)
    a.inc_ref(p[:1])
    assert a.dec_ref(p) == 1  # p[1] freed, p[0] still held once
    assert a.refcount[p[0]] == 1 and a.num_free == 2
    assert a.dec_ref(p[:1]) == 1
    assert a.num_free == 3
    assert sorted(a.alloc(3).tolist()) == [1, 2, 3]
    a.check()


def test_double_free_and_sink_free_raise():
    a = PageAllocator(4)
    p = a.alloc(1)
    a.dec_ref(p)
    with pytest.raises(ValueError, match="freed twice"):
        a.dec_ref(p)
    with pytest.raises(ValueError):
        a.dec_ref(np.array([0], np.int32))


def test_inc_ref_on_free_page_raises():
    a = PageAllocator(4)
    with pytest.raises(ValueError, match="free page"):
        a.inc_ref(np.array([2], np.int32))


def test_check_detects_a_leak():
    a = PageAllocator(4)
    a.alloc(1)
    a.refcount[3] = 1  # referenced but never handed out: on the free list
    with pytest.raises(AssertionError):
        a.check()
