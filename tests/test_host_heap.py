"""The glibc heap setting ``LLM`` makes once per process (``deepinfer_core/host_heap.py``)."""

from __future__ import annotations

import platform

import pytest

from deepinfer_core import host_heap

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for name in (host_heap.ENV, *host_heap._GLIBC_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    host_heap.keep_freed_heap.cache_clear()
    yield
    host_heap.keep_freed_heap.cache_clear()


@glibc
def test_the_heap_is_kept_where_the_c_library_is_glibc():
    assert host_heap.keep_freed_heap() is True


@pytest.mark.parametrize("name, value", [(host_heap.ENV, "0"), ("MALLOC_TRIM_THRESHOLD_", "1048576"),
                                         ("MALLOC_MMAP_THRESHOLD_", "131072")])
def test_the_switch_and_a_users_glibc_variable_leave_the_heap_alone(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert host_heap.keep_freed_heap() is False
