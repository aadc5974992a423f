"""Every launch variant of the Triton kernels compiles for sm_90 (no GPU needed: Triton's bundled ptxas).

The interpreter tests never run the GPU compiler; this does, with launch-like argument specialisation.
Two failures that only the H200 showed were of this kind (see oscar_compile/kernels/sm90.py). It runs in
a subprocess because the test session sets TRITON_INTERPRET=1, which replaces the kernels by interpreted ones.
"""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("d", [64, 128, 256])
def test_every_launch_variant_compiles_for_sm90(d):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "oscar_compile.kernels.sm90", str(d)], env=env, capture_output=True,
                          text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("ok", "FAILED"))]
    assert proc.returncode == 0, "\n".join(lines) + proc.stderr[-2000:]
    assert len(lines) >= 8 and all(ln.startswith("ok") for ln in lines)
