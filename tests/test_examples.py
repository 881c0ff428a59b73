"""The examples run as a user runs them and check themselves against the unsharded model."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_2d_launches_itself_and_matches_unsharded():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_2d.py")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded training matches the unsharded model" in out.stdout
    assert out.stdout.count("match") >= 5 and "MISMATCH" not in out.stdout
