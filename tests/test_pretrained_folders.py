"""Checkpoint folders as files on disk: the index decides which file a tensor is read
from, a save leaves no weight file of another model in its folder (a save that stops
midway leaves one that fails to load, never one that loads the old model or a mix),
``generation_config.json`` is written as transformers writes it, and the blocks say
how to train them. Tiny models of ``test_pretrained``; ranks simulated.
"""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import functp
from test_pretrained import _COMMON, EAGER

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

INDEX = "model.safetensors.index.json"


def _model(seed: int, **extra):
    config = transformers.LlamaConfig(**{**_COMMON, **extra})
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config)


def _folder(tmp, name: str, seed: int, shard: bool) -> str:
    """A tiny llama written by transformers: sharded (8 KB shards, an index) or one file."""
    path = os.path.join(str(tmp), name)
    _model(seed).save_pretrained(path, max_shard_size="8KB" if shard else "5GB")
    return path


def _hf_state(path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path, **EAGER).state_dict()


def _functp_state(path):
    """(on every rank) the full parameters functp.from_pretrained loads from ``path``."""
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, _ = functp.from_pretrained(path, mesh, **EAGER)
    return apply.unshard(params)


def _differs(got: dict, want: dict) -> list[str]:
    return sorted(k for k in got if not torch.equal(got[k], want[k]))


# -- the index decides ------------------------------------------------------------------


def test_a_tensor_in_two_files_is_read_from_the_file_the_index_names(run, tmp_path):
    path = _folder(tmp_path, "dup", 0, shard=True)
    with open(os.path.join(path, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    key = "lm_head.weight"
    a, b = weight_map[key], files[0]
    assert a == files[-1] and a != b, (a, files)
    # B holds a copy of the tensor with other values; the index still names A
    other = safetensors_torch.load_file(os.path.join(path, b))
    other[key] = torch.randn(_COMMON["vocab_size"], _COMMON["hidden_size"])
    safetensors_torch.save_file(other, os.path.join(path, b), metadata={"format": "pt"})
    # A's tensors listed first, so that a reader letting the last file read win reads B
    first = {k: v for k, v in weight_map.items() if v == a}
    ordered = {**first, **{k: v for k, v in weight_map.items() if v != a}}
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": ordered}, f)
    want = safetensors_torch.load_file(os.path.join(path, a))[key]
    got = run(2, _functp_state, path)[0][key]
    assert torch.equal(got, want), f"read from {b}, not from {a} the index names: " \
        f"{(got - want).abs().max().item():.2e}"
    # transformers 5 reads every file the index lists, in sorted order, the last copy
    # winning: A sorts last here, so its model has A's values too
    assert torch.equal(_hf_state(path)[key], want)


# -- a save leaves no weight file of another model ----------------------------------------


def _save_into(src: str, dst: str, world: int, fail: bool = False):
    """(on every rank) loads ``src`` on a ``world``-rank mesh and saves it into ``dst``;
    the error's message when the save fails."""
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((world,), ("tp",))
    apply, params, specs = functp.from_pretrained(src, mesh, **EAGER)
    try:
        functp.save_pretrained(dst, params, specs, mesh, apply.module.config)
    except functp.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.parametrize("old_sharded,world", [(True, 1), (False, 2)],
                         ids=["one-file-over-shards", "shards-over-one-file"])
def test_a_save_over_another_model_leaves_only_the_new_model(run, tmp_path, old_sharded, world):
    old = _folder(tmp_path, "old", 0, shard=old_sharded)
    new = _folder(tmp_path, "new", 1, shard=False)
    assert run(world, _save_into, new, old, world)[0] is None
    want = _hf_state(new)
    names = os.listdir(old)
    weights = sorted(f for f in names if f.endswith(".safetensors") or f == INDEX)
    expect = (["model.safetensors"] if world == 1 else sorted(
        [INDEX, "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]))
    assert weights == expect, f"weight files of the old model left: {weights}"
    got = run(2, _functp_state, old)[0]
    assert not _differs(got, want), f"functp loads the old model: {_differs(got, want)[:4]}"
    hf = _hf_state(old)
    assert not _differs({k: hf[k] for k in got}, want), "transformers loads the old model"


@pytest.mark.parametrize("old_names", ["other", "same"])
def test_a_save_that_fails_midway_never_loads_the_old_model(run, tmp_path, monkeypatch,
                                                            old_names):
    new = _folder(tmp_path, "new", 1, shard=False)
    if old_names == "other":       # transformers' 4 shards: none of the new save's names
        old = _folder(tmp_path, "old", 0, shard=True)
    else:                          # functp's 2 shards: the new save overwrites them
        old = str(tmp_path / "old")
        assert run(2, _save_into, _folder(tmp_path, "src", 0, shard=False), old, 2)[0] is None
    before, want = _hf_state(old), _hf_state(new)
    real = safetensors_torch.save_file

    def full_disk(tensors, filename, *args, **kwargs):      # the second shard's writer fails
        if "model-00002-of-" in os.path.basename(filename):
            raise OSError(28, "No space left on device (simulated)")
        return real(tensors, filename, *args, **kwargs)
    monkeypatch.setattr(safetensors_torch, "save_file", full_disk)
    errors = run(2, _save_into, new, old, 2)
    monkeypatch.undo()
    assert all(e and "No space left" in e for e in errors), errors
    for who, load in (("functp", lambda: run(2, _functp_state, old)[0]),
                      ("transformers", lambda: _hf_state(old))):
        try:
            got = load()
        except (functp.CheckpointError, OSError) as e:
            assert who == "transformers" or "model.safetensors" in str(e), e
            continue
        wrong = _differs({k: got[k] for k in want if k in got}, want)
        old_ = [k for k in wrong if torch.equal(got[k], before[k])]
        assert not wrong, f"{who} loads a folder a failed save left: of its tensors " \
            f"{len(old_)} are the old model's, {len(wrong) - len(old_)} neither model's " \
            f"({wrong[:3]})"


# -- generation_config.json ------------------------------------------------------------


def _save_gen(src: str, dst: str, keep: bool, architectures=None):
    warnings.simplefilter("ignore")
    mesh = functp.make_mesh((2,), ("tp",))
    apply, params, specs = functp.from_pretrained(src, mesh, **EAGER)
    config = apply.module.config
    if architectures is not None:
        config.architectures = architectures
    kwargs = {"generation_config": apply.module.generation_config} if keep else {}
    functp.save_pretrained(dst, params, specs, mesh, config, **kwargs)


def test_save_pretrained_writes_the_generation_config_transformers_writes(run, tmp_path):
    src = str(tmp_path / "src")
    model = _model(0)
    model.save_pretrained(src)                    # transformers' own: from the config
    out = str(tmp_path / "out")
    run(2, _save_gen, src, out, False)
    gen = os.path.join(out, "generation_config.json")
    assert os.path.isfile(gen), sorted(os.listdir(out))
    with open(gen) as f, open(os.path.join(src, "generation_config.json")) as g:
        assert json.load(f) == json.load(g)
    # a folder's own generation settings come back through from_pretrained's module
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.25
    model.save_pretrained(src)
    run(2, _save_gen, src, out, True)
    loaded = transformers.GenerationConfig.from_pretrained(out)
    assert (loaded.do_sample, loaded.temperature) == (True, 0.25), loaded
    # a model that does not generate gets none, as from transformers
    plain = str(tmp_path / "plain")
    run(2, _save_gen, src, plain, False, ["LlamaForSequenceClassification"])
    assert not os.path.exists(os.path.join(plain, "generation_config.json"))


# -- blocks for an optimizer -----------------------------------------------------------


def _grad_state(path):
    warnings.simplefilter("ignore")
    _, params, _ = functp.from_pretrained(path, functp.make_mesh((2,), ("tp",)))
    return [(v.requires_grad, v.is_leaf) for v in params.values()]


def test_the_blocks_say_how_to_train_them(run, tmp_path):
    flags = run(2, _grad_state, _folder(tmp_path, "m", 0, shard=False))[0]
    # plain leaves, as parallelize's: requires_grad_() makes them an optimizer's
    assert all(f == (False, True) for f in flags), flags
    doc = functp.from_pretrained.__doc__
    returns = doc[doc.index("**Returns:**"):doc.index("**Raises:**")]
    assert "requires_grad_()" in returns, returns
