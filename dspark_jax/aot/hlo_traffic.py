"""Memory traffic, kernels and weight copies of a compiled program, read off its optimized HLO
(`compiled.as_text()`): what one decoding step (paper §3.2.2, §5.2–5.3) reads and writes on an
accelerator, and whether it reads the weights where they lie.

The compiled program is a tree of computations: the entry, while bodies (scaled by their known
trip count; a loop whose trip count the compiler does not know is counted once, so a program
whose outer loop runs decoding steps is reported per step), conditional branches (the
costliest branch is counted, as the step pays at most that; with `branch="cheapest"` the least
costly, a lower bound: the path of greedy requests where sampling sits behind a `cond`) and
asynchronous wrappers. Every
top-level instruction that launches work (a fusion, a custom call such as a cuBLAS GEMM, a
copy, a sort, ...) is one kernel; its traffic is the bytes of its operands it reads plus the
bytes it writes, where a fused operand that is only sliced counts as the slices it reads
(through bitcasts, element-wise unary ops and nested fusions), and a buffer updated in place
(`dynamic-update-slice`, `scatter`) counts as the update it writes. Only HBM counts: arrays a
TPU program places in on-chip memory (layout `S(1)`, VMEM) are read and written for free, so a
weight prefetched into VMEM costs its one HBM read.

Weight copies: entry parameters are classified by their argument path (the `op_name` JAX gives
each parameter, e.g. ``state['layers'][3]['w_qkv'].value``). A kernel that only moves data (a
copy, or a fusion made of slices, bitcasts, transposes, concatenations and converts) and whose
input is a weight produces a weight copy when it writes HBM: those bytes are written and read
again before a dot reads the weights, which is what keeps a decoding step above its HBM floor.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Iterable

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
               "s4": 0.5, "u4": 0.5, "token": 0}

# opcodes that launch no work of their own
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional",
         "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
         "domain", "iota"}
_ASYNC_DONE = re.compile(r"-done$")
# ops a data-movement fusion may contain (no arithmetic)
_MOVES = {"parameter", "bitcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
          "concatenate", "convert", "broadcast", "tuple", "get-tuple-element", "constant",
          "pad"}
_SLICING = {"slice", "dynamic-slice", "gather"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_NONE: frozenset[str] = frozenset()


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    args: str = ""      # the text between the opcode's parentheses (a parameter's number)
    is_root: bool = False

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    def called(self) -> list[str]:
        out = [v for v in (self.attr(k) for k in ("calls", "body", "condition", "to_apply",
                                                   "true_computation", "false_computation"))
               if v]
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            out += [x.strip().lstrip("%") for x in m.group(1).split(",")]
        return out


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]
    is_entry: bool

    def by_name(self) -> dict[str, Instr]:
        return {i.name: i for i in self.instrs}


def _split_top(s: str) -> list[str]:
    """Splits on commas outside brackets, braces and parentheses."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _matching(s: str, start: int) -> int:
    """Index of the bracket closing the one at `start`."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced HLO text: {s[start:start + 80]!r}")


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


def _parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    name, rest = m.group(1), m.group(2)
    if rest.startswith("("):
        end = _matching(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op_m = re.match(r"([\w\-]+)\(", rest)
    if not op_m:
        return None
    open_at = op_m.end() - 1
    close = _matching(rest, open_at)
    operands = []
    for tok in _split_top(rest[open_at + 1:close]):
        ref = re.findall(r"%([\w.\-]+)", tok)
        if ref:
            operands.append(ref[-1])
    return Instr(name, shape, op_m.group(1), operands, rest[close + 1:],
                 rest[open_at + 1:close], line.lstrip().startswith("ROOT "))


def parse_hlo(text: str) -> dict[str, Computation]:
    """The computations of an HLO module's text, by name."""
    comps: dict[str, Computation] = {}
    cur: Computation | None = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith(("HloModule", "//", "#")):
            continue
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$", line)
        if head and not line.startswith(" "):
            cur = Computation(head.group(2), [], bool(head.group(1)))
            comps[cur.name] = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        if cur is not None:
            ins = _parse_instr(line)
            if ins is not None:
                cur.instrs.append(ins)
    return comps


_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\](\{[^{}]*\})?")


def _arrays(shape: str) -> list[tuple[str, int, bool]]:
    """(dtype, elements, in HBM) of each array of an HLO shape; a TPU layout's `S(1)` places
    the array in on-chip memory (VMEM), whose reads and writes are no HBM traffic."""
    return [(dt, math.prod(int(d) for d in dims.split(",") if d.strip()), "S(1)" not in layout)
            for dt, dims, layout in _ARRAY.findall(shape)]


def shape_bytes(shape: str, hbm_only: bool = False) -> float:
    """Bytes of an HLO shape (a tuple's elements summed; `hbm_only`: those in HBM)."""
    return float(sum(n * DTYPE_BYTES.get(dt, 4) for dt, n, hbm in _arrays(shape)
                     if hbm or not hbm_only))


def _elements(shape: str) -> int:
    return sum(n for _, n, _ in _arrays(shape))


def _leading_dim(shape: str) -> int:
    """The first dimension of an array shape (1 for a scalar)."""
    m = _ARRAY.search(shape)
    dims = [d for d in (m.group(2).split(",") if m else []) if d.strip()]
    return int(dims[0]) if dims else 1


def tuple_elements(shape: str) -> list[str]:
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    return [re.sub(r"/\*.*?\*/", "", e).strip() for e in _split_top(s[1:-1])]


def _trip_count(ins: Instr) -> int | None:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else None


@dataclasses.dataclass
class Kernel:
    computation: str
    name: str
    opcode: str
    shape: str
    times: int
    read: float
    written: float
    weight_copy: bool
    sources: list[str] = dataclasses.field(default_factory=list)   # the weights it copies
    kind: str = "other"      # KERNEL_KINDS
    functions: tuple[str, ...] = ()   # the Python functions its root came from, innermost first


Origin = list[frozenset[str]]   # per tuple element: the weight arguments a value is (a copy of)

# what a kernel does, by kind: matrix products, the attention (its scores, softmax and weighted
# sum, RoPE, the cache reads and writes), RMS norms, other element-wise work, copies, the rest
KERNEL_KINDS = ("gemm", "attention", "norm", "elementwise", "copy", "other")
# the Python functions (innermost frames of JAX's source metadata) of each kind
_ATTENTION_FUNCS = {"attend", "attend_cache_and_own", "attend_cache_and_own_xla",
                    "decode_attention", "layer_attention", "cached_attention", "masked_softmax",
                    "apply_rope",
                    "cache_layer", "cache_scatter", "causal_attention", "causal_mask"}
_NORM_FUNCS = {"rms_norm", "rms_norm_noscale", "add_rms_norm"}
# the kernels of products that take the work before them (a norm, an activation, the merge of
# the attention's cache splits): matrix products first
_GEMM_FUNCS = {"norm_gemm", "swiglu_gemm", "merge_gemm"}
_GEMM_TARGETS = ("cublas", "gemm", "matmul")


def parse_frames(hlo_text: str) -> dict[int, tuple[str, ...]]:
    """stack_frame_id → the Python function names of that frame and its callers (innermost
    first), from the FunctionNames / FileLocations / StackFrames tables that head an HLO module's
    text (empty where the text has none)."""
    tables: dict[str, dict[int, str]] = {}
    cur = None
    for line in hlo_text.splitlines()[:200000]:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = tables.setdefault(line, {})
            continue
        if cur is None:
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if not m:
            if line.startswith(("%", "ENTRY", "HloModule")) or not line.strip():
                if tables.get("StackFrames"):
                    break
                cur = None
            continue
        cur[int(m.group(1))] = m.group(2)
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    loc_func = {}
    for k, v in tables.get("FileLocations", {}).items():
        m = re.search(r"function_name_id=(\d+)", v)
        loc_func[k] = funcs.get(int(m.group(1)), "") if m else ""
    frames = {}
    for k, v in tables.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        # the text prints a frame's parent as its id + 1 (1: no parent)
        frames[k] = (loc_func.get(int(loc.group(1)), "") if loc else "",
                     int(parent.group(1)) - 1 if parent else 0)
    out: dict[int, tuple[str, ...]] = {}
    for k in frames:
        names, seen, f = [], set(), k
        while f in frames and f not in seen:
            seen.add(f)
            name, parent = frames[f]
            names.append(name)
            f = parent
        out[k] = tuple(names)
    return out


def _ops_within(called: list["Computation"], comps: dict[str, "Computation"]) -> set[str]:
    """The opcodes of `called` and of every computation they call in turn (nested fusions)."""
    ops: set[str] = set()
    stack, seen = list(called), set()
    while stack:
        c = stack.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        for i in c.instrs:
            ops.add(i.opcode)
            stack.extend(comps[n] for n in i.called() if n in comps)
    return ops


def kernel_kind(ins: Instr, frames: tuple[str, ...], called: list["Computation"],
                comps: dict[str, "Computation"]) -> str:
    """A kernel's kind (`KERNEL_KINDS`) from its opcode, the ops of the computations it calls
    (nested ones included) and the Python functions its root came from."""
    ops = _ops_within(called, comps)
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    inner = frames[0] if frames else ""
    near = set(frames[:3])   # the function and its callers (a generator's, a helper's)
    if ins.opcode == "custom-call" and target and target.group(1) in KERNEL_TARGETS:
        for f in frames[:6]:   # the innermost function of a kind names the kernel's
            if f in _GEMM_FUNCS:
                return "gemm"
            if f in _NORM_FUNCS:
                return "norm"
            if f in _ATTENTION_FUNCS:
                return "attention"
        return "other"
    if _ATTENTION_FUNCS & near:
        return "attention"
    is_gemm = ("dot" in ops or "convolution" in ops or ins.opcode in ("dot", "convolution")
               or (ins.opcode == "custom-call" and target is not None
                   and any(t in target.group(1).lower() for t in _GEMM_TARGETS)))
    if is_gemm:
        return "gemm"
    if inner in _NORM_FUNCS:
        return "norm"
    if ins.opcode in ("copy", "copy-start") or (ops and ops <= _CARRY_OPS):
        return "copy"
    if ins.opcode == "fusion":
        return "elementwise" if not ops & {"reduce", "sort", "scatter", "gather"} else "other"
    return "other"


_CARRY_OPS = {"parameter", "bitcast", "reshape", "transpose", "copy", "slice", "dynamic-slice",
              "concatenate", "convert", "broadcast", "tuple", "get-tuple-element", "constant",
              "pad", "dynamic-update-slice"}


class Program:
    """One compiled program's kernels with their traffic, each counted the times it runs per
    step, and the weight copies among them. `classify(op_name) -> "weights" | "cache" |
    None` names each entry parameter's role from its argument path."""

    def __init__(self, hlo_text: str, classify: Callable[[str], str | None],
                 branch: str = "costliest"):
        if branch not in ("costliest", "cheapest"):
            raise ValueError(f"branch must be 'costliest' or 'cheapest', got {branch!r}")
        self.branch = branch
        self.comps = parse_hlo(hlo_text)
        self.frames = parse_frames(hlo_text)
        entries = [c for c in self.comps.values() if c.is_entry]
        if len(entries) != 1:
            raise ValueError(f"expected one ENTRY computation, found {len(entries)}")
        self.entry = entries[0]
        self.kernels: list[Kernel] = []
        self.params: dict[str, float] = {"weights": 0.0, "cache": 0.0, "other": 0.0}
        self.param_bytes: dict[str, float] = {}   # argument path → bytes
        self.unknown_trip_loops = 0
        role: dict[str, Origin] = {}
        for ins in self.entry.instrs:
            if ins.opcode == "parameter":
                m = re.search(r'op_name="([^"]*)"', ins.attrs)
                path = m.group(1).replace("\\'", "'") if m else ""
                kind = classify(path) if m else None
                self.params[kind or "other"] += shape_bytes(ins.shape)
                if m:
                    self.param_bytes[path] = shape_bytes(ins.shape)
                name = frozenset({path}) if kind == "weights" else _NONE
                role[ins.name] = [name] * len(tuple_elements(ins.shape))
        self._walk(self.entry, 1, role)

    # ---------------------------------------------------------------- dataflow + costs
    def _walk(self, comp: Computation, times: int, origin: dict[str, Origin]) -> float:
        """Visits `comp` run `times` per step; `origin[name]` names, per tuple element, the
        weight arguments a value is (or is a copy of; empty: not weights). → the bytes it
        moves once."""
        moved = 0.0
        by = comp.by_name()

        def of(name: str) -> Origin:
            return origin.get(name, [_NONE] * (len(tuple_elements(by[name].shape))
                                               if name in by else 1))

        def params_of(c: str) -> list[Instr]:
            return self._params_in_order(self.comps[c])

        for ins in comp.instrs:
            n_out = len(tuple_elements(ins.shape))
            src = [of(o) for o in ins.operands]
            flat = frozenset().union(*(x for s in src for x in s))
            if ins.opcode == "parameter":
                origin.setdefault(ins.name, [_NONE] * n_out)
            elif ins.opcode == "get-tuple-element":
                idx = int(ins.attr("index") or 0)
                s0 = src[0] if src else []
                origin[ins.name] = [s0[idx] if idx < len(s0) else _NONE]
            elif ins.opcode == "tuple":
                origin[ins.name] = [frozenset().union(*s) for s in src]
            elif ins.opcode == "bitcast" or _ASYNC_DONE.search(ins.opcode):
                origin[ins.name] = [flat] * n_out
            elif ins.opcode == "while":
                trips = _trip_count(ins)
                if trips is None:
                    self.unknown_trip_loops += 1
                init = src[0] if src else [_NONE]
                for c in (ins.attr("body"), ins.attr("condition")):
                    if c in self.comps:
                        ps = params_of(c)
                        inner = {ps[0].name: list(init)} if ps else {}
                        moved += self._walk(self.comps[c], times * (trips or 1), inner)
                origin[ins.name] = list(init)
            elif ins.opcode == "conditional":
                moved += self._chosen_branch(ins, src, times)
                origin[ins.name] = [_NONE] * n_out
            elif ins.opcode == "call":
                c = ins.attr("to_apply")
                if c in self.comps:
                    inner = {p.name: src[k] for k, p in enumerate(params_of(c)) if k < len(src)}
                    moved += self._walk(self.comps[c], times, inner)
                origin[ins.name] = [_NONE] * n_out
            elif ins.opcode in _FREE:
                origin[ins.name] = [_NONE] * n_out
            else:
                read, written, moves_only = self._traffic(ins, by)
                # a move into on-chip memory (a TPU prefetch) writes no HBM: not a copy
                copy = moves_only and bool(flat) and written > 0
                origin[ins.name] = [flat if copy else _NONE] * n_out
                called = [self.comps[c] for c in ins.called() if c in self.comps]
                frames = self._frames_of(ins, called)
                self.kernels.append(Kernel(comp.name, ins.name, ins.opcode, ins.shape, times,
                                           read, written, copy, sorted(flat) if copy else [],
                                           kernel_kind(ins, frames, called, self.comps),
                                           frames))
                moved += (read + written) * times
        return moved

    def _frames_of(self, ins: Instr, called: list["Computation"]) -> tuple[str, ...]:
        """The Python functions `ins` came from: its own stack frame, or for a fusion the
        compiler wrote without one (XLA's split-K GEMMs), the first of its instructions'."""
        frame = re.search(r"stack_frame_id=(\d+)", ins.attrs)
        if frame:
            return self.frames.get(int(frame.group(1)), ())
        stack, seen = list(called), set()
        while stack:
            c = stack.pop(0)
            if c.name in seen:
                continue
            seen.add(c.name)
            for i in c.instrs:
                frame = re.search(r"stack_frame_id=(\d+)", i.attrs)
                if frame:
                    return self.frames.get(int(frame.group(1)), ())
                stack.extend(self.comps[n] for n in i.called() if n in self.comps)
        return ()

    def _chosen_branch(self, ins: Instr, src: list[Origin], times: int) -> float:
        """Walks each branch of a conditional and keeps the kernels of the costliest (or, with
        `branch="cheapest"`, the least costly)."""
        walked = []   # (cost, kernels) per branch
        for i, c in enumerate(b for b in ins.called() if b in self.comps):
            start = len(self.kernels)
            ps = self._params_in_order(self.comps[c])
            inner = {ps[0].name: list(src[i + 1])} if ps and i + 1 < len(src) else {}
            cost = self._walk(self.comps[c], times, inner)
            walked.append((cost, self.kernels[start:]))
            del self.kernels[start:]
        if not walked:
            return 0.0
        pick = max if self.branch == "costliest" else min
        cost, kernels = pick(walked, key=lambda w: w[0])
        self.kernels.extend(kernels)
        return max(cost, 0.0)

    def _out_bytes(self, ins: Instr) -> float:
        if ins.opcode.endswith("-start"):   # ((operands), result, context): the result;
            els = tuple_elements(ins.shape)  # copy-start: (destination, source, context)
            out = els[0 if ins.opcode == "copy-start" else 1] if len(els) > 1 else ins.shape
            return shape_bytes(out, hbm_only=True)
        if ins.opcode == "custom-call":      # drop the scratch workspace of library calls
            return sum(shape_bytes(e, hbm_only=True) for e in tuple_elements(ins.shape)
                       if not e.startswith("s8["))
        return shape_bytes(ins.shape, hbm_only=True)

    def _traffic(self, ins: Instr, by: dict[str, Instr]) -> tuple[float, float, bool]:
        """(bytes read, bytes written, only moves data) of one kernel."""
        operand_bytes = [shape_bytes(by[o].shape, hbm_only=True) if o in by else 0.0
                         for o in ins.operands]
        written = self._out_bytes(ins)
        if ins.opcode in ("copy", "copy-start"):
            return sum(operand_bytes), written, True
        if ins.opcode in ("slice", "slice-start", "dynamic-slice"):   # reads the slice alone
            els = tuple_elements(ins.shape)
            out = els[1] if ins.opcode == "slice-start" and len(els) > 1 else ins.shape
            return min(shape_bytes(out), operand_bytes[0] if operand_bytes else 0.0), written, True
        fused = None
        if ins.opcode == "fusion" or ins.opcode.endswith("-start"):
            fused = self.comps.get(ins.attr("calls") or "")
        if fused is None and ins.opcode == "custom-call":
            for name, (table, rows) in GATHERING_KERNELS.items():
                if f"/{name}/" in ins.attrs and max(table, rows) < len(operand_bytes):
                    # the table's rows the indices name, each read once from memory
                    t_shape = by[ins.operands[table]].shape
                    per_row = shape_bytes(t_shape) / max(_leading_dim(t_shape), 1)
                    operand_bytes[table] = min(
                        operand_bytes[table],
                        _elements(by[ins.operands[rows]].shape) * per_row)
            # a kernel's output aliased to an operand is that buffer updated in place: the
            # operand counts as read (the kernel may read all of it, as the decoding layer's
            # attention reads the cache it writes a token's rows into), the output as written
            # not at all (what a kernel stores into it is not known from the program: rows)
            pairs = [(int(o), int(i)) for o, i in re.findall(
                r"\{(\d+)\}:\s*\((\d+),", ins.attrs.split("output_to_operand_aliasing=")[-1])
                ] if "output_to_operand_aliasing=" in ins.attrs else []
            els = tuple_elements(ins.shape)
            written -= sum(shape_bytes(els[o], hbm_only=True) for o, _ in pairs if o < len(els))
            if pairs and any(f"/{n}/" in ins.attrs for n in WRITE_ONLY_KERNELS):
                # stores rows into its aliased buffers without reading them: what it reads
                # (the rows and their indices) is what it writes
                into = {i for _, i in pairs}
                read = sum(b for k, b in enumerate(operand_bytes) if k not in into)
                return read, read, False
            return sum(operand_bytes), written, False
        if fused is None:
            if ins.opcode in _IN_PLACE and operand_bytes:   # the buffer is updated in place
                upd = operand_bytes[2] if ins.opcode == "scatter" else operand_bytes[1]
                return sum(operand_bytes[1:]), upd, False
            return sum(operand_bytes), written, False
        fby = fused.by_name()
        root = next((i for i in fused.instrs if i.is_root), None)
        in_place_roots = self._in_place_roots(fused, root)
        read = 0.0
        for k, p in enumerate(self._params_in_order(fused)):
            full = operand_bytes[k] if k < len(operand_bytes) else shape_bytes(p.shape)
            read += self._param_read(fused, p, full, set(in_place_roots))
        if in_place_roots:   # the output aliases the updated operand: the update is written
            written = sum(shape_bytes(fby[r.operands[2 if r.opcode == "scatter" else 1]].shape,
                                      hbm_only=True)
                          for r in in_place_roots.values())
        moves_only = all(i.opcode in _MOVES for i in fused.instrs)
        return read, written, moves_only

    def _param_read(self, comp: Computation, param: Instr, full: float,
                    in_place: set[str]) -> float:
        """Bytes a fused computation reads of its parameter `param` (`full` bytes): what its
        slices take when every use ends in a slice (through bitcasts and element-wise unary
        ops, and into nested fusions), nothing for a buffer updated in place, else all."""
        users: dict[str, list[Instr]] = {}
        for i in comp.instrs:
            for o in set(i.operands):
                users.setdefault(o, []).append(i)
        by = comp.by_name()
        size = _elements(param.shape)
        per_elem = full / size if size else 0.0
        total, todo = 0.0, [param.name]
        while todo:
            name = todo.pop()
            for u in users.get(name, []):
                if u.opcode in _SLICING and u.operands[0] == name:
                    total += _elements(u.shape) * per_elem
                elif u.opcode in _IN_PLACE and u.name in in_place and u.operands[0] == name:
                    continue
                elif (len(set(u.operands)) == 1 and u.opcode not in ("reduce", "sort")
                      and _elements(u.shape) == _elements(by[name].shape)):
                    todo.append(u.name)   # bitcast, convert, copy, negate, ...: same elements
                elif u.opcode == "fusion" and u.attr("calls") in self.comps:
                    inner = self.comps[u.attr("calls")]
                    ps = self._params_in_order(inner)
                    for k, o in enumerate(u.operands):
                        if o == name and k < len(ps):
                            total += self._param_read(inner, ps[k], size * per_elem, set())
                else:
                    return full
        return min(total, full)

    @staticmethod
    def _params_in_order(comp: Computation) -> list[Instr]:
        ps = [i for i in comp.instrs if i.opcode == "parameter"]
        return sorted(ps, key=lambda i: int(i.args or 0))

    @staticmethod
    def _in_place_roots(fused: Computation, root: Instr | None) -> dict[str, Instr]:
        if root is None:
            return {}
        by = fused.by_name()
        outs = [by[o] for o in root.operands if o in by] if root.opcode == "tuple" else [root]
        found = {}
        for r in outs:
            while r.opcode == "bitcast" and r.operands and r.operands[0] in by:
                r = by[r.operands[0]]
            if r.opcode in _IN_PLACE:
                found[r.name] = r
        return found

    # ---------------------------------------------------------------- report
    def summary(self) -> dict[str, Any]:
        """The per-step figures: bytes_accessed, weights_bytes, cache_bytes,
        weight_copy_bytes, kernels_per_step, the first weight copies (with the weights they
        copy) and the loops whose trip count is unknown (each counted once)."""
        copies = [k for k in self.kernels if k.weight_copy]
        return {
            "bytes_accessed": sum((k.read + k.written) * k.times for k in self.kernels),
            "weights_bytes": self.params["weights"],
            "cache_bytes": self.params["cache"],
            "weight_copy_bytes": sum(k.written * k.times for k in copies),
            "kernels_per_step": sum(k.times for k in self.kernels),
            "kernels_by_kind": {kind: sum(k.times for k in self.kernels if k.kind == kind)
                                for kind in KERNEL_KINDS},
            "weight_copies": [f"{k.name}: {k.shape} x{k.times} of {', '.join(k.sources)}"
                              for k in copies[:8]],
            "loops_of_unknown_trip_count": self.unknown_trip_loops,
        }

    def kernels_within(self, function: str) -> int:
        """Kernels a step launched from inside the Python function `function` (a method
        matched by its own name: "backbone" is `DSparkDraft.backbone`)."""
        def within(functions: tuple[str, ...]) -> bool:
            return any(f == function or f.endswith("." + function) for f in functions)

        # a kernel the compiler wrote with no source at all (a deduplicated split-K GEMM, its
        # sum) runs where its neighbour in the schedule before it runs
        count, last = 0, ("", ())
        for k in self.kernels:
            functions = k.functions or (last[1] if last[0] == k.computation else ())
            last = (k.computation, functions)
            count += k.times if within(functions) else 0
        return count

    def top_kernels(self, n: int = 10) -> list[dict[str, Any]]:
        """The `n` kernels that move the most bytes a step."""
        ks = sorted(self.kernels, key=lambda k: -(k.read + k.written) * k.times)[:n]
        return [{"name": k.name, "opcode": k.opcode, "times": k.times,
                 "mb": round((k.read + k.written) * k.times / 1e6, 3),
                 "weight_copy": k.weight_copy} for k in ks]


# Pallas kernels (by their `pallas_call` name) that only store rows into their aliased
# operands, never reading them: `pallas_kernels.cache_write`'s
WRITE_ONLY_KERNELS = ("cache_write_rows", "cache_write_context_rows")
# Pallas kernels that read an operand only at the rows another operand names (a gather inside
# the kernel): name → (the table's operand, the row indices' operand). `markov_tiles` reads
# the W1 rows of the previous tokens
GATHERING_KERNELS = {"markov_tiles": (1, 0)}
# custom-call targets of Pallas kernels: Mosaic (TPU) and Triton (GPU)
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")
_COLLECTIVE = re.compile(r"^(all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute|"
                         r"collective-broadcast|ragged-all-to-all)")
# ops that only carry an operand on to the kernel (no arithmetic)
_CARRY = _MOVES | {"copy-start", "copy-done", "optimization-barrier"}


def pallas_kernels(hlo_text: str) -> list[Instr]:
    """The Pallas kernel calls (Mosaic or Triton custom calls) of a compiled program."""
    return [i for c in parse_hlo(hlo_text).values() for i in c.instrs
            if i.opcode == "custom-call" and _call_target(i) in KERNEL_TARGETS]


def _call_target(ins: Instr) -> str:
    m = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    return m.group(1) if m else ""


def collectives_feeding_kernels(hlo_text: str) -> list[dict[str, str]]:
    """The collectives (all-gather, all-to-all, ...) whose result reaches a Pallas kernel's
    operand through data movement alone (bitcasts, copies, transposes, converts, fusions of
    those): the gathers XLA adds where a kernel runs outside `shard_map` and its sharded
    inputs must be made whole first. One row per (kernel, operand, collective); empty where
    every kernel reads its operands where they lie."""
    comps = parse_hlo(hlo_text)
    found = []
    for comp in comps.values():
        by = comp.by_name()
        for ins in comp.instrs:
            if ins.opcode != "custom-call" or _call_target(ins) not in KERNEL_TARGETS:
                continue
            for operand in ins.operands:
                stack, seen = [operand], set()
                while stack:
                    name = stack.pop()
                    src = by.get(name)
                    if src is None or name in seen:
                        continue
                    seen.add(name)
                    if _COLLECTIVE.match(src.opcode):
                        found.append({"kernel": ins.name, "operand": operand,
                                      "collective": f"{src.opcode} {src.name} {src.shape}"})
                    elif src.opcode in _CARRY or (src.opcode == "fusion"
                                                  and _moves_only(comps, src)):
                        stack.extend(src.operands)
    return found


def _moves_only(comps: dict[str, Computation], fusion: Instr) -> bool:
    called = [comps[c] for c in fusion.called() if c in comps]
    return bool(called) and all(i.opcode in _CARRY or (i.opcode == "fusion" and
                                                       _moves_only(comps, i))
                                for c in called for i in c.instrs)


def compile_with_text(lowered: Any, via_dump: bool = False) -> tuple[Any, str]:
    """(compiled program, its optimized HLO text). The text is `compiled.as_text()`, which
    re-reads the program's HLO proto; where that round trip fails (libtpu writes some async
    instructions it cannot read back), the program is compiled again with XLA's own text dump
    (`xla_dump_to`), which prints the same optimized module. `via_dump` takes the dump at the
    first compile (for TPU programs, whose round trip mostly fails: one compile, not two)."""
    import glob
    import os
    import tempfile

    import jax

    if not via_dump:
        compiled = lowered.compile()
        try:
            return compiled, compiled.as_text()
        except jax.errors.JaxRuntimeError as e:
            if "RET_CHECK" not in str(e):
                raise
    name = re.search(r"module @([\w.\-]+)", lowered.as_text()[:4096])
    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile({"xla_dump_to": d, "xla_dump_hlo_as_text": True})
        dumps = glob.glob(f"{d}/*after_optimizations.txt")
        # the program itself: the module named as the lowered one, the largest if several
        named = [f for f in dumps if name and f".{name.group(1)}." in os.path.basename(f)]
        dumps = sorted(named or dumps, key=os.path.getsize)
        if not dumps:
            raise RuntimeError("the compiler wrote no optimized HLO text")
        with open(dumps[-1]) as f:
            return compiled, f.read()


def weights_or_cache(weight_prefixes: Iterable[str], cache_prefixes: Iterable[str]
                     ) -> Callable[[str], str | None]:
    """A `classify` for `Program`: argument paths starting with one of `weight_prefixes` are
    weights, with one of `cache_prefixes` the KV caches."""
    wp, cp = tuple(weight_prefixes), tuple(cache_prefixes)

    def classify(op_name: str) -> str | None:
        if op_name.startswith(wp):
            return "weights"
        if op_name.startswith(cp):
            return "cache"
        return None

    return classify
