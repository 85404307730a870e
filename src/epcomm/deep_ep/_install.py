"""Making ``import deep_ep`` resolve to epcomm's drop-in, for a process that asks for it, and saying which
``deep_ep`` a process would import. A DeepEP installation is never shadowed unless the caller forces it.

``python -m epcomm deep-ep SCRIPT [ARGS]`` (or ``-m MODULE [ARGS]``) runs a program with the drop-in
installed, without changing the program; under torchrun: ``torchrun ... -m epcomm deep-ep SCRIPT [ARGS]``.
``python -m epcomm deep-ep --status`` prints which ``deep_ep`` is active."""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
import warnings
from typing import Optional, Sequence

NAME = "deep_ep"
# DeepEP V1's module layout (deep_ep.utils, deep_ep.buffer), and V2's event module
_SUBMODULES = {"utils": "utils", "buffer": "buffer", "utils.event": "utils"}
DROP_IN = "epcomm.deep_ep"


def _is_drop_in(module) -> bool:
    return getattr(module, "__name__", None) == DROP_IN


def _real_location() -> Optional[str]:
    """Where a DeepEP installation (not this drop-in) would be imported from, or None if there is none."""
    module = sys.modules.get(NAME)
    if module is not None:
        return None if _is_drop_in(module) else str(getattr(module, "__file__", None) or "an imported module")
    try:
        spec = importlib.util.find_spec(NAME)
    except (ImportError, ValueError):
        return None
    return None if spec is None else str(spec.origin or (list(spec.submodule_search_locations or []) or [NAME])[0])


def status() -> tuple:
    """``(kind, detail)``: which module ``import deep_ep`` gives this process. ``kind`` is ``"epcomm"`` (this
    drop-in is installed), ``"deepep"`` (a DeepEP installation, at ``detail``) or ``"none"``."""
    module = sys.modules.get(NAME)
    if module is not None and _is_drop_in(module):
        return "epcomm", f"epcomm's drop-in ({DROP_IN}), installed in this process"
    real = _real_location()
    if real is not None:
        return "deepep", f"DeepEP at {real}"
    return "none", (f"no deep_ep is importable; {DROP_IN}.install() or `python -m epcomm deep-ep SCRIPT` makes "
                    f"`import deep_ep` resolve to epcomm's drop-in")


def install(force: bool = False) -> bool:
    """Make ``import deep_ep`` (and ``deep_ep.utils``, ``deep_ep.buffer``) resolve to ``epcomm.deep_ep`` in this
    process; call it before the code that imports ``deep_ep``. Returns True when the drop-in is then active.

    If a DeepEP installation is importable (or already imported), it is kept and a RuntimeWarning says so
    (returns False), unless ``force=True``; modules that imported DeepEP before keep their reference to it."""
    import epcomm.deep_ep as drop_in

    current = sys.modules.get(NAME)
    if current is drop_in:
        return True
    real = _real_location()
    if real is not None and not force:
        warnings.warn(f"epcomm.deep_ep.install: a DeepEP installation is importable ({real}); `import deep_ep` keeps "
                      f"resolving to it. Call install(force=True) to use epcomm's drop-in instead", RuntimeWarning,
                      stacklevel=2)
        return False
    for name in [m for m in sys.modules if m == NAME or m.startswith(NAME + ".")]:
        del sys.modules[name]  # a forced install replaces an imported DeepEP's modules too
    sys.modules[NAME] = drop_in
    for sub, ours in _SUBMODULES.items():
        sys.modules[f"{NAME}.{sub}"] = importlib.import_module(f"{DROP_IN}.{ours}")
    return True


def uninstall() -> None:
    """Undo ``install()``: ``import deep_ep`` finds what it would find without the drop-in."""
    for name in [NAME] + [f"{NAME}.{sub}" for sub in _SUBMODULES]:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__name__", "").startswith(DROP_IN):
            del sys.modules[name]


USAGE = "usage: python -m epcomm deep-ep [--force] (SCRIPT [ARGS...] | -m MODULE [ARGS...]) | --status"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m epcomm deep-ep``: run a program with ``import deep_ep`` resolving to epcomm's drop-in (the
    program's own arguments follow its name untouched)."""
    args = list(sys.argv[1:] if argv is None else argv)
    force = False
    while args and args[0] in ("--force", "--status", "-h", "--help"):
        flag = args.pop(0)
        if flag in ("-h", "--help"):
            print(f"{USAGE}\n\n{__doc__}")
            return 0
        if flag == "--status":
            kind, detail = status()
            print(f"deep_ep: {kind}: {detail}")
            return 0
        force = True
    module = None
    if args[:1] == ["-m"]:
        if len(args) < 2:
            print(f"python -m epcomm deep-ep: -m needs a module name\n{USAGE}", file=sys.stderr)
            return 2
        module, args = args[1], args[2:]
    elif not args or args[0].startswith("-"):
        print(f"python -m epcomm deep-ep: give a script or -m MODULE to run\n{USAGE}", file=sys.stderr)
        return 2
    real = _real_location()
    if real is not None and not force:
        print(f"python -m epcomm deep-ep: DeepEP is installed ({real}); not shadowing it. Pass --force to run with "
              f"epcomm's drop-in", file=sys.stderr)
        return 2
    install(force=True)
    if module is not None:
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")
    return 0


__all__ = ["install", "uninstall", "status", "main"]
