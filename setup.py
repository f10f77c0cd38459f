"""Metadata lives in setup.cfg; this only ships configs/, tools/ and model-index.yml.

Like mmdet, the package carries them under ``visattn_mm/.mim/``, where mim looks for a
package's model index, configs and training script (``mim search``, ``mim train``).
An installed copy gets real copies; a develop (editable) install gets links to the
checkout, so that edits to a config are seen without reinstalling.
"""

import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
MIM_ITEMS = ('configs', 'tools', 'model-index.yml')


def mirror_into_mim(link):
    """Fill ``visattn_mm/.mim`` with :data:`MIM_ITEMS`, as relative links or as copies."""
    mim = ROOT / 'visattn_mm' / '.mim'
    mim.mkdir(exist_ok=True)
    for name in MIM_ITEMS:
        source, target = ROOT / name, mim / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        if link:
            target.symlink_to(Path('..', '..', name))
        elif source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns('__pycache__'))
        else:
            shutil.copy2(source, target)


if __name__ == '__main__':
    mirror_into_mim(link=bool({'develop', 'editable_wheel'} & set(sys.argv)))
    setup()
