"""The C allocator tuning every model process applies (shared.settings.tune_malloc)."""

import platform

import pytest

from shared.settings import tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_every_setting():
    assert tune_malloc() is True
