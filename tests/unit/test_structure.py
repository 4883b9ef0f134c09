"""Small modules and small classes: the sizes a reader can hold, in sidecar/ and bench/.

- A module: at most 450 lines.
- A class: at most 330 lines.
- A class: at most 16 public names. What counts is what a reader must learn to use it:
  - its public methods, properties, class and static methods (every public ``def`` in its body);
  - its public mutable state: the annotated fields of a class that is not a frozen dataclass
    (a mutable dataclass's fields, an annotated attribute of a plain class) and the public
    attributes its methods assign on ``self``.

  What does not count is data that never changes once made: the fields of a frozen dataclass or
  of a NamedTuple (a record: a reader reads them as a row, not as behaviour), ``ClassVar`` annotations, and
  names assigned at class level without an annotation (the members of an enum, the entries of a
  declared table such as the metric families).

Each failure names the file or the class, its size and the rule it breaks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sidecar", "bench")
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 330
MAX_PUBLIC_NAMES = 16


def modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def _named(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _frozen_record(node: ast.ClassDef) -> bool:
    """A frozen dataclass or a NamedTuple: its fields never change once made."""
    if any(ast.unparse(base).endswith("NamedTuple") for base in node.bases):
        return True
    for decorator in node.decorator_list:
        if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).endswith("dataclass"):
            for keyword in decorator.keywords:
                if keyword.arg == "frozen" and isinstance(keyword.value, ast.Constant) and keyword.value.value is True:
                    return True
    return False


def _public(name: str) -> bool:
    return not name.startswith("_")


def public_names(node: ast.ClassDef) -> set[str]:
    """The class's public names under the rule of this module's docstring."""
    names: set[str] = set()
    frozen = _frozen_record(node)
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _public(item.name):
            names.add(item.name)
        elif (
            isinstance(item, ast.AnnAssign)
            and isinstance(item.target, ast.Name)
            and _public(item.target.id)
            and not frozen
            and "ClassVar" not in ast.unparse(item.annotation)
        ):
            names.add(item.target.id)
    for item in node.body:
        if not isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for sub in ast.walk(item):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = list(sub.targets)
            elif isinstance(sub, ast.AnnAssign | ast.AugAssign):
                targets = [sub.target]
            while any(isinstance(target, ast.Tuple | ast.List) for target in targets):
                targets = [
                    element
                    for target in targets
                    for element in (target.elts if isinstance(target, ast.Tuple | ast.List) else [target])
                ]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and _public(target.attr)
                ):
                    names.add(target.attr)
    return names


def classes(path: Path) -> list[ast.ClassDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def module_breaches() -> list[str]:
    found = []
    for path in modules():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{_named(path)}: {lines} lines (rule: a module at most {MAX_MODULE_LINES} lines)")
    return found


def class_breaches() -> list[str]:
    found = []
    for path in modules():
        for node in classes(path):
            where = f"{_named(path)}:{node.lineno} class {node.name}"
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_CLASS_LINES:
                found.append(f"{where}: {lines} lines (rule: a class at most {MAX_CLASS_LINES} lines)")
            names = public_names(node)
            if len(names) > MAX_PUBLIC_NAMES:
                found.append(
                    f"{where}: {len(names)} public names (rule: at most {MAX_PUBLIC_NAMES} methods, properties and "
                    f"mutable fields; a frozen record's fields are data): {', '.join(sorted(names))}"
                )
    return found


def test_no_module_is_over_the_line_limit() -> None:
    found = module_breaches()
    if found:
        pytest.fail("split these modules by concept:\n" + "\n".join(found), pytrace=False)


def test_no_class_is_over_the_line_or_name_limit() -> None:
    found = class_breaches()
    if found:
        pytest.fail("split these classes, or make their data a frozen record:\n" + "\n".join(found), pytrace=False)


def _class(source: str) -> ast.ClassDef:
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    return node


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "@dataclasses.dataclass(frozen=True)\nclass R:\n    a: int\n    b: int = 0\n"
            "    def total(self) -> int: ...",
            {"total"},
        ),
        ("@dataclasses.dataclass\nclass M:\n    a: int\n    _b: int\n    def grow(self) -> None: ...", {"a", "grow"}),
        ("class T(typing.NamedTuple):\n    a: int\n    b: str", set()),
        ("class E(enum.StrEnum):\n    A = 'a'\n    B = 'b'", set()),
        ("class K:\n    LIMIT: ClassVar[int] = 3\n    def __init__(self) -> None:\n        self.n = 0\n", {"n"}),
        (
            "class P:\n    @property\n    def size(self) -> int: ...\n    async def run(self) -> None:\n"
            "        self._x, self.left = 1, 2\n        self.done += 1\n",
            {"size", "run", "done", "left"},
        ),
    ],
)
def test_the_rule_counts_behaviour_and_mutable_state_not_a_records_fields(source: str, expected: set[str]) -> None:
    assert public_names(_class(source)) == expected
