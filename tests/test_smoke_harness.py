import torch.distributed as dist

GLOO = True     # run bodies on gloo processes: it tests the gloo process pool itself


def _rank_and_world():
    return dist.get_rank(), dist.get_world_size()


def test_pool_runs_every_rank(run):
    assert run(2, _rank_and_world) == [(0, 2), (1, 2)]
