"""Triton kernels through Triton's interpreter on CPU, for tests: a fresh Python process (the
interpreter is chosen when a kernel is defined, so TRITON_INTERPRET must be set before), and the
one patch the interpreter needs for our kernels. Imports no Triton itself: the caller skips first."""

from __future__ import annotations

import os
import subprocess
import sys


def allow_loaded_scalar_bounds() -> None:
    """Triton 3.6's interpreter holds a loaded scalar as a 1-element array, which cannot be a loop
    bound (``range(0, n, ...)`` with ``n = tl.load(...)``); compiled Triton can. Let it take the one
    element. Call it in the interpreted process before the kernels are imported."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def _patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patched


def run(code: str, *args: str, interpret: bool = True, timeout: float = 240) -> str:
    """Run ``code`` in a fresh Python with the tests and the project on its path (through Triton's
    interpreter if ``interpret``); the last line it printed. A failure asserts with its stderr."""
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]
