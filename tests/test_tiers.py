"""The tiers hold: a test not marked `slow` cannot compile a package, in its
own process or in one it starts (compile_guard.py, wired in conftest.py)."""

import os
import subprocess
import sys

import pytest
import torch._inductor
from compile_guard import FORBID_ENV, CompiledInFastTest


def test_a_fast_test_that_compiles_fails_naming_itself(request: pytest.FixtureRequest) -> None:
    assert os.environ[FORBID_ENV] == request.node.nodeid
    with pytest.raises(CompiledInFastTest, match="test_a_fast_test_that_compiles_fails_naming_itself.*slow"):
        torch._inductor.aoti_compile_and_package(None)


def test_its_subprocesses_cannot_compile_either() -> None:
    code = "import torch._inductor; torch._inductor.aoti_compile_and_package(None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "CompiledInFastTest" in proc.stderr and "its_subprocesses_cannot_compile" in proc.stderr


@pytest.mark.slow
def test_a_slow_test_may_compile() -> None:
    assert FORBID_ENV not in os.environ
    with pytest.raises(Exception) as raised:  # the real entry point, refusing its bad argument
        torch._inductor.aoti_compile_and_package(None)
    assert not isinstance(raised.value, CompiledInFastTest)
