"""The engine on a mesh of several devices (`decoding.placement`): with the target's weights
loaded over a (data, fsdp, tensor) mesh, the request slots' caches are laid on the same mesh
as `aot --decode --topology` lays them, every program is traced under it, and the tokens are
the ones one device decodes."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax.decoding import autoregressive_generate
from dspark_jax.models import init_draft, load_target
from dspark_jax.models import layers as L
from dspark_jax.serving import Engine, EngineSettings
from dspark_jax.sharding import active_mesh, make_mesh, use_mesh
from hf_tiny import save_tiny_hf

DRAFT = dict(block_size=3, num_draft_layers=1, target_layer_ids=(-1, 0), mask_token_id=96,
             markov_rank=8)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15, 16, 17, 18]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_hf(tmp_path_factory.mktemp("t"), "qwen3", head_dim=16, layers=2, seed=1)


def test_the_engine_lays_its_slots_on_the_weights_mesh(path, monkeypatch):
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    settings = EngineSettings(max_requests=4, max_len=64, scheduler="fixed", stop_token_ids=[])
    one = load_target(path)
    spread = load_target(path, mesh=mesh)
    want = Engine(one, init_draft(one, DRAFT, seed=3), settings=settings).generate(
        PROMPTS, max_new_tokens=8)
    ref_ar = autoregressive_generate(one, PROMPTS, max_new_tokens=8, stop_token_ids=[])

    traced: list = []   # the mesh active wherever a decoding layer asks for its kernels
    real = L.kernels_enabled
    monkeypatch.setattr(L, "kernels_enabled", lambda: traced.append(active_mesh()) or real())
    eng = Engine(spread, init_draft(spread, DRAFT, seed=3), settings=settings)
    assert Engine(one, None, settings=EngineSettings(scheduler="none")).spec.mesh is None
    assert eng.spec.mesh is mesh
    # a prefill call takes `prefill_tokens` for each of the 4 parts the slots are split into
    assert eng.spec.prefill_call_tokens == 4 * settings.prefill_tokens
    # the per-layer buffers an accelerator decodes on keep the weights' mesh
    assert Engine(spread, None, settings=EngineSettings(
        scheduler="none", layer_buffers=True)).spec.mesh is mesh
    state = eng.fresh_state()
    k = jax.tree.leaves(state.cache.k)[0]              # [1, R, S, Kh, H]: slots, heads
    assert k.sharding.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    assert state.anchor.sharding.spec == P(("data", "fsdp"))
    assert all(x.sharding.mesh is mesh for x in jax.tree.leaves(eng.grown(state, 128)))
    got = eng.generate(PROMPTS, max_new_tokens=8)
    assert got.tokens == want.tokens                     # greedy: the one device's tokens
    assert traced and all(m is mesh for m in traced)
    traced.clear()
    assert autoregressive_generate(spread, PROMPTS, max_new_tokens=8,
                                   stop_token_ids=[]) == ref_ar
    assert traced and all(m is mesh for m in traced)


def test_the_autoregressive_loop_keeps_its_rows_on_the_weights_mesh(path):
    """`autoregressive_generate`'s state on weights spread over a mesh: its rows lie on it as
    the engine's slots do, from the empty state through the prefill and the steps (left to
    XLA, the prefill's cache is replicated over the slot shards, then laid out again by the
    first step)."""
    import jax.numpy as jnp

    from dspark_jax.decoding import autoregressive as A

    mesh = make_mesh(data=1, fsdp=4, tensor=2)
    spread = load_target(path, mesh=mesh)
    stepper = spread.decoding_layout(None)
    stops = A.stop_array([], [])
    empty = A.empty_state(spread, A.row_key_data(0, 4), cache_len=64, max_new=4)
    cache_sh = jax.tree.leaves(empty.cache.k)[0].sharding
    rows_sh = empty.last_token.sharding
    assert cache_sh.spec == P(None, ("data", "fsdp"), None, "tensor", None)
    assert rows_sh.spec == P(("data", "fsdp"))

    def laid(state) -> bool:
        k = jax.tree.leaves(state.cache.k)[0]
        return (k.sharding.is_equivalent_to(cache_sh, k.ndim)
                and state.last_token.sharding.is_equivalent_to(rows_sh, 1))

    with use_mesh(mesh):
        s = A.prefilled_state(spread, PROMPTS, A.row_key_data(0, 4), jnp.float32(0), stops,
                              cache_len=64, max_new=4)
        assert laid(s)
        s = A.ar_decode(stepper.graphdef, stepper.state, s, jnp.float32(0), stops, num_steps=2)
        assert laid(s)


def test_the_engine_state_is_laid_out_as_aot_compiles_it(path):
    """`aot --decode`'s abstract round (`build_abstract_round`) and the engine on the same mesh
    lay every array of the state alike: the program aot reports is the engine's."""
    from dspark_jax.aot.decode import DecodeShape, build_abstract_round
    from dspark_jax.train.job_config import parse_config

    c = parse_config(["x", "--config=configs/tiny.py", f"--config.target={path}",
                      "--config.mesh.data=1", "--config.mesh.fsdp=4", "--config.mesh.tensor=2",
                      "--config.mesh.num_devices=-1"], require_target=False)
    rnd = build_abstract_round(c, jax.devices(), DecodeShape(4, 64, 0), layer_buffers=False)
    spread = load_target(path, mesh=rnd.mesh)
    eng = Engine(spread, init_draft(spread, DRAFT, seed=3), settings=EngineSettings(
        max_requests=4, max_len=64, scheduler="fixed", stop_token_ids=[]))
    abstract, state = rnd.round_args[1], eng.fresh_state(64)
    specs = lambda tree: [(x.shape, x.sharding.spec) for x in jax.tree.leaves(tree)]  # noqa
    assert specs(abstract.cache) == specs(state.cache)   # the target's KV cache and lengths
    assert specs(abstract.anchor) == specs(state.anchor)
    assert len({x.sharding.spec for x in jax.tree.leaves(state.cache.k)}) == 1
