"""The package layout's dependency order, read from the source: each package imports only those below it, kernels
import nothing of ours outside kernels/, and neither the protocol package nor the settings module imports torch (the
supervisor and the gateway read their settings without it)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kev_backend"
# Top to bottom: a package may import itself and those after it. `settings` is the one module beside the packages.
ORDER = ["serve", "dev", "settings", "engine", "gpu", "scoring", "model", "protocol"]
NO_TORCH = ("protocol", "settings")


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file, those inside functions included."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = ".".join(parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level else ""
            base = base or node.module or ""
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_lives_in_a_concept_package() -> None:
    loose = [p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "settings.py")]
    assert not loose, f"modules outside the concept packages: {loose}"
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == sorted(set(ORDER) - {"settings"})


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    rel = path.relative_to(PACKAGE).parts
    if rel == ("__init__.py",):
        return
    own = rel[0].removesuffix(".py")
    kernel = rel[:2] == ("gpu", "kernels")
    wrong = []
    for line, name in imports(path):
        if not name.startswith("kev_backend."):
            if own in NO_TORCH and name.split(".")[0] == "torch":
                wrong.append(f"{line}: {name} ({own} has no torch)")
            continue
        target = name.split(".")[1]
        if kernel and not name.startswith("kev_backend.gpu.kernels"):
            wrong.append(f"{line}: {name} (kernels are leaves)")
        elif target in ORDER and ORDER.index(target) < ORDER.index(own):
            wrong.append(f"{line}: {name} ({own} is below {target})")
    assert not wrong, "\n".join(wrong)


def test_serving_code_never_imports_the_lab() -> None:
    """What a server runs (serve/, and the Triton model beside the package) imports nothing of dev/: the benchmark,
    the synthetic checkpoints and the diagnostics stay out of a serving process."""
    serving = [p for p in modules() if p.relative_to(PACKAGE).parts[0] == "serve"]
    serving.append(PACKAGE.parent / "model_repository" / "kev" / "1" / "model.py")
    wrong = []
    for path in serving:
        for line, name in imports(path):
            if name.startswith("kev_backend.dev"):
                wrong.append(f"{path.name}:{line}: {name}")
    assert serving and not wrong, "\n".join(wrong)


# serve/'s sub-packages by who runs them, and what each may import of the others: what the Triton model imports (stub,
# inside Triton's Python stub) and the client (in users' programs) nothing of them; the gateway the client it sends
# with; the supervisor the stub's heartbeats it reads; the checkpoint fill (kev-fill, in a Job or an init container,
# standard library only) nothing of them.
# serve's own modules every sub-package may import: the project's version (every command's --version).
SERVE_SHARED = {"version"}
SERVE_MAY_IMPORT = {"stub": {"fill"}, "client": set(), "gateway": {"client"}, "supervisor": {"stub"}, "fill": set()}


def test_serve_subpackages_import_only_what_they_need() -> None:
    serve = PACKAGE / "serve"
    subpackages = sorted(p.name for p in serve.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert subpackages == sorted(SERVE_MAY_IMPORT)
    wrong = []
    for own, allowed in SERVE_MAY_IMPORT.items():
        for path in sorted((serve / own).rglob("*.py")):
            for line, name in imports(path):
                parts = name.split(".")
                if parts[:2] == ["kev_backend", "serve"] and len(parts) > 2 and parts[2] != own:
                    if parts[2] not in allowed | SERVE_SHARED:
                        wrong.append(f"{path.relative_to(serve)}:{line}: {name}")
    model = PACKAGE.parent / "model_repository" / "kev" / "1" / "model.py"
    wrong += [f"model.py:{line}: {name}" for line, name in imports(model)
              if name.startswith("kev_backend.serve.") and not name.startswith("kev_backend.serve.stub.")]  # fmt: skip
    assert not wrong, "\n".join(wrong)


def test_tests_mirror_the_packages() -> None:
    """tests/<package>/test_<what>.py: a test lives under the path of the package it tests (kev_backend's, or the
    repository's tools: bench/, loadtest/, deploy/ with the image); at the top only what tests the repository as a whole
    (this file, and test_readme.py: README's commands) and the one module beside the packages (settings.py)."""
    tests = Path(__file__).resolve().parent
    tools = ("bench", "loadtest", "deploy")
    wrong = []
    for path in sorted(tests.rglob("test_*.py")):
        where = path.parent.relative_to(tests).parts
        if not where:
            if path.name not in ("test_layout.py", "test_settings.py", "test_readme.py"):
                wrong.append(f"{path.name}: at the top")
        elif not (where[0] in tools and len(where) == 1) and not PACKAGE.joinpath(*where).is_dir():
            wrong.append(f"{path.relative_to(tests)}: no package kev_backend/{'/'.join(where)}")
    assert not wrong, "\n".join(wrong)
