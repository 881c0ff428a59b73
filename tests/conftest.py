from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _launcher import Pool  # noqa: E402

_POOLS: dict[int, Pool] = {}


@pytest.fixture(scope="session")
def _pools():
    yield _POOLS
    for p in _POOLS.values():
        p.close()
    _POOLS.clear()


@pytest.fixture
def run(_pools):
    """``run(world, body, *args)``: runs ``body(*args)`` on ``world`` gloo ranks and
    returns the list of their return values; a rank's exception fails the test
    with that rank's traceback. ``last=True`` discards the pool afterwards."""
    def _run(world: int, body, *args, timeout: float = 300.0, last: bool = False):
        # last=True: the body leaves process groups out of step (a timed-out
        # collective, a changed world timeout), so its pool is not used again
        pool = _pools.get(world)
        if pool is None or not pool.alive():
            pool = _pools[world] = Pool(world)
        try:
            return pool.run(body, args, timeout=timeout)
        finally:
            if last:
                pool.close(force=True)
                _pools.pop(world, None)
    return _run
