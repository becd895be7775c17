import json
import os
import subprocess
import sys

import pytest
from PIL import Image

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


@pytest.mark.slow
def test_compare_connectors_writes_table_plot_and_json(tmp_path):
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "compare_connectors.py"), "--steps", "2", "--batch-size", "2",
         "--eval", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "compare_connectors.json").read_text())["rows"]
    assert [r["connector"] for r in rows] == ["merger", "mlp", "qformer", "resampler"]
    # 128x128 px = 8x8 patches: the merger and mlp keep the grid (2x2 merged / every patch), the
    # query connectors emit their 16 queries
    assert [r["visual_tokens"] for r in rows] == [16, 64, 16, 16]
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["step_seconds"] > 0 and r["parameters_m"] > 0 for r in rows)
    table = (tmp_path / "compare_connectors.md").read_text()
    assert all(f"| {r['connector']} |" in table for r in rows)
    with Image.open(tmp_path / "compare_connectors.png") as plot:
        assert plot.size == (5 * 260, 220 + 2 * 30)
