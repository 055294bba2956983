"""Static rules a candidate must pass before it runs: it may not reach for the reference or special-case
the test inputs. They read the syntax tree; the sandbox enforces the rest at run time."""
from __future__ import annotations

import ast

ALLOWED_IMPORTS = {"math", "torch", "torch.nn.functional"}
FORBIDDEN_NAMES = {"importlib", "__import__", "exec", "eval", "compile", "open", "globals", "locals", "vars",
                   "getattr", "setattr", "__builtins__", "sys", "os", "breakpoint", "input"}
# the same reach through an attribute of an allowed module (torch.serialization.os.system, torch.ctypes,
# torch.sys.modules['builtins'].exec, ...): no op needs an attribute of these names
FORBIDDEN_ATTRS = FORBIDDEN_NAMES | {"ctypes", "modules", "environ", "system", "popen", "spawnv", "execv", "fork",
                                     "runpy", "run_path", "run_module", "import_module", "socket", "subprocess",
                                     "builtins", "serialization", "multiprocessing", "package", "hub", "load", "save"}
SHAPE_ATTRS = {"shape", "ndim"}


def violations(source: str) -> list[str]:
    """What the candidate does that it may not; [] when it passes."""
    try:
        tree = ast.parse(source)
    except SyntaxError as err:
        return [f"syntax error line {err.lineno}: {err.msg}"]
    found = []
    for node in ast.walk(tree):
        found += _check(node)
    return found


def _check(node: ast.AST) -> list[str]:
    line = getattr(node, "lineno", "?")
    if isinstance(node, ast.Import):
        return [f"line {line}: import {a.name}" for a in node.names if a.name not in ALLOWED_IMPORTS]
    if isinstance(node, ast.ImportFrom):
        return [f"line {line}: from {node.module} import" for _ in [0] if node.module not in ALLOWED_IMPORTS]
    if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
        return [f"line {line}: uses {node.id}"]
    if isinstance(node, ast.Attribute) and node.attr.startswith("__"):
        return [f"line {line}: dunder attribute {node.attr}"]
    if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
        return [f"line {line}: uses attribute {node.attr}"]
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)) and _patches_attribute(node):
        return [f"line {line}: assigns to an attribute (patches a module or object shared with the caller)"]
    if isinstance(node, ast.Try):
        return [f"line {line}: try/except (it hides failures)"]
    if isinstance(node, ast.Compare) and _shape_vs_literal(node):
        return [f"line {line}: compares a shape or size with a literal (special-cases input shapes)"]
    return []


def _patches_attribute(node: ast.AST) -> bool:
    targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
    return any(isinstance(sub, ast.Attribute) for target in targets for sub in ast.walk(target)
               if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)))


def _shape_vs_literal(node: ast.Compare) -> bool:
    sides = [node.left, *node.comparators]
    return any(_is_shape(s) for s in sides) and any(_has_number(s) for s in sides)


def _is_shape(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and sub.attr in SHAPE_ATTRS:
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in ("size", "numel", "dim"):
            return True
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "len":
            return True
    return False


def _has_number(node: ast.AST) -> bool:
    return any(isinstance(s, ast.Constant) and isinstance(s.value, (int, float)) and not isinstance(s.value, bool)
               for s in ast.walk(node))
