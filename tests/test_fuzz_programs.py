"""Property test: random well-typed programs compile, deterministically, and explain.

Unlike tests/test_fuzz.py (printing, parsing and mutations of the corpus), this builds
programs that should pass every check: nodes with typed ports and phases, walks whose
calls pass values of the right types, with the edges their values need, loops (fixed, with a
request count, dynamic), carried and accumulated values, values rebound by a call to its
own output, parallel branches, stream blocks with the three chunk policies, forks, emits
and acyclic transitions; placed on one CPU rank or spread over two GPUs. For each:

- `mstarc compile` succeeds (no diagnostic, no internal error);
- compiling it again gives the same bytes;
- `mstarc explain` renders the plan in every format.

The example count is modest (CI runs it in seconds); raise FUZZ_EXAMPLES to search longer.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mstarc.cli import main

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))

# Port and value types, with a constant of each (None: no literal of that type).
TYPES = {
    "f32[2]": "[0.5, 1.5]",
    "f32[4]": "[1.0, 2.0, 3.0, 4.0]",
    "f32[T]": "[1.0]",
    "i32[1]": "[7]",
    "i32[N]": "[1, 2]",
    "bool": "true",
    "bool[1]": "false",  # a bool tensor takes a bool constant
    "int": "3",
    "float": "0.25",
    "str": '"s"',
}
TENSORS = [t for t in TYPES if "[" in t]
PLACEMENTS = {
    "cpu": "devices:\n  - {rank: 0, type: cpu, memory_gib: 16}\n",
    "gpu2": "devices: {count: 2, type: cuda, name: H200, memory_gib: 139.8}\ndefault_rank: spread\nmax_batch: 8\n",
}
POLICIES = ["fixed(4)", "fixed(size = 1)", "sliding(window = 4, stride = 2)", "sliding(4, 4)",
            "left_context(chunk = 2, left = 3)", "left_context(3, 0)"]
ARCH = ("arch llama(layers = 2, hidden = 64, heads = 4, kv_heads = 2, head_dim = 16, intermediate = 128, "
        "vocab = 256)")


def _parse(t: str) -> tuple[str, tuple[str, ...] | None]:
    if "[" not in t:
        return t, None
    name, dims = t[:-1].split("[")
    return name, tuple(d.strip() for d in dims.split(","))


def compatible(value: str, port: str) -> bool:
    """mstarc.ir.ValueType.compatible on type strings (a capitalised dim is symbolic)."""
    (vk, vd), (pk, pd) = _parse(value), _parse(port)
    if vk != pk or (vd is None) != (pd is None):
        return False
    if vd is None:
        return True
    return len(vd) == len(pd) and all(a == b or a.isalpha() or b.isalpha() for a, b in zip(vd, pd))


def acc_type(t: str) -> str:
    kind, dims = _parse(t)
    return f"{kind}[{', '.join(('N',) + dims[1:])}]" if dims else t


@dataclass
class Node:
    name: str
    kv: bool
    ins: dict[str, str]
    outs: dict[str, str]
    phases: dict[str, tuple[list[str], list[str]]]
    tags: list[str] = field(default_factory=list)
    arch: bool = False

    def text(self) -> str:
        items = [ARCH, "max_seq_len = 256"] if self.arch else []
        if self.tags:
            items.append("tags " + ", ".join(self.tags))
        items += [f"in {p} : {t}" for p, t in self.ins.items()] + [f"out {p} : {t}" for p, t in self.outs.items()]
        items += [f"phase {ph}({', '.join(i)}) -> ({', '.join(o)})" for ph, (i, o) in self.phases.items()]
        return f"  node {self.name} : {'kv' if self.kv else 'stateless'} = fuzz.N {{\n    " + "\n    ".join(items) \
            + "\n  }"


@dataclass(frozen=True)
class Value:
    type: str
    producer: tuple[str, str] | None  # (node, output port)


class Gen:
    """Draws one program; every choice keeps it well typed."""

    def __init__(self, draw):
        self.draw = draw
        self.n = 0
        self.edges: dict[tuple[str, str, str, str], None] = {}
        self.config = {"k0": "2", "k1": "k0 * 3 + 1", "k2": "(k1 - k1 % 2) / 2", "name": '"fuzz"', "dtype": '"f32"'}
        self.nodes: list[Node] = []
        self.streams: list[tuple[str, str]] = []  # (policy, walk that drains it)

    def fresh(self, prefix: str = "v") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def choice(self, items):
        return self.draw(st.sampled_from(list(items)))

    def flip(self, p: float = 0.5) -> bool:
        return self.draw(st.floats(0, 1)) < p

    # ---- nodes
    def make_nodes(self) -> None:
        for i in range(self.draw(st.integers(1, 4))):
            kv = self.flip(0.4)
            ins = {f"i{j}": self.choice(TYPES) for j in range(self.draw(st.integers(0, 3)))}
            outs = {f"o{j}": self.choice(TYPES) for j in range(self.draw(st.integers(1, 3)))}
            if self.flip(0.4):
                outs["stop"] = self.choice(["bool", "bool[1]"])
            phases = {}
            for p in range(self.draw(st.integers(1, 2))):
                reads = [k for k in ins if self.flip(0.7)]
                writes = [k for k in outs if self.flip(0.8)] or [next(iter(outs))]
                phases[f"p{p}"] = (reads, writes)
            tags = ["main", "alt"] if kv and self.flip(0.3) else []
            self.nodes.append(Node(f"n{i}", kv, ins, outs, phases, tags, arch=kv and self.flip(0.5)))

    # ---- values
    def out_type(self, producer: tuple[str, str]) -> str:
        return next(n.outs[producer[1]] for n in self.nodes if n.name == producer[0])

    def operand(self, port: str, env: dict[str, Value], node: str, in_port: str) -> str:
        names = [n for n, v in env.items() if compatible(v.type, port) and (  # the edge it needs type-checks too
            v.producer is None or v.producer[0] == node or compatible(self.out_type(v.producer), port))]
        if names and self.flip(0.8):
            name = self.choice(sorted(names))
            prod = env[name].producer
            if prod is not None and prod[0] != node:
                self.edges[(prod[0], prod[1], node, in_port)] = None
            return name
        if port == "int" and self.flip(0.5):
            return self.choice(["k0", "k1", "k2", "k0 + k1"])
        if port == "str" and self.flip(0.3):
            return "name"
        return TYPES[port]

    def call(self, env: dict[str, Value], out: list[str], pad: str, rebind: bool, want: str | None = None,
             bind_as: str | None = None) -> str | None:
        """A call binding all its outputs (or, rarely, none). With `want`, one output has exactly
        that type and is bound to `bind_as` (else a fresh name), which is returned; None when no
        phase has such an output. With `rebind`, an output may rebind a value of its type."""
        options = [(nd, ph) for nd in self.nodes for ph, (_, o) in nd.phases.items()
                   if want is None or any(nd.outs[p] == want for p in o)]
        if not options:
            return None
        node, phase = self.choice(options)
        reads, writes = node.phases[phase]
        args = ", ".join(f"{p} = {self.operand(node.ins[p], env, node.name, p)}" for p in reads)
        names, wanted = [], None
        for p in writes:
            t = node.outs[p]
            same = [n for n, v in env.items() if v.type == t] if rebind else []
            if want is not None and wanted is None and t == want:
                wanted = bind_as or self.fresh()
                name = wanted
            elif same and self.flip(0.4):
                name = self.choice(sorted(same))  # `x = a.f(x = x)`: checked like a fresh name
            else:
                name = self.fresh()
            names.append(name)
        tag = f" @{self.choice(node.tags)}" if node.tags and self.flip(0.5) else ""
        bind = f"{', '.join(names)} = " if names and (want or self.flip(0.9)) else ""
        out.append(f"{pad}{bind}{node.name}.{phase}({args}){tag}")
        if bind:
            for name, p in zip(names, writes):
                env[name] = Value(node.outs[p], (node.name, p))
        return wanted

    def block(self, env: dict[str, Value], out: list[str], depth: int, frozen: frozenset[str] | None) -> None:
        """Statements; `frozen`: the values a loop around it does not carry (None: no loop)."""
        for _ in range(self.draw(st.integers(1, 3))):
            kind = self.choice(["call"] * 4 + (["loop", "dynamic", "parallel"] if depth < 3 else []) + ["fork"])
            pad = "    " * (depth + 1)
            if kind == "call":
                self.call(env, out, pad, rebind=frozen is None and depth == 0)
            elif kind == "fork":
                kvs = [n for n in self.nodes if n.tags]
                if kvs:
                    out.append(f"{pad}fork {self.choice(kvs).name} @main -> @alt")
            elif kind == "parallel":
                out.append(f"{pad}parallel {{")
                merged: dict[str, Value] = {}
                for _ in range(self.draw(st.integers(1, 3))):
                    out.append(f"{pad}  branch {self.fresh('b')} {{")
                    inner = dict(env)
                    # a branch that rebinds a value binds it (two such branches would clash, E045)
                    self.block(inner, out, depth + 1, frozenset(env) | (frozen or frozenset()))
                    merged.update({n: v for n, v in inner.items() if n not in env})
                    out.append(f"{pad}  }}")
                out.append(f"{pad}}}")
                env.update(merged)
            else:
                self.loop(kind == "dynamic", env, out, depth, pad, frozen or frozenset())

    def loop(self, dynamic: bool, env: dict[str, Value], out: list[str], depth: int, pad: str,
             frozen: frozenset[str]) -> None:
        inner = dict(env)
        body: list[str] = []
        # carried: values the loop rebinds; not those an enclosing loop keeps fixed
        carry = [n for n in sorted(env) if n not in frozen and self.flip(0.3)][:2]
        flag = None
        if dynamic:
            flag = self.call(inner, body, pad + "    ", rebind=False, want=self.choice(["bool", "bool[1]"]))
            if flag is None:
                return
        index = self.fresh("i") if self.flip(0.3) else None
        if index:
            inner[index] = Value("int", None)
        kept = []
        for name in carry:  # a carried value is rebound in the body, to a value of its type
            if self.call(inner, body, pad + "    ", rebind=False, want=env[name].type, bind_as=name) is not None:
                kept.append(name)
        self.block(inner, body, depth + 1, frozenset(n for n in env if n not in kept))
        accs = []
        tensors = [n for n, v in inner.items() if n not in env and "[" in v.type]
        if tensors and self.flip(0.4):
            src = self.choice(sorted(tensors))
            acc = self.fresh("a")
            body.append(f"{pad}    acc {acc} += {src}")
            accs.append((acc, inner[src]))
        if dynamic:
            head = f"dynamic_loop max = {self.choice(['k1', '5', '1'])} until {flag}"
        else:
            ints = sorted(n for n, v in env.items() if v.type == "int")
            count = self.choice(ints) if ints and self.flip(0.3) else self.choice(["k0", "3", "0"])
            head = f"loop n = {count}" + (" max = 8" if count in ints else "")
        head += f" index {index}" if index else ""
        head += f" carry {', '.join(kept)}" if kept else ""
        out.append(f"{pad}{head} {{")
        out.extend(body)
        out.append(f"{pad}}}")
        for name in kept:
            env[name] = inner[name]
        for acc, v in accs:
            env[acc] = Value(acc_type(v.type), v.producer)

    # ---- walks
    def walk(self, name: str, flag_out: bool, defaults: bool) -> tuple[str, list[str]]:
        ins = {f"x{self.fresh('')}": self.choice(TYPES) for _ in range(self.draw(st.integers(0, 3)))}
        env = {n: Value(t, None) for n, t in ins.items()}
        out: list[str] = []
        outputs: dict[str, str] = {}
        if self.streams and self.streams[-1][1] == name:
            out.append("    on stream src.code -> sink.codes as chunk { pcm = sink.decode(codes = chunk) "
                       "emit audio += pcm }")
            out.append(f"    c{self.fresh('')} = src.step(t = [1])")
            outputs["audio"] = "f32[S]"
        self.block(env, out, 0, None)
        for n, v in sorted(env.items()):
            if self.flip(0.4) or not outputs:
                o = f"out{len(outputs)}"
                op = "+=" if "[" in v.type and self.flip(0.3) else "="
                outputs[o] = v.type if op == "=" or self.flip(0.5) else acc_type(v.type)
                out.append(f"    emit {o} {op} {n}")
        if not env:  # nothing bound: emit a constant
            outputs["out0"] = "int"
            out.append("    emit out0 = k1")
        flags = []
        if flag_out:
            bools = [n for n, v in env.items() if v.type in ("bool", "bool[1]")]
            src = self.choice(sorted(bools)) if bools else "true"
            outputs["go"] = env[src].type if bools else "bool"
            out.append(f"    emit go = {src}")
            flags.append("go")
        params = ", ".join(f"{n}: {t}" + (f" = {TYPES[t]}" if defaults else "") for n, t in ins.items())
        outs = ", ".join(f"{n}: {t}" for n, t in outputs.items())
        return f"  walk {name}({params}) -> ({outs}) {{\n" + "\n".join(out) + "\n  }", flags

    def program(self) -> tuple[str, str]:
        self.make_nodes()
        walks = [f"w{i}" for i in range(self.draw(st.integers(1, 3)))]
        if self.flip(0.4):
            self.streams.append((self.choice(POLICIES), self.choice(walks)))
            self.nodes.append(Node("src", False, {"t": "i32[1]"}, {"code": "i32[1]"}, {"step": (["t"], ["code"])}))
            self.nodes.append(Node("sink", False, {"codes": "i32[N]"}, {"pcm": "f32[S]"},
                                   {"decode": (["codes"], ["pcm"])}))
        stream_nodes = self.nodes[-2:] if self.streams else []
        self.nodes = [n for n in self.nodes if n not in stream_nodes]  # walks call them only as written above
        texts, transitions = [], []
        for i, w in enumerate(walks):
            text, flags = self.walk(w, flag_out=i + 1 < len(walks), defaults=i > 0)
            texts.append(text)
            if flags and self.flip(0.7):
                dst = self.choice(walks[i + 1:])  # forward only: transitions never cycle
                keep = [n for n in self.nodes if n.kv]
                keep_text = f" keep {keep[0].name}@main" if keep and self.flip(0.5) else ""
                transitions.append(f"  transition {w} -> {dst} when go{keep_text}")
        self.nodes += stream_nodes
        variant = "  variant real {\n" + "\n".join(f"    {k} = {v}" for k, v in self.config.items()) + "\n  }"
        edges = [f"  edge {a}.{b} -> {c}.{d}" for a, b, c, d in self.edges]
        streams = [f"  stream src.code -> sink.codes : {p}" for p, _ in self.streams]
        parts = [variant, *(n.text() for n in self.nodes), *edges, *streams, *texts, *transitions]
        return "model fuzz {\n" + "\n".join(parts) + "\n}\n", self.choice(sorted(PLACEMENTS))


@st.composite
def programs(draw) -> tuple[str, str]:
    return Gen(draw).program()


def _run(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs())
def test_random_well_typed_programs_compile_deterministically_and_explain(program: tuple[str, str],
                                                                          tmp_path_factory) -> None:
    text, placement = program
    tmp = tmp_path_factory.mktemp("fuzz")
    src, yaml = tmp / "fuzz.walk", tmp / f"{placement}.yaml"
    src.write_text(text)
    yaml.write_text(PLACEMENTS[placement])
    plans = []
    for i in range(2):
        plan = tmp / f"plan{i}.bin"
        code, _, err = _run(["compile", str(src), "-p", str(yaml), "-o", str(plan), "--verify-each"])
        assert code == 0, f"{err}\n--- program:\n{text}"
        assert "error[" not in err and "Traceback" not in err
        plans.append(plan.read_bytes())
    assert plans[0] == plans[1], f"compiling twice gave different plans\n--- program:\n{text}"
    for fmt in ("text", "markdown", "dot", "json"):
        code, out, err = _run(["explain", str(tmp / "plan0.bin"), "--format", fmt])
        assert code == 0 and out, f"explain --format {fmt}: {err}\n--- program:\n{text}"


def test_the_generator_covers_the_language() -> None:
    """The generator can produce each construct (a guard against a strategy that silently
    stopped producing one)."""
    seen: set[str] = set()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None,
              derandomize=True)
    @given(programs())
    def collect(program: tuple[str, str]) -> None:
        text = program[0]
        for word in ("dynamic_loop", "loop n", "carry", "acc ", "index", "parallel", "on stream", "fork",
                     "transition", "edge ", "emit", "+=", "@alt", "max = 8", "keep"):
            if word in text:
                seen.add(word)

    collect()
    missing = {"dynamic_loop", "loop n", "carry", "acc ", "parallel", "on stream", "transition", "edge ", "emit",
               "+="} - seen
    assert not missing, f"the generator never produced: {sorted(missing)}"

