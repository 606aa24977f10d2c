"""The package's import structure (benchmarks/structure.py, docs/design.md 2): no import circles and
no back arrows against the layering codec <- kernels <- comm <- parallel <- train <- bench <- cli."""

from pathlib import Path

from benchmarks.structure import analyse, main

ROOT = Path(__file__).resolve().parents[1]



def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root / "taco"


def test_the_checker_sees_circles_back_arrows_and_skips_script_entries(tmp_path, capsys):
    pkg = _write(tmp_path, {
        "taco/__init__.py": "",
        "taco/codec/__init__.py": "",
        "taco/codec/a.py": "def f():\n    from taco.comm import b\n",  # lazy: still an arrow
        "taco/comm/__init__.py": "from . import b\n",
        "taco/comm/b.py": "from ..codec import a\n",
        "taco/train/__init__.py": "",
        "taco/train/t.py": "if __name__ == '__main__':\n    import taco.cli\n",  # a script entry
        "taco/cli.py": "import taco.train.t\n",
    })  # fmt: skip
    mods, pkgs, back, _ = analyse(pkg)
    assert mods == [["taco.codec.a", "taco.comm.b"]]
    assert pkgs == [["codec", "comm"]]
    assert back == [("taco.codec.a", "taco.comm.b")]
    assert main(["--root", str(pkg)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "module circle: taco.codec.a -> taco.comm.b -> taco.codec.a" in out
    assert out[-1] == "2 circles, 1 back arrows"


def test_no_back_arrows():
    _, _, back, _ = analyse(ROOT / "taco")
    assert back == [], "\n".join(f"{m} imports {d}" for m, d in back)


def test_no_import_circles():
    mods, pkgs, _, _ = analyse(ROOT / "taco")
    assert mods == [] and pkgs == [], (mods, pkgs)


def test_no_test_module_imports_another():
    """Shared builders live in tests/helpers; a test module importing another couples their fates."""
    import ast

    tests = ROOT / "tests"
    hits = []
    for f in tests.rglob("test_*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])  # fmt: skip
            hits += [f"{f.relative_to(ROOT)}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    assert hits == [], hits
