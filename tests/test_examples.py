import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_load_qwen3vl_checkpoint_example_reports_parity():
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "load_qwen3vl_checkpoint.py")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert "missing=[] unexpected=[]" in result.stdout
    line = next(l for l in result.stdout.splitlines() if l.startswith("max |logit difference|"))
    assert float(line.rsplit(":", 1)[1]) <= 1e-5
    assert "greedy generation of 12 tokens identical: True" in result.stdout
