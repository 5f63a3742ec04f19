"""What every command line of dspark_jax shares: `run_main`, the process entry that its
`if __name__ == "__main__":` calls.

`run_main(main)` turns on JAX's persistent compilation cache (`enable_compilation_cache`), runs
`main()`, and turns a `CheckpointError` (a missing, truncated or inconsistent checkpoint file,
models/io/errors.py) and the command's own usage errors into one line, `error: <message>`, on
stderr and exit status 2, instead of a traceback. `main`'s return value is the exit status
when it is an int, else 0.

The compilation cache is `$DSPARK_JAX_COMPILATION_CACHE`, by default
`$XDG_CACHE_HOME/dspark_jax/jax_cache` (`~/.cache/dspark_jax/jax_cache`); an empty value turns
it off. Programs that compile in under `MIN_COMPILE_TIME_S` seconds are not stored (JAX's own
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`, when set, decides instead). Without the variable,
a directory already given to JAX itself (`JAX_COMPILATION_CACHE_DIR`) is kept.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any, Callable, NoReturn

CACHE_ENV = "DSPARK_JAX_COMPILATION_CACHE"
MIN_COMPILE_TIME_S = 1.0


def compilation_cache_dir() -> pathlib.Path | None:
    """The persistent compilation cache's directory: `$DSPARK_JAX_COMPILATION_CACHE` (empty:
    None, the cache off), else the user cache directory's `dspark_jax/jax_cache`."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return pathlib.Path(value).expanduser() if value.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return pathlib.Path(base).expanduser() / "dspark_jax" / "jax_cache"


def enable_compilation_cache(min_compile_time_s: float = MIN_COMPILE_TIME_S
                             ) -> pathlib.Path | None:
    """Points JAX's persistent compilation cache at `compilation_cache_dir()`, storing programs
    that take at least `min_compile_time_s` to compile (unless
    `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` is set); returns the directory in use (None:
    off). JAX reads the setting at its first compilation, so a process calls this before
    compiling."""
    import jax

    if os.environ.get(CACHE_ENV) is None and jax.config.jax_compilation_cache_dir:
        return pathlib.Path(jax.config.jax_compilation_cache_dir)   # JAX_COMPILATION_CACHE_DIR
    path = compilation_cache_dir()
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    return path


def exit_with_error(exc: BaseException) -> NoReturn:
    """`error: <message>` on one line of stderr, exit status 2."""
    message = " ".join(str(exc).split("\n")).strip() or type(exc).__name__
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def run_main(main: Callable[[], Any], *, errors: tuple[type[BaseException], ...] = (),
             compilation_cache: bool = True) -> NoReturn:
    """Runs a command line's `main()` as the process (module docstring): `CheckpointError` and
    `errors` exit 2 with one line; `compilation_cache=False` leaves JAX's cache setting alone
    (commands that time their own compilation, or compile for chips this machine lacks)."""
    if compilation_cache:
        enable_compilation_cache()     # before anything compiles: JAX reads it once
    from dspark_jax.models.io.errors import CheckpointError

    try:
        result = main()
    except (CheckpointError, *errors) as exc:
        exit_with_error(exc)
    sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)


__all__ = ["CACHE_ENV", "MIN_COMPILE_TIME_S", "compilation_cache_dir", "enable_compilation_cache",
           "exit_with_error", "run_main"]
