"""docs/architecture.md stays true: its tables name every package and module of hf_fsdp2/ and nothing else, and its
layer line is what scripts/check_imports.py prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from support.launch import REPO

DOC = REPO / "docs" / "architecture.md"
PACKAGE = REPO / "hf_fsdp2"


def _rows() -> dict[str, set[str]]:
    """Each table row's first cell (``config/``, ``collectives.py``, ``methods/dpo``) -> the modules its second cell
    names in backticks."""
    rows: dict[str, set[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        name = cells[0].strip("`")
        rows[name] = set(re.findall(r"`([^`]+)`", cells[1]))
    return rows


def _tree() -> dict[str, set[str]]:
    """The same shape, read from the folder: ``pkg/`` -> its modules and subpackages; a top-level module -> nothing."""
    tree: dict[str, set[str]] = {}
    for entry in sorted(PACKAGE.iterdir()):
        if entry.suffix == ".py" and entry.name != "__init__.py":
            tree[entry.name] = set()
        elif entry.is_dir() and (entry / "__init__.py").is_file():
            tree[f"{entry.name}/"] = {
                p.stem if p.is_file() else f"{p.name}/"
                for p in entry.iterdir()
                if (p.suffix == ".py" and p.name != "__init__.py")
                or (p.is_dir() and (p / "__init__.py").is_file())
            }
    for method in sorted((PACKAGE / "methods").iterdir()):
        if method.is_dir() and (method / "__init__.py").is_file():
            tree[f"methods/{method.name}"] = {
                p.stem for p in method.glob("*.py") if p.name != "__init__.py"
            } | {f"{p.name}/" for p in method.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    return tree


def test_the_tables_name_every_package_and_module_and_nothing_else() -> None:
    rows, tree = _rows(), _tree()
    assert sorted(rows) == sorted(tree), "rows of docs/architecture.md vs hf_fsdp2/"
    for name, modules in tree.items():
        assert rows[name] == modules, (
            f"{name}: the doc names {sorted(rows[name])}, the folder holds {sorted(modules)}"
        )


def test_the_layer_line_is_the_import_checkers() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_imports.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    layers = next(line for line in out.splitlines() if "layers, bottom first:" in line).split(": ", 1)[1]
    assert f"\n{layers}\n" in DOC.read_text()


def test_the_loop_shown_is_the_librarys() -> None:
    """The snippet's lines are the loop's own (compared line by line, the elisions aside)."""
    snippet = DOC.read_text().split("```python", 1)[1].split("```", 1)[0]
    loop = (PACKAGE / "run" / "loop.py").read_text()
    for line in snippet.splitlines():
        code = line.split("#", 1)[0].strip()
        if code and "..." not in code:
            assert code in loop, f"not in hf_fsdp2/run/loop.py: {code!r}"
    assert Path(REPO / "recipes" / "sft.py").read_text().count("\n") < 40  # a short script over the library


def test_the_adding_a_method_checklist_is_the_method_contract() -> None:
    """Every field of ``Method`` is an item of the checklist (in order), and nothing else is: a new field without its
    item, or an item for a field that went away, fails here."""
    import dataclasses

    from hf_fsdp2.run.method import Method

    section = DOC.read_text().split("### Adding a method", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^\d+\. `(\w+)`", section, flags=re.M)
    assert items == [f.name for f in dataclasses.fields(Method)], items


def test_a_method_folder_imports_no_other_method() -> None:
    """What two methods share lives below them (data/, run/): a method's files never import another method's."""
    import ast

    from hf_fsdp2.run.registry import BUILTIN

    methods = {module.rsplit(".", 1)[1] for module in BUILTIN.values()}
    for name in methods:
        for path in (PACKAGE / "methods" / name).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                modules = []
                if isinstance(node, ast.ImportFrom) and node.module:
                    modules = [node.module]
                elif isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                for module in modules:
                    parts = module.split(".")
                    if parts[:2] == ["hf_fsdp2", "methods"] and len(parts) > 2:
                        assert parts[2] == name, f"{path.relative_to(REPO)} imports {module}"


def test_the_layout_steps_are_the_ones_parallelize_states() -> None:
    """The doc's order of the parallelize steps is the function's (float8, tp, cp, ep, ac, compile, fsdp2, compile)."""
    import inspect

    from hf_fsdp2.parallel import parallelize

    body = inspect.getsource(parallelize.parallelize)
    calls = [
        "convert_float8",
        "apply_tensor_parallel",
        "apply_context_parallel",
        "apply_expert_parallel",
        "apply_activation_checkpointing",
        "compile_regions",
        "shard_with_accelerate",
        "compile_model",
    ]
    positions = [body.index(call) for call in calls]
    assert positions == sorted(positions), calls
    text = DOC.read_text()
    assert (
        "float8 -> tensor parallel -> context parallel -> expert parallel ->\nactivation checkpointing -> regional compile -> FSDP2"
        in text
    )


def _dataclasses() -> dict[tuple[str, str], tuple[int, bool, list[str]]]:
    """Every dataclass of hf_fsdp2/ -> (its own constructor fields, whether it is ``kw_only=True``, its base names)."""
    import ast

    found: dict[tuple[str, str], tuple[int, bool, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            decorators = [
                d
                for d in node.decorator_list
                if ast.unparse(d.func if isinstance(d, ast.Call) else d)
                in ("dataclass", "dataclasses.dataclass")
            ]
            if not decorators:
                continue
            kw_only = isinstance(decorators[0], ast.Call) and any(
                k.arg == "kw_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in decorators[0].keywords
            )
            own = [
                s
                for s in node.body
                if isinstance(s, ast.AnnAssign)
                and "ClassVar" not in ast.unparse(s.annotation)
                and not (s.value is not None and "init=False" in ast.unparse(s.value))
            ]
            bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
            found[(str(path.relative_to(REPO)), node.name)] = (len(own), kw_only, bases)
    return found


def test_constructors_of_more_than_four_fields_take_keywords() -> None:
    """A dataclass whose constructor has more than four fields (its bases' included) is ``kw_only=True``, and so is
    every dataclass base it inherits fields from: at a call site ``Finding(level="ok", check=..., ...)`` says which
    value is which, and a field added or reordered cannot shift the others silently."""
    found = _dataclasses()
    by_name: dict[str, list[tuple[str, str]]] = {}
    for key in found:
        by_name.setdefault(key[1], []).append(key)

    def lineage(key: tuple[str, str]) -> list[tuple[str, str]]:
        """The class and its dataclass bases (a base resolved in its own file first, else by its unique name)."""
        out = [key]
        for base in found[key][2]:
            same_file = (key[0], base)
            candidates = [same_file] if same_file in found else by_name.get(base, [])
            assert len(candidates) <= 1, f"{key}: base {base} is ambiguous: {candidates}"
            out += [k for c in candidates for k in lineage(c)]
        return out

    chains = {key: lineage(key) for key in found}
    wide = [chain for chain in chains.values() if sum(found[k][0] for k in chain) > 4]
    offenders = {k for chain in wide for k in chain if not found[k][1]}
    assert len(wide) > 50, "the walk found the package's dataclasses"
    assert not offenders, (
        f"add kw_only=True to {sorted(offenders)} (more than four constructor fields, their own or a subclass's), "
        "and pass their fields by keyword at every call site"
    )


def test_written_constructors_of_more_than_four_parameters_take_keywords() -> None:
    """The same rule for a class that writes its own ``__init__``: with more than four parameters, at most the first
    three (the objects it wraps: a model, an optimizer ...) are positional, the rest keyword-only (``*``), as
    ``LossStep(model, optimizer, scheduler, *, settings=..., ...)``."""
    import ast

    offenders, checked = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for init in node.body:
                if not (isinstance(init, ast.FunctionDef) and init.name == "__init__"):
                    continue
                positional = len(init.args.posonlyargs) + len(init.args.args) - 1  # self
                if positional + len(init.args.kwonlyargs) > 4:
                    checked += 1
                    if positional > 3:
                        offenders.append(f"{path.relative_to(REPO)}:{node.name} ({positional} positional)")
    assert checked > 10, "the walk found the package's written constructors"
    assert not offenders, f"make the parameters after the third keyword-only (*) in {offenders}"


def test_no_library_file_is_over_500_lines() -> None:
    """One concern per module keeps files short: a file that grows past 500 lines is split along a seam (a concern
    of its own in a module of its own), not trimmed."""
    sizes = {str(p.relative_to(REPO)): p.read_text().count("\n") for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 150, "the walk found the package's files"
    over = {path: n for path, n in sizes.items() if n > 500}
    assert not over, f"split these along a seam (docs/architecture.md names each module): {over}"


def test_the_data_a_method_built_takes_no_writes_afterwards() -> None:
    """No hidden channel from a method's objective to the loop through the data object (GRPO once set
    ``data.reads_per_step`` and ``data.stream.holder`` after ``build_data``): ``TrainData`` is frozen and its streams
    (``DataStream``, GRPO's ``GenerationStream``) take no attribute beyond their own, so such a write raises; the loop
    asks the ``Step`` instead."""
    import dataclasses

    from hf_fsdp2.data.loader import DataStream, ShardedSampler
    from hf_fsdp2.methods.grpo.batching import GenerationStream
    from hf_fsdp2.run.data import TrainData

    for cls in (DataStream, GenerationStream):
        stream = cls(None, ShardedSampler(4, rank=0, world_size=1, seed=0, shuffle=False), 2)  # type: ignore[arg-type]
        stream.epoch = 1  # its own position: written by the stream and by a resume
        try:
            stream.holder = object()  # type: ignore[attr-defined]
        except AttributeError:
            continue
        raise AssertionError(f"{cls.__name__} took stream.holder after it was built")

    data = TrainData(
        stream=None,  # type: ignore[arg-type]
        collator=None,
        eval_set=None,
        steps_per_epoch=1,
        total_steps=1,
        examples_per_step=1,
    )
    for name, value in (("total_steps", 2), ("reads_per_step", 1)):
        try:
            setattr(data, name, value)
        except dataclasses.FrozenInstanceError:
            continue
        raise AssertionError(f"TrainData took data.{name} = {value} after it was built")


def test_every_capability_is_asked_by_a_layout_and_refused_by_its_setting() -> None:
    """``Capabilities`` (what a method supports), the registry's refusal table and ``asked_layouts`` (what a run
    needs) name the same layouts: a field no run asks would be a capability never checked, a layout asked without a
    field an unchecked run. Every mesh size set to 2 (``cp_backend`` ring with it) and ``mixed_precision: fp8`` are
    the runs (and ``freeze_vision_tower: false``, which needs image records); a method lacking only one layout a run asks is refused, naming that layout's setting."""
    import dataclasses

    from hf_fsdp2.config import ConfigError, parse_config
    from hf_fsdp2.config.plans import MeshPlan
    from hf_fsdp2.methods import get_method
    from hf_fsdp2.run import registry
    from hf_fsdp2.run.method import Capabilities

    caps = {f.name for f in dataclasses.fields(Capabilities)}
    assert caps == set(registry._LAYOUTS), (caps, set(registry._LAYOUTS))
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", "o"]
    runs = [(base, MeshPlan(**{f.name: 2})) for f in dataclasses.fields(MeshPlan) if f.type in ("int", int)]
    runs += [(base, MeshPlan(cp=2, cp_backend="ring")), (base + ["--mixed_precision", "fp8"], MeshPlan())]
    runs += [(base + ["--freeze_vision_tower", "false"], MeshPlan())]  # images: a composite's tower trained
    asked: set[str] = set()
    sft = get_method("sft")
    for argv, mesh in runs:
        cfg = parse_config(argv)
        layouts = registry.asked_layouts(cfg, mesh)
        asked |= set(layouts)
        for layout in layouts:
            setting = registry._LAYOUTS[layout][0].format(cp=mesh.cp, tp=mesh.tp)
            lacking = Capabilities(**{name: name != layout for name in caps})
            try:
                registry.check_capabilities(dataclasses.replace(sft, capabilities=lacking), cfg, mesh)
            except ConfigError as err:
                assert setting in str(err), (layout, str(err))
            else:
                raise AssertionError(
                    f"{layout} asked by {mesh} {argv[6:]} but not refused for a method without it"
                )
    assert asked == caps, (asked, caps)
