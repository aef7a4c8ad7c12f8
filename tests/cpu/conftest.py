"""Fixtures shared by the CPU kernel tests."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture(scope="session")
def avx2_library(tmp_path_factory):
    """The kernel library built with ``-mno-avx512f``: its AVX2 + FMA paths, on an AVX-512 CPU as on a laptop's
    (built once per session: ~30 s)."""
    from roofline.kernels import cpu_paged_attention as cpa

    lib = cpa._compile_and_load(shutil.which("g++"), "avx2.so", tmp_path_factory.mktemp("avx2"), ("-mno-avx512f",))
    assert not isinstance(lib, str), lib
    return lib
