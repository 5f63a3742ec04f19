"""Where a round's device calls spend their time on the backend's threads (the roofline
behind the one-request bars).

`bench.matmul_rows` times the target's matmuls alone; this benchmark profiles the calls of a
speculative round as the engine builds them, with `--requests` in flight (default one): the
plain decode step (engine `none`), verification of K tokens (`cost_profile.verify_step_fn`,
K = 2 and γ + 1) and the draft (`cost_profile.draft_step_fn`), each `--steps` steps a device
call as the rounds' loop runs them (`--draft ''`: the plain step only, e.g. regeneration's
batch of 32 requests). `jax.profiler` records every op the runtime executes on its worker
threads; per call the table gives the wall time a step, the time with no op / one op / two or
more ops running (the host's cores kept busy), and the thread time of the dots (YNNPACK /
oneDNN / Eigen matmul fusions) against every other op, beside the weight bytes a step reads and
the byte floor at the host's copy bandwidth (`bench.common.host_facts`); for the plain step,
the thread time of each kind of op (the dots; the copies of a layer's weights and cache out of
the stacked layers; ...).

With one request in flight, XLA:CPU runs the dots one op at a time on one thread each, so one
core's bandwidth, not the host's, sets a step's time: a plain step spends most of its time with
a single op running, and its dots read the weights at about one core's copy bandwidth; at 32
requests the copies of each layer's weight and cache slices run beside the dots (figures: this
command's tables).

  JAX_PLATFORMS=cpu python -m dspark_jax.bench.op_profile --draft runs/smollm2_dspark/export
  JAX_PLATFORMS=cpu python -m dspark_jax.bench.op_profile --draft '' --requests 32 --max-len 256

(With libtpu installed, the profiler needs JAX_PLATFORMS=cpu on a CPU host: libtpu's profiler
plugin crashes otherwise.)
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time
from typing import Any, Callable, Iterable, Sequence

import jax

from dspark_jax.bench.common import (build_target, device_name, host_facts, save_json,
                                     weight_bytes)

# op-name prefixes of matrix products in XLA:CPU's thunks (YNNPACK / XNNPACK / oneDNN fusions,
# Eigen dot thunks)
DOT_PREFIXES = ("ynn_fusion", "xnn_fusion", "onednn", "dot", "custom-call")
# profiler events that wrap or wait on ops rather than run one
WRAPPERS = ("end:", "ThunkExecutor", "SlinkyThreadPool", "ThreadpoolListener")

Event = tuple[int, int, str]   # (start ns, end ns, op name)


def occupancy(events: Sequence[Event]) -> dict[int, int]:
    """ns of the span of `events` during which 0, 1 and 2 or more of them ran at once."""
    edges = sorted([(a, 1) for a, b, _ in events] + [(b, -1) for a, b, _ in events])
    out = {0: 0, 1: 0, 2: 0}
    if not edges:
        return out
    running, last = 0, edges[0][0]
    for t, delta in edges:
        out[min(running, 2)] += t - last
        running, last = running + delta, t
    return out


def thread_time(events: Iterable[Event], prefixes: Sequence[str] = DOT_PREFIXES
                ) -> tuple[int, int]:
    """(ns of the ops whose name starts with one of `prefixes`, ns of every other op)."""
    dots = other = 0
    for a, b, name in events:
        if name.startswith(tuple(prefixes)):
            dots += b - a
        else:
            other += b - a
    return dots, other


def worker_events(trace_dir: str) -> list[Event]:
    """The ops run on the runtime's worker threads in the newest trace under `trace_dir`."""
    from jax.profiler import ProfileData

    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))[-1]
    events: list[Event] = []
    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            if not line.name.startswith(("tf_XLAEigen", "tf_XLACpu", "XLA")):
                continue
            for ev in line.events:
                if not ev.name.startswith(WRAPPERS):
                    events.append((int(ev.start_ns), int(ev.start_ns + ev.duration_ns),
                                   ev.name))
    return events


def skip_mismatched_plugin_profilers() -> list[str]:
    """Keeps JAX from registering the profiler of a PJRT plugin built for another jaxlib (the
    CUDA plugin installed to compile for a GPU without one: `jax-cuda13-pjrt` of the lent GPU's
    JAX beside an older jaxlib), whose profiler API jaxlib's tracer reads wrongly and crashes
    on when a trace starts. The plugin still compiles. Call it before JAX first picks a
    backend (that is when it loads its plugins). → the mismatched distributions."""
    import re
    import warnings
    from importlib import metadata

    import jaxlib
    from jax._src import xla_bridge

    def norm(name: str | None) -> str:
        return re.sub(r"[-_.]+", "-", name or "").lower()

    mismatched = [f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                  if norm(d.metadata["Name"]).startswith(("jax-cuda", "jax-rocm"))
                  and norm(d.metadata["Name"]).endswith("-pjrt")
                  and d.version != jaxlib.__version__]
    if not mismatched:
        return mismatched
    real = getattr(xla_bridge, "_profiler", None)
    if real is None or getattr(xla_bridge, "_backends", None):
        warnings.warn(f"{', '.join(mismatched)} beside jaxlib {jaxlib.__version__}: its "
                      "profiler could not be kept out (JAX's internals differ, or a backend "
                      "already started); a trace may crash", RuntimeWarning, stacklevel=2)
    elif not isinstance(real, _NoPluginProfilers):
        xla_bridge._profiler = _NoPluginProfilers(real)
    return mismatched


class _NoPluginProfilers:
    """jaxlib's profiler module as `xla_bridge` sees it, less plugin profiler registration."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def register_plugin_profiler(self, c_api: Any) -> None:
        del c_api


def profile(fn: Callable[[], Any], calls: int) -> tuple[list[Event], float]:
    """Runs `fn` (warm) `calls` times under the profiler → (worker events, wall seconds)."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        t0 = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
        return worker_events(d), wall


def summarise(events: list[Event], wall_s: float, steps: int, nbytes: float | None,
              copy_gbps: float) -> dict[str, float | None]:
    """Per step, in ms: wall, each occupancy, the dots' and the other ops' thread time, and the
    byte floor of `nbytes` (None: not given)."""
    occ = occupancy(events)
    dots, other = thread_time(events)
    ms = 1e-6 / steps
    return dict(wall_ms=1e3 * wall_s / steps, idle_ms=occ[0] * ms, one_op_ms=occ[1] * ms,
                two_plus_ms=occ[2] * ms, dots_thread_ms=dots * ms, other_thread_ms=other * ms,
                floor_ms=None if nbytes is None else 1e3 * nbytes / (copy_gbps * 1e9))


def run(a: argparse.Namespace) -> dict:
    from dspark_jax.bench.spec_round import plain_device_step_fn
    from dspark_jax.models import load_draft
    from dspark_jax.serving import Engine, EngineSettings, cost_profile

    target = build_target(a.target, a.dtype)
    kw = dict(max_requests=a.requests, max_len=a.max_len, stop_token_ids=[])
    plain = Engine(target, None, settings=EngineSettings(scheduler="none", **kw))
    plain_fn = plain_device_step_fn(plain, steps=a.steps)
    calls = {"plain step": (plain_fn, weight_bytes(target))}
    if a.draft:
        draft = load_draft(a.draft, target=target)
        g = int(draft.config.num_drafts)
        eng = Engine(target, draft, settings=EngineSettings(scheduler="fixed", **kw))
        verify = cost_profile.verify_step_fn(eng, a.steps)
        drafting = cost_profile.draft_step_fn(eng, a.steps)
        calls |= {"verify K = 2": (lambda: verify(2), weight_bytes(target)),
                  f"verify K = {g + 1}": (lambda: verify(g + 1), weight_bytes(target)),
                  "draft": (lambda: drafting(0), None)}   # reads the draft vocabulary's rows
    ops: dict[str, float] = {}
    facts = host_facts()
    parts = {}
    for name, (fn, wb) in calls.items():
        events, wall = profile(fn, a.calls)
        parts[name] = dict(summarise(events, wall, a.steps * a.calls, wb,
                                     facts["memory_copy_gbs"]),
                           weight_mb=None if wb is None else wb / 1e6)
        if name == "plain step":
            ops = op_kinds(events, a.steps * a.calls)
    return {"target": a.target, "device": device_name(), "backend": jax.default_backend(),
            "host": facts, "dtype": a.dtype, "draft": a.draft, "steps": a.steps,
            "calls": a.calls, "max_len": a.max_len, "requests": a.requests, "parts": parts,
            "plain_step_ops_ms": ops}


def op_kinds(events: Iterable[Event], steps: int, top: int = 8) -> dict[str, float]:
    """Thread ms a step of the `top` costliest kinds of op (an op's name less its number:
    `ynn_fusion`, `dynamic-slice_bitcast_fusion`, ...)."""
    out: dict[str, float] = {}
    for a, b, name in events:
        kind = name.split(".")[0]
        out[kind] = out.get(kind, 0.0) + (b - a) * 1e-6 / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:top])


def table(r: dict) -> str:
    """The result as a markdown table, each part's ms a step."""
    lines = [f"| call (R = {r.get('requests', 1)}) | wall | no op running | one op | ≥ 2 ops | dots thread-ms | "
             "other ops thread-ms | weight MB | byte floor |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in r["parts"].items():
        mb = "–" if s["weight_mb"] is None else f"{s['weight_mb']:.0f}"
        floor = "–" if s["floor_ms"] is None else f"{s['floor_ms']:.1f}"
        lines.append(f"| {name} | {s['wall_ms']:.1f} | {s['idle_ms']:.1f} | "
                     f"{s['one_op_ms']:.1f} | {s['two_plus_ms']:.1f} | "
                     f"{s['dots_thread_ms']:.1f} | {s['other_thread_ms']:.1f} | {mb} | {floor} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--draft", default=os.path.join("runs", "smollm2_dspark", "export"),
                   help="a drafter export directory (default: the main job's); empty: the "
                        "plain step only")
    p.add_argument("--requests", type=int, default=1, help="requests in flight R")
    p.add_argument("--max-len", type=int, default=512, help="the cache's positions")
    p.add_argument("--steps", type=int, default=4, help="steps a device call")
    p.add_argument("--calls", type=int, default=3, help="profiled calls a part")
    p.add_argument("--json", default=None, help="also write the result here")
    a = p.parse_args(argv)
    if a.steps < 1 or a.calls < 1 or a.requests < 1 or a.max_len < 16:
        raise SystemExit("--steps, --calls and --requests must be >= 1, --max-len >= 16")
    if a.draft and not os.path.isdir(a.draft):
        raise SystemExit(f"--draft: no drafter export at {a.draft!r} (run the main job, or "
                         "pass --draft DIR)")
    skip_mismatched_plugin_profilers()
    r = run(a)
    save_json(r, a.json)
    h = r["host"]
    print(f"{a.target} {a.dtype}, {r['device']}, {h['cpu']}, {h['logical_cpus']} CPUs, copy "
          f"{h['memory_copy_gbs']} GB/s; cache {a.max_len}, {a.steps} steps a call; ms a step")
    print(table(r))
    print("plain step, thread ms a step by kind of op: " + ", ".join(
        f"{k} {v:.1f}" for k, v in r["plain_step_ops_ms"].items()))
    return r


if __name__ == "__main__":
    from dspark_jax.cli_support import run_main

    run_main(main, compilation_cache=False)      # it times its own compilation
