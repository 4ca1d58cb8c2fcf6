"""The engine binary inside the package (`automoe/bin/automoe`, the C++ command): where it is, the
environment it runs in (jemalloc as its allocator, LibTorch's directory) and the exec that starts
it. Used by the console script (automoe.cli) and by `automoe train` (automoe.train)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def binary() -> Path:
    path = Path(__file__).resolve().parent / "bin" / "automoe"
    if not path.exists():
        raise SystemExit(f"automoe: the engine binary is missing ({path}); build with `make` or `pip install .`")
    return path


# The engine allocates and frees the same large activations every step. glibc's malloc hands each
# allocation above 32 MiB back to the kernel on free, so the next step's same-sized tensor
# page-faults all of its memory in again (measured: a fresh 128 MiB tensor costs 48 ms to first
# touch against 4 ms to refill, which made the memory-bound ops 5-10x slower than their loops).
# jemalloc configured to keep freed pages (the setting Intel's PyTorch launcher uses) reuses them.
# AUTOMOE_ALLOCATOR=system keeps glibc's malloc.
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
JEMALLOC_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                 "/usr/local/lib")


def find_jemalloc() -> str | None:
    for d in JEMALLOC_DIRS:
        path = Path(d) / "libjemalloc.so.2"
        if path.exists():
            return str(path)
    return None


def allocator_env(env: dict) -> dict:
    """`env` with jemalloc preloaded as the engine's allocator, unless AUTOMOE_ALLOCATOR=system,
    the user preloads something already (their allocator, or a sanitizer that must come first),
    or jemalloc is not installed (then glibc's malloc runs, slower)."""
    choice = env.get("AUTOMOE_ALLOCATOR", "jemalloc")
    if choice not in ("jemalloc", "system"):
        raise SystemExit(f"automoe: AUTOMOE_ALLOCATOR={choice!r}: expected 'jemalloc' or 'system'")
    preload = env.get("LD_PRELOAD", "").strip()
    if choice == "system" or preload:
        return env
    lib = find_jemalloc()
    if lib is None:
        return env
    env = dict(env)
    env["LD_PRELOAD"] = lib
    env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    return env


def engine_env() -> dict:
    env = allocator_env(dict(os.environ))
    # The binary finds LibTorch next to it when torch and automoe share a site-packages; point it
    # at the torch Python would import otherwise (found without importing it).
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        torch_lib = str(Path(spec.origin).parent / "lib")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (torch_lib, env.get("LD_LIBRARY_PATH")) if p)
    return env


def exec_engine(args: list[str]) -> None:
    """Replaces this process with the C++ command (signals and exit status go straight to it)."""
    exe = binary()
    os.execve(exe, [str(exe), *args], engine_env())
