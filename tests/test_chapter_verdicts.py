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


# functions that combine verdicts into one: a comparison among their arguments decides the claim itself (given's
# positional arguments are conditions of testability, which can only make a claim not testable: its verdict= counts)
COMBINERS = {"every", "all", "any", "bool"}


def _raw_decisions(expr: ast.AST, assignments: dict[str, list[ast.AST]], depth: int = 0) -> list[ast.Compare]:
    """The comparisons (``a > b``) that decide ``expr`` directly rather than through a verdict: reached from it
    through negations, boolean operators, conditional values, lists, comprehensions' elements, subscripts,
    the arguments of :data:`COMBINERS`, ``given``'s ``verdict=`` and the values assigned to the names it uses."""
    if isinstance(expr, ast.Compare):
        return [expr]
    if depth > 6:
        return []
    parts: list[ast.AST] = []
    if isinstance(expr, ast.BoolOp):
        parts = expr.values
    elif isinstance(expr, ast.UnaryOp):
        parts = [expr.operand]
    elif isinstance(expr, ast.IfExp):
        parts = [expr.body, expr.orelse]
    elif isinstance(expr, (ast.List, ast.Tuple, ast.Set)):
        parts = expr.elts
    elif isinstance(expr, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        parts = [expr.elt]
    elif isinstance(expr, ast.DictComp):
        parts = [expr.value]
    elif isinstance(expr, ast.Dict):
        parts = expr.values
    elif isinstance(expr, ast.Subscript):
        parts = [expr.value]
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in COMBINERS:
        parts = list(expr.args) + [k.value for k in expr.keywords]
    elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "given":
        parts = [k.value for k in expr.keywords if k.arg == "verdict"]
    elif isinstance(expr, ast.Name):
        parts = [value for value in assignments.get(expr.id, []) if not isinstance(value, ast.FunctionDef)]
    return [found for part in parts for found in _raw_decisions(part, assignments, depth + 1)]


def _assignments(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """Every name of the chapter's code, with the values it is bound to (the iterables of loop variables, the
    function definitions of parameters)."""
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
    return assignments


def _claims(tree: ast.Module) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "claim"]


def _verdict_of(call: ast.Call) -> ast.AST | None:
    holds = next((k.value for k in call.keywords if k.arg == "holds"), None)
    return call.args[4] if holds is None and len(call.args) >= 5 else holds


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
    assignments = _assignments(tree)
    claims = _claims(tree)
    if path.stem in NO_CLAIMS:
        assert not claims, f"{path.stem} is listed as making no claim but makes {len(claims)}"
        return
    assert claims, f"{path.stem} makes no claim"
    for call in claims:
        holds = _verdict_of(call)
        assert holds is not None, f"{path.stem}: a claim without a verdict at line {call.lineno}"
        assert _decided_by_verdicts(holds, assignments), \
            f"{path.stem}: the claim at code line {call.lineno} decides {ast.unparse(holds)!r} without verdicts"
        raw = _raw_decisions(holds, assignments)
        assert not raw, (f"{path.stem}: the claim at code line {call.lineno} is decided by the comparison "
                         f"{ast.unparse(raw[0])!r} (line {raw[0].lineno}), not by a rule of sphereml.book.verdicts")


@pytest.mark.parametrize("holds", ["a > b", "given(True, verdict=a > b)", "every([a > b])", "every(x < y for x in z)",
                                   "(a > b) if c.holds else None", "all(v > 0 for v in values)"])
def test_a_bare_comparison_cannot_decide_a_claim(holds):
    """The check above on cases it must catch, beside a verdict that mentions a verdict's name."""
    tree = ast.parse(f"c = table.compare('a', 'b')\nverdict = {holds}\nch.claim('x', 's', 'src', holds=verdict)")
    assert _raw_decisions(_verdict_of(_claims(tree)[0]), _assignments(tree))


def test_verdicts_pass_the_comparison_check():
    tree = ast.parse("c = table.compare('a', 'b')\nok = [table.trains(v) for v in vs]\n"
                     "ch.claim('x', 's', 'src', holds=given(steps > 10, verdict=every([c.holds, not ok[0]])))")
    assert not _raw_decisions(_verdict_of(_claims(tree)[0]), _assignments(tree))


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_claim_says_what_it_is_about(path):
    """Each claim carries a kind the conclusion groups by: a literal of CLAIM_KINDS, checked before any run."""
    from sphereml.book.chapter import CLAIM_KINDS

    for call in _claims(_code(path)):
        kind = next((k.value for k in call.keywords if k.arg == "kind"), None)
        assert isinstance(kind, ast.Constant) and kind.value in CLAIM_KINDS, \
            f"{path.stem}: the claim at code line {call.lineno} has no kind from {CLAIM_KINDS}"


# what a GPU box has (numpy, scipy, matplotlib, torch, the standard library) besides sphereml: no IPython, papermill
# or jupytext there, and the chapters run there as plain scripts (benchmarks/gpu_check.sh chapters); scipy is also
# sphereml's own dependency (sphereml.book.verdicts)
SCRIPT_IMPORTS = {"sphereml", "torch", "numpy", "scipy", "matplotlib"}


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
