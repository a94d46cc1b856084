"""Batch norm inside control flow v2: the branch functions of If/StatelessIf nodes.

The bodies of the branches that a top-level If calls (and of the gradient If that reads its
outputs) are flattened into one combined Graph beside the top-level nodes: body node `n`
becomes `<If>/_fn_then/n` (its gradient body `<If>/_fn_then_grad/...`, with `gradients/...`
names kept under `gradients/<forward prefix>/` so gradient Reshapes still name their forward
op), function-style inputs `node:out_arg:i` become flat `node:k`, and each argument becomes
an Identity pseudo node that reads what the caller feeds it: the If's input at top level,
or, for a gradient body, the forward body's tensor behind the OptionalFromValue that carried
it. The ordinary scan, plan and passes then run on the combined graph; `restore` writes every
body back into its FunctionDef (in function-style names; replaced ops are IdentityN, so
`FusedBatchNormV3:y:0` becomes `FusedBatchNormV3:output:0`) and drops control edges that
order_collectives added across function boundaries (they cannot be expressed).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tensorflow.core.framework import function_pb2, node_def_pb2
from tensorflow.python.framework import op_def_registry

from bnrewrite.errors import PassError
from bnrewrite.graph.edit import Editor
from bnrewrite.graph.index import Graph
from bnrewrite.graph.names import parse_input, tensor_name
from bnrewrite.graph.nodes import BODY_MARK, MARK
from bnrewrite.graph.ops import IF_OPS
from bnrewrite.match.census import Census, Skip
from bnrewrite.match.sites import FUSED_GRAD

_FORWARD_OPS = frozenset({"FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "Mean"})


def in_body(name: str) -> bool:
    return BODY_MARK in name


@dataclass
class Body:
    function: str
    prefix: str
    caller: str  # the If node that calls it
    args: list[str]  # pseudo node of each argument, in signature order
    originals: dict[str, node_def_pb2.NodeDef] = field(default_factory=dict)  # combined name -> function NodeDef
    created: dict[str, node_def_pb2.NodeDef] = field(default_factory=dict)  # combined name -> combined NodeDef
    ret: dict[str, str] = field(default_factory=dict)  # output arg -> combined tensor
    pseudo: dict[str, node_def_pb2.NodeDef] = field(default_factory=dict)  # argument nodes this body owns
    names: dict[str, str] = field(default_factory=dict)  # function node name -> combined name
    fn: function_pb2.FunctionDef | None = None


@dataclass
class Bodies:
    bodies: list[Body]
    forward: dict[str, Body]  # prefix -> body of a forward branch
    skipped: list[tuple[str, str]]  # (forward If, why its branches stay as they are)
    called: frozenset[str]  # every function some node calls

    @property
    def functions(self) -> set[str]:
        return {b.function for b in self.bodies}


def _attr_value(node: node_def_pb2.NodeDef, op_def: object, name: str) -> object:
    if name in node.attr:
        return node.attr[name]
    for a in op_def.attr:
        if a.name == name and a.HasField("default_value"):
            return a.default_value
    raise PassError(f"{node.name}: attribute {name} missing")


def output_ranges(node: node_def_pb2.NodeDef) -> list[tuple[str, int, int]]:
    """(output arg, first flat index, count) of a node's outputs."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:
        raise PassError(f"op {node.op} of {node.name} is not registered")
    ranges, start = [], 0
    for arg in op_def.output_arg:
        if arg.number_attr:
            n = _attr_value(node, op_def, arg.number_attr).i
        elif arg.type_list_attr:
            n = len(_attr_value(node, op_def, arg.type_list_attr).list.type)
        else:
            n = 1
        ranges.append((arg.name, start, n))
        start += n
    return ranges


def _calls(graph: Graph) -> dict[str, int]:
    """Function name -> how many nodes (top level or in the library) call it, by op or attr."""
    count: dict[str, int] = {}
    nodes = list(graph)
    if graph.library is not None:
        for f in graph.library.function:
            nodes.extend(f.node_def)
    for node in nodes:
        count[node.op] = count.get(node.op, 0) + 1
        for value in node.attr.values():
            kind = value.WhichOneof("value")
            if kind == "func":
                count[value.func.name] = count.get(value.func.name, 0) + 1
            elif kind == "list":
                for f in value.list.func:
                    count[f.name] = count.get(f.name, 0) + 1
    return count


def flatten(graph: Graph) -> tuple[Graph, Bodies | None]:
    """The combined graph, or (graph, None) when no If branch holds batch norm."""
    if graph.library is None:
        return graph, None
    library = graph.functions
    calls = _calls(graph)
    called = frozenset(name for name, n in calls.items() if n)
    ifs = [n for n in graph if n.op in IF_OPS]
    forward_ifs = []
    skipped: list[tuple[str, str]] = []
    for node in ifs:
        branches = [node.attr["then_branch"].func.name, node.attr["else_branch"].func.name]
        if not any(b in library and any(n.op in _FORWARD_OPS for n in library[b].node_def) for b in branches):
            continue
        if any(n.op in ("FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3") for b in branches
               for n in library[b].node_def):
            continue  # a gradient If; paired below
        forward_ifs.append(node)
    if_names = {n.name for n in ifs}
    readers: dict[str, list[node_def_pb2.NodeDef]] = {}  # If -> the other Ifs that read it, in graph order
    for n in ifs:
        for src in dict.fromkeys(parse_input(i)[0] for i in n.input):
            if src in if_names and src != n.name:
                readers.setdefault(src, []).append(n)
    bodies: list[Body] = []
    forward: dict[str, Body] = {}
    for fwd in forward_ifs:
        grads = readers.get(fwd.name, [])
        group = [fwd, *grads]
        names = [(n, k) for n in group for k in ("then_branch", "else_branch")]
        reason = ""
        for n, k in names:
            fname = n.attr[k].func.name
            if fname not in library:
                reason = reason or f"{fname} is not in the function library"
            elif calls.get(fname, 0) != 1:
                reason = reason or f"function {fname} is called {calls.get(fname, 0)} times"
            elif any(op_def_registry.get(x.op) is None for x in library[fname].node_def):
                reason = reason or f"function {fname} calls functions or unregistered ops"
        several = next((g.name for g in grads if any(src in if_names and src != fwd.name
                                                     for src, _ in map(parse_input, g.input))), None)
        if several is not None:
            reason = reason or f"{several} reads several conditionals"
        if reason:
            skipped.append((fwd.name, reason))
            continue
        for k, tag in (("then_branch", "then"), ("else_branch", "else")):
            fb = _body(library[fwd.attr[k].func.name], f"{fwd.name}{BODY_MARK}{tag}", fwd, None, None)
            bodies.append(fb)
            forward[fb.prefix] = fb
            for j, g in enumerate(grads):  # one per gradient computation (a second optimizer, a recompiled model)
                gb = _body(library[g.attr[k].func.name], f"{fwd.name}{BODY_MARK}{tag}_grad{f'_{j}' if j else ''}", g,
                           fwd, fb)
                bodies.append(gb)
    if not bodies:
        return graph, Bodies([], {}, skipped, called)
    editor = Editor(graph)
    for body in bodies:
        for node in [*body.pseudo.values(), *body.created.values()]:
            editor.add(node)
    return editor.finish(), Bodies(bodies, forward, skipped, called)


def _body(function: function_pb2.FunctionDef, prefix: str, caller: node_def_pb2.NodeDef,
          forward_if: node_def_pb2.NodeDef | None, forward_body: Body | None) -> Body:
    sig = function.signature
    body = Body(function=sig.name, prefix=prefix, caller=caller.name, args=[], fn=function)
    index = {n.name: n for n in function.node_def}
    grad_prefix = forward_body.prefix if forward_body is not None else ""
    for node in function.node_def:
        if grad_prefix and node.name.startswith("gradients/"):
            body.names[node.name] = f"{prefix}/gradients/{grad_prefix}/{node.name[len('gradients/'):]}"
        else:
            body.names[node.name] = f"{prefix}/{node.name}"
    arg_names: dict[str, str] = {}
    caller_inputs = [i for i in caller.input if not i.startswith("^")][1:]
    linked: set[str] = set()
    for i, arg in enumerate(sig.input_arg):
        pseudo = node_def_pb2.NodeDef(name=f"{prefix}/_arg/{arg.name}", op="Identity", device=caller.device)
        source = caller_inputs[i]
        src, out = parse_input(source)
        if forward_if is not None and forward_body is not None and src == forward_if.name:
            ret_tensor = forward_body.ret[sig_output_name(forward_body, out)]
            producer, _ = parse_input(ret_tensor)
            original = forward_body.originals.get(producer)
            if original is not None and original.op == "OptionalFromValue":
                ret_tensor = forward_body.created[producer].input[0]
                linked.add(arg.name)
            source = ret_tensor
        elif forward_body is not None:
            shared = next((p for p, n in forward_body.pseudo.items() if list(n.input) == [source]), None)
            if shared is not None:  # the same tensor the forward branch reads: one node, as in a flat graph
                body.args.append(shared)
                arg_names[arg.name] = shared
                continue
        pseudo.input.append(source)
        body.pseudo[pseudo.name] = pseudo
        body.args.append(pseudo.name)
        arg_names[arg.name] = pseudo.name
    for node in function.node_def:
        flat = node_def_pb2.NodeDef()
        flat.CopyFrom(node)
        flat.name = body.names[node.name]
        flat.device = caller.device
        del flat.input[:]
        flat.input.extend(_to_flat(spec, body, arg_names, index) for spec in node.input)
        if node.op == "OptionalGetValue" and node.input and node.input[0] in linked:
            flat.op = "Identity"  # so matching sees the forward tensor it unwraps
            flat.attr.clear()
        body.originals[flat.name] = node
        body.created[flat.name] = flat
    for out, spec in function.ret.items():
        body.ret[out] = _to_flat(spec, body, arg_names, index)
    return body


def sig_output_name(body: Body, index: int) -> str:
    return body.fn.signature.output_arg[index].name  # type: ignore[union-attr]


def _to_flat(spec: str, body: Body, args: dict[str, str], index: dict[str, node_def_pb2.NodeDef]) -> str:
    """A function-style input (`arg`, `node:out_arg:i`, `^node`) as a combined-graph input."""
    if spec.startswith("^"):
        return "^" + body.names[spec[1:]]
    parts = spec.split(":")
    if len(parts) == 1:
        return args[spec]
    name, out_arg, position = parts
    for arg, start, _ in output_ranges(index[name]):
        if arg == out_arg:
            return tensor_name(body.names[name], start + int(position))
    raise PassError(f"{body.function}: {spec} names no output")


def statistic_outputs(graph: Graph, bodies: Bodies, site_name: str, statistics: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The caller's outputs through which a body site's statistics leave the function."""
    body = next((b for b in bodies.forward.values() if site_name.startswith(b.prefix + "/")), None)
    if body is None:
        return []
    wanted = {(n, o): s for n, o, s in statistics}
    out = []
    for j, arg in enumerate(body.fn.signature.output_arg):
        src = parse_input(body.ret[arg.name])
        src = through_identity(graph, src)
        if src in wanted:
            out.append((body.caller, j, wanted[src]))
    return out


def through_identity(graph: Graph, src: tuple[str, int]) -> tuple[str, int]:
    """The tensor behind a chain of Identity/Squeeze nodes (and a body's argument pseudo nodes)."""
    for _ in range(8):
        node = graph.node(src[0]) if src[0] in graph else None
        if node is None or node.op not in ("Identity", "Squeeze") or MARK in node.attr:
            return src
        src = parse_input(node.input[0])
    return src


def _innermost(name: str, by_prefix: dict[str, Body]) -> Body | None:
    """The body with the longest prefix that `name` lies under (one look-up per scope of it)."""
    end = name.rfind("/")
    while end > 0:
        body = by_prefix.get(name[:end])
        if body is not None:
            return body
        end = name.rfind("/", 0, end)
    return None


def restore(graph: Graph, bodies: Bodies) -> Graph:
    """The top-level graph with every body written back into its FunctionDef."""
    by_prefix = {b.prefix: b for b in bodies.bodies}
    owner: dict[str, Body] = {}
    pseudo: set[str] = set()
    for b in bodies.bodies:
        pseudo.update(b.pseudo)
    members: dict[str, list[node_def_pb2.NodeDef]] = {b.prefix: [] for b in bodies.bodies}
    editor = Editor(graph)
    top: list[node_def_pb2.NodeDef] = []
    for node in graph:
        if node.name in pseudo:
            editor.remove(node.name)
            continue
        body = _innermost(node.name, by_prefix) if BODY_MARK in node.name else None  # a body's names all hold it
        if body is None:
            top.append(node)
        else:
            owner[node.name] = body
            members[body.prefix].append(node)
            editor.remove(node.name)
    for node in top:  # what a top-level node reads from a body is named under the body's prefix
        if any(BODY_MARK in i for i in node.input) and any(
                src in owner or src in pseudo for src, _ in map(parse_input, node.input)):
            kept = []
            for spec in node.input:
                src, out = parse_input(spec)
                if src in owner or src in pseudo:
                    if out >= 0:
                        raise PassError(f"{node.name} reads {spec} inside a function body (a bnrewrite bug)")
                    continue
                kept.append(spec)
            inputs = editor.mutable(node.name).input
            del inputs[:]
            inputs.extend(kept)
    library = function_pb2.FunctionDefLibrary()
    library.CopyFrom(graph.library)  # type: ignore[arg-type]
    functions = {f.signature.name: f for f in library.function}
    for body in bodies.bodies:
        _write_body(graph, body, members[body.prefix], owner, functions[body.function])
    editor.library = library
    return editor.finish()


def _write_body(graph: Graph, body: Body, nodes: list[node_def_pb2.NodeDef], owner: dict[str, Body],
                function: function_pb2.FunctionDef) -> None:
    arg_of = {p: body.fn.signature.input_arg[i].name for i, p in enumerate(body.args)}
    fname: dict[str, str] = {flat: orig.name for flat, orig in body.originals.items()}
    used = set(fname.values())
    for node in nodes:
        if node.name not in fname:
            name = node.name[len(body.prefix) + 1:]
            while name in used:
                name += "_"
            fname[node.name] = name
            used.add(name)

    def convert(spec: str) -> str | None:
        src, out = parse_input(spec)
        if out < 0:
            return f"^{fname[src]}" if owner.get(src) is body else None
        if src in arg_of:
            return arg_of[src]
        if owner.get(src) is not body:
            raise PassError(f"a node of {body.function} reads {spec} from outside the function (a bnrewrite bug)")
        for arg, start, n in output_ranges(emitted[src]):
            if start <= out < start + n:
                return f"{fname[src]}:{arg}:{out - start}"
        raise PassError(f"{spec} names no output")

    emitted: dict[str, node_def_pb2.NodeDef] = {}
    caller = graph.node(body.caller).device
    for node in nodes:
        new = node_def_pb2.NodeDef()
        if MARK in node.attr or node.name not in body.originals:
            new.CopyFrom(node)
            if new.device == caller:  # placed with the call; another (a tower's, in a gradient body) stays
                new.device = ""
        else:
            new.CopyFrom(body.originals[node.name])
        new.name = fname[node.name]
        emitted[node.name] = new
    out_nodes = []
    for node in nodes:
        new = emitted[node.name]
        del new.input[:]
        new.input.extend(c for c in (convert(s) for s in node.input) if c is not None)
        out_nodes.append(new)
    del function.node_def[:]
    function.node_def.extend(out_nodes)
    for key, spec in body.ret.items():
        function.ret[key] = convert(spec)  # type: ignore[assignment]


def adopt_sites(graph: Graph, bodies: Bodies, census: Census) -> None:
    """Sites in If branches leave through the If's outputs; skips and inference-mode batch norm
    counted in the function library name only what stays unflattened and is called."""
    flattened = bodies.functions

    def still_reported(node: str) -> bool:
        if not node.startswith("function "):
            return True
        name = node[len("function "):].split("/", 1)[0]
        return name not in flattened and name in bodies.called  # uncalled functions are dead code

    census.skips = [s for s in census.skips if still_reported(s.node)]
    census.inference = [n for n in census.inference if still_reported(n)]
    for name, reason in bodies.skipped:
        census.skips.append(Skip(name, f"batch norm in its branch functions is not rewritten: {reason}"))
    sites = []
    trained: set[str] | None = None
    for site in census.sites:
        if in_body(site.name):
            exits = statistic_outputs(graph, bodies, site.name, site.statistics)
            site = replace(site, exits=tuple(exits))
            if site.kind == "fused" and not site.grads:
                if trained is None:
                    trained = _trained_outer_names(graph)
                if site.name.split(BODY_MARK)[0] in trained:
                    census.skips.append(Skip(site.name, "its gradient function could not be paired with it"))
                    continue
        sites.append(site)
    census.sites = sites


def _trained_outer_names(graph: Graph) -> set[str]:
    """The outer names (before the first BODY_MARK) of the flattened bodies that hold a
    training-mode fused batch-norm gradient: one pass over the graph for every site."""
    return {n.name.split(BODY_MARK)[0] for n in graph if BODY_MARK in n.name and n.op in FUSED_GRAD
            and ("is_training" not in n.attr or n.attr["is_training"].b)}
