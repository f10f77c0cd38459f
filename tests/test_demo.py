"""The demo's learning signal: `tools/run_demo.py`, exactly what `bash tools/demo.sh` runs.

Trains Mask R-CNN ViL-T from scratch on the generated toy COCO data through
tools/train.py, evaluates the trained and the untrained model through
tools/test.py, and checks that training clearly helped and a picture was drawn.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_learns(tmp_path):
    work_dir = tmp_path / 'demo'
    proc = subprocess.run(
        [sys.executable, 'tools/run_demo.py', '--work-dir', str(work_dir)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((work_dir / 'summary.json').read_text())
    trained, untrained = summary['trained'], summary['untrained']
    assert untrained['bbox_mAP'] < 0.05, summary
    assert trained['bbox_mAP'] > untrained['bbox_mAP'] + 0.10, summary
    assert 'segm_mAP' in trained
    picture = (work_dir / 'prediction.png').read_bytes()
    assert picture[:8] == b'\x89PNG\r\n\x1a\n' and len(picture) > 1000
