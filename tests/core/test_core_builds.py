"""Both builds of ``narwhal_core`` pass the core's tests (``setup.py``, ``tests/corebuild.py``).

The suite runs the build that is installed: compiled by Cython where the
install could, pure Python otherwise. Here the core's own tests run once
more in a subprocess on the pure sources, so neither build goes untested
whichever is installed; and each run checks it loaded the build it claims.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import narwhal_core
from narwhal_build import core_build

from .. import corebuild

ROOT = Path(__file__).resolve().parents[2]

#: The core's behavioural tests of the compiled modules (the static ones -- purity, mypy -- read sources, the
#: same for both builds; the tests of modules never compiled -- auth, config, errors -- would run the
#: same code twice: :data:`PURE_ONLY_TESTS`, checked below).
CORE_TESTS = (
    "tests/core/test_router_scenarios.py",
    "tests/core/test_router_machine.py",
    "tests/core/test_http.py",
    "tests/core/test_contract_properties.py",
    "tests/core/test_leg_bodies_properties.py",
    "tests/core/test_ids.py",
    "tests/core/test_core_tree.py",  # (its watch of the lifecycle runs on the pure core only)
)
#: Core tests that import no compiled module: their code is the same in both builds.
PURE_ONLY_TESTS = (
    "tests/core/test_auth.py",
    "tests/core/test_config.py",
    "tests/core/test_local_failure.py",
)


def loaded_core_modules() -> dict[str, str]:
    """Every loaded module of the core, with the file it was loaded from."""
    return {
        name: module.__file__ or ""
        for name, module in sys.modules.items()
        if name.startswith("narwhal_core.") and module is not None
        and name != f"narwhal_core.{corebuild.MYPYC_LIBRARY}"  # mypyc's code of the parts, not a module
    }


def test_this_run_loaded_the_build_it_should() -> None:
    # Importing the package loads every module the router uses.
    assert narwhal_core.Router is not None
    loaded = loaded_core_modules()
    assert "narwhal_core.router" in loaded and "narwhal_core.http.server" in loaded
    compiled = corebuild.compiled_files()
    for name, path in loaded.items():
        if corebuild.pure_requested() or name not in compiled:
            assert path.endswith(".py"), f"{name} should run from its source, runs {path}"
        else:
            # (By its name: a module mypyc compiled gives its directory twice in __file__.)
            assert Path(path).name == compiled[name].name, f"{name} should run compiled ({compiled[name]}), runs {path}"
    # What the router's `listening` log line reports (only the modules the build compiles count).
    kind, stale = core_build()
    assert stale == []
    built = [f"narwhal_core.{stem}" for stem in corebuild.COMPILED]
    if corebuild.pure_requested() or not compiled:
        assert kind == "pure"
    elif all(name in compiled for name in built):
        assert kind == "compiled"
    else:
        assert kind == "mixed"  # a module the compiler failed on stays pure


def test_the_build_compiles_exactly_the_listed_modules() -> None:
    # setup.py reads the list from narwhal_build/__init__.py; an install compiles those and no other.
    for stem in corebuild.COMPILED:
        assert (CORE / f"{stem.replace('.', '/')}.py").is_file(), stem
        assert stem not in ("__init__", "config"), "config's attrs field types must stay real types (setup.py)"
    if corebuild.pure_requested():
        return  # nothing compiled runs here, whatever lies beside the sources
    compiled = set(corebuild.compiled_files())
    listed = {f"narwhal_core.{stem}" for stem in corebuild.COMPILED}
    # One left over from an older build would shadow its source with old code (setup.py removes them).
    assert compiled <= listed, f"compiled, but no longer in the list: {sorted(compiled - listed)}"


def test_every_declaration_file_belongs_to_a_compiled_module() -> None:
    # A .pxd is read only when its module is compiled; one beside a pure module would be dead weight.
    for pxd in CORE.rglob("*.pxd"):
        stem = module_stem(pxd)
        assert stem in corebuild.COMPILED, f"{pxd.name}: {stem} is not compiled (narwhal_build)"
        # An extension type's base declared in another module must be compiled too.
        for cimported in re.findall(r"^from narwhal_core\.([\w.]+) cimport", pxd.read_text(), re.MULTILINE):
            assert cimported in corebuild.COMPILED, f"{pxd.name} cimports {cimported}, which is not compiled"


def test_the_pure_python_core_passes_the_core_tests() -> None:
    if corebuild.pure_requested():
        pytest.skip("this run tests the pure core already")
    # The properties walk a quarter of their examples here, the router state machine
    # an eighth (corebuild.examples): their full walks have just run on the installed build.
    env = {**os.environ, corebuild.PURE_ENV: "1", corebuild.RERUN_ENV: "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/core/test_core_builds.py::test_this_run_loaded_the_build_it_should", *CORE_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


def test_a_compiled_module_older_than_its_source_is_reported_stale() -> None:
    compiled = corebuild.compiled_files()
    if corebuild.pure_requested() or "narwhal_core.wire" not in compiled:
        # Nothing compiled runs: nothing can be stale.
        assert core_build() == ("pure", [])
        return
    source = ROOT / "narwhal_core" / "wire.py"
    before = source.stat()
    built = compiled["narwhal_core.wire"].stat().st_mtime
    try:
        os.utime(source, (before.st_atime, built + 10))  # edited after it was compiled
        assert core_build()[1] == ["narwhal_core.wire"]
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert core_build()[1] == []


def build_checkout(root: Path, lists: str, files: dict[str, str], older: list[str]) -> tuple[Path, str]:
    """Build a checkout-shaped copy of setup.py's world in ``root``; its package dir and what setup.py said.

    ``lists``: narwhal_build's lists; ``files``: the package's modules; ``older``: compiled files an
    older build left in the package (they must be gone after the build).
    """
    (root / "setup.py").write_text((ROOT / "setup.py").read_text())
    (root / "narwhal_build").mkdir()
    (root / "narwhal_build" / "__init__.py").write_text(lists)
    package = root / "narwhal_core"
    package.mkdir()
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).write_text(text)
    for name in older:
        (package / name).write_bytes(b"built from an older source")
    # (A session of its own: no terminal, so setup.py says what it did on stderr.)
    run = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root,
                         capture_output=True, text=True, timeout=240, start_new_session=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not any((package / name).exists() for name in older)
    return package, run.stderr


def test_a_module_cython_refuses_loses_its_compiled_file_of_an_older_build(tmp_path: Path) -> None:
    # One module listed: its declarations no longer match its source, and an older build left a
    # compiled file beside it, which would shadow the source with old code.
    pytest.importorskip("Cython")
    package, said = build_checkout(
        tmp_path, 'CYTHON = ("wire",)\nMYPYC = ()\nMYPYC_LIBRARY = "_parts__mypyc"\n',
        {"wire.py": "def scan(data):\n    return 0\n", "wire.pxd": "cpdef int scan(bytes data, int start)\n"},
        ["wire.cpython-311-x86_64-linux-gnu.so"],
    )
    assert "narwhal_core.wire not compiled" in said
    assert sorted(path.name for path in package.iterdir()) == ["__init__.py", "wire.pxd", "wire.py"]


def test_parts_mypyc_refuses_stay_pure_with_no_compiled_file_left(tmp_path: Path) -> None:
    # One Cython module, one mypyc part that mypy's check refuses, and an older build's stub and
    # library beside it. The install goes on; the part runs from its source.
    pytest.importorskip("Cython")
    pytest.importorskip("mypyc")
    package, said = build_checkout(
        tmp_path, 'CYTHON = ("wire",)\nMYPYC = ("part",)\nMYPYC_LIBRARY = "_parts__mypyc"\n',
        {"wire.py": "def scan(data: bytes) -> int:\n    return 0\n",
         "part.py": "def count() -> int:\n    return 'not a count'\n"},
        ["part.cpython-311-x86_64-linux-gnu.so", "_parts__mypyc.cpython-311-x86_64-linux-gnu.so"],
    )
    assert "mypyc did not compile the router's parts" in said, said
    assert sorted(path.name.partition(".")[0] for path in package.iterdir()) == ["__init__", "part", "wire", "wire"]

def test_a_declaration_file_edited_after_compilation_makes_its_module_stale(tmp_path: Path) -> None:
    # A checkout-shaped copy: setup.py and pyproject.toml beside the package.
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "pyproject.toml").write_text("")
    package = tmp_path / "narwhal_core"
    package.mkdir()
    for stem in ("router", "wire"):
        (package / f"{stem}.py").write_text("")
        (package / f"{stem}.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    (package / "router.pxd").write_text("")
    for path in package.iterdir():
        os.utime(path, (1_000_000, 1_000_000))
    assert corebuild.stale_files(package) == []
    os.utime(package / "router.pxd", (1_000_000, 1_000_010))
    assert corebuild.stale_files(package) == ["narwhal_core.router"]
    os.utime(package / "wire.py", (1_000_000, 1_000_010))
    assert corebuild.stale_files(package) == ["narwhal_core.router", "narwhal_core.wire"]


# ----------------------------------------------------- declarations for Cython

_PXD_CLASS = re.compile(r"^cdef class (\w+)(?:\((\w+)\))?:\n((?:    .*\n)+)", re.MULTILINE)
CORE = ROOT / "narwhal_core"


def module_stem(path: Path) -> str:
    """A core module's name below ``narwhal_core``, as ``COMPILED`` lists it: ``router``, ``http.server``."""
    return ".".join(path.relative_to(CORE).with_suffix("").parts)


def pxd_classes() -> dict[str, tuple[Path, str | None, set[str]]]:
    """Every ``cdef class`` the core's ``.pxd`` files declare: its file, its base and its fields."""
    classes = {}
    field_types: list[tuple[Path, str, str]] = []
    for path in sorted(CORE.rglob("*.pxd")):
        for name, base, body in _PXD_CLASS.findall(path.read_text()):
            fields: set[str] = set()
            for line in body.splitlines():
                declaration = line.strip()
                if declaration == "pass":
                    continue
                # Python objects, or (one per line) an instance of a class some .pxd declares.
                typed = re.fullmatch(r"cdef public (\w+) (\w+)", declaration)
                if typed is not None and typed[1] != "object":
                    fields.add(typed[2])
                    field_types.append((path, name, typed[1]))
                    continue
                assert declaration.startswith("cdef public object "), f"{path.name}: {line!r}"
                fields.update(f.strip() for f in declaration.removeprefix("cdef public object ").split(","))
            classes[name] = (path, base or None, fields)
    for path, name, type_name in field_types:
        assert type_name in classes, f"{path.name}: {name} has a field of undeclared type {type_name}"
    return classes


def source_fields(path: Path, name: str) -> set[str]:
    """A class's ``__slots__``, or, without them, every ``self.<field>`` its methods assign."""
    cls = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == name)
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    assigned = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                    assigned.add(target.attr)
    return assigned


@pytest.mark.parametrize("name", sorted(pxd_classes()))
def test_each_declared_class_declares_exactly_its_fields(name: str) -> None:
    classes = pxd_classes()
    pxd, base, declared = classes[name]
    source = source_fields(pxd.with_suffix(".py"), name)
    if base is None:
        assert declared == source, (
            f"{pxd.name} and its source disagree on {name}'s fields: only declared "
            f"{sorted(declared - source)}, only in the source {sorted(source - declared)}"
        )
    else:
        # A subclass declares only what it adds; what it assigns of its base's is the base's.
        inherited = classes[base][2]
        assert not declared & inherited, f"{name} declares again {sorted(declared & inherited)}"
        assert declared <= source, f"{name} declares fields it never assigns: {sorted(declared - source)}"
        assert source <= declared | inherited, f"{name} assigns undeclared {sorted(source - declared - inherited)}"


def test_the_declared_classes_are_extension_types_in_the_compiled_build() -> None:
    heap_type = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement, not by C
    compiled_modules = {} if corebuild.pure_requested() else corebuild.compiled_files()
    classes = pxd_classes()
    assert {"EngineConnection", "RequestReader", "ServerConnection", "SseRelay"} <= set(classes)
    for name, (pxd, _, _) in classes.items():
        module_name = f"narwhal_core.{module_stem(pxd)}"
        module = importlib.import_module(module_name)
        compiled = module_name in compiled_modules
        assert bool(getattr(module, name).__flags__ & heap_type) is not compiled, f"{name}: compiled {compiled}"
    if "narwhal_core.relay" in compiled_modules:
        from narwhal_core import relay

        # A field the declarations lack does not exist: the test above keeps them complete.
        with pytest.raises(AttributeError):
            relay.SseRelay.__new__(relay.SseRelay).undeclared = 1  # type: ignore[attr-defined]


def _core_imports(stem: str) -> set[str]:
    """The core modules ``stem`` imports at run time, transitively (annotation-only imports excluded)."""
    seen: set[str] = set()
    todo = [stem]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        path = CORE / f"{current.replace('.', '/')}.py"
        if not path.is_file():
            path = CORE / current.replace(".", "/") / "__init__.py"
        package = current.rsplit(".", 1)[0] if "." in current and path.name != "__init__.py" else (
            current if path.name == "__init__.py" else "")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []  # annotation-only
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)] if package else []
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    name = f"{target}.{alias.name}" if target else alias.name
                    todo.append(name if module_exists(name) else target)
    return {name for name in seen if name}


def module_exists(stem: str) -> bool:
    return (CORE / f"{stem.replace('.', '/')}.py").is_file() or (CORE / stem.replace(".", "/") / "__init__.py").is_file()


@pytest.mark.parametrize("test_file", PURE_ONLY_TESTS)
def test_the_tests_left_out_of_the_pure_rerun_touch_no_compiled_module(test_file: str) -> None:
    used: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / test_file).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("narwhal_core"):
            for alias in node.names:
                if node.module == "narwhal_core":  # re-exported by the package: where it is defined
                    stem = getattr(narwhal_core, alias.name).__module__.removeprefix("narwhal_core.")
                else:
                    stem = node.module.removeprefix("narwhal_core.")
                used |= _core_imports(stem)
    assert used, test_file
    assert not used & set(corebuild.COMPILED), f"{test_file} runs {sorted(used & set(corebuild.COMPILED))}"
