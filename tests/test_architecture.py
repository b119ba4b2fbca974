"""The shape of the code: one namespace, imports that only run downward through the layers and never in a circle,
helpers that never import a step kind, every artifact and work-folder name spelled only in infra/layout.py, one
registry of step kinds that is cheap to load, and a new step kind added in one module running through compile,
plan and run."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from compass.flows.compiler import compile_spec
from compass.flows.reports.plan_status import plan_status
from compass.infra.store import Store
from compass.specs import load_spec
from compass.tasks.steps import registry
from compass.tasks.steps.placement import place
from tests import step_kind_example
from tests.conftest import REPO, prefect_client, seeded, settled_task_runs, write_minimal_spec

LAYERS = ("specs", "infra", "model", "tasks", "flows")  # bottom to top
HELPERS = ("tasks/steps", "tasks/common", "tasks/data", "tasks/evaluation", "tasks/post_training")
LAYOUT = REPO / "infra" / "layout.py"
# names of the artifacts' and work folders' insides: only infra/layout.py spells them
LAYOUT_FOLDERS = {"final", "state", "checkpoints", "chosen", "candidates", "hf", "train", "heldout"}
LAYOUT_FILES = {"metrics.jsonl", "loss.png", "result.json", "checksums.json", "job.json", "step-job.json",
                "step-result.json", "slurm.log", "slurm-job.json", "job.sbatch", "events.jsonl", "model.safetensors"}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in a file, those inside functions and TYPE_CHECKING blocks included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def test_no_import_runs_upward_and_every_import_names_the_namespace():
    problems = []
    for layer_index, layer in enumerate(LAYERS):
        for path in sorted((REPO / layer).rglob("*.py")):
            for line, module in imports_of(path):
                parts = module.split(".")
                if module.startswith(".") or parts[0] in LAYERS:
                    problems.append(f"{path.relative_to(REPO)}:{line}: '{module}' is not imported as compass.*")
                elif parts[0] == "compass" and len(parts) > 1 and LAYERS.index(parts[1]) > layer_index:
                    problems.append(f"{path.relative_to(REPO)}:{line}: {layer} imports {module} from a higher layer")
    assert not problems, "\n".join(problems)


def module_files() -> dict[str, Path]:
    """compass.* module name -> file, for every module of the five folders."""
    out = {}
    for layer in LAYERS:
        for path in (REPO / layer).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out["compass." + ".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def compass_imports(path: Path, modules: dict[str, Path], by_name: bool = True) -> set[str]:
    """The compass modules a file imports: at its top, inside functions and under TYPE_CHECKING (a type-only import
    is coupling too), and (`by_name`) the kind modules a registry loads by name."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                      for a in node.names}
        elif by_name and isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules \
                and path.name == "registry.py":
            found.add(node.value)
    return found & set(modules)


def test_no_import_cycle_anywhere():
    """Strongly connected components of the import graph (function-level and TYPE_CHECKING imports and the
    registry's kind modules included): every one is a single module. Type-only circles were broken by a Protocol
    (model/training/loop_view.py: the trainer's face for callbacks) and by StepConfig's own module."""
    import sys

    modules = module_files()
    graph = {name: compass_imports(path, modules) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

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
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for name in graph:
        if name not in index:
            visit(name)
    assert sum(len(edges) for edges in graph.values()) > 200  # the graph is the real one
    assert not cycles, cycles


def test_sibling_folders_import_one_way():
    """Inside every folder, its sub-folders form a stack: none imports a sibling that imports it back, directly or
    through others (before: tasks/evaluation and tasks/post_training read each other's arithmetic problems and
    package, tasks/data read evaluation's items while evaluation's kinds read data, tasks/steps ran tasks/data's
    executors). The registry's list of kind modules by name is no import: the framework names the kinds it loads."""
    modules = module_files()
    folders = {name: path.parent for name, path in modules.items()}
    edges: dict[Path, set[Path]] = {}
    for name, path in modules.items():
        for other in compass_imports(path, modules, by_name=False):
            a, b = folders[name], folders[other]
            if a == b or a.parent == b.parent == a or a in b.parents or b in a.parents:
                continue  # one folder, or a folder and what it holds: not siblings
            common = next(p for p in a.parents if p in b.parents or p == b.parent)
            child_a = next(p for p in [a, *a.parents] if p.parent == common)
            child_b = next(p for p in [b, *b.parents] if p.parent == common)
            edges.setdefault(child_a, set()).add(child_b)
    back = [(a, b) for a, targets in edges.items() for b in targets if _reaches(edges, b, a)]
    assert sum(len(t) for t in edges.values()) > 10  # the graph is the real one
    assert not back, "\n".join(f"{a.relative_to(REPO)} -> {b.relative_to(REPO)} -> ... -> back" for a, b in back)


def _reaches(edges: dict[Path, set[Path]], start: Path, goal: Path) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo += edges.get(node, ())
    return False


def test_helpers_never_import_a_step_kind():
    """tasks/steps (the framework) and the helper packages sit below the kinds: a kind imports them, never the
    other way (the registry loads the kinds by name)."""
    modules = module_files()
    problems = [f"{path.relative_to(REPO)} imports {name}"
                for helper in HELPERS for path in sorted((REPO / helper).rglob("*.py")) if path.name != "registry.py"
                for name in compass_imports(path, modules) if name.startswith("compass.tasks.kinds")]
    assert not problems, problems


def test_artifact_and_work_folder_names_are_spelled_only_in_the_layout():
    problems = []
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            if path == LAYOUT:
                continue
            tree = ast.parse(path.read_text())
            docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                          if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                          and node.body and isinstance(node.body[0], ast.Expr)}
            for node in ast.walk(tree):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and \
                        isinstance(node.right, ast.Constant) and node.right.value in LAYOUT_FOLDERS:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: / {node.right.value!r}")
                elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    text = node.value
                    if text in LAYOUT_FILES or any(f"/{name}" in text for name in LAYOUT_FILES) \
                            or any(f"/{name}/" in text for name in LAYOUT_FOLDERS):
                        problems.append(f"{path.relative_to(REPO)}:{node.lineno}: {text!r}")
    assert not problems, "\n".join(problems)


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "broadcast",
               "broadcast_object_list", "barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
               "gather", "scatter", "send", "recv", "init_process_group", "destroy_process_group", "monitored_barrier"}


def nodes_outside(own: Path | tuple[Path, ...], found: Callable[[ast.AST], str | None]) -> list[str]:
    """`file:line: what` for every syntax node of the package's layers, `own` (files or folders) left out, that
    `found` names."""
    owned = own if isinstance(own, tuple) else (own,)
    problems = []
    for layer in LAYERS:
        for path in sorted((REPO / layer).rglob("*.py")):
            if not any(path == o or o in path.parents for o in owned):
                problems += [f"{path.relative_to(REPO)}:{node.lineno}: {what}"
                             for node in ast.walk(ast.parse(path.read_text())) if (what := found(node))]
    return problems


def test_only_the_collectives_module_calls_a_collective():
    """NCCL moves CUDA tensors only and gloo (every CPU test) forgives CPU ones: one module puts every collective's
    tensors on the backend's device, and nothing else calls torch.distributed's collectives."""

    def collective(node: ast.AST) -> str | None:
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and \
                ast.unparse(node.value) in ("dist", "torch.distributed", "distributed"):
            return ast.unparse(node)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed") and \
                any(a.name in COLLECTIVES for a in node.names):
            return "imports a collective"
        return None

    problems = nodes_outside(REPO / "model" / "training" / "collectives.py", collective)
    assert not problems, "\n".join(problems)


def test_the_layers_only_exist_inside_the_compass_namespace(tmp_path: Path):
    """Outside the checkout `import specs` fails (nothing installs top-level packages) and compass.* works."""
    for name in LAYERS:
        done = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode != 0 and "ModuleNotFoundError" in done.stderr, name
    code = "import compass.specs, compass.flows.cli.app, compass.model.training.trainer; print(compass.specs.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert Path(done.stdout.strip()).parent == REPO / "specs"


def test_every_package_folder_is_in_the_distribution():
    declared = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {"compass." + ".".join(p.parent.relative_to(REPO).parts)
               for layer in LAYERS for p in (REPO / layer).rglob("__init__.py")}
    assert folders <= declared, folders - declared


def test_loading_the_registry_and_compiling_import_no_heavy_library():
    """`compass validate` and `compass plan` load every kind; the kinds keep torch, transformers, datatrove's
    pipeline, TRL, lighteval and Prefect out of that path."""
    code = ("import sys; from compass.flows.compiler import compile_spec; from compass.specs import load_spec; "
            f"compile_spec(load_spec({str(REPO / 'specs/examples/tiny.yaml')!r}).spec); "
            "heavy = ('torch', 'transformers', 'trl', 'lighteval', 'prefect', 'datatrove.pipeline', 'deepspeed'); "
            "print([m for m in sys.modules if m.split('.')[0] in heavy or m.startswith('datatrove.pipeline')])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# Libraries imported inside functions on purpose, and why: seconds of import (measured with -X importtime), or an
# extra that a CPU install or a run without that feature lacks. Any other import goes at the top of its file.
DEFERRED_LIBRARIES = {
    "torch": "1-2 s", "transformers": "1-3 s", "datasets": "0.5 s", "trl": "3 s", "peft": "1 s", "accelerate": "1 s",
    "lighteval": "3 s", "deepspeed": "2 s", "datatrove": "0.5-1 s", "prefect": "1 s", "prefect_ray": "1.3 s",
    "ray": "1 s", "matplotlib": "0.5 s", "numpy": "0.1 s", "fsspec": "0.1 s", "s3fs": "0.5 s", "nltk": "1.4 s",
    "py3langid": "0.14 s", "huggingface_hub": "0.3 s", "tokenizers": "0.1 s", "safetensors": "torch's",
    "httpx": "0.14 s", "warcio": "only WARC sources", "mlflow": "1.4 s, how.tracking only",
    "wandb": "0.5 s, how.tracking only", "vllm": "the vllm extra", "flash_attn": "the gpu extra",
    "liger_kernel": "the gpu extra", "pynvml": "the gpu extra", "selenium": "tests only", "psycopg": "PostgreSQL only",
    "sqlalchemy": "0.3 s", "tensorboard": "1 s", "scipy": "0.3 s", "pandas": "0.5 s", "pyarrow": "0.3 s",
    "boto3": "0.3 s", "botocore": "0.3 s", "trackio": "0.6 s, how.tracking only",
}


def top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports a module runs when it is imported (its top, and the top of its top-level if/try blocks)."""
    return [node for statement in tree.body if not (isinstance(statement, ast.If) and "TYPE_CHECKING" in
                                                    ast.unparse(statement.test))
            for node in (ast.walk(statement) if isinstance(statement, (ast.If, ast.Try)) else [statement])
            if isinstance(node, (ast.Import, ast.ImportFrom))]


def imported_names(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The modules an import statement may load: `from a import b` may load `a` and `a.b`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    return [node.module or "", *[f"{node.module}.{a.name}" for a in node.names]]


def test_imports_sit_at_the_top_unless_heavy_or_they_say_why():
    """A file's top shows what it depends on (issue 42 part 7: a quarter of the imports sat inside functions). An
    import inside a function loads a library of DEFERRED_LIBRARIES, a compass module that loads one at its top (its
    packages' `__init__` included), or says why on its line (`# deferred: ...`)."""
    modules = module_files()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    tops = {name: top_level_imports(tree) for name, tree in trees.items()}
    loads = {name: {m for m in (".".join(name.split(".")[:i]) for i in range(2, name.count(".") + 2)) if m != name}
             | {imported for node in tops[name] for imported in imported_names(node)} for name in modules}
    heavy = {name for name, loaded in loads.items() if any(m.split(".")[0] in DEFERRED_LIBRARIES for m in loaded)}
    while grown := {name for name, loaded in loads.items() if name not in heavy and loaded & heavy}:
        heavy |= grown  # a module that loads a heavy one at its top is heavy

    def is_heavy(module: str) -> bool:
        return module in heavy if module.startswith("compass.") else module.split(".")[0] in DEFERRED_LIBRARIES

    problems = []
    for name, tree in trees.items():
        at_top = {id(node) for node in tops[name]} | {id(node) for statement in tree.body if isinstance(
            statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test) for node in ast.walk(statement)}
        lines = modules[name].read_text().splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in at_top or "# " in \
                    lines[node.lineno - 1]:
                continue
            if not any(is_heavy(m) for m in imported_names(node) if m in modules or not m.startswith("compass.")):
                problems.append(f"{modules[name].relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not problems, "light imports inside functions (move them to the top, or say why):\n" + "\n".join(problems)


def test_each_kind_is_declared_once_with_everything_the_runner_needs():
    kinds = registry.kinds()
    names = [k.name for k in kinds]
    assert len(names) == len(set(names))
    assert {"gate", "base_model", "model", "ingest", "curate", "tokenizer", "tokenize", "ablate", "compare", "pretrain",
            "long_context", "post_train", "mid_training", "evaluate", "curves", "report", "fence_index",
            "decontaminate"} == set(names)
    bookkeeping = {k.name for k in kinds if k.resources is None}
    assert bookkeeping == {"compare", "curves", "report"}  # every other kind declares what its steps need
    assert set(registry.model_kinds()) == {"base_model", "pretrain", "long_context", "post_train", "mid_training"}
    assert registry.deployment_kinds("ablations") == ["ablate", "compare"]
    spec = load_spec(REPO / "specs/examples/tiny.yaml").spec
    plan = compile_spec(spec)
    for step in plan.steps:  # every step's config is its kind's typed model, and steps holding devices are tagged
        kind = registry.kind(step.kind)
        assert isinstance(step.config, kind.config), step.id
        assert ("gpu" in step.tags) == place(kind, step.config, spec.how).holds_devices, step.id


@pytest.fixture
def word_count():
    registry.register(step_kind_example.KIND)
    yield step_kind_example.KIND
    registry.unregister(step_kind_example.KIND.name)


@pytest.mark.slow
def test_a_step_kind_added_in_one_module_compiles_plans_and_runs(word_count, prefect_server: str, data_store: Path,
                                                                 tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from compass.flows.lifecycle import lifecycle

    spec = write_minimal_spec(tmp_path)
    plan = compile_spec(load_spec(spec).spec)
    counts = [s for s in plan.steps if s.kind == "word_count"]
    assert [(s.id, dict(s.inputs)) for s in counts] == [("word_count:notes", {"curated": "curate:notes"}),
                                                         ("word_count:code", {"curated": "curate:code"})]
    store = Store(str(seeded(tmp_path / "store", data_store)))  # the documents curated already
    statuses = {s.step_id: (s.state, s.reason) for s in plan_status(plan, store)}
    assert statuses["word_count:notes"] == ("run", "new") and statuses["curate:notes"][0] == "cached"

    monkeypatch.chdir(tmp_path)
    with temporary_settings({PREFECT_API_URL: prefect_server}):  # the flow runs here, reporting to the server
        summary = lifecycle.with_options(flow_run_name="new-step-kind")(
            spec_yaml=spec.read_text(), spec_path=str(spec), base_dir=str(tmp_path), store_root=store.root,
            until=["word_count"])
    ran = {r["step"] for r in summary["steps"] if r["executed"]}
    assert ran == {"word_count:notes", "word_count:code"}
    with prefect_client(prefect_server) as client:
        (run,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["new-step-kind"])))
    tasks = settled_task_runs(prefect_server, run.id, {"word_count:notes"})
    assert run.state.is_completed() and tasks["word_count:notes"].state.is_completed()
    assert tasks["word_count:notes"].tags == []  # no tag: no concurrency slots asked for (flows/lifecycle.py)
    manifest = store.read_manifest(store.uri("word_count", "notes", plan.fingerprints["word_count:notes"]))
    assert manifest.config == {"min_length": 4} and manifest.phase_version == "1"
    counted = json.loads((Path(manifest.uri) / "counts.json").read_text())
    assert counted["words"] > 100 and counted == {k: manifest.metrics[k] for k in ("words", "documents")}
    statuses = {s.step_id: s.state for s in plan_status(plan, store)}
    assert statuses["word_count:notes"] == "cached"


def test_callbacks_use_the_trainers_public_face():
    """Callbacks, monitors and telemetry see the trainer through its public methods and attributes (e.g.
    `settle_checkpoint_writes`), never its private ones: the trainer may change its internals without them."""

    def private(node: ast.AST) -> str | None:
        return ast.unparse(node) if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
            node.value.id == "trainer" and node.attr.startswith("_") else None

    problems = nodes_outside(REPO / "model" / "training" / "trainer.py", private)
    assert not problems, "\n".join(problems)


def test_every_package_says_what_lives_in_it():
    """A docstring in every package's `__init__`: the floor plan is read from them."""
    missing = [str(p.relative_to(REPO)) for layer in LAYERS for p in sorted((REPO / layer).rglob("__init__.py"))
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing


def sections_read(function: ast.FunctionDef) -> set[str]:
    """The spec sections a check reads through its `spec` argument (`spec.what.data` -> what.data, `spec.how` ->
    how), following local aliases (`what = spec.what`); the whole spec handed on counts as every section."""
    aliases: dict[str, str] = {"spec": ""}
    for node in ast.walk(function):  # aliases first: `x = spec.what` / `x = spec.how`
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _chain(node.value)
            if chain and chain[0] == "spec" and len(chain) <= 2:
                aliases[node.targets[0].id] = ".".join(chain[1:])
    read: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Name) and a.id == "spec" for a in node.args):
            read.add("*")
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in aliases:
            path = [p for p in [aliases[chain[0]], *chain[1:]] if p]
            if path and path[0] in ("what", "how", "why"):
                read.add(".".join(path[:2]) if path[0] == "what" and len(path) > 1 else path[0])
    return {s for s in read if s != "what"}


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else None


def test_a_rule_reading_one_section_sits_beside_its_schema():
    """specs/checks.py keeps the rules that read two sections or more of the spec (issue 42 part 6); a rule of one
    section lives in that section's module, callable with the section alone (architecture_rules, data_rules,
    pretraining_rules, how_rules)."""
    from compass.specs.architecture import Architecture, architecture_rules
    from compass.specs.data import Data, data_rules
    from compass.specs.how import How, how_rules
    from compass.specs.training import Pretraining, pretraining_rules

    tree = ast.parse((REPO / "specs" / "checks.py").read_text())
    one_section = {}
    for function in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        if "spec" not in [a.arg for a in function.args.args]:
            continue
        read = sections_read(function)
        if "*" not in read and len(read) < 2:
            one_section[function.name] = sorted(read)
    assert not one_section, f"rules of one section in specs/checks.py: {one_section}: move them beside the schema"
    loaded = load_spec(REPO / "tests" / "specs" / "minimal.yaml").spec
    bad_pattern = loaded.what.data.sources[0].model_copy(update={"include": ["../outside/*.txt"]})
    data = Data.model_validate({**loaded.what.data.model_dump(exclude_unset=True),
                                "sources": [bad_pattern.model_dump(exclude_unset=True)]})
    assert [i.loc for i in data_rules(data)] == [("what", "data", "sources", 0, "include", 0)]
    assert list(architecture_rules(Architecture.model_validate(
        {**loaded.what.architecture.model_dump(exclude_unset=True), "num_kv_heads": 3}), ("x",)))[0].loc == \
        ("x", "num_kv_heads")
    assert list(pretraining_rules(Pretraining.model_validate(loaded.what.pretraining.model_dump(exclude_unset=True))))\
        == []
    assert list(how_rules(How.model_validate({"evaluation": {"schedule_cron": "0 * * * *",
                                                             "schedule_interval_seconds": 60}})))[0].loc == \
        ("how", "evaluation")


def test_every_repository_path_the_code_and_docs_name_exists():
    """Docstrings, comments and docs point at files (`model/training/staging.py`); a file moved leaves them naming
    one that is gone (issue 42: seven did). Pages the docs build generates are the exception."""
    import re

    generated = {"docs/reference/spec.md"}  # docs/hooks/spec_reference.py writes it at every site build
    named = re.compile(r"\b(?:specs|infra|model|tasks|flows|tests|benchmarks|docs)/[\w/]+\.(?:py|md|sh|yaml|yml)\b")
    texts = [p for layer in (*LAYERS, "tests", "benchmarks", "docs") for p in (REPO / layer).rglob("*")
             if p.suffix in (".py", ".md") and ".venv" not in p.parts] + [REPO / "README.md"]
    missing = sorted({f"{text.relative_to(REPO)}: {path}" for text in texts for path in named.findall(text.read_text())
                      if path not in generated and not (REPO / path).exists()})
    assert not missing, "\n".join(missing)
