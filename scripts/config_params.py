"""Count the function parameters that take the whole config: typed ``AppConfig`` (or an
unannotated ``cfg``), across ``apps/train/src`` (issue 26's measure: 62 before, at most 30).

    python scripts/config_params.py [-v]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "apps/train/src"


def whole_config_parameters(root: Path = SRC) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            args = node.args
            for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
                note = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if (note and "AppConfig" in note) or (note is None and arg.arg == "cfg"):
                    name = getattr(node, "name", "<lambda>")
                    found.append(f"{path.relative_to(root)}:{node.lineno} {name}({arg.arg})")
    return found


if __name__ == "__main__":
    params = whole_config_parameters()
    if "-v" in sys.argv:
        print("\n".join(params))
    print(len(params))
