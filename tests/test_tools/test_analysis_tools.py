"""tools/analysis/model_zoo.py and the package modules it runs on (visattn_mm.analysis.flops: parameter / FLOPs
counts; paper_numbers: flagging; model_zoo_page: the generated page), tools/analysis/get_flops.py and
tools/analysis/plot_curves.py (visattn_mm.analysis.training_curves: scalar parsing; the PNG)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from paths import ROOT
from tool_runs import _load_tool
from visattn_mm.analysis import flops, model_zoo_page, paper_numbers, training_curves

CONFIG_DIR = ROOT / 'configs'
SEG_STEM = 'upernet_vvt_s_160k_ade20k'


model_zoo = _load_tool('analysis/model_zoo')


@pytest.fixture(scope='module')
def plot_curves():
    return _load_tool('analysis/plot_curves')


# --------------------------------------------------------------------------
# model_zoo.py
# --------------------------------------------------------------------------
def test_flagging_threshold():
    assert paper_numbers.relative_difference(102, 100) == pytest.approx(0.02)
    assert paper_numbers.is_flagged(102.1, 100) and paper_numbers.is_flagged(97.9, 100)
    assert not paper_numbers.is_flagged(101.9, 100) and not paper_numbers.is_flagged(98.1, 100)
    assert not paper_numbers.is_flagged(None, 100) and not paper_numbers.is_flagged(100, None)
    assert paper_numbers.is_flagged(105, 100, tolerance=0.04) and not paper_numbers.is_flagged(103, 100, 0.04)


def test_table_flags_only_rows_off_by_more_than_two_percent():
    rows = paper_numbers.planned_configs(['maskrcnn'])
    measured = {
        # Paper: 26.9M, 145.6G -> params -7.1% (flagged), FLOPs +1.0% (not flagged).
        'maskrcnn_vil_t_1x': flops.Measurement(
            params=25_000_000,
            flops=147_056_000_000,
            flops_input=(800, 1333),
            flops_parts=dict(backbone=100_000_000_000, roi_head=47_056_000_000),
        ),
        # Paper: 45.0M; FLOPs skipped.
        'maskrcnn_vil_s_1x': flops.Measurement(params=45_500_000),
    }
    lines = {
        re.search('`(\\w+)`', line).group(1): line
        for line in model_zoo_page.table('maskrcnn', rows, measured, config_dir=CONFIG_DIR).splitlines()[2:]
    }
    assert len(lines) == len(rows) == 30  # 15 backbones x 2 schedules
    vil_t = lines['maskrcnn_vil_t_1x'].split(' | ')
    assert vil_t[3] == '25.00 **(-7.1%)**' and vil_t[4] == '26.9'
    assert vil_t[5] == '147.1' and vil_t[6] == '145.6' and vil_t[7] == '800x1333'
    assert vil_t[8] == 'backbone 100.0, roi_head 47.1'
    assert vil_t[9] == '41.4 / 38.1' and vil_t[10] == ''  # our AP stays empty
    vil_s = lines['maskrcnn_vil_s_1x'].split(' | ')
    assert vil_s[3] == '45.50' and vil_s[5] == ''
    # Planned, not measured, its config present: named without a label, paper numbers still shown.
    assert lines['maskrcnn_vil_b_1x'].startswith('| `maskrcnn_vil_b_1x` | ViL-B |')
    assert '76.1' in lines['maskrcnn_vil_b_1x']
    assert lines['maskrcnn_vvt_l_1x'].count('|') == 13  # no paper row: empty cells


def test_planned_config_without_a_file_is_labelled(tmp_path):
    (line,) = [
        line
        for line in model_zoo_page.table(
            'upernet', paper_numbers.planned_configs(['upernet']), {}, config_dir=tmp_path
        ).splitlines()
        if f'`{SEG_STEM}`' in line
    ]
    assert line.startswith(f'| `{SEG_STEM}` (no config yet) |')


def test_paper_rows_cite_a_source_and_name_planned_configs():
    planned = {stem for stem, *_ in paper_numbers.planned_configs()}
    for stem, row in paper_numbers.PAPER.items():
        assert stem in planned, stem
        assert row.source and row.metric and row.flops_input, stem
    assert paper_numbers.flops_input('upernet_pale_t_160k_ade20k', 'upernet', 'pale') == (512, 2048)
    assert paper_numbers.flops_input('maskrcnn_pale_t_3x_ms', 'maskrcnn', 'pale') == (800, 1280)
    # ViL-LS rows follow ViL's paper, so the two stay comparable.
    assert paper_numbers.flops_input('maskrcnn_vil_ls_t_1x', 'maskrcnn', 'vil_ls') == (800, 1333)
    assert paper_numbers.flops_input('upernet_vil_t_160k_ade20k', 'upernet', 'vil') == (512, 512)
    assert paper_numbers.flops_input('retinanet_vvt_s_1x', 'retinanet', 'vvt') == (800, 1280)


def test_counter_sees_the_attention_ops():
    """Multiply-adds of the ops the backbones' attention is written with."""
    q, k, v = torch.randn(1, 2, 5, 3), torch.randn(1, 2, 7, 3), torch.randn(1, 2, 7, 4)
    mask = torch.rand(1, 2, 5, 7) > 0.3
    assert flops.count_macs(torch.einsum, 'bhnd,bhmd->bhnm', q, k) == 2 * 5 * 7 * 3
    assert flops.count_macs(torch.matmul, q, k.transpose(-1, -2)) == 2 * 5 * 7 * 3
    qk_av = 2 * 5 * 7 * 3 + 2 * 5 * 7 * 4
    assert flops.count_macs(F.scaled_dot_product_attention, q, k, v) == qk_av
    assert flops.count_macs(F.scaled_dot_product_attention, q, k, v, attn_mask=mask) == qk_av
    # The fused CPU kernel F.scaled_dot_product_attention dispatches to on larger
    # inputs; torch's own counter skips it.
    q, k, v = torch.randn(1, 2, 64, 8), torch.randn(1, 2, 48, 8), torch.randn(1, 2, 48, 8)
    cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    assert flops.count_macs(cpu_flash, q, k, v) == 2 * 64 * 48 * 8 * 2
    # The backbones' attention entry point (ViL, ViL-LS, Pale), whatever kernel it picks.
    from visattn_mm.ops.common import fused_attention

    q, k, v = torch.randn(4, 2, 49, 16), torch.randn(4, 2, 98, 16), torch.randn(4, 2, 98, 16)
    assert flops.count_macs(fused_attention, q, k, v) == 4 * 2 * 49 * 98 * 16 * 2
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    assert flops.count_macs(conv, torch.randn(1, 3, 6, 5)) == 8 * 3 * 9 * 6 * 5


@pytest.fixture(scope='module')
def seg_model():
    return flops.build_model(ROOT / 'configs' / f'{SEG_STEM}.py')


def test_real_config_params_and_flops(seg_model):
    model, scope = seg_model
    assert scope == 'mmseg'
    # UperNet VVT-S as tests/test_models/test_vvt.py and the paper (55.5M) count it.
    assert round(flops.count_parameters(model) / 1e6, 2) == 55.50
    small, parts = flops.count_flops(model, scope, 64, 64)
    large, _ = flops.count_flops(model, scope, 128, 128)
    assert small > 0
    # mmseg's tensor-mode forward: backbone and decode head, the auxiliary head is not run.
    assert set(parts) == {'backbone', 'decode_head'} and sum(parts.values()) == small
    # VVT's attention and every UperNet op are at most linear in the pixel count, and
    # most of the work grows with it: 4x the pixels cost between 3x and 4x.
    assert 3.0 < large / small <= 4.0, large / small
    assert flops.count_flops(model, scope, 64, 64)[0] == small  # reproducible


def test_tool_writes_the_page(tmp_path, capsys):
    out = tmp_path / 'model_zoo.md'
    model_zoo.main(['--tasks', 'upernet', '--configs', SEG_STEM, '--skip-flops', '--out', str(out)])
    text = out.read_text()
    assert text.startswith('# Model zoo') and '## UperNet (ADE20K)' in text
    assert '## Mask R-CNN' not in text
    assert f'--configs {SEG_STEM} --skip-flops' in text  # the command that made it
    (row,) = [line for line in text.splitlines() if line.startswith(f'| `{SEG_STEM}`')]
    cells = row.split(' | ')
    # 55.50M ours against the paper's 55.5M: within 2%, so not flagged.
    assert cells[3] == '55.50' and cells[4] == '55.5' and cells[9] == '46.8'
    assert '55.50M params' in capsys.readouterr().out
    assert 'no config yet' not in text  # the rows this run did not measure have configs
    with pytest.raises(SystemExit, match='not in the planned matrix'):
        model_zoo.main(['--configs', 'maskrcnn_vil_t_2x', '--out', str(out)])


def test_partial_run_merges_into_the_page(tmp_path, capsys):
    """A run of one table, one config, without FLOPs keeps everything it did not measure."""
    page = (ROOT / 'docs' / 'model_zoo.md').read_text()
    out = tmp_path / 'docs' / 'model_zoo.md'
    out.parent.mkdir()
    out.write_text(page)
    model_zoo.main(['--tasks', 'upernet', '--configs', SEG_STEM, '--skip-flops', '--out', str(out)])
    assert 'every other row and table kept' in capsys.readouterr().out
    text = out.read_text()
    _, before = model_zoo_page.read_page(page)
    _, after = model_zoo_page.read_page(text)
    assert set(after) == set(before) and len(after) == 75  # all three tables are still there
    for stem, cells in before.items():
        if stem != SEG_STEM:
            assert after[stem] == cells, stem
    # The measured row: parameters recomputed, the FLOPs cells it skipped kept.
    for i in range(len(before[SEG_STEM])):
        if i != 3:
            assert after[SEG_STEM][i] == before[SEG_STEM][i], i
    assert after[SEG_STEM][3] == '55.50' and after[SEG_STEM][5] == before[SEG_STEM][5] != ''
    assert text.count('## Notes on the flagged differences') == 1
    assert text.startswith(
        '# Model zoo\n\nGenerated by `python tools/analysis/model_zoo.py`, '
        f'updated by `python tools/analysis/model_zoo.py --tasks upernet '
        f'--configs {SEG_STEM} --skip-flops --out {out}`'
    )
    # Merging into something that is not a model-zoo page is refused, the file untouched.
    other = tmp_path / 'notes.md'
    other.write_text('# my notes\n')
    with pytest.raises(SystemExit, match='no model-zoo table rows.*new --out'):
        model_zoo.main(['--tasks', 'upernet', '--configs', SEG_STEM, '--skip-flops', '--out', str(other)])
    assert other.read_text() == '# my notes\n'


def test_page_round_trips():
    """Rendering the page again from its own rows changes nothing (so merges are exact)."""
    page = (ROOT / 'docs' / 'model_zoo.md').read_text()
    command, _ = model_zoo_page.read_page(page)
    assert model_zoo_page.render(['upernet'], {}, command, page, config_dir=CONFIG_DIR) == page


# --------------------------------------------------------------------------
# get_flops.py (mmseg 1.2.2's get_flops fails on every config; mmdet's has no --shape)
# --------------------------------------------------------------------------
def test_get_flops_counts_the_zoo_way_at_the_size_given(capsys):
    get_flops = _load_tool('analysis/get_flops')
    config = ROOT / 'configs' / 'upernet_vvt_t_160k_ade20k.py'
    get_flops.main([str(config), '--shape', '64', '96'])
    printed = capsys.readouterr().out
    expected = flops.measure(config, skip_flops=False, input_size=(64, 96))
    assert 'Input shape: (3, 64, 96)' in printed
    assert f'Flops: {expected.flops / 1e9:.2f} G multiply-adds' in printed
    assert f'Params: {expected.params / 1e6:.2f} M' in printed
    for part, macs in expected.flops_parts.items():
        assert f'  {part}: {macs / 1e9:.2f} G' in printed
    assert get_flops.parse_shape(None, 'mmseg') == (512, 512) and get_flops.parse_shape([96], 'mmdet') == (96, 96)
    with pytest.raises(SystemExit, match='--shape takes H or H W'):
        get_flops.parse_shape([1, 2, 3], 'mmdet')


# --------------------------------------------------------------------------
# plot_curves.py
# --------------------------------------------------------------------------
def _write_run(work_dir: Path, timestamp: str, records: list[dict]) -> None:
    vis = work_dir / timestamp / 'vis_data'
    vis.mkdir(parents=True)
    (vis / 'scalars.json').write_text(''.join(json.dumps(r) + '\n' for r in records))


@pytest.fixture
def work_dir(tmp_path) -> Path:
    """A training of 4 iterations, validated at 2, resumed at 2 and run to 4 again."""
    first = [
        dict(lr=0.1, loss=4.0, iter=1, step=1),
        dict(lr=0.1, loss=3.0, iter=2, step=2),
        {'coco/bbox_mAP': 0.1, 'step': 2},
        dict(lr=0.1, loss=9.9, iter=3, step=3),
    ]
    second = [
        dict(lr=0.01, loss=2.5, iter=3, step=3),
        dict(lr=0.01, loss=2.0, iter=4, step=4),
        {'coco/bbox_mAP': 0.3, 'data_time': 0.5, 'step': 4},
    ]
    _write_run(tmp_path, '20260101_000000', first)
    _write_run(tmp_path, '20260102_000000', second)
    return tmp_path


def test_series_join_resumed_runs(work_dir):
    files = training_curves.find_scalar_files(work_dir)
    assert [f.parent.parent.name for f in files] == ['20260101_000000', '20260102_000000']
    series, validation = training_curves.read_series(files)
    assert series['loss'] == {1: 4.0, 2: 3.0, 3: 2.5, 4: 2.0}  # the resumed run wins at 3
    assert series['lr'] == {1: 0.1, 2: 0.1, 3: 0.01, 4: 0.01}
    assert series['coco/bbox_mAP'] == {2: 0.1, 4: 0.3}
    assert 'iter' not in series and 'step' not in series
    assert validation == {'coco/bbox_mAP', 'data_time'}
    assert training_curves.select_keys(series, None) == ['loss', 'lr', 'coco/bbox_mAP']
    with pytest.raises(KeyError, match="available: .*'loss'"):
        training_curves.select_keys(series, ['mIoU'])


def test_plot_writes_a_png(plot_curves, work_dir, tmp_path):
    from PIL import Image

    out = tmp_path / 'plots' / 'curves.png'  # the tool creates the folder
    plot_curves.main([str(work_dir), '--keys', 'loss', 'coco/bbox_mAP', '--out', str(out)])
    with Image.open(out) as image:
        assert image.format == 'PNG'
        width, height = image.size
    assert width > 100 and height > 200  # two panels stacked
    with pytest.raises(SystemExit, match='no vis_data/scalars.json'):
        plot_curves.main([str(tmp_path / 'nowhere'), '--out', str(out)])


def test_model_fingerprint_comparison_reports_every_kind_of_change():
    fingerprint = _load_tool('analysis/model_fingerprint')
    entry = dict(keys=[('a.weight', (2, 3))], params='6 parameters', outputs=[torch.ones(2, 3)])
    before = {'config/x': entry, 'config/gone': entry}
    assert fingerprint.compare(before, {'config/x': entry, 'config/gone': entry}) == []
    changed = {
        'config/x': dict(keys=[('a.weight', (3, 2))], params='7 parameters', outputs=[torch.ones(2, 3) + 1e-7]),
        'config/new': entry,
    }
    problems = '\n'.join(fingerprint.compare(before, changed))
    for expected in (
        'config/gone: only in before',
        'config/new: only in after',
        'keys or shapes differ',
        'parameter count / load report differs',
        'output 0 differs',
    ):
        assert expected in problems


def test_config_dump_comparison_names_every_changed_key():
    dump = _load_tool('analysis/config_dump')
    cfg = dict(optim_wrapper=dict(optimizer=dict(lr=8e-5), clip_grad=dict(max_norm=0.5)), scales=[(1333, 800)])
    before = {'a.py': cfg, 'gone.py': cfg}
    assert dump.compare(before, {'a.py': cfg, 'gone.py': cfg}) == ([], [])
    changed = dict(optim_wrapper=dict(optimizer=dict(lr=1e-4)), scales=[[1333, 800]], table={})
    problems, notes = dump.compare(before, {'a.py': changed, 'new.py': cfg})
    assert problems == [
        'a.py: optim_wrapper.optimizer.lr: 8e-05 -> 0.0001',
        'a.py: optim_wrapper.clip_grad: only before',
        'a.py: scales[0]: (1333, 800) -> [1333, 800]',
        'a.py: table: only after',
        'gone.py: only in before',
        'new.py: only in after',
    ]
    assert notes == []
    problems, notes = dump.compare({'a.py': cfg}, {'a.py': dict(cfg, table={})}, new_tables=['table'])
    assert (problems, notes) == ([], ["new table 'table' in 1 configs"])


def test_model_fingerprint_comparison_accepts_only_the_documented_renaming():
    """Keys and load reports of the numbered layout compare equal under the renaming the backbone
    documents (VVT: norm{n} into the stage; Pale: norm{n} -> norm{n-1}), and only under it."""
    fingerprint = _load_tool('analysis/model_fingerprint')
    outputs = [torch.ones(1)]

    def unprefixed(keys):
        return [(key[len('backbone.') :], shape) for key, shape in keys]

    old_keys = [
        ('backbone.patch_embed1.proj.weight', (8, 3)),
        ('backbone.block1.0.norm1.weight', (8,)),
        ('backbone.norm1.weight', (8,)),
    ]
    before = {
        'config/vvt': dict(keys=old_keys, params=3, outputs=outputs),
        'config/pale': dict(keys=old_keys, params=3, outputs=outputs),
        'load/pale': dict(keys=unprefixed(old_keys), params='fresh: norm1.weight, norm2.bias', outputs=outputs),
    }
    vvt_keys = [
        ('backbone.stages.0.patch_embed.proj.weight', (8, 3)),
        ('backbone.stages.0.blocks.0.norm1.weight', (8,)),
        ('backbone.stages.0.norm.weight', (8,)),
    ]
    pale_keys = vvt_keys[:2] + [('backbone.norm0.weight', (8,))]
    after = {
        'config/vvt': dict(keys=vvt_keys, params=3, outputs=outputs, backbone='VVT', prefix='backbone.'),
        'config/pale': dict(keys=pale_keys, params=3, outputs=outputs, backbone='PaleTransformer', prefix='backbone.'),
        'load/pale': dict(
            keys=unprefixed(pale_keys),
            params='fresh: norm0.weight, norm1.bias',
            outputs=outputs,
            backbone='PaleTransformer',
            prefix='',
        ),
    }
    assert fingerprint.compare(before, after) == []
    swapped = dict(
        after,
        **{
            'config/vvt': dict(after['config/vvt'], keys=pale_keys),
            'load/pale': dict(after['load/pale'], params='fresh: norm1.weight, norm2.bias'),
        },
    )
    problems = '\n'.join(fingerprint.compare(before, swapped))
    assert 'config/vvt: state-dict keys or shapes differ' in problems
    assert 'load/pale: parameter count / load report differs' in problems
