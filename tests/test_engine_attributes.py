"""The CUDA halves of the ops run only on a GPU, so a name they read that nothing defines would pass every CPU
test and fail on the first GPU step. Read statically: every attribute the CUDA engine's classes (CudaEngine and
the ops' CudaOps it mixes in) read on `self`, and every one read on its Fp8Book (`self.fp8_book`, or a local
bound to it) or, inside the book, on its engine (`self.engine`), is defined by those classes: a method, a class
attribute, or an attribute some method assigns."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = [*sorted((REPO / "andrea" / "ops").glob("*.py")), REPO / "andrea" / "engines" / "cuda_engine.py"]


def classes(files=FILES) -> dict[str, list[ast.ClassDef]]:
    found: dict[str, list[ast.ClassDef]] = {"engine": [], "book": []}
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and node.name in ("CudaOps", "CudaEngine"):
                found["engine"].append(node)
            elif isinstance(node, ast.ClassDef) and node.name == "Fp8Book":
                found["book"].append(node)
    return found


def defined(nodes: list[ast.ClassDef]) -> set[str]:
    names = set(dir(object))
    for cls in nodes:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        names.update(n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                     and isinstance(n.value, ast.Name) and n.value.id == "self")
    return names


# what `self.<attr>` is, seen from each kind of class
HOLDS = {"engine": {"fp8_book": "book"}, "book": {"engine": "engine"}}


def unresolved(found: dict[str, list[ast.ClassDef]]) -> list[str]:
    names = {kind: defined(nodes) for kind, nodes in found.items()}
    missing = []
    for kind, nodes in found.items():
        for cls in nodes:
            for fn in (n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
                local = {"self": kind}
                for n in ast.walk(fn):  # locals bound to self.fp8_book / self.engine
                    if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
                            and isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name)
                            and n.value.value.id == "self" and n.value.attr in HOLDS[kind]):
                        local[n.targets[0].id] = HOLDS[kind][n.value.attr]
                for n in ast.walk(fn):
                    if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)):
                        continue
                    owner = None
                    if isinstance(n.value, ast.Name):
                        owner = local.get(n.value.id)
                    elif (isinstance(n.value, ast.Attribute) and isinstance(n.value.value, ast.Name)
                          and n.value.value.id == "self"):
                        owner = HOLDS[kind].get(n.value.attr)
                    if owner and n.attr not in names[owner]:
                        missing.append(f"{cls.name}.{fn.name} line {n.lineno}: {owner}.{n.attr}")
    return sorted(set(missing))


def test_every_attribute_the_cuda_halves_read_is_defined():
    found = classes()
    assert len(found["engine"]) > 10 and found["book"], "the CUDA engine's classes were not found where expected"
    assert unresolved(found) == []


def test_the_check_finds_a_name_nothing_defines(tmp_path):
    (tmp_path / "ops.py").write_text(
        "class CudaOps:\n"
        "    def mlp_fwd(self, out):\n"
        "        book = self.fp8_book\n"
        "        book.wrote(out)\n"
        "        book.wrote_twice(out)\n"
        "        self.launch('k', 1, 1)\n"
        "        self.fp8_book.gone()\n"
        "\n"
        "class CudaEngine(CudaOps):\n"
        "    def __init__(self):\n"
        "        self.fp8_book = Fp8Book(self)\n"
        "    def launch(self, name, grid, threads):\n"
        "        pass\n"
        "\n"
        "class Fp8Book:\n"
        "    def __init__(self, engine):\n"
        "        self.engine = engine\n"
        "    def wrote(self, *bufs):\n"
        "        self.engine.launch('k', 1, 1)\n"
        "        self.launch('k', 1, 1)\n"
        "        self.engine.k['x']\n")
    assert unresolved(classes([tmp_path / "ops.py"])) == [
        "CudaOps.mlp_fwd line 5: book.wrote_twice", "CudaOps.mlp_fwd line 7: book.gone",
        "Fp8Book.wrote line 20: book.launch", "Fp8Book.wrote line 21: engine.k"]
