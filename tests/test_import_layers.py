"""Imports point one way: no cycle, nothing climbs back up a layer.

Read from the sources (``ast``), not by importing them, so a lazy import
inside a function counts as much as one at the top: a cycle broken only by
importing late is still a cycle. Imports under ``if TYPE_CHECKING:`` are
annotations only and do not count. Importing ``a.b.c`` runs package
``a.b``'s ``__init__`` first, so that is an edge too.

The layers, lowest first: the four packages (DESIGN.md: server -> {triton,
ref} -> core; ref never imports triton), and inside ``paged_server`` its
top-level modules and subpackages in ``SERVER_LAYERS``. A module may import
its own layer and those below, never one above.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["paged_core", "paged_ref", "paged_triton", "paged_server"]  # lowest first
SERVER_LAYERS = [
    # process-wide helpers that import nothing of ours; what the device type decides
    {"start_up_heap", "platform"},
    # shared vocabulary: errors, outputs, request parameters, the tokenizer
    {"errors", "outputs", "sampling_params", "pooling_params", "output_constraint", "tokenizer",
     "lora_request"},
    # where a model lives and its recommended sampling settings (read by config and engine)
    {"model_dir", "generation_defaults"},
    {"models", "default_model"},  # model code and its loader; know no engine config
    {"attention_backends"},  # every attention backend by name (the config resolves one)
    {"config", "speculative_config"},  # the engine config (names model quantization methods)
    {"engine", "parallel"},  # the engine and its tensor-parallel ranks
    {"data_parallel"},  # engine replicas in their own processes, as one engine for the server
    {"entrypoints", "bench"},  # what a user runs: LLM, the HTTP server, the CLI, benchmarks
]
# Inside ``paged_server.engine``, its folders by concern, lowest first.
ENGINE_LAYERS = [
    {"sample", "kv"},  # logits to tokens; the KV cache's factory, sizing and tiers
    {"worker"},  # one rank: the model's forward pass over its KV tensors
    {"request"},  # per-request state: requests, sequences, pooling answers
    {"output", "speculative"},  # after sampling: text and stop checks; drafts and their checks
    {"core"},  # the engine core: scheduler, step batch, executor, LLMEngine
]


def find_modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package ``__init__``) for every module of ours."""
    out = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        for file in src.rglob("*.py"):
            parts = list(file.relative_to(src).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def imports_of(
    name: str, modules: dict[str, tuple[Path, bool]], annotations: bool = False
) -> list[tuple[str, int]]:
    """``(module of ours, line)`` for each runtime import in ``name``, at any depth
    (``annotations``: those under ``if TYPE_CHECKING:`` too)."""
    file, is_package = modules[name]
    package = name if is_package else name.rpartition(".")[0]
    found: list[tuple[str, int]] = []
    todo: list[ast.AST] = [ast.parse(file.read_text())]
    while todo:
        for node in ast.iter_child_nodes(todo.pop()):
            if isinstance(node, ast.If) and _is_type_checking(node) and not annotations:
                todo.extend(node.orelse)
            elif isinstance(node, ast.Import):
                found += [(alias.name, node.lineno) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.append((full if full in modules else base, node.lineno))
            else:
                todo.append(node)
    out = []
    for target, line in found:
        if target.split(".")[0] not in PACKAGES:
            continue
        while target not in modules and "." in target:
            target = target.rpartition(".")[0]
        out.append((target, line))
    return out


def import_graph(
    modules: dict[str, tuple[Path, bool]], annotations: bool = False
) -> dict[str, set[str]]:
    """Module -> the modules importing it runs (package ``__init__``s included)."""
    graph: dict[str, set[str]] = {}
    for name in modules:
        own = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
        edges = set()
        for target, _ in imports_of(name, modules, annotations):
            parts = target.split(".")
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)} - own
        graph[name] = {t for t in edges if t in modules}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer(module: str) -> tuple[int, int, int]:
    """``(package layer, layer inside paged_server, layer inside its engine)`` of a module."""
    parts = module.split(".")
    if parts[0] != "paged_server" or len(parts) == 1:
        return PACKAGES.index(parts[0]), 0, 0
    server = next(i for i, unit in enumerate(SERVER_LAYERS) if parts[1] in unit)
    if parts[1] != "engine" or len(parts) == 2:
        return PACKAGES.index("paged_server"), server, 0
    return PACKAGES.index("paged_server"), server, next(i for i, unit in enumerate(ENGINE_LAYERS) if parts[2] in unit)


def upward_imports(modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """``file:line: a -> b`` for each import of a higher layer than its own."""
    return [
        f"{modules[name][0].relative_to(ROOT)}:{line}: {name} -> {target}"
        for name in sorted(modules)
        for target, line in imports_of(name, modules)
        if climbs(name, target)
    ]


def climbs(name: str, target: str) -> bool:
    """Whether ``name`` importing ``target`` climbs a layer (the engine's folders are
    ordered among themselves only: ``parallel`` sits beside the whole engine)."""
    inside = all(m.startswith("paged_server.engine.") for m in (name, target))
    return layer(target)[: 3 if inside else 2] > layer(name)[: 3 if inside else 2]


def test_every_server_unit_has_a_layer():
    server = ROOT / "packages/paged-server/src/paged_server"
    units = {p.stem for p in server.glob("*.py")} | {p.parent.name for p in server.glob("*/__init__.py")}
    assert units - {"__init__"} <= set().union(*SERVER_LAYERS), "place the new module in SERVER_LAYERS"
    engine = server / "engine"
    folders = {p.stem for p in engine.glob("*.py")} | {p.parent.name for p in engine.glob("*/__init__.py")}
    assert folders - {"__init__"} <= set().union(*ENGINE_LAYERS), "place the new folder in ENGINE_LAYERS"


def test_no_import_cycle():
    assert cycles(import_graph(find_modules())) == []


# Cycles through ``TYPE_CHECKING`` imports that are known and not yet opened: the model
# classes and their layers name each other in annotations. No other may appear.
ANNOTATION_CYCLE_ROOTS = {"paged_server.models"}


def test_no_new_import_cycle_through_annotations():
    found = cycles(import_graph(find_modules(), annotations=True))
    assert [c for c in found if not all(m.startswith(tuple(ANNOTATION_CYCLE_ROOTS)) for m in c)] == []


def test_no_import_climbs_a_layer():
    assert upward_imports(find_modules()) == []


def test_the_checks_catch_a_cycle_and_a_climb():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("paged_server.tokenizer") < layer("paged_server.models.errors")
    assert layer("paged_core.protocols") < layer("paged_ref.ops") < layer("paged_triton.ops")
    assert climbs("paged_server.engine.sample.sampler", "paged_server.engine.core.scheduler")
    assert not climbs("paged_server.engine.worker.worker", "paged_server.parallel.pipeline")
