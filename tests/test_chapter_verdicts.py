"""Every chapter decides its claims with the one rule of ``sphereml.book.verdicts`` and keeps no rule of its
own; every chapter runs as a plain script on a machine without the notebook packages."""

import ast
from pathlib import Path

import jupytext
import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((REPO / "notebooks").glob("*.md"))
# chapters that make no claim of their own: the conclusion weighs the other chapters' claims from the ledger
NO_CLAIMS = {"10_conclusion"}
# the per-chapter rules and collectors the book used to have, each replaced by sphereml.book.verdicts
OWN_RULES = ("noise", "beats", "all_of", "seed_values", "over_seeds", "SEED_RANGE")
# what a claim's verdict may be made from
VERDICT_NAMES = {"holds", "equivalent", "at_most", "every", "given", "within", "NOT_TESTABLE", "trains",
                 "beats"}  # SeedTable.beats: given(trains(a), trains(b), verdict=compare(a, b).holds)


def _code(path: Path) -> ast.Module:
    notebook = jupytext.read(path)
    source = "\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
    return ast.parse("\n".join(lines))


def _names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            found.add(sub.attr)
    return found


def _decided_by_verdicts(expr: ast.AST, assignments: dict[str, list[ast.AST]], depth: int = 0) -> bool:
    names = _names(expr)
    if names & VERDICT_NAMES:
        return True
    if depth > 4:
        return False
    return any(_decided_by_verdicts(value, assignments, depth + 1)
               for name in names for value in assignments.get(name, []))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_keeps_no_decision_rule_of_its_own(path):
    tree = _code(path)
    defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assigned = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    own = sorted((defined & set(OWN_RULES)) | (assigned & {"SEED_RANGE"}))
    assert not own, f"{path.stem} defines its own rule(s) {own}: use sphereml.book.verdicts"
    ranges = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "ptp"]
    assert not ranges, f"{path.stem} uses a range (np.ptp) as a noise level: use sphereml.book.verdicts"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_claim_is_decided_by_sphereml_verdicts(path):
    tree = _code(path)
    assignments: dict[str, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        assignments.setdefault(name.id, []).append(node.value)
        elif isinstance(node, (ast.For, ast.comprehension)):
            for name in ast.walk(node.target):
                if isinstance(name, ast.Name):
                    assignments.setdefault(name.id, []).append(node.iter)
        elif isinstance(node, ast.FunctionDef):  # a helper's parameters: judged by its call sites' arguments
            for arg in node.args.args:
                assignments.setdefault(arg.arg, []).append(node)
    claims = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
              and n.func.attr == "claim"]
    if path.stem in NO_CLAIMS:
        assert not claims, f"{path.stem} is listed as making no claim but makes {len(claims)}"
        return
    assert claims, f"{path.stem} makes no claim"
    for call in claims:
        holds = next((k.value for k in call.keywords if k.arg == "holds"), None)
        if holds is None and len(call.args) >= 5:
            holds = call.args[4]
        assert holds is not None, f"{path.stem}: a claim without a verdict at line {call.lineno}"
        assert _decided_by_verdicts(holds, assignments), \
            f"{path.stem}: the claim at code line {call.lineno} decides {ast.unparse(holds)!r} without verdicts"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_claim_says_what_it_is_about(path):
    """Each claim carries a kind the conclusion groups by: a literal of CLAIM_KINDS, checked before any run."""
    from sphereml.book.chapter import CLAIM_KINDS

    calls = [n for n in ast.walk(_code(path)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "claim"]
    for call in calls:
        kind = next((k.value for k in call.keywords if k.arg == "kind"), None)
        assert isinstance(kind, ast.Constant) and kind.value in CLAIM_KINDS, \
            f"{path.stem}: the claim at code line {call.lineno} has no kind from {CLAIM_KINDS}"


# what a GPU box has (numpy, matplotlib, torch, the standard library) besides sphereml: no IPython, papermill or
# jupytext there, and the chapters run there as plain scripts (benchmarks/gpu_check.sh chapters)
SCRIPT_IMPORTS = {"sphereml", "torch", "numpy", "matplotlib"}


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_runs_as_a_script_without_notebook_packages(path):
    import sys

    modules = set()
    for node in ast.walk(_code(path)):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            modules.add(node.module.split(".")[0])
    foreign = sorted(modules - SCRIPT_IMPORTS - set(sys.stdlib_module_names))
    assert not foreign, f"{path.stem} imports {foreign}: a GPU box runs the chapter as a script without them"
