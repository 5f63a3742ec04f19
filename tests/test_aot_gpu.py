"""Decoding programs read off their compiled HLO (dspark_jax.aot.hlo_traffic) and compiled for
an H200 without one (python -m dspark_jax.aot --chip h200 --decode), and the matmul precision
policy of decoding (dspark_jax.decoding.precision)."""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.aot import gpu
from dspark_jax.aot.hlo_traffic import Program, weights_or_cache

L, D, F = 4, 64, 256


def _weights(n: int = L) -> dict[str, jax.Array]:
    k = jax.random.split(jax.random.key(0), 2)
    return {"up": jax.random.normal(k[0], (n, D, F)), "down": jax.random.normal(k[1], (n, F, D))}


def _stacked(w, x):
    def body(h, lw):
        return h + jnp.tanh(h @ lw["up"]) @ lw["down"], None
    return jax.lax.scan(body, x, w)[0]


def _per_layer(ws, x):
    for lw in ws:
        x = x + jnp.tanh(x @ lw["up"]) @ lw["down"]
    return x


def _program(fn, *args) -> Program:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return Program(text, weights_or_cache(["w", "ws"], []))


def test_a_scan_over_stacked_weights_copies_them_and_per_layer_buffers_do_not():
    x = jnp.ones((1, D))
    w = _weights()
    stacked = _program(_stacked, w, x).summary()
    layer_bytes = (D * F + F * D) * 4
    assert stacked["weights_bytes"] == L * layer_bytes
    # every layer's slices are written out before the dots read them
    assert stacked["weight_copy_bytes"] >= L * layer_bytes
    ws = [jax.tree.map(lambda a: a[i], w) for i in range(L)]
    per_layer = _program(_per_layer, ws, x).summary()
    assert per_layer["weight_copy_bytes"] == 0
    assert per_layer["weights_bytes"] == L * layer_bytes
    # each weight read once (plus the activations): within a few percent of the weights
    assert L * layer_bytes <= per_layer["bytes_accessed"] <= 1.05 * L * layer_bytes
    assert stacked["bytes_accessed"] > 2 * per_layer["bytes_accessed"]
    # a known trip count scales the loop body: the scan's kernels count L times a step
    assert stacked["kernels_per_step"] >= L


def test_kernels_are_classified_by_what_they_compute():
    """A program's kernels take their kind from the ops they run and the Python functions their
    root came from (the source frames XLA keeps in the HLO text): an RMS norm, a GEMM and the
    attention's softmax each show up under their own kind, and every kernel has one."""
    from dspark_jax.aot.hlo_traffic import parse_frames
    from dspark_jax.models import layers as L

    def f(x, w, g, k, v):
        q = (L.rms_norm(x, g, 1e-6) @ w).reshape(1, 4, 2, 8)
        return jnp.tanh(L.attend(q, k, v, L.causal_mask(1, 4)))

    args = (jnp.ones((1, 4, 16)), jnp.ones((16, 16)), jnp.ones((16,)), jnp.ones((1, 4, 2, 8)),
            jnp.ones((1, 4, 2, 8)))
    text = jax.jit(f).lower(*args).compile().as_text()
    frames = parse_frames(text)
    assert any(fr[0] == "rms_norm" and fr[1].endswith("f") for fr in frames.values())
    s = Program(text, weights_or_cache([], [])).summary()
    kinds = s["kernels_by_kind"]
    assert sum(kinds.values()) == s["kernels_per_step"]
    assert kinds["gemm"] >= 1 and kinds["norm"] >= 1 and kinds["attention"] >= 1


def test_traffic_of_a_loop_free_program_agrees_with_xla_cost_analysis():
    ws = [jax.tree.map(lambda a: a[i], _weights()) for i in range(L)]
    compiled = jax.jit(_per_layer).lower(ws, jnp.ones((2, D))).compile()
    ours = Program(compiled.as_text(), lambda _: None).summary()["bytes_accessed"]
    xla = compiled.cost_analysis()
    xla = (xla[0] if isinstance(xla, (list, tuple)) else xla)["bytes accessed"]
    assert ours == pytest.approx(xla, rel=0.1)



def test_a_conditional_counts_its_costliest_or_its_cheapest_branch():
    """A step pays one branch of a `cond`: the summary counts the costlier (an upper bound),
    `branch="cheapest"` the other (the greedy path where sampling sits behind a `cond`)."""
    big = jnp.ones((64, 1024))

    def fn(flag, x, w):
        return jax.lax.cond(flag, lambda: jnp.sum(jnp.exp(w) @ jnp.exp(w).T),
                            lambda: jnp.sum(x))

    text = jax.jit(fn).lower(True, jnp.ones((4,)), big).compile().as_text()
    costly = Program(text, lambda _: None).summary()["bytes_accessed"]
    cheap = Program(text, lambda _: None, branch="cheapest").summary()["bytes_accessed"]
    assert costly >= big.size * 4 > 100 * cheap > 0
    with pytest.raises(ValueError, match="branch"):
        Program(text, lambda _: None, branch="median")

_TPU_PREFETCH_HLO = """HloModule m, entry_computation_layout={(bf16[32,128,256]{2,1,0})->f32[]}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_reduce (p: bf16[8,128,256]) -> f32[] {
  %p = bf16[8,128,256]{2,1,0:T(8,128)(2,1)S(1)} parameter(0)
  %c = f32[8,128,256]{2,1,0} convert(%p)
  %z = f32[] constant(0)
  ROOT %r = f32[] reduce(%c, %z), dimensions={0,1,2}, to_apply=%add
}

ENTRY %main (w: bf16[32,128,256]) -> f32[] {
  %w = bf16[32,128,256]{2,1,0:T(8,128)(2,1)} parameter(0), metadata={op_name="state['w']"}
  %ss = ((bf16[32,128,256]{2,1,0:T(8,128)(2,1)}), bf16[8,128,256]{2,1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:8], [0:128], [0:256]}
  %sd = bf16[8,128,256]{2,1,0:T(8,128)(2,1)S(1)} slice-done(%ss)
  ROOT %f = f32[] fusion(%sd), kind=kLoop, calls=%fused_reduce
}
"""


def test_a_tpu_prefetch_into_vmem_costs_its_slice_read_once():
    """A weight slice DMA'd into VMEM (layout S(1)) reads its slice from HBM once; the fusion
    that reads it in VMEM adds no HBM traffic, and the DMA is no weight copy."""
    p = Program(_TPU_PREFETCH_HLO, weights_or_cache(("state[",), ()))
    s = p.summary()
    assert s["weights_bytes"] == 32 * 128 * 256 * 2
    assert s["bytes_accessed"] == 8 * 128 * 256 * 2 + 4     # the slice + the f32 result
    assert s["weight_copy_bytes"] == 0 and not s["weight_copies"]


needs_plugin = pytest.mark.skipif(not gpu.has_cuda_plugin(),
                                  reason=f"needs the CUDA plugin: {gpu.GPU_INSTALL_HINT}")


def _aot_in_subprocess(args: list[str], dump: pathlib.Path | None = None) -> int:
    """`python -m dspark_jax.aot ARGS` in its own process (its optimized HLO text written
    under `dump`, if given): compiling Triton kernels for a GPU loads the CUDA plugin's LLVM
    beside XLA:CPU's, and a test process that goes on compiling for the CPU afterwards has
    crashed in XLA:CPU's compiler."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    if dump is not None:
        env["XLA_FLAGS"] = f"--xla_dump_to={dump}"
    return subprocess.run([sys.executable, "-m", "dspark_jax.aot", *args], env=env,
                          capture_output=True, timeout=600).returncode


def _round_branches(dump: pathlib.Path) -> tuple[Program, Program]:
    """The round whose optimized HLO text lies under `dump`: (its cheapest branch, its
    costliest)."""
    text = next(dump.glob("*jit_speculative_rounds*after_optimizations.txt")).read_text()
    return (Program(text, lambda name: None, branch="cheapest"),
            Program(text, lambda name: None, branch="costliest"))


@pytest.fixture(scope="module")
def h200_report(tmp_path_factory):
    """`aot --chip h200 --decode` of the plain steps and the chain round, for a tiny Qwen3 with
    128-wide heads at Qwen3's vocabulary (151,936 ids): (its report, the model's directory,
    the round's (cheapest branch, costliest)), compiled once for the tests that read it."""
    from hf_tiny import save_tiny_hf

    path = save_tiny_hf(tmp_path_factory.mktemp("tgt"), "qwen3", head_dim=128, layers=2,
                        vocab=151936)
    out = tmp_path_factory.mktemp("aot") / "h200.json"
    dump = tmp_path_factory.mktemp("dump")
    rc = _aot_in_subprocess(["--config", "configs/tiny.py", "--chip", "h200", "--decode",
                             "--max-len", "256", "--json", str(out), f"--config.target={path}",
                             "--config.train.target_dtype=bfloat16", "--programs",
                             "decode_step,plain_step,round"], dump=dump)
    assert rc == 0
    return json.loads(out.read_text()), path, _round_branches(dump)


@pytest.mark.gpu
@needs_plugin
def test_h200_plain_steps_read_the_weights_where_they_lie(h200_report):
    progs = h200_report[0]["programs"]
    assert h200_report[0]["layout"] == "per-layer"
    assert set(progs) == {"decode_step", "plain_step", "round"}
    for name in ("decode_step", "plain_step"):
        p = progs[name]
        for key in ("bytes_accessed", "weights_bytes", "cache_bytes", "weight_copy_bytes",
                    "kernels_per_step", "temp_bytes"):
            assert key in p, (name, key)
        assert p["weight_copy_bytes"] == 0, (name, p["weight_copies"])
        assert p["weights_bytes"] > 0 and p["cache_bytes"] > 0
        assert p["loops_of_unknown_trip_count"] == 1     # the step loop, counted once
    layers = json.loads((h200_report[1] / "config.json").read_text())["num_hidden_layers"]
    for name, p in progs.items():   # kernels per layer, by kind, and the projected time
        assert sum(p["kernels_by_kind"].values()) == p["kernels_per_step"], name
        if name != "round":   # the round's are per target layer too, the draft's per drafter's
            assert p["kernels_per_layer"] == pytest.approx(p["kernels_per_step"] / layers)
        assert p["kernels_by_kind"]["attention"] > 0 and p["kernels_by_kind"]["norm"] > 0
        model = p["bytes_accessed"] / (0.9 * 4.8e12) + p["kernels_per_step"] * 2e-6
        assert p["projected_s"] == pytest.approx(model, rel=0.01)
    assert h200_report[0]["round_over_plain_step_projected"] == pytest.approx(
        progs["round"]["projected_s"] / progs["plain_step"]["projected_s"])


@pytest.mark.gpu
@needs_plugin
def test_h200_round_copies_no_weight(h200_report):
    """The round reads every weight where it lies, the drafter's too: its layers' context k|v
    products share an input, and XLA would merge them into one dot over their weights
    concatenated every call (`DSparkDraft.context_kv` keeps them apart)."""
    r = h200_report[0]["programs"]["round"]
    assert r["weight_copy_bytes"] == 0 and not r["weight_copies"], r["weight_copies"]


@pytest.mark.gpu
@needs_plugin
def test_h200_stacked_layers_copy_the_weights(h200_report, tmp_path):
    """`--stacked-layers` compiles the layout the engine avoids on a GPU, where XLA:GPU copies
    weight slices out of the stack (at the tiny model's sizes some projections, transposed; at
    Qwen3's every matrix of every layer) and the per-layer layout copies none."""
    from dspark_jax.aot import command as cli

    out = tmp_path / "stacked.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--chip", "h200", "--decode",
                   "--max-len", "256", "--json", str(out), f"--config.target={h200_report[1]}",
                   "--config.train.target_dtype=bfloat16", "--programs", "decode_step",
                   "--stacked-layers"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["layout"] == "stacked"
    step = r["programs"]["decode_step"]
    assert step["weight_copy_bytes"] > 0, step
    assert all("state['layers']" in c for c in step["weight_copies"]), step["weight_copies"]
    assert h200_report[0]["programs"]["decode_step"]["weight_copy_bytes"] == 0


def test_a_chip_excludes_a_topology(capsys):
    """Usage errors before anything compiles: a chip and a topology at once, slices of a
    single chip, no slice at all."""
    from dspark_jax.aot import command as cli

    for extra, message in ((["--chip", "h200", "--topology", "v5e:2x2"], "one of --topology"),
                           (["--chip", "h200", "--num-slices", "2"], "needs --topology"),
                           (["--topology", "v5e:2x2", "--num-slices", "0"], "must be ≥ 1")):
        with pytest.raises(SystemExit) as exc:
            cli.main(["aot", "--config", "configs/tiny.py", "--decode", *extra])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.gpu
@needs_plugin
def test_h200_training_step_report(tmp_path):
    """`--chip h200` alone compiles the training step for the H200 and reports its traffic
    beside its FLOPs: a step reads at least its weights, and neither bound is zero."""
    from hf_tiny import save_tiny_hf
    from dspark_jax.aot import command as cli

    path = save_tiny_hf(tmp_path / "tgt", "qwen3")
    out = tmp_path / "train.json"
    rc = cli.main(["aot", "--config", "configs/tiny.py", "--chip", "h200", "--json", str(out),
                   f"--config.target={path}", "--config.train.global_batch_size=2",
                   "--config.data.max_length=64"])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["chip"] == "h200" and r["num_chips"] == 1 and r["fits"]
    assert r["weights_bytes"] > 0 and r["bytes_accessed"] > r["weights_bytes"]
    assert r["kernels_per_step"] > 10 and r["top_kernels"]
    assert r["flops_per_step"] >= r["model_flops_per_step"] > 0
    assert r["memory_time_lower_bound_s"] > 0 and 0 < r["mfu_at_lower_bound"] <= 1


# ---------------------------------------------------------------- the precision policy
def _dot_precisions(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if "dot_general" in ln and "stablehlo" in ln]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoding_dots_carry_the_policy_precision(dtype, tmp_path):
    """Under the backend's default precision, every lowered decoding program (the decode step,
    the engine's plain steps, drafting, verification, the chain round and the tree round) runs
    every dot at HIGHEST for fp32 weights and leaves bf16 at the default."""
    from hf_tiny import save_tiny_hf
    from dspark_jax.aot.decode import DecodeShape
    from dspark_jax.aot.decode_floor import _programs
    from dspark_jax.train.job_config import parse_config

    path = save_tiny_hf(tmp_path, "qwen3")
    c = parse_config(["x", "--config=configs/tiny.py", f"--config.target={path}",
                      f"--config.train.target_dtype={dtype}"], require_target=False)
    cpu = jax.devices("cpu")[:1]
    chain, _, _ = _programs(c, cpu, DecodeShape(1, 64, 0))
    tree, _, _ = _programs(c, cpu, DecodeShape(2, 64, 0, tree_budget=8))
    lowered = {name: chain[name] for name in ("decode_step", "plain_step", "draft", "verify",
                                             "round")}
    lowered["tree round"] = tree["round"]
    with jax.default_matmul_precision("default"):
        texts = {name: lower(*args, **kw).as_text()
                 for name, (lower, args, kw) in lowered.items()}
    for name, text in texts.items():
        dots = _dot_precisions(text)
        assert len(dots) > 2, name
        highest = ["HIGHEST" in d for d in dots]
        assert all(highest) if dtype == "float32" else not any(highest), (name, dots[:2])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_split_k_products_carry_the_policy_precision(dtype, tmp_path, monkeypatch):
    """The GPU's program, its kernels interpreted and its products split along K (the split's
    threshold lowered to the tiny model): every dot carries the policy's precision (HIGHEST
    for fp32 weights, the default for bf16), the row kernels' (every product of the target's
    and the drafter's layers, each taken in its kernel) and the split products' (a layer's o
    product where the merge stays apart, here the drafter's) alike."""
    from hf_tiny import save_tiny_hf
    from dspark_jax.aot.decode import DecodeShape
    from dspark_jax.aot.decode_floor import _programs
    from dspark_jax.models import decoding_layer as DL
    from dspark_jax.models import layers as L
    from dspark_jax.train.job_config import parse_config

    monkeypatch.setattr(DL, "SPLIT_K_MIN_CHUNK", 16)
    path = save_tiny_hf(tmp_path, "qwen3", head_dim=32)
    c = parse_config(["x", "--config=configs/tiny.py", f"--config.target={path}",
                      f"--config.train.target_dtype={dtype}"], require_target=False)
    def texts(names):
        with L.interpret_kernels():
            chain, _, _ = _programs(c, jax.devices("cpu")[:1], DecodeShape(1, 64, 0))
            with jax.default_matmul_precision("default"):
                return {name: chain[name][0](*chain[name][1], **chain[name][2]).as_text()
                        for name in names}

    programs = texts(("decode_step", "verify", "draft"))
    monkeypatch.setattr(DL, "merged_o_takes", lambda *a, **k: False)   # the merge apart
    jax.clear_caches()   # the draft traced again, not the merged one reused
    programs["draft, the merge apart"] = texts(("draft",))["draft"]
    jax.clear_caches()   # and no later test reuses a program traced with the merge apart
    for name, text in programs.items():
        dots = _dot_precisions(text)
        if name == "draft, the merge apart":   # the split products: dots batched over parts
            # (x [B, T, P, K/P], w [P, K/P, F])
            assert any("batching_dims = [2] x [0], contracting_dims = [3] x [1]" in d
                       for d in dots), name
        highest = ["HIGHEST" in d for d in dots]
        assert all(highest) if dtype == "float32" else not any(highest), (name, dots[:2])


def test_the_policy_is_per_dtype():
    from dspark_jax.decoding.precision import matmul_precision, weights_dtype

    assert matmul_precision(jnp.float32) == "highest"
    assert matmul_precision(jnp.bfloat16) == "default"
    assert weights_dtype({"a": np.zeros(2, np.int32), "b": jnp.zeros(2, jnp.bfloat16)}) == \
        jnp.bfloat16


@pytest.mark.gpu
@needs_plugin
def test_h200_decode_step_launches_five_kernels_a_layer(tmp_path):
    """The decode step and the draft compiled for an H200 with the decoding layer's kernels:
    what one more layer adds (4 target layers against 2, 3 drafter layers against 1; Qwen3 with
    128-wide heads, 2 query heads a key head) is the layer's kernels alone, five: the previous
    layer's activation with its down product, the residual sum with the input norm and the
    q/k/v product, the attention's splits (q/k norms, RoPE, the cache write), their merge with
    the o product, the residual sum with the post-attention norm and the gate/up product; a
    drafter layer's, counted in its layers apart from its heads, the same five (its block's
    attention over the context cache in place of the cached one), and its heads and sampling
    a few kernels a draft slot. No weight is copied."""
    from hf_tiny import save_tiny_hf

    kernels, drafter, chain = {}, {}, {}
    for layers, draft_layers in ((2, 1), (4, 3)):
        path = save_tiny_hf(tmp_path / f"l{layers}", "qwen3", head_dim=128, layers=layers)
        out = tmp_path / f"l{layers}.json"
        assert _aot_in_subprocess(["--config", "configs/tiny.py", "--chip", "h200",
                                   "--decode", "--max-len", "256", "--json", str(out),
                                   f"--config.target={path}",
                                   f"--config.draft.num_draft_layers={draft_layers}",
                                   "--config.train.target_dtype=bfloat16", "--programs",
                                   "decode_step,draft"]) == 0
        report = json.loads(out.read_text())
        progs = report["programs"]
        for p in progs.values():
            assert p["weight_copy_bytes"] == 0, p["weight_copies"]
        # the Markov head sampled by the tiled kernels: a few kernels a slot (its scan in
        # XLA's ops takes about forty)
        assert progs["draft"]["drafting_head_kernels"] <= 12 * report["gamma"], progs["draft"]
        kernels[layers] = progs["decode_step"]["kernels_per_step"]
        chain[layers] = progs["decode_step"]["target_layer_chain"]
        assert (progs["decode_step"]["outside_layer_kernels"]
                + chain[layers] * layers == pytest.approx(kernels[layers]))
        drafter[draft_layers] = progs["draft"]["drafter_layer_kernels"]
        assert progs["draft"]["kernels_per_layer"] == pytest.approx(
            drafter[draft_layers] / draft_layers)
    per_layer = (kernels[4] - kernels[2]) / 2
    assert per_layer == 5, kernels
    # the report's chain (the kernels its source attributes to the layer function) grows by
    # exactly what one more layer adds; the last layer's activation and down product are taken
    # by the final norm's kernel, outside the layers' function, and nothing else is there (the
    # RoPE angles are the attention kernel's own)
    assert chain[4] * 4 - chain[2] * 2 == pytest.approx(2 * per_layer), (chain, per_layer)
    assert all(c * n - per_layer * n == -1 for n, c in chain.items()), (chain, per_layer)
    assert (drafter[3] - drafter[1]) / 2 == 5, drafter


@pytest.mark.gpu
@needs_plugin
def test_h200_qwen3_8b_layer_sums_its_split_k_parts_in_its_kernels(tmp_path):
    """At Qwen3-8B's layer shape (hidden 4096, 32 heads over 8, MLP 12288; a config alone, no
    weights) the decode step's o and down products are split along K and their parts summed
    by the kernels that read them, the norms, the activation and the attention's merge taken in
    the products' kernels: one more layer adds 5 kernels (12 with XLA's norms and sums of its
    own split-K parts), and no weight is copied."""
    from hf_tiny import tiny_hf_config

    kernels = {}
    for layers in (2, 3):
        cfg = tiny_hf_config("qwen3", head_dim=128, layers=layers).to_dict()
        cfg.update(hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                   num_key_value_heads=8)
        path = tmp_path / f"l{layers}"
        path.mkdir()
        (path / "config.json").write_text(json.dumps(cfg))
        out = tmp_path / f"l{layers}.json"
        assert _aot_in_subprocess(["--config", "configs/tiny.py", "--chip", "h200", "--decode",
                                   "--max-len", "256", "--json", str(out),
                                   f"--config.target={path}",
                                   "--config.train.target_dtype=bfloat16",
                                   "--programs", "decode_step"]) == 0
        step = json.loads(out.read_text())["programs"]["decode_step"]
        assert step["weight_copy_bytes"] == 0, step["weight_copies"]
        kernels[layers] = step["kernels_per_step"]
    assert kernels[3] - kernels[2] == 5, kernels


_ROW_WRITE_HLO = """HloModule m, entry_computation_layout={(bf16[1,2,64,2,8]{4,3,2,1,0}, bf16[1,4,2,8]{3,2,1,0}, s32[4]{0})->(bf16[1,2,64,2,8]{4,3,2,1,0})}

ENTRY %main (c: bf16[1,2,64,2,8], k: bf16[1,4,2,8], r: s32[4]) -> (bf16[1,2,64,2,8]) {
  %c = bf16[1,2,64,2,8]{4,3,2,1,0} parameter(0), metadata={op_name="state['cache']"}
  %k = bf16[1,4,2,8]{3,2,1,0} parameter(1)
  %r = s32[4]{0} parameter(2)
  ROOT %w = (bf16[1,2,64,2,8]{4,3,2,1,0}) custom-call(%r, %k, %c), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{0}: (2, {})}, metadata={op_name="jit(f)/KERNEL/pallas_call"}
}
"""


def test_a_row_writing_kernel_reads_none_of_the_buffers_it_writes_into():
    """`cache_write_rows` stores rows into its aliased caches without reading them: its traffic
    is the rows and indices it reads and the same bytes written; a kernel not known to be
    write-only (the decoding attention, which reads the cache it writes into) counts the whole
    aliased buffer as read."""
    rows = 4 * 2 * 8 * 2 + 4 * 4
    cache = 2 * 64 * 2 * 8 * 2
    write = Program(_ROW_WRITE_HLO.replace("KERNEL", "cache_write_rows"), lambda _: None)
    assert write.summary()["bytes_accessed"] == 2 * rows
    other = Program(_ROW_WRITE_HLO.replace("KERNEL", "layer_attention_splits"), lambda _: None)
    assert other.summary()["bytes_accessed"] == rows + cache


_GATHER_HLO = """HloModule m, entry_computation_layout={(s32[3]{0}, bf16[1000,64]{1,0})->f32[3,1000]{1,0}}

ENTRY %main (p: s32[3], w: bf16[1000,64]) -> f32[3,1000] {
  %p = s32[3]{0} parameter(0)
  %w = bf16[1000,64]{1,0} parameter(1), metadata={op_name="w1"}
  ROOT %x = f32[3,1000]{1,0} custom-call(%p, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/KERNEL/pallas_call"}
}
"""


def test_a_gathering_kernel_reads_the_rows_it_names():
    """`markov_tiles` reads W1 only at the rows of the previous tokens: its traffic counts
    those rows (and the indices and its output), not the table; another kernel given the same
    operands counts the whole table."""
    indices, out, row = 3 * 4, 3 * 1000 * 4, 64 * 2
    gather = Program(_GATHER_HLO.replace("KERNEL", "markov_tiles"), lambda _: None)
    assert gather.summary()["bytes_accessed"] == indices + 3 * row + out
    other = Program(_GATHER_HLO.replace("KERNEL", "markov_pick"), lambda _: None)
    assert other.summary()["bytes_accessed"] == indices + 1000 * row + out


def _h200_round(tmp_path, tiny: dict, *flags: str) -> tuple[Program, Program]:
    """The round `aot --decode` compiles for an H200 for a tiny Qwen3 with 128-wide heads
    (`save_tiny_hf` options `tiny`, aot `flags`), in a subprocess: (its cheapest branch, its
    costliest)."""
    from hf_tiny import save_tiny_hf

    path = save_tiny_hf(tmp_path / "t", "qwen3", head_dim=128, layers=2, **tiny)
    dump = tmp_path / "dump"
    assert _aot_in_subprocess(["--config", "configs/tiny.py", "--chip", "h200", "--decode",
                               "--max-len", "256", *flags, "--programs", "round",
                               f"--config.target={path}",
                               "--config.train.target_dtype=bfloat16"], dump=dump) == 0
    return _round_branches(dump)


@pytest.fixture(scope="module")
def h200_tree_round(tmp_path_factory) -> tuple[Program, Program]:
    """The tree round for an H200 (tiny Qwen3 with 128-wide heads at Qwen3's vocabulary,
    4 requests, trees of 8, γ = 4, at most 4 children a node: `--tree-branching`): (its
    cheapest branch, its costliest), compiled once for the tests that read it."""
    return _h200_round(tmp_path_factory.mktemp("tree"), {"vocab": 151936}, "--tree-budget", "8",
                       "--tree-branching", "4", "--requests", "4")


@pytest.mark.gpu
@needs_plugin
def test_h200_greedy_tree_round_keeps_the_vocabulary_wide_arrays_off_hbm(h200_tree_round):
    """The tree round compiled for an H200: with every request greedy (each conditional's
    cheapest branch) its children come from the tree-children kernel, no kernel computes the
    frontier's logits or the tree's q, and its verification attends through the
    decode-attention kernel; the sampled branch still computes them (so the check reads the
    branches apart)."""
    greedy, sampled = h200_tree_round
    assert greedy.kernels_within("top_children") > 0
    assert greedy.kernels_within("decode_attention") > 0
    for fn in ("LowRankChildren.logits", "_candidates.<locals>.mixed",
               "_cell_probs.<locals>.q"):
        assert greedy.kernels_within(fn) == 0, fn
        assert sampled.kernels_within(fn) > 0, fn


_SMEM_SCRIPT = """
import functools
import jax, jax.numpy as jnp
from jax.sharding import SingleDeviceSharding
from dspark_jax.aot.gpu import gpu_devices
from pallas_kernels.decode_attention import decode_attention, layer_attention
sh = SingleDeviceSharding(gpu_devices("h200")[0])
spec = lambda s, d: jax.ShapeDtypeStruct(s, d, sharding=sh)
n, kh, S, h = 16, 8, 8192, 512
cache = spec((1, S, kh, h), jnp.bfloat16)
for T in (32,):
    fn = functools.partial(layer_attention, scale=1.0, num_q_heads=n, eps=1e-6, write=True,
                           v_norm=True)
    jax.jit(fn).lower(spec((1, T, n + 2 * kh, h), jnp.bfloat16), spec((h,), jnp.bfloat16),
                      spec((h,), jnp.bfloat16), spec((h // 2,), jnp.float32),
                      spec((1,), jnp.int32), cache, cache).compile()
    print("layer", T, flush=True)
for T in (17, 64):
    fn = functools.partial(decode_attention, scale=1.0)
    own = spec((1, T, kh, h), jnp.bfloat16)
    jax.jit(fn).lower(spec((1, T, n, h), jnp.bfloat16), cache, cache, spec((1,), jnp.int32),
                      own, own, spec((1, T, T), jnp.bool_)).compile()
    print("decode", T, flush=True)
"""


@pytest.mark.gpu
@needs_plugin
def test_gemma4_full_layer_attention_fits_shared_memory_at_its_largest_tiles():
    """Heads of 512 (Gemma4's full layers) with 64 query rows a program (T = 32 over G = 2) or
    the decode kernel's query tiles (T = 17, 64): compiled for an H200 (its shared-memory
    check runs without a GPU), each fits its 228 KB: a program that large runs one pipeline
    stage and tiles of at most 64 rows at that head size."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SMEM_SCRIPT], capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["layer", "32", "decode", "17", "decode", "64"], out.stdout


@pytest.mark.gpu
@needs_plugin
def test_h200_round_takes_taps_rows_and_draws_in_the_kernels_there(h200_report):
    """The chain round compiled for an H200 (tiny Qwen3, DSpark tapping its first layer of
    two): the tapped layer's sum is taken by the next layer's input-norm kernel, with no kernel
    of its own; the layers' deferred K/V rows reach the cache write where each layer left
    them, with no kernel stacking them; the Markov head draws each draft slot in its two
    kernels (tile partials, pick), the picks writing the draft's tokens in place, plus one
    pass for the draft's probabilities: 2γ + 1; the drafter's context is written by one kernel
    that norms and rotates its keys on the way (`write_context_rows`), after the product's,
    with none of XLA's angles, norm, RoPE or transposes; the target's and the drafter's layers
    take their RoPE angles in the attention kernel, so no kernel computes cos / sin."""
    gamma = h200_report[0]["gamma"]
    for branch in h200_report[2]:
        assert branch.kernels_within("_tap_output") == 0
        stacks = [k.name for k in branch.kernels if len(k.functions) > 1
                  and k.functions[0].endswith("<lambda>") and k.functions[1] == "run_layers"]
        assert not stacks, stacks
        assert branch.kernels_within("markov_sample_tiled") == 2 * gamma + 1
        assert branch.kernels_within("write_context_rows") == 1
        assert branch.kernels_within("_stacked_context_kv") == 0
        assert branch.kernels_within("rope_cos_sin") == 0


@pytest.mark.gpu
@needs_plugin
def test_h200_sampled_acceptance_rule_launches_few_kernels_at_a_full_vocabulary(h200_report):
    """The chain round compiled for an H200 (tiny Qwen3 at Qwen3's vocabulary, 151,936 ids):
    with sampling, the target's probabilities beyond the top-k / top-p filter are one
    reduction over the vocabulary (an online softmax, split in two kernels, and the filter's
    predicate; a softmax and an argmax make 5) and the rejection rule draws its correction by a
    tiled inverse CDF (tile sums, a prefix over the tiles, one within the chosen tile; a
    cumulative sum over the vocabulary, a tree of kernels, makes the rule 14); with every
    request greedy neither runs."""
    greedy, sampled = h200_report[2]
    probs = sampled.kernels_within("filtered_probs") - sampled.kernels_within("_sorted_threshold")
    assert 0 < probs <= 3
    assert 0 < sampled.kernels_within("ref_verify") <= 9
    for fn in ("filtered_probs", "ref_verify"):
        assert greedy.kernels_within(fn) == 0, fn


@pytest.mark.gpu
@needs_plugin
def test_h200_chain_drafter_draws_in_two_kernels_and_writes_its_cache_in_place(tmp_path):
    """Eagle3's round compiled for an H200 (tiny Qwen3 at Qwen3's vocabulary, one request, a
    256-position cache, γ = 3): each of its draft tokens is drawn by the row sampler's two
    kernels (tile masses, then the pick), where XLA's inverse CDF over the vocabulary takes
    seven or more a draw, and none of XLA's remains; the chain's scratch K/V go into the
    drafter's cache where it lies: no kernel copies the cache ([1 layer, 1, 256, 2, 128]); and
    the chain runs unrolled (no kernel of it repeats in a loop)."""
    gamma = 3
    greedy, sampled = _h200_round(
        tmp_path, {"vocab": 151936}, "--config.draft.model_type=eagle3",
        "--config.draft.draft_num_hidden_layers=1", "--config.draft.markov_rank=0",
        "--config.draft.enable_confidence_head=False", f"--config.draft.ttt_length={gamma}")
    for branch in (greedy, sampled):
        assert branch.kernels_within("inverse_cdf_sample") == 0
        # 2 a draw (and at most a fusion that stacks the chain's tokens)
        assert 2 * gamma <= branch.kernels_within("row_sample") <= 2 * gamma + 2
        copies = [k.name for k in branch.kernels
                  if k.kind == "copy" and k.shape.startswith("bf16[1,1,256,2,128]")]
        assert not copies, copies
        chain = [k.times for k in branch.kernels
                 if any(f.endswith("Eagle3Draft.propose") for f in k.functions)]
        assert len(chain) > 50 and max(chain) == 1


@pytest.mark.gpu
@needs_plugin
def test_h200_sampled_tree_rule_reads_each_node_once_a_sibling(h200_tree_round):
    """The sampled tree round compiled for an H200: the tree's rejection rule writes
    vocabulary-wide rows only at each depth's node (its p and q), at the node it stops at and
    for the final residual, where the stepwise recurrence writes the residual and q at every
    sibling (2 × 4 × 4 rows); each sibling is one reduction over the node's p and q, and each
    depth sums q once: as many as the `--tree-branching` it was compiled for."""
    _, sampled = h200_tree_round
    rule = [k for k in sampled.kernels
            if any(f.endswith("tree_rejection_verify_with_uniforms") for f in k.functions)]
    row = 4 * 151936 * 4
    gamma, siblings = 4, 4
    assert 0 < sum(k.written * k.times for k in rule) <= (2 * (gamma + 1) + 1) * row
    read = sum(k.read * k.times for k in rule if k.functions[0] == "_try_children")
    assert gamma * siblings * 2 * row <= read <= gamma * (siblings * 2 + 1) * row + row
