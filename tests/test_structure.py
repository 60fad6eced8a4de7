"""The shape of the scheduler, checked on the source: composed parts, not mixins; one place for a
request's lifecycle; and the phase that the lifecycle methods move."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest

from radixserve.managers.req import PHASE_MOVES, FinishReason, PhaseError, Req, ReqPhase
from radixserve.managers.scheduler import Scheduler
from radixserve.protocol.io_struct import LogprobSpec
from radixserve.sampling_params import SamplingParams

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "radixserve"

MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove"}


def _modules() -> list[tuple[pathlib.Path, ast.Module]]:
    return [(p, ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py"))]


def _new_req() -> Req:
    return Req("r", [1, 2, 3], SamplingParams(max_new_tokens=50), logprob=LogprobSpec(return_logprob=True,
                                                                                        top_logprobs_num=1))


def _list_fields() -> set[str]:
    """A request's list fields (its tokens and logprobs), from the class: what `Req.__init__` sets to a list."""
    return {name for name, value in vars(_new_req()).items() if isinstance(value, list)}


def _mutations_outside_req(tree: ast.Module, fields: set[str]) -> list[str]:
    """Calls that change one of `fields` in place (`req.output_ids.append(...)`), or assign to it, on an object other
    than `self` (another class's own field of the same name is its own)."""
    found: list[str] = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            targets = [node.func.value]
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and t.attr in fields
                  and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    return found


def test_no_class_in_the_package_is_a_mixin() -> None:
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert "Mixin" not in node.name and not any("Mixin" in b for b in bases), (path, node.name)
    assert Scheduler.__bases__ == (object,)


def test_the_scheduler_is_composed_of_parts_given_their_dependencies() -> None:
    params = inspect.signature(Scheduler._compose_parts).parameters
    assert list(params) == ["self", "args"]
    source = inspect.getsource(Scheduler._compose_parts)
    for part in ("RequestQueue", "PrefillPlanner", "DecodePlanner", "OutputProcessor", "InputProcessor",
                 "Pipelines", "FailureContainment"):
        assert f"{part}(" in source


def test_a_requests_lists_change_only_in_its_own_module() -> None:
    """Attribute writes are held at run time (test_every_req_field_written_outside_its_owner_fails); a list changed
    in place is not a write, so its mutations are found in the source."""
    fields = _list_fields()
    assert {"output_ids", "fill_ids", "output_token_logprobs", "input_top_logprobs"} <= fields
    writers = {path.relative_to(PACKAGE).as_posix(): w for path, tree in _modules()
               if (w := _mutations_outside_req(tree, fields)) and path.name != "req.py"}
    assert not writers, writers


def test_every_req_field_written_outside_its_owner_fails() -> None:
    """The suite runs with every Req write checked (RADIXSERVE_CHECK_REQ_WRITES, tests/conftest.py): a package
    module that is not a field's writer raises, and so does a field that Req.__init__ does not set."""
    from radixserve.managers import req_owners

    assert getattr(Req, "_fields_guarded", False), "the guard is off: conftest sets it before the package loads"
    req = _new_req()
    req.to_abort = None  # NOTE: from outside the package (a test): allowed
    fake = PACKAGE / "managers" / "scheduler_output_processor.py"
    write = compile("req.finished_reason = None", str(fake), "exec")
    with pytest.raises(req_owners.FieldOwnerError, match="finished_reason written by radixserve/managers/scheduler_o"):
        exec(write, {"req": req})
    progress = compile("req.cached_tokens = 3", str(PACKAGE / "managers" / "schedule_batch.py"), "exec")
    exec(progress, {"req": req})  # NOTE: a forward's progress, the batch's to write
    assert req.cached_tokens == 3
    with pytest.raises(req_owners.FieldOwnerError, match="not a field of Req"):
        req.phase_cache = 1
    assert set(req_owners.FIELD_WRITERS) <= set(vars(req)), "a writer declared for a field Req does not have"


def test_the_lifecycle_methods_move_the_phase() -> None:
    req = _new_req()
    assert req.phase is ReqPhase.WAITING
    req.admit(longest_request=10, arrival_step=4)
    assert req.max_new_tokens == 7  # clamped to the context
    req.kv.req_pool_idx = 0  # what KVManager does when it admits the request into a prefill
    assert req.phase_problem() is not None  # NOTE: holds a row, still stored as WAITING
    req.start_running()
    assert req.phase is ReqPhase.RUNNING and req.phase_problem() is None
    req.begin_chunk()
    assert req.end_chunk() and not req.end_chunk()  # one non-final chunk, then a sampling result
    req.note_first_token(9)
    req.append_token(9, -0.5, [(9, -0.5), (4, -1.0)])
    assert req.count_once() and not req.count_once()  # its prompt is counted once
    assert req.queue_steps == 5 and req.output_token_logprobs == [-0.5] and req.output_top_logprobs == [[(9, -0.5)]]
    out = req.take_output()
    assert out.new_token_ids == [9] and not req.has_output_to_send()
    req.kv.req_pool_idx = None
    req.reset_for_retract()  # NOTE: KVManager.release first, then the request goes back to the queue
    assert req.phase is ReqPhase.WAITING and req.output_ids == [9]
    req.kv.req_pool_idx = 1
    req.start_running()
    req.mark_abort(FinishReason.abort("gone", 499))
    assert req.phase is ReqPhase.ABORTING
    req.check_finished()
    assert req.phase is ReqPhase.FINISHED and req.finished_reason.status_code == 499
    assert req.has_output_to_send() and req.take_output().finished_reason["type"] == "abort"
    assert not req.count_once()  # NOTE: retracted: its re-prefill is not its prompt (counted once, before)
    with pytest.raises(PhaseError, match="no move from finished to waiting"):
        req.reset_for_retract()


def test_the_phase_table_has_every_phase_and_an_end() -> None:
    assert set(PHASE_MOVES) == set(ReqPhase)
    assert all(to in PHASE_MOVES for moves in PHASE_MOVES.values() for to in moves)
    assert PHASE_MOVES[ReqPhase.FINISHED] == frozenset()  # NOTE: nothing leaves FINISHED
    # every phase can reach FINISHED: no request is stuck
    for phase in ReqPhase:
        seen, todo = {phase}, [phase]
        while todo:
            for nxt in PHASE_MOVES[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert ReqPhase.FINISHED in seen, phase


def test_a_request_aborted_while_retracted_runs_as_aborting() -> None:
    req = _new_req()
    req.mark_abort(FinishReason.abort("gone", 499))  # NOTE: queued (retracted): the abort waits for its next step
    assert req.phase is ReqPhase.WAITING
    req.kv.req_pool_idx = 0
    req.start_running()
    assert req.phase is ReqPhase.ABORTING and req.phase_problem() is None


def _package_imports() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module's imports of other package modules (module- and function-level), and its type-only ones."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in names:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in names}
    type_only: dict[str, set[str]] = {m: set() for m in names}
    for module, path in names.items():
        tree = ast.parse(path.read_text())
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target) if target.startswith("radixserve") else None
                if found is not None and found != module:
                    (type_only if id(node) in guarded else edges)[module].add(found)
    return edges, type_only


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_among_the_package_modules() -> None:
    edges, _ = _package_imports()
    assert _cycles(edges) == []
    # NOTE: the checker finds one when there is one
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# NOTE: the package tiers, lowest first. A package imports at run time only from packages in lower tiers (never one of
# its own tier, never above); an import under TYPE_CHECKING may name any package's type. A new package takes a tier.
PACKAGE_TIERS = (
    ("version", "envs", "forward_batch", "function_call"),  # the vocabulary every layer shares
    ("configs", "platform", "cpu_memory", "sampling_params", "mem_cache"),
    ("kernels", "protocol", "server_args", "constrained", "model_loader", "examples"),
    ("layers", "client"),
    ("lora",),
    ("models",),
    ("model_executor",),
    ("speculative",),
    ("managers",),  # the scheduler process
    ("frontend",),  # the HTTP process's scheduler client
    ("entrypoints",),
    ("launch_server", "bench", "radixserve"),
    ("cli",),
)


def _package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _upward_imports(edges: dict[str, set[str]], tiers: tuple[tuple[str, ...], ...]) -> list[tuple[str, str]]:
    tier = {package: n for n, names in enumerate(tiers) for package in names}
    return sorted((module, dep) for module, deps in edges.items() for dep in deps
                  if _package_of(module) != _package_of(dep)
                  and tier[_package_of(dep)] >= tier[_package_of(module)])


def test_packages_import_only_from_lower_tiers() -> None:
    edges, _ = _package_imports()
    placed = {package for names in PACKAGE_TIERS for package in names}
    assert {_package_of(m) for m in edges} == placed, "every package (and top-level module) has one tier"
    assert _upward_imports(edges, PACKAGE_TIERS) == []
    # NOTE: the checker finds an import that goes up, or sideways within a tier
    assert _upward_imports({"radixserve.layers.x": {"radixserve.models.y", "radixserve.client.z"}},
                           PACKAGE_TIERS) == [("radixserve.layers.x", "radixserve.client.z"),
                                              ("radixserve.layers.x", "radixserve.models.y")]


_THRESHOLD_NAME = re.compile(r"(_ROWS|_M|_NEW_TOKENS|_LIMIT)$")
# NOTE: names that match but are no kernel switch: the roofline probe's size, the environment switches RowTable reads,
# the scheduler's token budget, and the dtype choice's slowdown bound
_NOT_ROW_SWITCHES = {("bench/roofline.py", "GEMM_ROWS"), ("envs.py", "GEMV_MAX_ROWS"), ("envs.py", "F32_GEMV_MAX_ROWS"),
                     ("managers/schedule_policy.py", "CLIP_MAX_NEW_TOKENS"), ("platform.py", "NATIVE_SLOWDOWN_LIMIT")}


def _row_constants(source: str) -> list[str]:
    """Module-level constants of `source` named like a row or token threshold."""
    names = []
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names += [t.id for t in targets if isinstance(t, ast.Name) and _THRESHOLD_NAME.search(t.id)]
    return names


def test_the_row_table_is_the_only_place_a_row_threshold_is_defined() -> None:
    """Every row count where a kernel changes is a field of configs/row_table.RowTable, which the execution plan
    builds once and hands out; no other module defines one (and the GEMV switch is read there alone)."""
    found = {(path.relative_to(PACKAGE).as_posix(), name) for path in PACKAGE.rglob("*.py")
             for name in _row_constants(path.read_text())}
    assert {(p, n) for p, n in found if p != "configs/row_table.py"} == _NOT_ROW_SWITCHES
    readers = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if "GEMV_MAX_ROWS.get(" in path.read_text()}  # NOTE: both switches, RADIXSERVE_(F32_)GEMV_MAX_ROWS
    assert readers == {"configs/row_table.py"}
    # NOTE: the checker finds one where there is one
    assert _row_constants("F32_GEMV_ROWS = 8\nTILED_MAX_M: int = 32\nOTHER = 1\n") == ["F32_GEMV_ROWS", "TILED_MAX_M"]


def test_the_scheduler_process_and_the_http_process_live_in_separate_folders() -> None:
    edges, _ = _package_imports()
    scheduler_side = {m for m in edges if m.startswith("radixserve.managers.")}
    assert not {m for m in scheduler_side for dep in edges[m] if dep.startswith("radixserve.frontend.")}, \
        "the scheduler process imports HTTP-process code"
    assert not {m for m in edges if m.startswith(("radixserve.frontend.", "radixserve.client."))
                for dep in edges[m] if dep.startswith("radixserve.managers.")}, \
        "the front ends reach the scheduler through protocol/, not through the scheduler's modules"
    assert "radixserve.frontend.tokenizer_manager" in edges


def test_no_module_is_over_500_lines() -> None:
    sizes = {path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 500} == {}


def test_one_module_builds_native_libraries_from_one_source_folder() -> None:
    compiles = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                if any(marker in path.read_text() for marker in ('"-shared"', "c_compiler()", '"-O3"'))}
    assert compiles == {"kernels/build.py"}
    c_files = {path.parent.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.[ch]")}
    assert c_files == {"kernels/csrc"}


def test_kernel_bindings_live_in_kernels_and_nothing_else_loads_our_libraries() -> None:
    """Only kernels/ loads what build.py built (`load_library`, `load_amx_library`, `build_level_library`)
    or binds a C function of ours; ctypes elsewhere is libc's (thread and memory tuning)."""
    loaders = ("load_library(", "load_amx_library(", "build_level_library(", "ctypes.Structure")
    outside = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
               if path.parent.name != "kernels" and any(marker in path.read_text() for marker in loaders)}
    assert outside == set()
    ctypes_users = {path.relative_to(PACKAGE).as_posix() for path in PACKAGE.rglob("*.py")
                    if path.parent.name != "kernels" and "import ctypes" in path.read_text()}
    assert ctypes_users <= {"model_executor/cpu_threads.py", "cpu_memory.py",
                            "entrypoints/dp_processes.py"}


def test_quantization_gives_linear_layers_a_method_and_swaps_no_linear_module() -> None:
    import torch

    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.linear import LinearBase
    from radixserve.layers.quantization.linear import PackedLinearMethod, QuantizedEmbedding
    from radixserve.models.loader import build_model

    config = ModelConfig(architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                         context_len=64, tie_word_embeddings=True)
    model = build_model(config, torch.float32, torch.device("cpu"), "int4")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 * 2 + 1 and all(isinstance(m, LinearBase) for m in linears)
    assert all(isinstance(m.method, PackedLinearMethod) and m.weight is None for m in linears)
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.lm_head.method.packed is model.model.embed_tokens.packed  # tied: one table
