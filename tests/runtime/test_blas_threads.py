"""``blas_threads``: MKL runs one thread on the calling thread inside the block, and its count (eager
torch's in the same process) comes back after; other threads keep MKL's default."""

from __future__ import annotations

import threading

import pytest
import torch

from kvexport.runtime.blas_threads import _mkl, one_blas_thread


def test_mkl_runs_one_thread_on_the_calling_thread_inside_the_block_and_its_count_after():
    mkl = _mkl()
    if mkl is None:
        pytest.skip("this torch has no MKL")
    if torch.get_num_threads() < 2:
        torch.set_num_threads(2)  # a count to restore that differs from one

    def on_another_thread() -> int:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(mkl.mkl_get_max_threads()))
        thread.start()
        thread.join()
        return seen[0]

    before, torch_threads, default = mkl.mkl_get_max_threads(), torch.get_num_threads(), on_another_thread()
    assert before == torch_threads >= 2
    with one_blas_thread():
        assert mkl.mkl_get_max_threads() == 1 and on_another_thread() == default
    assert mkl.mkl_get_max_threads() == before and torch.get_num_threads() == torch_threads
