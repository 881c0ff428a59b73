"""functp.pipeline: the schedules' tables, and every schedule's loss and gradients
against the unpipelined float64 model (1e-10), on simulated ranks (values) and gloo
processes (one launch); the errors of ranks that disagree, raised on every rank."""
from __future__ import annotations

import itertools

import optree
import pytest
import torch

import functp
from functp import P
from functp.pipelines._schedule import Schedule

D, VOCAB = 4, 7
SCHEDS = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1), ("interleaved", 2)]


# -- the tables --------------------------------------------------------------------------

def _check_table(s):
    pp, m, v = s.stages, s.microbatches, s.virtual_stages
    end = {}
    for r, acts in enumerate(s.actions):
        for a, b in zip(acts, acts[1:]):
            assert a.tick + a.ticks <= b.tick, f"rank {r} runs two actions at once: {a}, {b}"
        for a in acts:
            end[(a.kind, r + a.chunk * pp, a.microbatch)] = (a.tick, a.tick + a.ticks)
    kinds = {"zero_bubble": "FBW", "forward": "F"}.get(s.schedule, "FB")
    want = {(k, vs, mb) for k in kinds for vs in range(pp * v) for mb in range(m)}
    assert set(end) == want and sum(map(len, s.actions)) == len(want), "each action once"
    for (k, vs, mb), (start, _) in end.items():
        needs = {"F": [("F", vs - 1, mb)] if vs else [],
                 "B": [("F", vs, mb)] + ([("B", vs + 1, mb)] if vs < pp * v - 1 else []),
                 "W": [("B", vs, mb)]}[k]
        for n in needs:
            assert end[n][1] <= start, f"{k}{mb} of stage {vs} starts before {n} ends"


def test_schedule_tables_are_valid_and_bounded():
    for sched, pp, m in itertools.product(["gpipe", "1f1b", "zero_bubble", "interleaved"],
                                          [1, 2, 3, 4, 8], [1, 2, 3, 5, 8, 9]):
        for v in ([1, 2, 3] if sched == "interleaved" else [1]):
            s = functp.pipeline_schedule(sched, pp, m, v)
            _check_table(s)
            if sched in ("1f1b", "zero_bubble"):      # the 1F1B memory bound
                assert max(s.peak_in_flight) <= min(pp, m), (sched, pp, m, s.peak_in_flight)
            if sched == "gpipe":
                assert s.peak_in_flight[0] == m
            # Megatron's bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1)
            # interleaved (m a multiple of p), forward 1 tick and backward 2
            if sched in ("gpipe", "1f1b") or (sched == "interleaved" and m % pp == 0):
                assert abs(s.bubble - (pp - 1) / (v * m + pp - 1)) < 1e-12, (sched, pp, m, v)
            if sched == "zero_bubble" and m >= pp > 1:
                assert s.bubble < functp.pipeline_schedule("1f1b", pp, m).bubble
            # evaluate's table: every forward once, GPipe's forward phase, nothing held
            f = Schedule("forward", pp, m, v)
            _check_table(f)
            assert f.peak_in_flight == [0] * pp
            if v == 1 or m % pp == 0:          # (interleaved's rounds of pp otherwise)
                assert f.ticks == pp - 1 + m * v, (pp, m, v, f.ticks)


def test_schedule_text_and_errors():
    assert functp.pipeline_schedule("1f1b", 2, 3).text() == (
        "rank 0: F0 F1 .  .  B0 B0 F2 B1 B1 .  B2 B2\n"
        "rank 1: .  F0 B0 B0 F1 B1 B1 F2 B2 B2 .  .")
    with pytest.raises(functp.ShardingError, match="schedule='pipedream'"):
        functp.pipeline_schedule("pipedream", 2, 3)
    with pytest.raises(functp.ShardingError, match="virtual_stages=2 needs"):
        functp.pipeline_schedule("1f1b", 2, 3, 2)
    with pytest.raises(functp.ShardingError, match="microbatches=0"):
        functp.pipeline_schedule("1f1b", 2, 0)


# -- exactness -----------------------------------------------------------------------------
# a model with different stages: the first embeds ids, the last holds the head, the
# layers between are split unevenly (the first stage holds one more)

def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(VOCAB, D, generator=g, dtype=torch.float64),
            "w": torch.randn(9, D, D, generator=g, dtype=torch.float64) / 2,
            "head": torch.randn(D, VOCAB, generator=g, dtype=torch.float64)}


def _layers(w, x):
    for i in range(w.shape[0]):
        x = x + torch.tanh(x @ w[i])
    return x


def _full(p, ids):
    return _layers(p["w"], p["emb"][ids]) @ p["head"]


def _ce(logits, t):
    return torch.nn.functional.cross_entropy(logits.flatten(0, -2), t.flatten())


def _cuts(stages):
    """Layer runs per virtual stage: stage 0 one more than the rest (9 layers)."""
    base, extra = divmod(9, stages)
    sizes = [base + (1 if i < extra else 0) for i in range(stages)]
    if stages > 1 and sizes[0] == sizes[-1]:
        sizes[0], sizes[-1] = sizes[0] + 1, sizes[-1] - 1
    starts = [sum(sizes[:i]) for i in range(stages)]
    return [(s, s + n) for s, n in zip(starts, sizes)]


def _stage_params(p, vs, stages):
    a, b = _cuts(stages)[vs]
    out = {"w": p["w"][a:b]}
    if vs == 0:
        out["emb"] = p["emb"]
    if vs == stages - 1:
        out["head"] = p["head"]
    return out


def _stage(p, x, vs):
    if "emb" in p:
        x = p["emb"][x]
    x = _layers(p["w"], x)
    return x @ p["head"] if "head" in p else x


def _exact_body(cases, debug=None, calls=1):
    """Each case's errors against the float64 model; ``calls`` steps of each pipeline
    (the later ones reuse the first's boundary headers); ``debug`` sets the check mode
    (off: point-to-point transfers, on: one all-to-all per tick)."""
    if debug is not None:
        prev = functp.set_debug(debug)
        try:
            return _exact_body(cases, None, calls)
        finally:
            functp.set_debug(prev)
    pp = functp.process_count()
    mesh = functp.make_mesh((pp,), ("pp",))
    r = functp.process_index()
    p = _model()
    g = torch.Generator().manual_seed(1)
    errs = []
    for sched, v, m, n, mode in cases:
        ids = torch.randint(0, VOCAB, (n, 3), generator=g)
        tgt = torch.randint(0, VOCAB, (n, 3), generator=g)
        ref_g, ref_l = torch.func.grad_and_value(lambda q: _ce(_full(q, ids), tgt))(p)
        S = pp * v
        mine = [_stage_params(p, r + j * pp, S) for j in range(v)]
        step = functp.pipeline(_stage, mesh, microbatches=m, schedule=sched, loss_fn=_ce,
                               virtual_stages=v, backward=mode)
        for _ in range(calls):
            loss, grads = step(mine if sched == "interleaved" else mine[0], ids, tgt)
        grads = grads if sched == "interleaved" else [grads]
        err = abs(loss.item() - ref_l.item())
        for j, gj in enumerate(grads):
            ref = _stage_params(ref_g, r + j * pp, S)
            assert sorted(gj) == sorted(ref)
            err = max([err] + [_maxdiff(gj[k], ref[k]) for k in ref])
        in_flight = step.peak_saved
        # evaluation, forward only, on other rows: the unsharded loss, nothing kept
        held_ids = torch.randint(0, VOCAB, (n, 3), generator=g)
        held_tgt = torch.randint(0, VOCAB, (n, 3), generator=g)
        ev = step.evaluate(mine if sched == "interleaved" else mine[0], held_ids, held_tgt)
        err = max(err, abs(ev.item() - _ce(_full(p, held_ids), held_tgt).item()))
        bound = m if sched == "gpipe" and r == 0 else None
        errs.append((sched, v, m, mode, err, in_flight, bound, step.schedule.peak_in_flight[r],
                     step.peak_saved))
    return errs


def _maxdiff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item() if a.numel() else 0.0


def _assert_exact(results):
    for rank, rows in enumerate(results):
        for sched, v, m, mode, err, live, bound, table_peak, eval_saved in rows:
            assert err < 1e-10, f"rank {rank} {sched} v={v} M={m} {mode}: off by {err}"
            assert eval_saved == 0, (rank, sched, eval_saved)    # evaluate keeps nothing
            # the executor's count of live saved activations is the table's
            assert live == table_peak, (rank, sched, m, live, table_peak)
            if bound is not None:
                assert live == bound


@pytest.mark.parametrize("world", [2, 4])
def test_every_schedule_exact_on_simulated_ranks(run, world):
    # M = 3 and 5: not multiples of pp; 5 rows in 3 microbatches are uneven (2, 2, 1)
    cases = [(s, v, m, n, mode) for (s, v) in SCHEDS for m, n in ((3, 5), (5, 10))
             for mode in ("tape", "func")]
    _assert_exact(run(world, _exact_body, cases))


def test_eight_stages_and_memory_bound(run):
    cases = [("1f1b", 1, 8, 8, "tape"), ("gpipe", 1, 8, 8, "tape"),
             ("zero_bubble", 1, 9, 9, "func"), ("interleaved", 2, 8, 8, "tape")]
    results = run(8, _exact_body, cases)
    _assert_exact(results)
    for rank, rows in enumerate(results):
        assert rows[0][5] <= 8 - rank      # 1F1B: pp - rank microbatches in flight
        assert rows[2][5] <= 8             # zero-bubble: at most pp


def test_schedules_exact_on_gloo(run):
    cases = [(s, v, 3, 6, "tape") for s, v in SCHEDS] + [("zero_bubble", 1, 4, 4, "func")]
    _assert_exact(run(2, _exact_body, cases, gloo=True))
    # the check mode off (point-to-point, waited for where read), two calls each
    _assert_exact(run(2, _exact_body, cases, False, 2, gloo=True))
    _assert_exact(run(4, _exact_body, cases[:4], False, 2, gloo=True))


def _sending_body(schedule: str, microbatches: int) -> int:
    """The most sent activations a step on gloo processes held at once, point-to-point
    (the check mode off)."""
    mesh = functp.make_mesh((functp.process_count(),), ("pp",))
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(16, 16, generator=g) * 0.05 for _ in range(2)]
    x = torch.randn(2 * microbatches, 16, generator=g)
    step = functp.pipeline(lambda p, h: torch.tanh(torch.tanh(h @ p[0]) @ p[1]), mesh,
                           microbatches=microbatches, schedule=schedule,
                           loss_fn=lambda a, b: ((a - b) ** 2).mean())
    previous = functp.set_debug(False)
    try:
        step(w, x, x)
    finally:
        functp.set_debug(previous)
    return step.peak_sending


@pytest.mark.parametrize("world", [2, 4])
def test_sent_activations_are_freed_as_the_peers_answer(run, world):
    # a send's tensor is freed once its peer has been heard from since (a later
    # transfer from it read): gloo's send works never say they completed before
    # wait(), so every microbatch's sent activation was held to the step's end (12
    # of them here), past 1F1B's memory bound
    for sched in ("1f1b", "zero_bubble", "gpipe"):
        held = run(world, _sending_body, sched, 12, gloo=True)
        bound = world if sched != "gpipe" else 12      # (GPipe's forwards come first)
        assert all(0 < h <= bound for h in held), (sched, held)
        if sched == "1f1b":     # the warm-up's forwards, then one each way
            assert all(h <= max(world - r, 2) for r, h in enumerate(held)), held


# -- accumulation, and a tp axis beside pp --------------------------------------------------

def _accumulate_body():
    mesh = functp.make_mesh((2,), ("pp",))
    r = functp.process_index()
    p = _model(3)
    mine = _stage_params(p, r, 2)
    ids = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(4))
    tgt = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(5))
    step2 = functp.pipeline(_stage, mesh, microbatches=2, loss_fn=_ce)
    step4 = functp.pipeline(_stage, mesh, microbatches=4, loss_fn=_ce, schedule="zero_bubble")
    l1, g1 = step2(mine, ids[:4], tgt[:4])
    l2, g2 = step2(mine, ids[4:], tgt[4:])
    big_l, big_g = step4(mine, ids, tgt)
    return (max(abs((l1 + l2).item() / 2 - big_l.item()),
                *[((g1[k] + g2[k]) / 2 - big_g[k]).abs().max().item() for k in mine]))


def test_two_accumulated_steps_equal_one_big_batch(run):
    assert max(run(2, _accumulate_body)) < 1e-12


def _tp_stage(p, x, vs):
    # Megatron's MLP per stage: w1 split by columns, w2 by rows over tp, one psum
    h = torch.tanh(x @ p["w1"])
    return x + functp.psum(h @ p["w2"], "tp")


def _tp_body(cases):
    mesh = functp.make_mesh((2, 2), ("pp", "tp"))
    g = torch.Generator().manual_seed(6)
    w1 = torch.randn(4, D, 6, generator=g, dtype=torch.float64) / 2   # 4 layers
    w2 = torch.randn(4, 6, D, generator=g, dtype=torch.float64) / 2
    x = torch.randn(6, D, generator=g, dtype=torch.float64)
    y = torch.randn(6, D, generator=g, dtype=torch.float64)

    def full(a, b):
        h = x
        for i in range(4):
            h = h + torch.tanh(h @ a[i]) @ b[i]
        return ((h - y) ** 2).mean()
    ref = torch.func.grad(full, argnums=(0, 1))(w1, w2)
    pp, tp = functp.process_index() // 2, functp.process_index() % 2
    out = []
    for sched, v, mode in cases:
        chunks = []
        for j in range(v):
            layers = range((pp + j * 2) * 4 // (2 * v), (pp + j * 2 + 1) * 4 // (2 * v))
            chunks.append([{"w1": w1[i][:, tp * 3:(tp + 1) * 3], "w2": w2[i][tp * 3:(tp + 1) * 3]}
                           for i in layers])

        def stage(p, x, vs):
            for layer in p:
                x = _tp_stage(layer, x, vs)
            return x
        step = functp.pipeline(stage, mesh, microbatches=3, schedule=sched, virtual_stages=v,
                               loss_fn=lambda a, b: ((a - b) ** 2).mean(), backward=mode)

        def body(params, x, y):
            return step(params, x, y)
        spec = [[{"w1": P(None, "tp"), "w2": P("tp")}] * len(c) for c in chunks]
        mapped = functp.shard_map(body, mesh, in_specs=(spec if v > 1 else spec[0], P(), P()),
                                  out_specs=(P(), spec if v > 1 else spec[0]),
                                  axis_names={"tp"})
        loss, grads = mapped(chunks if v > 1 else chunks[0], x, y)
        grads = grads if v > 1 else [grads]
        err = 0.0
        for j, layers in enumerate(range(v)):
            idx = range((pp + j * 2) * 4 // (2 * v), (pp + j * 2 + 1) * 4 // (2 * v))
            for gl, i in zip(grads[j], idx):
                err = max(err, (gl["w1"] - ref[0][i][:, tp * 3:(tp + 1) * 3]).abs().max().item(),
                          (gl["w2"] - ref[1][i][tp * 3:(tp + 1) * 3]).abs().max().item())
        out.append((sched, mode, err, abs(loss.item() - full(w1, w2).item())))
    return out


def test_tp_inside_each_stage(run):
    cases = [("1f1b", 1, "tape"), ("zero_bubble", 1, "func"), ("interleaved", 2, "tape"),
             ("gpipe", 1, "func")]
    for rank, rows in enumerate(run(4, _tp_body, cases)):
        for sched, mode, err, lerr in rows:
            assert err < 1e-10 and lerr < 1e-12, (rank, sched, mode, err, lerr)


# -- ranks that disagree: the same error on every rank, no hang -------------------------------

def _error_body(case, debug=None):
    """``debug=False``: the check mode off, so that processes agree by point-to-point
    messages (``_transfer.gather_rows_later``), not by the check mode's all-gather."""
    prev = functp.set_debug(debug) if debug is not None else None
    try:
        return _disagreeing(case)
    finally:
        if debug is not None:
            functp.set_debug(prev)


def _disagreeing(case):
    mesh = functp.make_mesh((2,), ("pp",))
    r = functp.process_index()
    p = _stage_params(_model(), r, 2)
    ids = torch.randint(0, VOCAB, (5, 3), generator=torch.Generator().manual_seed(0))
    m, sched, stage = 3, "1f1b", _stage
    if case == "microbatches":
        m = 3 + r
    elif case == "schedule":
        sched = ["1f1b", "gpipe"][r]
    elif case == "shape":           # stage 0's third microbatch (1 row) drops a feature
        def stage(q, x, vs):
            y = _stage(q, x, vs)
            return y[..., :-1] if vs == 0 and y.shape[0] == 1 else y
    elif case == "loss":
        step = functp.pipeline(_stage, mesh, microbatches=3, loss_fn=lambda a, b: a.sum(-1))
    elif case == "chunks":
        sched, p = "interleaved", ([p, p] if r == 0 else p)
    if case != "loss":
        step = functp.pipeline(stage, mesh, microbatches=m, schedule=sched, loss_fn=_ce,
                               virtual_stages=2 if sched == "interleaved" else 1)
    try:
        if case == "evaluate" and r == 0:     # rank 0 evaluates while rank 1 trains
            step.evaluate(p, ids, ids)
        else:
            step(p, ids, ids)
    except functp.ShardingError as e:
        again = functp.pipeline(_stage, mesh, microbatches=2, loss_fn=_ce)
        loss, _ = again(p if case != "chunks" else _stage_params(_model(), r, 2), ids, ids)
        return str(e), loss.item()       # (and the axis still works afterwards)
    return None, None


@pytest.mark.parametrize("case, says", [
    ("microbatches", r"disagree on microbatches \(stage 0: 3, stage 1: 4\)"),
    ("schedule", r"disagree on schedule \(stage 0: 1f1b, stage 1: gpipe\)"),
    ("evaluate", r"disagree on schedule \(stage 0: forward, stage 1: 1f1b\)"),
    ("shape", r"stage 0's output for microbatch 2 has shape \(1, 3, 3\)"),
    ("loss", r"loss_fn returned shape \(2, 3\)"),
    ("chunks", "must be a list of 2 chunks"),
])
@pytest.mark.parametrize("ranks", ["simulated", "processes"])
def test_disagreeing_ranks_raise_on_every_rank(run, case, says, ranks):
    import re
    out = (run(2, _error_body, case) if ranks == "simulated" else
           run(2, _error_body, case, False, gloo=True, timeout=120))
    assert out[-1][0] is not None and re.search(says, out[-1][0]), out
    if case != "chunks":
        assert out[0] == out[1], "the same message on every rank"
    else:
        assert all(o[0] is not None and "stage(s) [1]" in o[0] for o in out), out


# -- a stage that raises on one rank: every rank raises, no rank waits in a transfer ----------

def _raising_body(cases):
    """Rank ``bad``'s stage raises in its forward of microbatch 2 (or its last stage's
    loss_fn, or its backward): each rank's outcome, then a good step on the same axis."""
    pp = functp.process_count()
    mesh = functp.make_mesh((pp,), ("pp",))
    r = functp.process_index()
    p = _model()
    ids = torch.randint(0, VOCAB, (8, 3), generator=torch.Generator().manual_seed(0))
    out = []
    for sched, v, mode, bad, where, debug in cases:
        prev = functp.set_debug(debug)
        try:
            S = pp * v
            mine = [_stage_params(p, r + j * pp, S) for j in range(v)]
            seen = {"n": 0}

            class Boom(torch.autograd.Function):
                @staticmethod
                def forward(x):
                    return x.clone()

                @staticmethod
                def setup_context(ctx, inputs, output):
                    pass

                @staticmethod
                def backward(ctx, g):
                    raise ValueError("boom in a backward")

            def stage(q, x, vs):
                y = _stage(q, x, vs)
                if r == bad and where == "forward" and vs == r:
                    seen["n"] += 1
                    if seen["n"] == 3:              # its third forward: microbatch 2
                        raise ValueError(f"boom on rank {r}")
                if r == bad and where == "backward" and vs == r:
                    seen["n"] += 1
                    if seen["n"] == 3:              # so microbatch 2's backward raises
                        y = Boom.apply(y)
                return y

            def loss(y, t):
                if r == bad and where == "loss":
                    seen["n"] += 1
                    if seen["n"] == 3:
                        raise ValueError("boom in loss_fn")
                return _ce(y, t)
            step = functp.pipeline(stage, mesh, microbatches=4, schedule=sched, loss_fn=loss,
                                   virtual_stages=v, backward=mode)
            try:
                step(mine if v > 1 else mine[0], ids, ids)
                got = ("ok", "")
            except Exception as e:      # noqa: BLE001 - the test reads what each rank got
                got = (type(e).__name__, str(e) + "".join(getattr(e, "__notes__", [])))
            good = functp.pipeline(_stage, mesh, microbatches=2, schedule=sched, loss_fn=_ce,
                                   virtual_stages=v, backward=mode)
            after = good(mine if v > 1 else mine[0], ids, ids)[0].item()
            out.append((sched, mode, bad, where, debug) + got + (after,))
        finally:
            functp.set_debug(prev)
    return out


def _assert_raised_everywhere(results):
    for r, rows in enumerate(results):
        for i, (sched, mode, bad, where, debug, kind, msg, after) in enumerate(rows):
            case = (r, sched, mode, bad, where, debug)
            stage = len(results) - 1 if where == "loss" else bad
            assert kind == ("ValueError" if r == bad else "ShardingError"), (case, kind, msg)
            assert f"stage {stage}" in msg and "microbatch" in msg, (case, msg)
            assert "microbatch 2" in msg and where in msg, (case, msg)
            if r != bad:
                assert "ValueError: boom" in msg and f"rank {bad}" in msg, (case, msg)
            assert after == results[0][i][7], case     # the axis works afterwards


@pytest.mark.parametrize("world", [2, 4])
def test_a_stage_raising_on_one_rank_raises_on_every_rank(run, world):
    # gloo processes, the check mode on (an all-to-all per tick) and off (point-to-point
    # sends, where a peer's recv would otherwise block for the process group's timeout)
    bad = world - 2
    cases = [(s, v, "tape", bad, "forward", debug) for s, v in SCHEDS for debug in (False, True)]
    cases += [("1f1b", 1, "func", bad, "backward", False), ("zero_bubble", 1, "tape", world - 1,
                                                            "loss", False)]
    _assert_raised_everywhere(run(world, _raising_body, cases, gloo=True, timeout=120))


# -- a compiled stage inside every schedule ------------------------------------------------------
# What compiles is the stage function (torch.compile(stage_fn, fullgraph=True) given as
# stage_fn), not the whole step: the step is the schedule's host program around
# point-to-point sends, which are its synchronization points, and unrolled into one
# graph it would be M x ticks long and recompile per M; the stage is what runs M times
# on the same shapes. Under backward="tape" AOTAutograd compiles its forward and its
# backward (zero-bubble's B and W are two autograd.grad calls over the one compiled
# graph); torch.func.vjp of a compiled function is refused by torch (Dynamo: not from
# eager), so backward="func" raises that on every rank.

def _compiled_body():
    import functools

    from torch._dynamo.backends.debugging import aot_eager, boxed_nop
    pp = functp.process_count()
    mesh = functp.make_mesh((pp,), ("pp",))
    r = functp.process_index()
    p = _model()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (6, 3), generator=g)
    tgt = torch.randint(0, VOCAB, (6, 3), generator=g)
    out = []
    for sched, v in SCHEDS:
        graphs = {"fw": 0, "bw": 0}

        def counting(kind):
            def compiler(gm, example_inputs):
                graphs[kind] += 1
                return boxed_nop(gm, example_inputs)
            return compiler
        backend = functools.partial(aot_eager, fw_compiler=counting("fw"),
                                    bw_compiler=counting("bw"))
        torch._dynamo.reset()
        compiled = torch.compile(_stage, fullgraph=True, backend=backend)
        mine = [_stage_params(p, r + j * pp, pp * v) for j in range(v)]
        mine = mine if sched == "interleaved" else mine[0]
        kw = dict(microbatches=4, schedule=sched, loss_fn=_ce, virtual_stages=v)
        want = functp.pipeline(_stage, mesh, **kw)(mine, ids, tgt)
        got = functp.pipeline(compiled, mesh, **kw)(mine, ids, tgt)
        err = max(_maxdiff(a, b) for a, b in zip(optree.tree_leaves(got),
                                                   optree.tree_leaves(want)))
        out.append((sched, err, graphs["fw"], graphs["bw"]))
    try:
        functp.pipeline(torch.compile(_stage, fullgraph=True, backend="aot_eager"), mesh,
                        microbatches=2, loss_fn=_ce, backward="func")(
            _stage_params(p, r, pp), ids, tgt)
        refused = None
    except Exception as e:      # noqa: BLE001 - the test reads what each rank got
        refused = f"{type(e).__name__}: {e}"
    return out, refused


def test_a_compiled_stage_in_every_schedule(run):
    for rank, (rows, refused) in enumerate(run(2, _compiled_body, gloo=True, timeout=600)):
        for sched, err, fw, bw in rows:
            # the eager pipeline's loss and gradients (aot_eager runs the same ops)
            assert err < 1e-12, (rank, sched, err)
            # its forward and its backward compiled, one graph each per virtual stage
            # (and per shape: 6 rows in 4 microbatches are 2, 2, 1, 1)
            assert fw >= 1 and bw >= 1, (rank, sched, fw, bw)
        assert refused is not None and "functorch" in refused, (rank, refused)


# -- the boundary headers of a call, reused by the next one with the same shapes ---------------

def _reuse_body():
    mesh = functp.make_mesh((2,), ("pp",))
    r = functp.process_index()
    p = _stage_params(_model(), r, 2)
    ids = torch.randint(0, VOCAB, (6, 3), generator=torch.Generator().manual_seed(0))
    wide = {"on": False}

    def stage(q, x, vs):            # a later call widens stage 0's output (same inputs)
        y = _stage(q, x, vs)
        return torch.cat([y, y], -1) if wide["on"] and vs == 0 else y
    step = functp.pipeline(stage, mesh, microbatches=3, loss_fn=_ce)
    gathers = []
    for _ in range(2):
        with functp.comm_log() as log:
            loss = step(p, ids, ids)[0].item()
        gathers.append(sum(e.op == "all_gather" for e in log))
    wide["on"] = True
    try:
        step(p, ids, ids)
        said = None
    except functp.ShardingError as e:
        said = str(e)
    wide["on"] = False
    return gathers, said, step(p, ids, ids)[0].item() == loss


def test_headers_reused_and_a_changed_shape_raised(run):
    for gathers, said, same in run(2, _reuse_body):
        # the first call: the agreement, stage 0's header, the close; then no header
        assert gathers == [3, 2], gathers
        assert said is not None and "stage 0's output for microbatch 0 has shape (2, 3, 8)" \
            in said, said
        assert same                  # the next call (its headers found anew) is right


def _dp_body(cases):
    """functp.pipeline inside a shard_map body manual over dp, mesh (dp, pp) = (2, 2):
    each dp row pipes its own 4 of the 8 rows; the parameters replicated over dp, so
    every stage's implicit pvary sums their gradients over dp (the rows' sum; halved
    here for the mean) - but not the activations' and gradients' a stage receives,
    which vary over dp as the batch does (before: untyped, their gradients were summed
    over the rows too, and the first stage's were wrong)."""
    mesh = functp.make_mesh((2, 2), ("dp", "pp"))
    g = torch.Generator().manual_seed(3)
    ws = torch.randn(4, 5, 5, dtype=torch.float64, generator=g) * 0.5
    x, y = (torch.randn(8, 5, dtype=torch.float64, generator=g) for _ in range(2))

    def full(w):
        h = x
        for i in range(4):
            h = torch.tanh(h @ w[i])
        return ((h - y) ** 2).mean()
    ref = torch.func.grad(full)(ws)
    pp = mesh.coordinate["pp"]
    out = []
    for sched, mode in cases:
        step = functp.pipeline(lambda p, h: torch.tanh(torch.tanh(h @ p[0]) @ p[1]), mesh,
                               microbatches=2, schedule=sched, backward=mode,
                               loss_fn=lambda a, b: ((a - b) ** 2).mean())

        def body(p, xb, yb):
            loss, grads = step(p, xb, yb)
            return functp.pmean(functp.pvary(loss, "dp"), "dp"), grads / 2
        mapped = functp.shard_map(body, mesh, in_specs=(P(), P("dp"), P("dp")),
                                  out_specs=(P(), P()), axis_names={"dp"})
        loss, grads = mapped(ws[2 * pp:2 * pp + 2], *functp.shard((x, y), mesh, P("dp")))
        out.append((sched, mode, (grads - ref[2 * pp:2 * pp + 2]).abs().max().item(),
                    abs(loss.item() - full(ws).item())))
    return out


def test_dp_inside_the_body_of_every_schedule(run):
    cases = [("gpipe", "tape"), ("1f1b", "func"), ("zero_bubble", "tape")]
    for rank, rows in enumerate(run(4, _dp_body, cases)):
        for sched, mode, err, lerr in rows:
            assert err < 1e-10 and lerr < 1e-12, (rank, sched, mode, err, lerr)
