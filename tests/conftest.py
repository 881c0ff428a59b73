from __future__ import annotations

import itertools
import os
import sys

# One intra-op thread per test process (and for the processes it starts): the tests'
# tensors are tiny, and two pytest workers (-n 2) with two OpenMP threads each on a
# 2-core machine spin-wait on one another (tests/test_hf_moe.py alone: 88 s with two
# threads, 57 s with one, serially; 35 s on two workers)
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor's CPU kernels without the vector ISA (scalar C++): what the tests check is
# functp's graphs, their collectives and their values, which Inductor's CPU vector
# code does not change, while g++ then compiles each kernel without ATen's vector
# headers. With an empty Inductor cache (a fresh machine, CI) test_compile.py and
# test_whole_step.py took 306 CPU-s with it, 266 without (2026-12-04); GPU runs
# generate Triton, not this.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, os.path.dirname(__file__))
from _launcher import Pool  # noqa: E402

_POOLS: dict[int, Pool] = {}


@pytest.fixture(scope="session")
def _pools():
    yield _POOLS
    for p in _POOLS.values():
        p.close(force=True)      # the session is over: no need for gloo's slow goodbye
    _POOLS.clear()


# The inner loop (README, "Testing"): `pytest -n 2 -m "not slow" tests` leaves out these
# files, each for what makes it slow; the whole suite runs them all
SLOW_FILES = {
    "test_compile.py": "Dynamo and Inductor compiles",
    "test_examples.py": "the examples, launched as torchrun jobs",
    "test_docs.py": "every docs page's code, some under torchrun",
    "test_watch.py": "torchrun jobs that wait for the divergence watcher",
    "test_exit.py": "torchrun jobs, for the process's exit",
    "test_estimate.py": "fake-tensor traces of transformers models, against real runs",
    "test_estimate_host.py": "traced and real steps, counted",
    "test_estimate_gpu_truth.py": "fake-tensor traces of GPU-sized models",
    "test_hf_models.py": "every transformers model class, built and run",
    "test_hf_moe.py": "every transformers MoE class, built and run",
    "test_crosscheck.py": "gloo processes that time out on purpose",
    "test_paths_errors.py": "gloo processes with a stalled peer",
    "test_reliability.py": "gloo processes that raise on some ranks",
    "test_simulate.py": "simulate against gloo processes, bitwise",
    "test_checkpoint.py": "checkpoints written and read across processes and meshes",
    "test_models.py": "the bundled models trained against unsharded ones",
    "test_pretrained.py": "transformers checkpoint folders, written and loaded",
    "test_fsdp_groups.py": "FSDP groups on gloo processes and estimated",
    "test_whole_step_compile.py": "the whole train step compiled (Dynamo, aot_eager)",
    "test_context_parallel_cost.py": "fake-tensor estimates of transformers models on cp",
    "test_context_parallel_hf.py": "the transformers model matrix on cp meshes",
    "test_pipeline_hf.py": "the transformers model matrix on pp meshes",
}
# and single tests (or one case of one: its [id] too) of files the inner loop keeps
SLOW_TESTS = {
    "test_whole_step.py::test_the_compiled_train_step_is_one_graph_equal_to_the_eager_step":
        "the whole train step compiled (39 s of the file's 42, the machine shared)",
    "test_whole_step_ep.py::test_the_compiled_expert_parallel_step_is_one_graph_equal_"
    "to_eager_and_torch_optim": "the expert-parallel step compiled (13 s)",
    "test_pipeline.py::test_a_compiled_stage_in_every_schedule":
        "a stage compiled in every schedule (15 s)",
    "test_replay_probe.py::test_a_rank_that_replayed_while_a_peer_agrees_is_found_without_"
    "waiting": "two processes, one held outside functp on purpose (14 s)",
    "test_torch_compat.py::test_torch_compile_in_two_simulated_ranks_at_once":
        "two Dynamo compiles (5 s)",
    "test_porting.py::test_an_id_outside_the_vocabulary_raises_in_a_compiled_step":
        "a Dynamo compile (3 s)",
    "test_api.py::test_one_process_mesh_needs_no_launcher": "a fresh Python process (6 s)",
    "test_torch_compat.py::test_import_functp_leaves_the_compiler_and_the_memory_tracker_"
    "for_later": "a fresh Python process (3 s)",
    "test_ragged_sizes.py::test_a_second_mesh_over_the_same_groups_keeps_the_check_agreed_"
    "not_an_abort": "a fresh Python process with gloo ranks (6 s)",
    "test_interop.py::test_to_from_dtensor_round_trip": "DTensor's layouts, 4 gloo ranks (7 s)",
    # (one case of a parametrized test: the inner loop keeps the others)
    "test_context_parallel.py::test_every_strategy_exact_on_a_cp_axis[4]":
        "every strategy on 4 ranks (7 s; 2 ranks stay)",
    "test_vma.py::test_random_programs_vma_equals_sum_semantics_equals_oracle[shape3-names3-4]":
        "random programs on a 4-axis mesh (5 s; the 1-, 2- and 3-axis cases stay)",
    "test_porting.py::test_full_state_dict_with_module_round_trips_strictly_with_tied_keys"
    "[hf-dp2_tp2]": "a transformers model on 4 ranks (3 s; tp2 stays)",
}


# The longest tests (seconds on one of -n 2's workers, the whole suite with an empty
# Inductor cache, 2026-12-04), longest first: they start first, dealt in turn to the
# workers' shares (--dist worksteal, set in pytest_configure below, hands each worker a
# contiguous share of the collection, then an idle worker takes the back half of the
# other's queue), so that the workers end together on short tests instead of one
# running a 40 s test alone at the end
LONGEST = [
    "test_estimate.py::test_every_hf_model_class_estimates_under_func_grad_without_a_mask",  # 42
    "test_examples.py::test_train_llama_full_matches_unsharded_in_float64_and_bf16",   # 41
    "test_examples.py::test_train_lm_loss_falls_and_resumes_on_another_mesh_in_a_fresh_process",
    "test_compile.py::test_inductor_compiles_a_transformers_llama_through_parallelize_tp2",  # 35
    "test_examples.py::test_train_lm_compiled_whole_step_trains_to_the_eager_losses",  # 32
    "test_compile.py::test_inductor_compiles_a_tied_sliding_window_gemma3_through_"
    "parallelize_tp2",                                                                 # 25
    "test_whole_step_compile.py::test_compiled_whole_step_of_transformers_models_equals_eager",
    "test_docs.py::test_doc_torchrun_snippets_print_what_the_page_shows",   # 22 (all 9: 61)
    "test_docs.py::test_doc_snippets_print_what_the_page_shows",            # 23 (all 8: 31)
    "test_compile.py::test_inductor_compiles_a_check_vma_false_body_of_gpt2",          # 21
    "test_watch.py::test_a_rank_0_only_evaluation_is_an_error_on_every_rank",          # 21
    "test_examples.py::test_train_2d_launches_itself_and_matches_unsharded",           # 20
    "test_watch.py::test_a_plain_argument_on_some_ranks_only_is_an_error_on_every_rank",  # 20
    "test_whole_step.py::test_the_compiled_train_step_is_one_graph_equal_to_the_eager_step",
    "test_compile.py::test_compiled_transformers_step_matches_eager",                  # 15 (8: 56)
    "test_replay_probe.py::test_a_rank_that_replayed_while_a_peer_agrees_is_found_without_"
    "waiting",                                                                         # 14
    "test_checkpoint.py::test_packed_weights_and_their_adam_moments_resume_on_any_mesh",  # 14
    "test_compile.py::test_inductor_buckets_functp_all_reduces",                       # 8
]


def _longest_rank(item) -> int:
    name = item.nodeid.split("[")[0]
    return next((k for k, t in enumerate(LONGEST) if name.endswith(t)), len(LONGEST))


def _dealt(items: list, workers: int, total: int) -> list:
    """``items`` (the first of ``total``) with the LONGEST first in each of the
    ``workers`` contiguous shares worksteal makes of ``total`` (the first
    ``total // workers``, then of the rest likewise), dealt longest first in turn; the
    others keep their order."""
    longest = sorted((it for it in items if _longest_rank(it) < len(LONGEST)), key=_longest_rank)
    rest = iter([it for it in items if _longest_rank(it) == len(LONGEST)])
    out, left = [], total
    for w in range(workers):
        size = left // (workers - w)
        mine = longest[w::workers]
        out += mine + list(itertools.islice(rest, max(0, size - len(mine))))
        left -= size
    return out + list(rest)


def pytest_collection_modifyitems(config, items):
    for it in items:
        if it.path.name in SLOW_FILES or any(
                n.endswith(tuple(SLOW_TESTS)) for n in (it.nodeid, it.nodeid.split("[")[0])):
            it.add_marker(pytest.mark.slow)
    # tests that discard a gloo pool (run(..., last=True)) go last, so that no test
    # after them pays for starting a new one
    late = [it for it in items if it.get_closest_marker("discards_pool")]
    workers = getattr(config, "workerinput", {}).get("workercount", 1)   # (pytest-xdist's)
    items[:] = _dealt([it for it in items if it not in late], workers, len(items)) + late


def pytest_configure(config):
    config.addinivalue_line("markers", "discards_pool: the test ends its gloo pool")
    config.addinivalue_line("markers", "slow: left out of the inner loop (SLOW_FILES)")
    # worksteal: an idle pytest worker (-n 2) takes half of the other's queue, so that
    # both end together (the longest tests start first: LONGEST). Set here, not in
    # pyproject's addopts, where it would make pytest refuse to start wherever
    # pytest-xdist is not installed (a user's plain pytest; CI's wheel smoke at stop 58)
    args = config.invocation_params.args
    explicit = any(str(a).startswith("--dist") for a in args)
    if getattr(config.option, "dist", "no") == "load" and not explicit:
        config.option.dist = "worksteal"


@pytest.fixture
def run(_pools, request):
    """``run(world, body, *args)``: runs ``body(*args)`` on ``world`` ranks and returns
    the list of their return values; a rank's exception fails the test with that
    rank's traceback.

    The ranks are simulated in this process (``functp.simulate``, with the cross-rank
    check mode on) unless ``gloo=True``: then they are processes of a gloo pool, for
    what needs torch.distributed's default group (DTensor, checkpoints, the world
    group's timeout) or real processes; a module that sets ``GLOO = True`` runs all
    its bodies so. ``last=True`` (gloo) discards the pool afterwards."""
    def _run(world: int, body, *args, timeout: float = 300.0, last: bool = False,
             gloo: bool = False):
        gloo = gloo or getattr(request.module, "GLOO", False)
        if not (gloo or last or os.environ.get("FUNCTP_TEST_GLOO")):
            import functp
            return functp.simulate(body, world, *args, timeout=timeout,
                                   check=os.environ.get("FUNCTP_DEBUG", "0") != "0")
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


# FUNCTP_TEST_CPU=FILE: each test's CPU seconds appended to FILE ("nodeid seconds"),
# this process's and every process under it (a gloo pool's ranks, a torchrun job's),
# for finding where the suite's time goes: on 2 cores two workers contend, so a
# test's wall time (--durations) says more about its neighbours than about itself
def _tree_cpu() -> float:
    """CPU seconds of this process and every live process under it, the reaped ones'
    included (their parents' cutime)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats, children = {}, {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(pid)] = sum(map(int, fields[11:15]))     # utime stime cutime cstime
            children.setdefault(int(fields[1]), []).append(int(pid))
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0)
        todo += children.get(pid, [])
    return total / tick


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("FUNCTP_TEST_CPU")
    start = _tree_cpu() if path else 0.0
    yield
    if path:
        with open(path, "a") as f:
            f.write(f"{item.nodeid} {_tree_cpu() - start:.2f}\n")
