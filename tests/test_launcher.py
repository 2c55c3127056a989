"""The tests' one process launcher names the ranks that fail or hang."""

import sys
import time

import pytest

from tests.helpers import spawn_ranks


def _rank_one_fails(rank, world, shared, barrier):
    if rank == 1:
        sys.exit(3)


def _rank_one_hangs(rank, world, shared, barrier):
    if rank == 1:
        time.sleep(600)


def test_a_failed_rank_is_named():
    with pytest.raises(AssertionError, match=r"ranks failed \(exit codes\): \{1: 3\}"):
        spawn_ranks(_rank_one_fails, 2)


def test_a_hung_rank_is_named_and_killed():
    # 20 s: a spawned rank imports torch and this module before it can return, which took
    # more than 5 s on a loaded 2-core machine
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks still running after 20 s \(killed\): \[1\]"):
        spawn_ranks(_rank_one_hangs, 2, timeout=20)
    assert time.monotonic() - start < 80
