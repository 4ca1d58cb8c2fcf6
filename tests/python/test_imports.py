"""scripts/check_imports.py (run by `make test`): finds import cycles among a package's modules,
counting imports inside functions and relative ones, and passes automoe itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import REPO

CHECKER = REPO / "scripts" / "check_imports.py"


def check(package: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECKER), str(package)], capture_output=True, text=True,
                          timeout=60)


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_finds_a_cycle_through_a_function_level_and_a_relative_import(tmp_path):
    pkg = write(tmp_path / "cyc", {
        "__init__.py": "",
        "front.py": "def main():\n    from cyc import back\n    return back.run\n",
        "back.py": "from .front import main\n",
        "leaf.py": "import os\n",
    })
    proc = check(pkg)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "import cycle: cyc.back -> cyc.front -> cyc.back" in proc.stdout, proc.stdout
    assert "front.py:2: cyc.front imports cyc.back" in proc.stdout, proc.stdout
    assert "back.py:1: cyc.back imports cyc.front" in proc.stdout, proc.stdout
    assert "leaf" not in proc.stdout


def test_finds_a_longer_cycle_across_subpackages(tmp_path):
    pkg = write(tmp_path / "cyc", {
        "__init__.py": "",
        "a.py": "import cyc.sub.b\n",
        "sub/__init__.py": "",
        "sub/b.py": "from ..c import thing\n",
        "c.py": "thing = 1\nif False:\n    from cyc import a\n",
    })
    proc = check(pkg)
    assert proc.returncode == 1, proc.stdout
    assert "import cycle: cyc.a -> cyc.sub.b -> cyc.c -> cyc.a" in proc.stdout, proc.stdout


def test_a_name_from_the_package_init_counts_a_submodule_of_no_file_does_not(tmp_path):
    # `from cyc import Error` runs cyc/__init__.py, which imports the module back; `from cyc import
    # _ext` (an extension module, no .py file) does not.
    pkg = write(tmp_path / "cyc", {
        "__init__.py": "from cyc.errors import Error\n",
        "errors.py": "from cyc import _ext\nError = ValueError\n",
    })
    assert check(pkg).returncode == 0
    (pkg / "errors.py").write_text("Error = ValueError\n\n\ndef f():\n    from cyc import Error\n")
    proc = check(pkg)
    assert proc.returncode == 1 and "cyc -> cyc.errors -> cyc" in proc.stdout, proc.stdout


def test_a_generated_module_absent_from_a_fresh_clone_is_no_edge_to_its_package(tmp_path):
    # `from cyc._build_info import X` / `import cyc._C` where those files are written by the build:
    # on a fresh clone they are absent, and the check must answer as on a built tree.
    pkg = write(tmp_path / "cyc", {
        "__init__.py": "from cyc.engine import load\n",
        "engine.py": "def load():\n    from cyc._build_info import V\n    import cyc._C\n    return V\n",
    })
    proc = check(pkg)
    assert proc.returncode == 0, proc.stdout
    (pkg / "_build_info.py").write_text("V = 1\n")
    assert check(pkg).returncode == 0


def test_passes_an_acyclic_package(tmp_path):
    pkg = write(tmp_path / "ok", {
        "__init__.py": "from ok import low\n",
        "low.py": "import json\n",
        "high.py": "from ok.low import json\nfrom . import low\n",
    })
    proc = check(pkg)
    assert proc.returncode == 0, proc.stdout
    assert "no import cycle among the 3 modules" in proc.stdout


def test_automoe_has_no_import_cycle():
    proc = check(REPO / "python" / "automoe")
    assert proc.returncode == 0, proc.stdout
