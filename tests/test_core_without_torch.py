"""The control plane imports and runs without the `profile` extra (torch, triton, GPU libraries)."""

from __future__ import annotations

import subprocess
import sys

BLOCK_GPU_STACK = "import sys\nfor name in ('torch', 'triton', 'pynvml', 'amdsmi'):\n    sys.modules[name] = None\n"


def run_without_gpu_stack(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_GPU_STACK + code], capture_output=True, text=True, timeout=120)


def test_cli_help_and_spec_commands_run_without_torch() -> None:
    result = run_without_gpu_stack(
        "import sys\nfrom hetsched.cli import main\nsys.argv = ['hetsched', 'fit', 'qwen3-8b', 'l4', '-o', 'json']\nmain()\n"
    )
    assert result.returncode == 0, result.stderr
    assert '"fits": true' in result.stdout


def test_every_command_group_registers_without_torch() -> None:
    result = run_without_gpu_stack(
        "import sys\nfrom hetsched.cli import main\nsys.argv = ['hetsched', '--help']\nmain()\n"
    )
    assert result.returncode == 0, result.stderr
    assert "fit" in result.stdout
