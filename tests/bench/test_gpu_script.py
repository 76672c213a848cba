"""bench/gpu_issue7_s5.sh on the CPU (the embedded default model, short inputs): its parts run,
and $OUT ends with only the packed files the device returns (results.tar.gz and summary.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_issue7_s5.sh"


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("tar") is None, reason="needs bash and tar")
def test_script_packs_its_results(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "MODEL": "random:tiny", "DTYPE": "float32", "KV_MEMORY": "4MiB",
           "INPUT": "200", "OUTPUT_LEN": "128", "E2E_BATCH": "4", "E2E_STEPS": "4", "PARTS": "a b",
           "EXTRA": "--device cpu --attention-backend torch --budget 64 --page-size 4 --max-batch 8",
           "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(SCRIPT), str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "## tune_compaction: rc=" in summary  # no GPU here: it fails, the script goes on
    assert "## e2e32_snapkv: rc=0" in summary and "| snapkv | 200 | e2e | 4 |" in summary
    with tarfile.open(out / "results.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
        assert {"summary.md", "e2e32_snapkv.json", "e2e32_snapkv.md", "e2e32_snapkv.log",
                "tune_compaction.log"} <= names
        result = json.load(tar.extractfile("./e2e32_snapkv.json"))
    modes = [(r["mode"], r["batch"]) for r in result["rows"]]
    assert modes == [("decode_window", 8), ("e2e", 4)]
    assert result["rows"][1]["window_step_ratio"] > 0
    assert not list(tmp_path.glob("kvc_s5.*"))  # the scratch folder is removed
