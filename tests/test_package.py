"""The package's shape: the module map in ``sphereml.__doc__``, no private imports across modules, short files."""

import ast
from pathlib import Path

import pytest

import sphereml

SRC = Path(sphereml.__file__).resolve().parent
MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)
MAX_LINES = 450


def _public_modules() -> list[str]:
    names = [p.stem for p in SRC.glob("*.py") if not p.name.startswith("_")]
    names += [p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").is_file()]
    return sorted(names)


def _imports(path: Path):
    """(module, names) of every ``from X import names`` inside the package, relative or absolute."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = ("." * node.level) + (node.module or "")
            if node.level or (node.module or "").startswith("sphereml"):
                yield module, [alias.name for alias in node.names]


def test_the_module_map_lists_every_module():
    doc = sphereml.__doc__
    for name in _public_modules():
        assert f"sphereml.{name}`" in doc, f"the module map in sphereml/__init__.py misses {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_a_private_name_of_another(path):
    for module, names in _imports(path):
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        helper_module = module.lstrip(".").startswith("_")  # names of a private helper module (_checks, _io)
        helper_modules = module.strip(".") == "" and all((path.parent / f"{n}.py").is_file() for n in private)
        assert not private or helper_module or helper_modules, f"{path.name} imports private {private} from {module}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_modules_stay_short(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.name} is over {MAX_LINES} lines: split it"


def test_convsim_is_pure_tensor_math():
    imported = {module for module, _ in _imports(SRC / "convsim.py")}
    assert imported <= {"._checks"}, f"convsim imports {imported} from the package"


def test_import_sphereml_brings_no_book_machinery():
    """A project of one's own imports the operators, heads and regularisers, not the chapter runtime or plotting."""
    import subprocess
    import sys

    probe = ("import sys, sphereml\n"
             "book = [f'sphereml.{m}' for m in sphereml.BOOK_MODULES] + ['matplotlib', 'seaborn', 'papermill']\n"
             "print([m for m in book if m in sys.modules])\n"
             "print(sphereml.regularizers.MHE.__name__, sphereml.chapter.Chapter.__name__)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines() == ["[]", "MHE Chapter"], run.stdout + run.stderr[-2000:]


def test_every_book_module_exists_and_is_lazy():
    assert all((SRC / f"{name}.py").is_file() for name in sphereml.BOOK_MODULES)
    assert not set(sphereml.BOOK_MODULES) & set(sphereml.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        sphereml.nonexistent
