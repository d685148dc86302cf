"""The package's shape: the module map in ``sphereml.__doc__``, no private imports across modules, short files."""

import ast
from pathlib import Path

import pytest

import sphereml

SRC = Path(sphereml.__file__).resolve().parent
MODULES = sorted(p for p in SRC.rglob("*.py") if p.name != "__init__.py" or p.parent != SRC)
MAX_LINES = 450


MAPPED_PACKAGES = ("layers", "heads", "regularizers", "book")  # packages whose modules the maps list one by one


def _public_modules() -> list[str]:
    """Dotted names below ``sphereml`` of every public top-level module and package, and of the modules of
    :data:`MAPPED_PACKAGES` (``layers``, ``layers.sphereconv``, ...)."""
    names = set()
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        parts = parts[:-1] if parts[-1] in ("__init__", "__main__") else parts
        if not parts or any(p.startswith("_") for p in parts):
            continue
        if len(parts) == 1 or parts[0] in MAPPED_PACKAGES:
            names.add(".".join(parts))
    return sorted(names)


def _imports(path: Path):
    """(module, names) of every ``from X import names`` inside the package, relative or absolute."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = ("." * node.level) + (node.module or "")
            if node.level or (node.module or "").startswith("sphereml"):
                yield module, [alias.name for alias in node.names]


def test_the_module_maps_list_every_module():
    """sphereml/__init__.py maps every module; a package's own docstring lists its modules too."""
    import importlib

    for name in _public_modules():
        assert f"sphereml.{name}`" in sphereml.__doc__ or name.startswith("book."), \
            f"the module map in sphereml/__init__.py misses {name}"
        if "." in name:
            package = importlib.import_module("sphereml." + name.rsplit(".", 1)[0])
            assert f"sphereml.{name}`" in package.__doc__, f"{package.__name__}'s docstring misses {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_imports_a_private_name_of_another(path):
    for module, names in _imports(path):
        private = [n for n in names if n.startswith("_") and n != "__version__"]
        helper_module = module.lstrip(".").startswith("_")  # names of a private helper module (_checks, _io)
        folder = path.parents[len(module) - len(module.lstrip(".")) - 1] if module.startswith(".") else path.parent
        helper_modules = module.strip(".") == "" and all((folder / f"{n}.py").is_file() for n in private)
        assert not private or helper_module or helper_modules, f"{path.name} imports private {private} from {module}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_modules_stay_short(path):
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path.name} is over {MAX_LINES} lines: split it"


def test_convsim_is_pure_tensor_math():
    imported = {module for module, _ in _imports(SRC / "regularizers" / "convsim.py")}
    assert imported <= {".._checks"}, f"convsim imports {imported} from the package"


def test_import_sphereml_brings_no_book_machinery():
    """A project of one's own imports the operators, heads and regularisers, not the chapter runtime or plotting."""
    import subprocess
    import sys

    probe = ("import sys, sphereml\n"
             "print([m for m in sys.modules if m.startswith('sphereml.book') or m.split('.')[0] in "
             "('matplotlib', 'seaborn', 'papermill')])\n"
             "print(sphereml.regularizers.MHE.__name__, sphereml.layers.SphereConv2d.__name__, "
             "sphereml.heads.ArcFaceLoss.__name__, sphereml.book.chapter.Chapter.__name__ if "
             "__import__('sphereml.book.chapter') else None)")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.stdout.splitlines() == ["[]", "MHE SphereConv2d ArcFaceLoss Chapter"], run.stdout + run.stderr[-2000:]


def test_the_book_package_is_lazy():
    assert (SRC / "book" / "__init__.py").is_file() and (SRC / "book" / "__main__.py").is_file()
    assert not set(sphereml.BOOK_MODULES) & set(sphereml.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        sphereml.nonexistent
