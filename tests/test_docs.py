"""The documentation: every relative link and anchor between the pages resolves, docs/benchmarks.md stays a
short page of today's results, and the device calls' files stay in results/, each call described there."""

import re

import pytest

from paths import ROOT

RESULTS = ROOT / 'results'  # the device calls' files (tools/analysis/decide_cuda_defaults.py's RESULTS_DIR)
PAGES = sorted([ROOT / 'README.md', RESULTS / 'README.md', *(ROOT / 'docs').glob('*.md')])
BENCHMARKS_PAGE_LINES = 300
# What a device call brings back (tools/gpu_session.sh), by name: JUnit reports, logs, the session's summary.
DEVICE_CALL_FILES = ('*.xml', '*.log', 'summary.txt', 'session.*')
LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
FENCE = re.compile(r'^```.*?^```', re.M | re.S)
INLINE_CODE = re.compile(r'`[^`\n]*`')


def prose(page):
    """The page's text without fenced code blocks and inline code, where brackets are not links."""
    return INLINE_CODE.sub('', FENCE.sub('', page.read_text()))


def anchors(page):
    """The anchors GitHub gives the page's headings: lowercase, punctuation dropped, spaces to hyphens, a
    repeated heading's anchor suffixed -1, -2, ..."""
    found = set()
    for heading in re.findall(r'^#+ +(.+?) *$', FENCE.sub('', page.read_text()), re.M):
        slug = re.sub(r'[^\w\- ]', '', heading.replace('`', '').lower()).replace(' ', '-')
        count = sum(1 for name in found if name == slug or re.fullmatch(re.escape(slug) + r'-\d+', name))
        found.add(f'{slug}-{count}' if count else slug)
    return found


@pytest.mark.parametrize('page', PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_between_pages_resolve(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r'[a-z]+:', target):  # http, https, mailto: outside the repository
            continue
        path, _, anchor = target.partition('#')
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f'{target}: no such file')
        elif anchor and linked.suffix == '.md' and anchor not in anchors(linked):
            broken.append(f'{target}: no heading with that anchor in {linked.relative_to(ROOT)}')
    assert not broken, broken


def test_anchors_follow_githubs_rules():
    """Checked on headings whose GitHub anchors other pages already link to."""
    page = ROOT / 'docs' / 'benchmarks.md'
    assert {'what-auto-runs-on-cuda-the-defaults-table', 'h200-2026-11-27'} <= anchors(page)
    assert 'whole-models-load_from-toolstestpy---resume' in anchors(ROOT / 'docs' / 'checkpoints.md')


def test_benchmarks_page_holds_todays_results_in_a_few_screens():
    lines = (ROOT / 'docs' / 'benchmarks.md').read_text().splitlines()
    assert len(lines) <= BENCHMARKS_PAGE_LINES, (
        f'docs/benchmarks.md has {len(lines)} lines, more than {BENCHMARKS_PAGE_LINES}: move superseded results '
        'to docs/benchmarks_history.md'
    )


def test_device_call_files_stay_out_of_docs():
    docs = ROOT / 'docs'
    found = [path for pattern in DEVICE_CALL_FILES for path in docs.rglob(pattern)]
    found += [path for path in docs.rglob('gpu_*') if path.is_dir()]
    assert not found, f'device calls\' files belong in results/gpu_DATE/callN/ (results/README.md): {found}'


def test_every_recorded_call_is_described():
    readme = (RESULTS / 'README.md').read_text()
    calls = sorted(str(path.relative_to(RESULTS)) for path in RESULTS.glob('gpu_*/call*') if path.is_dir())
    assert calls, f'no device calls in {RESULTS}'
    assert [call for call in calls if f'`{call}`' not in readme] == []
