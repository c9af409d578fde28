#!/usr/bin/env python3
"""Lists the pairs of modules of a crate that import each other (`crate::a` in b and
`crate::b` in a): the layout check of the house rules (no module imports one that imports it
back). Usage: module_cycles.py CRATE_SRC...; exit 1 when a pair is found."""
import re
import sys
from pathlib import Path


def modules(src: Path):
    """Top-level module name of each file under src, and the modules it names."""
    out = {}
    for f in src.rglob("*.rs"):
        rel = f.relative_to(src)
        name = rel.parts[0].removesuffix(".rs")
        if name in ("lib", "main"):
            continue
        text = re.sub(r"//.*", "", f.read_text())
        used = set(re.findall(r"crate::([a-z_][a-z0-9_]*)", text))
        # `use crate::{a, b::c}` groups.
        for group in re.findall(r"crate::\{([^}]*)\}", text):
            used |= set(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
        out.setdefault(name, set()).update(used - {name})
    return out


def main() -> int:
    bad = 0
    for src in map(Path, sys.argv[1:]):
        deps = modules(src)
        for a in sorted(deps):
            for b in sorted(deps[a]):
                if a < b and a in deps.get(b, set()):
                    print(f"{src}: {a} <-> {b}")
                    bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
