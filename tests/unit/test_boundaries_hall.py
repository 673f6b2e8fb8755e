"""Guards of the central hall (issue 30, DESIGN "Boundaries"), a few lines of ``ast`` each.

Each guard has an allow-list (file -> what is left, with its reason) that may only shrink: a new branch,
global or import outside the allowed places fails here and names the file.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "zerospeed"
PLACES_THAT_DECIDE = {"runtime/plan.py", "runtime/build.py", "runtime/build_model.py", "runtime/build_optimizer.py",
                      "runtime/build_parallel.py", "runtime/build_data.py", "runtime/build_checkpoint.py",
                      "runtime/facts.py"}


@lru_cache(maxsize=1)
def _files() -> list[tuple[str, ast.Module]]:
    return [(str(p.relative_to(SRC)), ast.parse(p.read_text())) for p in sorted(SRC.rglob("*.py"))]


# --- 1. stage / offload / parallelism branches ------------------------------------------------------------
BRANCH_NAMES = {"zero_stage", "stage", "offload_optimizer", "offload_param", "ep_size", "mp_world_size",
                "sequence_parallel_size", "tensor_parallel"}
BRANCHES_ALLOWED: dict[str, tuple[int, str]] = {
    "accelerator/host_malloc.py": (2, "heap_trim_setting: the trim default (start-only at stages 2-3, full at stage 3 "
                                   "from FULL_TRIM_PARAMS parameters), both measured (issue 38)"),
    "compression/runtime.py": (1, "weight_quantization.quantized_initialization refused under AutoTP (a refusal)"),
    "autotuning/memory.py": (4, "the autotuner's memory model of each stage (a planner, not the runtime)"),
    "checkpointing.py": (2, "activation checkpointing's mp_world_size (partition_activations over model parallel)"),
    "config/zero.py": (3, "config validation of the zero_optimization section's own keys"),
    "inference/config.py": (2, "the inference config's tensor_parallel section"),
    "integrations/lightning/config.py": (1, "Lightning's strategy arguments mapped to a config"),
    "parallel/expert/groups.py": (2, "expert groups: ep_size decides the group layout"),
    "parallel/expert/layer.py": (2, "the MoE layer: ep_size decides local vs all-to-all dispatch"),
    "parallel/expert/training.py": (3, "MoE training's stage-3 and ep_size paths (issue 30 item 3: not done)"),
    "parallel/sequence/groups.py": (1, "the sequence grid's size check"),
    "parallel/sequence/hf.py": (1, "the HF adapter's sequence size check"),
    "profiling/plan.py": (16, "`zerospeed plan`: the memory model of each stage (a planner, not the runtime)"),
    "runtime/checkpoint/deepspeed_read.py": (4, "reading DeepSpeed's per-stage checkpoint layouts"),
    "runtime/checkpoint/load.py": (3, "check_partitioning: names the saved stage / tensor-parallel size against this "
                                   "engine's (the third was counted 0 while hidden in a getattr probe)"),
}


def _branches(tree: ast.Module) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            names = {a.attr for a in ast.walk(node.test) if isinstance(a, ast.Attribute)}
            names |= {a.id for a in ast.walk(node.test) if isinstance(a, ast.Name)}
            n += bool(names & BRANCH_NAMES)
    return n


def test_no_stage_offload_or_parallelism_branch_outside_the_plan() -> None:
    over = [f"{rel}: {n} branches (allowed {BRANCHES_ALLOWED.get(rel, (0,))[0]})" for rel, tree in _files()
            if rel not in PLACES_THAT_DECIDE and (n := _branches(tree)) > BRANCHES_ALLOWED.get(rel, (0, ""))[0]]
    assert not over, "decide in runtime/plan.py (a TrainPlan field) or runtime/build*.py, not here:\n" + "\n".join(over)


def test_the_reducer_orchestrates_only() -> None:
    """Issue 30 item 4: the reducer's concerns live in their own modules (arrival, bucket store, destination,
    compressor, late gradients); the orchestrator stays small and has no stage branch (counted above)."""
    lines = len((SRC / "zero" / "grad_reducer.py").read_text().splitlines())
    assert lines <= 300, f"zero/grad_reducer.py has {lines} lines (at most 300): move a concern into its own part"
    assert not (SRC / "zero" / "parted_reducer.py").exists(), "one reducer: each group carries its process group"


# --- 2. no __dict__ copying -------------------------------------------------------------------------------
DICT_COPIES_ALLOWED: dict[str, str] = {}  # none: the parallelisms describe themselves (zero/norm_axes.py)


def _is_dict_of(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "__dict__") or (
        isinstance(node, ast.Call) and getattr(node.func, "id", "") == "vars")


def _copies_dict(tree: ast.Module) -> bool:
    """``a.__dict__.update(b.__dict__)`` (or ``vars``): one object's state poured into another."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update"
                and _is_dict_of(node.func.value) and any(_is_dict_of(a) for a in node.args)):
            return True
    return False


def test_no_dict_copying() -> None:
    bad = [rel for rel, tree in _files() if _copies_dict(tree) and rel not in DICT_COPIES_ALLOWED]
    assert not bad, f"objects are built with their parts, never copied through __dict__: {bad}"


# --- 3. module-level mutable state ------------------------------------------------------------------------
PURE_CALLS = {"frozenset", "tuple", "TypeVar", "getLogger", "compile", "NewType", "Path", "object", "int", "float",
              "str", "MappingProxyType", "cast", "timedelta", "range", "getattr", "dirname", "namedtuple"}
STATE_ALLOWED = {
    "accelerator/__init__.py:_ACCELERATOR": "the accelerator singleton (sanctioned: one device kind per process)",
    "accelerator/host_malloc.py:_MALLINFO2": "a libc function pointer, resolved once",
    "comm/backend.py:_AT_EXIT": "the process group's exit handler (one per process, as torch.distributed's)",
    "comm/logger.py:COMMS_LOGGER": "the process default DeepSpeed's module-level comm API writes to",
    "comm/logger.py:_ENGINE_LOGGER": "a ContextVar: the running engine's own logger, set only inside its calls",
    "checkpointing.py:_PROCESS": "the process default DeepSpeed's module-level deepspeed.checkpointing API acts "
                                 "on outside an engine's calls (the last engine built with the section)",
    "checkpointing.py:_CURRENT": "a ContextVar: the running engine's activation checkpointing, set only inside its calls",
    "launcher/*:COMMAND": "each subcommand's constant description",
    "offload/cpu_adam.py:ADAM": "a constant kernel description", "offload/cpu_adam.py:ADAMW": "ditto",
    "offload/cpu_adam.py:ADAGRAD": "ditto",
    "profiling/flops_profiler/rules.py:RULES": "a constant table built once",
    "testing/harness.py:_WARMED": "the test harness warmed torch up once per process (tests only)",
    "runtime/torch_backward.py:_ENGINE_TASKS": "autograd graph tasks an engine owns (a backward pass is "
                                               "process-wide: other engines' output hooks stand aside in it)",
    "runtime/log.py:_seen": "log_dist_once's messages already printed (DeepSpeed's logging helper)",
    "zero/stage3/param_store.py:_SHARDS": "zero.Init's identity-keyed side table (sanctioned)",
    "zero/stage3/setup.py:_EXTERNAL": "zero.Init's identity-keyed side table (sanctioned)",
    "zero/stage3/setup.py:_UNITS": "zero.Init's identity-keyed side table (sanctioned)",
    "compat/partition_parameters.py:partitioned_param_data_shape": "DeepSpeed's public constant "
                                                                   "(runtime.zero.partition_parameters), never written",
    "compat/zero_linear.py:_DEVICE": "the accelerator's device name, read once at import (as DeepSpeed's module)",
    "compat/zero_linear.py:autocast_custom_fwd": "DeepSpeed's public decorator: torch.amp.custom_fwd for the device",
    "compat/zero_linear.py:autocast_custom_bwd": "DeepSpeed's public decorator: torch.amp.custom_bwd for the device",
    "zero/stage3/graph_ops.py:_GRAPHS": "DeepCompile: torch.library ops are module-level functions that reach "
                                        "their engine's gather units by an integer handle (a weak table)",
    "zero/stage3/graph_ops.py:_HANDLES": "DeepCompile: the counter that numbers those handles",
    "compat/op_builder.py:__compatible_ops__": "DeepSpeed's public table users and frameworks read and set "
                                               "(deepspeed.ops.__compatible_ops__)",
    "compat/groups.py:_PROCESS": "the expert groups DeepSpeed's module-level deepspeed.utils.groups API makes "
                                 "(_create_expert_and_data_parallel); the engine never reads them",
    "compat/git_version_info.py:installed_ops": "DeepSpeed's build facts (deepspeed.git_version_info), made once",
    "compat/git_version_info.py:compatible_ops": "ditto", "compat/git_version_info.py:torch_info": "ditto",
    "inference/logits_process.py:PLAIN": "a frozen default LogitsOptions (the fast path checks identity with it)",
}


def _state(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        for t in targets:
            if not isinstance(t, ast.Name) or t.id == "__all__":
                continue
            constant_name = t.id.lstrip("_").isupper()
            if isinstance(value, ast.Call):
                f = value.func
                if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) not in PURE_CALLS:
                    names.add(t.id)
            elif isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
                if not constant_name:
                    names.add(t.id)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            names.update(node.names)
    return names


def test_no_module_level_mutable_state_outside_the_allow_list() -> None:
    bad = []
    for rel, tree in _files():
        for name in sorted(_state(tree)):
            if f"{rel}:{name}" not in STATE_ALLOWED and not (rel.startswith("launcher/") and name == "COMMAND"):
                bad.append(f"{rel}:{name}")
    assert not bad, f"runtime state belongs to an object the engine owns (EngineParts), not to a module: {bad}"


# --- 4. parallel/ does not import runtime/ ----------------------------------------------------------------
RUNTIME_INTERFACES: dict[str, str] = {}  # none left: the pipeline's facade and checkpoints live in runtime/


def _resolve(rel: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    pkg = ["zerospeed", *Path(rel).with_suffix("").parts]
    pkg = pkg[: len(pkg) - node.level]
    return ".".join(pkg + ([node.module] if node.module else []))


def test_parallel_imports_runtime_only_through_documented_interfaces() -> None:
    bad = []
    for rel, tree in _files():
        if not rel.startswith("parallel/"):
            continue
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [_resolve(rel, node)] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m.startswith("zerospeed.runtime") and not any(m == i or m.startswith(i + ".")
                                                                 for i in RUNTIME_INTERFACES):
                    bad.append(f"{rel}: {m}")
    assert not bad, bad


def test_parallel_imports_no_engine_and_no_checkpoint_code() -> None:
    """The pipeline's executor runs the instruction table without the engine (runtime/pipeline_engine.py is
    DeepSpeed's facade over it); checkpoints of every parallelism are written by runtime/checkpoint's parts."""
    bad = [f"{rel}: {m}" for rel, tree in _files() if rel.startswith("parallel/") for node in ast.walk(tree)
           for m in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [_resolve(rel, node)] if isinstance(node, ast.ImportFrom) else [])
           if m.startswith(("zerospeed.runtime.engine", "zerospeed.runtime.checkpoint",
                            "zerospeed.runtime.pipeline_engine"))]
    assert not bad, bad


# --- 4b. checkpoint code reads the engine's parts, it does not probe for them -------------------------------
CHECKPOINT_CODE = ("runtime/checkpoint/", "profiling/memory_timeline.py", "zero/stage3/export.py")
PROBED = {"engine", "eng", "group", "grp"}  # the engine and its ZeRO groups declare what they have


def _probes(tree: ast.Module) -> list[str]:
    """``getattr(engine..., "x", default)`` / ``hasattr(grp, "x")``: a part found by looking for it."""
    found = []

    def probed(n: ast.AST) -> bool:
        return (isinstance(n, ast.Name) and n.id in PROBED) or (isinstance(n, ast.Attribute) and n.attr in PROBED)

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("getattr", "hasattr") and node.args
                and any(probed(n) for n in ast.walk(node.args[0]))):
            found.append(f"{node.func.id}({ast.unparse(node.args[0])}, ...) line {node.lineno}")  # type: ignore[attr-defined]
    return found


def _lazy_imports(tree: ast.Module) -> list[str]:
    """Imports inside functions of zerospeed.parallel: the upward-import workaround of two layers that import
    each other (a pipeline that imported runtime/checkpoint)."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level >= 3 and (node.module or "").startswith("parallel"):
                    found.append(f"{fn.name}: from {'.' * node.level}{node.module}")
    return found


def test_checkpoint_code_has_no_probes_of_engine_parts_and_no_lazy_parallel_imports() -> None:
    bad = [f"{rel}: {p}" for rel, tree in _files() if rel.startswith(CHECKPOINT_CODE)
           for p in _probes(tree) + _lazy_imports(tree)]
    assert not bad, ("save/load iterate engine.checkpoint_parts (runtime/checkpoint/part.py; built in "
                     "runtime/build_checkpoint.py), they do not look for parts:\n" + "\n".join(bad))


# --- 5. torch.cuda only inside accelerator/ ----------------------------------------------------------------
CUDA_ALLOWED: dict[str, tuple[int, str]] = {
    "recompute.py": (7, "activation checkpointing's CUDA RNG states"),
    "launcher/report.py": (1, "`zerospeed report` prints what torch sees"),
    "offload/stepper.py": (4, "the offload copy stream and event (to move behind Accelerator.side_stream)"),
    "parallel/sequence/tiled.py": (3, "tiled compute's CUDA RNG state"),
    "precision/fp8/convert.py": (3, "FP8 needs a device capability check"),
    "profiling/_device.py": (5, "the profilers' CUDA memory statistics (to move into accelerator/)"),
    "profiling/memory.py": (9, "the memory tracker's CUDA allocator statistics (to move into accelerator/)"),
    "profiling/memory_timeline.py": (6, "the timeline's CUDA allocator samples (to move into accelerator/)"),
}


def _cuda_uses(tree: ast.Module) -> int:
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and getattr(node.value, "id", "") == "torch":
            n += 1
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            n += sum(m == "torch.cuda" or m.startswith("torch.cuda.") for m in mods)
    return n


def test_torch_cuda_only_inside_accelerator() -> None:
    over = []
    for rel, tree in _files():
        if rel.startswith("accelerator/"):
            continue
        n = _cuda_uses(tree)
        allowed = CUDA_ALLOWED.get(rel, (0, ""))[0]
        if n > allowed:
            over.append(f"{rel}: {n} (allowed {allowed})")
    assert not over, "device specifics go through zerospeed.accelerator:\n" + "\n".join(over)
