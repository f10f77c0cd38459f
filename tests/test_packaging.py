"""What the built package ships: every file of configs/ and tools/ under visattn_mm/.mim/.

setup.py mirrors configs/ and tools/ into visattn_mm/.mim/ and setup.cfg's
package_data globs pick the files from there; a file no glob matches is left
out of the wheel and the sdist silently (tools/analysis/ was, once). The globs
are applied to the mirrored tree exactly as setuptools applies them.
"""

import configparser
import glob
from pathlib import Path

from paths import ROOT


def _package_data_globs():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / 'setup.cfg')
    return [p.strip() for p in cfg['options.package_data']['visattn_mm'].split(',') if p.strip()]


def _shipped_sources():
    """configs/ and tools/ files as setup.py mirrors them (no __pycache__)."""
    files = set()
    for folder in ('configs', 'tools'):
        for path in (ROOT / folder).rglob('*'):
            if path.is_file() and '__pycache__' not in path.parts:
                files.add(f'.mim/{path.relative_to(ROOT).as_posix()}')
    return files


def test_package_data_globs_cover_configs_and_tools(tmp_path):
    package = tmp_path / 'visattn_mm'
    sources = _shipped_sources()
    for name in sources:
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).touch()
    matched = set()
    for pattern in _package_data_globs():
        matched.update(Path(p).as_posix() for p in glob.glob(pattern, root_dir=package))
    assert '.mim/tools/analysis/model_zoo.py' in sources
    missing = sorted(sources - matched)
    assert not missing, f'no package_data glob in setup.cfg matches {missing}'
