"""Metadata lives in setup.cfg; this only ships configs/ and tools/ as package data.

Like mmdet, the installed package carries them under ``visattn_mm/.mim/`` so that
tools such as mim find the configs of an installed (non-editable) copy.
"""
import shutil
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def mirror_into_mim():
    mim = ROOT / 'visattn_mm' / '.mim'
    for name in ('configs', 'tools'):
        target = mim / name
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns('__pycache__'))


if __name__ == '__main__':
    mirror_into_mim()
    setup()
