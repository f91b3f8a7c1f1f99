"""The layers of `connector/` (docs/architecture.md, "Layers"): each folder imports only from itself or a folder
below it, there is no import cycle, and the heavy or framework imports stay where they belong. The lab
(`sparse_kv_lab/`) has layers of its own, may import any of connector, and connector never imports it. Read from the
source with `ast` (every import, also those inside functions), so nothing is imported to check it."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "connector"
LAB = ROOT.parent / "sparse_kv_lab"

FLOORS = {"core": 0, "protocol": 1, "transport": 2, "engine": 3, "vllm": 4, "cli": 5}
"""Floor of each folder. A folder may import its own modules and those of lower floors; folders on one floor do not
import each other. The package root (`connector/__init__.py`, `__main__.py`) sits on top."""
LAB_FLOORS = {"sim": 0, "pd": 0, "cli": 1}
"""The lab's floors, above all of connector (which it may import): sim and pd not each other, cli above both."""
ONLY_IN = {"nixl": "transport.nixl", "vllm": "vllm"}
"""Third-party packages only one folder may import."""
NOT_IN = {"core": ("torch", "asyncio", "nixl", "vllm"), "protocol": ("torch", "asyncio", "nixl", "vllm")}
MAX_LINES = 500


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name (the package root is `connector`, or the lab's) -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file: our own modules resolved to the most specific known
    module (`from connector.core import plan` -> connector.core.plan), third-party ones to their top-level name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = name.split(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target and target.split(".")[0] == own:
                target = target.rpartition(".")[0]
            out.append((target if target.split(".")[0] == own else target.split(".")[0], node.lineno))
    return out


def floors(module: str) -> dict[str, int]:
    return LAB_FLOORS if module.split(".")[0] == LAB.name else FLOORS


def folder(module: str) -> str:
    """`connector.transport.nixl.agent` -> `transport`; the package root -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in floors(module)) else ""


def floor(module: str) -> int:
    return floors(module)[folder(module)] if folder(module) else max(floors(module).values()) + 1


def graph(root: pathlib.Path) -> dict[str, list[tuple[str, int]]]:
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def upward_arrows(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for src, targets in g.items():
        for dst, line in targets:
            if dst.split(".")[0] != src.split(".")[0] or folder(src) == folder(dst):
                continue
            if floor(dst) >= floor(src):  # (different folders: the same floor is a sideways arrow)
                bad.append(f"{src}:{line} imports {dst} ({folder(src) or 'root'} floor {floor(src)} -> "
                           f"{folder(dst)} floor {floor(dst)})")
    return bad


def cycles(g: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (or a module importing itself), by Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or any(t == v for t, _ in g.get(v, ())):
                found.append(sorted(group))

    for v in g:
        if v not in index:
            visit(v)
    return found


def misplaced_imports(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    bad = []
    for src, targets in g.items():
        sub = src.split(".")[1:3]
        for dst, line in targets:
            owner = ONLY_IN.get(dst)
            if owner is not None and ".".join(sub[: owner.count(".") + 1]) != owner:
                bad.append(f"{src}:{line} imports {dst}, which only connector.{owner} may import")
            if dst in NOT_IN.get(folder(src), ()):
                bad.append(f"{src}:{line} imports {dst}; {folder(src)}/ must not")
    return bad


# ------------------------------------------------------------------ the real tree


@pytest.fixture(scope="module")
def tree() -> dict[str, list[tuple[str, int]]]:
    return graph(ROOT)


def test_every_folder_has_a_floor(tree):
    unknown = sorted({m.split(".")[1] for m in tree if m.count(".") >= 2 and folder(m) not in FLOORS})
    assert not unknown, f"folders {unknown} have no floor in FLOORS: add them (and say why in docs/architecture.md)"
    loose = sorted(m for m in tree if m.count(".") == 1 and m.split(".")[1] not in FLOORS | {"__main__": 0})
    assert not loose, f"modules {loose} sit flat in connector/: put each in the folder of its layer"


def test_no_import_runs_up(tree):
    assert upward_arrows(tree) == []


def test_no_import_cycle(tree):
    assert cycles(tree) == []


def test_nixl_vllm_torch_and_asyncio_stay_in_their_folders(tree):
    assert misplaced_imports(tree) == []
    importers = {dst: sorted({src for src, ts in tree.items() for d, _ in ts if d == dst}) for dst in ONLY_IN}
    assert importers["nixl"] and importers["vllm"], "the checks would pass vacuously: nothing imports nixl or vllm"


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in [*ROOT.rglob("*.py"), *LAB.rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}; split them along what they do"


# ------------------------------------------------------------------ the lab beside it


@pytest.fixture(scope="module")
def lab() -> dict[str, list[tuple[str, int]]]:
    return graph(LAB)


def lab_imports(g: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Every import of the lab from connector: none may exist (the CLI finds the lab's commands by name)."""
    return [f"{src}:{line} imports {dst}" for src, ts in g.items() for dst, line in ts if dst.split(".")[0] == LAB.name]


def test_connector_never_imports_the_lab(tree):
    assert lab_imports(tree) == [], "connector must not import the lab: its wheel does not hold it"


def test_the_lab_keeps_its_layers(lab):
    unknown = sorted({m.split(".")[1] for m in lab if m.count(".") >= 1 and folder(m) not in LAB_FLOORS})
    assert not unknown, f"lab folders or modules {unknown} have no floor in LAB_FLOORS: put each in a folder with one"
    assert upward_arrows(lab) == []
    assert cycles(lab) == []
    assert misplaced_imports(lab) == []
    assert any(dst == "connector" for ts in lab.values() for dst, _ in ts), "the lab reads connector"


# ------------------------------------------------------------------ the checks catch what they claim to


def test_the_checks_catch_a_cycle_an_upward_arrow_and_a_misplaced_import(tmp_path):
    pkg = tmp_path / "connector"
    files = {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "import torch\nfrom connector.core import b\n",
        "core/b.py": "def f():\n    from connector.core.a import x\n",  # a <-> b, through a lazy import
        "engine/__init__.py": "",
        "engine/e.py": "from . import f\n",
        "engine/f.py": "import nixl\n",
        "vllm/__init__.py": "from connector.cli import s\n",  # up
        "cli/__init__.py": "",
        "cli/s.py": "",
        "protocol/__init__.py": "from connector.engine.e import y\n",  # up
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    g = graph(pkg)
    assert ("connector.engine.f", 1) in g["connector.engine.e"]
    assert cycles(g) == [["connector.core.a", "connector.core.b"]]
    assert sorted(a.split(" ")[0] for a in upward_arrows(g)) == ["connector.protocol:1", "connector.vllm:1"]
    assert misplaced_imports(g) == ["connector.core.a:1 imports torch; core/ must not",
                                    "connector.engine.f:1 imports nixl, which only connector.transport.nixl may import"]


def test_the_checks_catch_an_import_of_the_lab_and_a_sideways_arrow_in_it(tmp_path):
    files = {
        "connector/__init__.py": "", "connector/cli/__init__.py": "",
        "connector/cli/main.py": "def f():\n    from sparse_kv_lab.cli import demo\n",  # connector -> lab
        "sparse_kv_lab/__init__.py": "", "sparse_kv_lab/sim/__init__.py": "", "sparse_kv_lab/pd/__init__.py": "",
        "sparse_kv_lab/sim/a.py": "from connector.cli import main\n",  # the lab may import connector
        "sparse_kv_lab/pd/b.py": "from sparse_kv_lab.sim import a\n",  # sideways, same floor
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert lab_imports(graph(tmp_path / "connector")) == ["connector.cli.main:2 imports sparse_kv_lab"]
    assert [a.split(" ")[0] for a in upward_arrows(graph(tmp_path / "sparse_kv_lab"))] == ["sparse_kv_lab.pd.b:1"]


def test_every_public_exception_is_in_the_one_tree():
    """One root (connector/core/errors.py): exception classes are declared in core/errors.py only, each under InputError or
    PeerError (PlanError, a bug, directly under the root) and keeping its stdlib parent."""
    from connector.core import errors

    elsewhere = [f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name}" for p in ROOT.rglob("*.py")
                 if p.name != "errors.py" for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                 and any(getattr(b, "id", "").endswith(("Error", "Exception", "Failed")) for b in node.bases)]
    assert not elsewhere, f"exception classes outside connector/core/errors.py: {elsewhere}"
    leaves = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ConnectorError)
              and c not in (errors.ConnectorError, errors.InputError, errors.PeerError)]
    assert len(leaves) >= 12
    for cls in leaves:
        branch = errors.InputError if issubclass(cls, errors.InputError) else errors.PeerError
        if cls is errors.PlanError:
            assert issubclass(cls, AssertionError) and not issubclass(cls, (errors.InputError, errors.PeerError))
            continue
        assert issubclass(cls, branch) and not issubclass(cls, errors.InputError if branch is errors.PeerError
                                                           else errors.PeerError), cls
        assert issubclass(cls, ValueError if branch is errors.InputError else RuntimeError), cls


def test_no_merge_conflict_markers():
    """A merge left unresolved must not land (README.md once carried three such hunks)."""
    import subprocess
    files = subprocess.run(["git", "ls-files"], cwd=ROOT.parent, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    marked = []
    for name in files:
        path = ROOT.parent / name
        if path.suffix not in (".py", ".md", ".toml", ".sh", ".json", ".txt", ".cfg", ".yaml", ".yml") or not path.is_file():
            continue
        lines = path.read_text(errors="replace").splitlines()
        if any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in lines):
            marked.append(name)
    assert not marked, f"merge conflict markers in {marked}: resolve them"


def test_transfer_secrets_are_minted_in_one_function():
    """The proxy, the lab and the tools mint a transfer's capability with connector.protocol.auth.new_transfer_secret
    (they minted their own in three places, one of them weaker once)."""
    top = ROOT.parent
    minting = [f"{p.relative_to(top)}:{i}" for folder in ("connector", LAB.name, "examples", "tools")
               for p in (top / folder).rglob("*.py")
               for i, line in enumerate(p.read_text().splitlines(), 1)
               if "token_urlsafe(" in line and p.relative_to(top).as_posix() != "connector/protocol/auth.py"
               and not line.lstrip().startswith(("#", "f\"", "\""))]
    assert minting == [], f"mint transfer secrets with new_transfer_secret: {minting}"
