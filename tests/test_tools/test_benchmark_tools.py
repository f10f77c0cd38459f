"""tools/analysis/benchmark.py and attention_benchmark.py: end to end (their main()) on tiny cases,
the ratio and growth arithmetic on crafted rows, and the peak-memory meter on known
allocations (visattn_mm.analysis.benchmarking, benchmark_backbones)."""

from __future__ import annotations

import csv
import sys

import pytest
import torch

from paths import ROOT
from tool_runs import DET_CONFIG, _load_tool, _run
from visattn_mm import toy_data as toy
from visattn_mm.analysis import benchmark_backbones, benchmarking

ANALYSIS = ROOT / 'tools' / 'analysis'


MIB = 2**20
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


benchmark = _load_tool('analysis/benchmark')
attention_benchmark = _load_tool('analysis/attention_benchmark')
train_throughput = _load_tool('analysis/train_throughput')


def _read_csv(path):
    with open(path, newline='') as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def _assert_png(path):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    height, width, _ = mpimg.imread(path).shape
    assert height > 100 and width > 100


# --- peak memory -------------------------------------------------------------------


@pytest.fixture(scope='module')
def cpu_meter():
    return benchmarking.CpuPeakMemory()


# A block (at most 256 KiB, inside the tolerance) allocated at the end of each measured
# call and kept alive: it sits above the freed blocks in the heap, so glibc cannot hand
# those back by trimming its top, and only the meter's malloc_trim makes their reuse by
# the next call visible (without it, the second heap case reads ~0).
_HEAP_PINS = []


def _measure_touched(meter, block_bytes, count):
    meter.start()
    blocks = [torch.ones(block_bytes // 4) for _ in range(count)]  # ones() touches every page
    _HEAP_PINS.append(torch.ones(min(block_bytes, 256 * 1024) // 4))
    del blocks
    return meter.peak()


@pytest.mark.parametrize(
    'block_bytes, count',
    [
        (256 * MIB, 1),
        (64 * MIB, 1),
        # Twice the same heap-sized blocks: the second must not hide in memory kept from the first.
        (256 * 1024, 200),
        (256 * 1024, 200),
    ],
)
def test_cpu_meter_measures_known_allocations(cpu_meter, block_bytes, count):
    """Within 5% (+4 MiB) in one of three tries: the meter reads the process's resident memory, which the kernel
    may lower meanwhile by dropping mapped library pages when a parallel test worker presses on memory (CI once
    measured 160 of 256 MiB that way; alone, every try is within 1%). A meter that is wrong fails all three."""
    size = block_bytes * count
    measured = []
    for _ in range(3):
        measured.append(_measure_touched(cpu_meter, block_bytes, count))
        if abs(measured[-1] - size) < 0.05 * size + 4 * MIB:
            return
    pytest.fail(f'allocated {size} bytes, measured {measured}')


def test_cpu_meter_sees_nothing_when_nothing_is_allocated(cpu_meter):
    cpu_meter.start()
    assert cpu_meter.peak() < 4 * MIB


@pytest.mark.cuda
def test_cuda_meter_measures_known_allocation():
    meter = benchmarking.CudaPeakMemory(torch.device('cuda'))
    meter.start()
    block = torch.ones(64 * MIB // 4, device='cuda')
    del block
    assert abs(meter.peak() - 64 * MIB) < 2 * MIB


# --- ratios and growth on crafted rows ------------------------------------------------


def test_ratio_columns_use_the_baseline_row_of_the_same_case():
    rows = [
        dict(model='swin-t', size=512, mode='fwd', time_ms=10.0, mem=100.0),
        dict(model='swin-t', size=800, mode='fwd', time_ms=40.0, mem=400.0),
        dict(model='vil-t', size=512, mode='fwd', time_ms=5.0, mem=300.0),
        dict(model='vil-t', size=800, mode='fwd', time_ms=30.0, mem=100.0),
        dict(model='vil-t', size=800, mode='fwd+bwd', time_ms=90.0, mem=500.0),
        dict(model='r50', size=512, mode='fwd', time_ms=None, mem=50.0),
    ]
    benchmarking.add_ratio_columns(rows, 'swin-t', ('size', 'mode'), ('time_ms', 'mem'))
    assert [r['time_ms_vs_swin-t'] for r in rows] == [1.0, 1.0, 0.5, 0.75, None, None]
    assert [r['mem_vs_swin-t'] for r in rows] == [1.0, 1.0, 3.0, 0.25, None, 0.5]


def test_growth_rows_divide_consecutive_sizes():
    def row(tokens, ms, mib, status='ok'):
        return dict(
            attention='vicinity',
            impl='math',
            mode='fwd',
            dtype='fp32',
            tokens=tokens,
            time_ms=ms,
            peak_mem_mib=mib,
            status=status,
        )

    rows = [
        row(3136, 8.0, 40.0),
        row(784, 2.0, 10.0),
        row(196, 1.0, 2.0),
        row(12544, None, None, 'skipped: would need 9.0 GiB'),
    ]
    growth = attention_benchmark.growth_rows(rows)
    assert [(g['tokens_from'], g['tokens_to']) for g in growth] == [(196, 784), (784, 3136)]
    assert [g['mem_ratio'] for g in growth] == [5.0, 4.0]
    assert [g['time_ratio'] for g in growth] == [2.0, 4.0]


def test_dense_memory_estimate_is_the_fp32_score_matrices():
    # 2 fp32 copies of a (1, 4, 4096, 4096) matrix in forward, 4 with backward.
    assert attention_benchmark.dense_score_gib(1, 4, 4096, 'fwd') == 0.5
    assert attention_benchmark.dense_score_gib(1, 4, 4096, 'fwd+bwd') == 1.0


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
    'argv, message',
    [
        (['--sizes', '800by1333'], 'HEIGHTxWIDTH'),
        (['--models', 'vit-b'], '--models'),
        (['--dtypes', 'fp8'], '--dtypes'),
        (['--repeats', '0'], '--repeats'),
        (['--batches', 'two'], '--batches'),
        (['--batches', '2,0'], '--batches: batch sizes must be >= 1'),
        (['--device', 'tpu'], '--device'),
        (['--cuda-graphs'], "CUDA graphs need --device cuda, not 'cpu'"),
        (['--cuda-graphs', '--device', 'cuda', '--warmup', '0'], 'give --warmup 1 or more'),
        (['--cuda-graphs', '--device', 'cuda', '--compile'], 'choose one'),
    ],
)
def test_benchmark_rejects_bad_options(argv, message):
    with pytest.raises(SystemExit, match=message):
        args = benchmark.parse_args(argv)
        benchmarking.resolve_device(args.device)


def test_benchmark_help_lists_the_choices(capsys):
    with pytest.raises(SystemExit):
        benchmark.parse_args(['--help'])
    text = ' '.join(capsys.readouterr().out.split())
    for option, choices in (
        ('--modes', 'any of: fwd, fwd+bwd'),
        ('--batches', 'batch sizes (ints >= 1)'),
        ('--warmup', 'calls before the timed ones, an int >= 0'),
    ):
        assert choices in text.split(f'{option} {option[2:].upper()}', 1)[1], option


def test_attention_benchmark_rejects_odd_heads_for_pale():
    with pytest.raises(SystemExit, match='even'):
        attention_benchmark.parse_args(['--attentions', 'pale', '--heads', '3'])


# --- end to end -----------------------------------------------------------------------


def test_benchmark_end_to_end(tmp_path):
    # Two tiny backbones (a cheaper baseline than Swin-T) keep this fast.
    benchmark.main(
        [
            '--models',
            'vvt-t',
            '--baseline',
            'vil-t',
            '--sizes',
            '64x64',
            '--batches',
            '1',
            '--dtypes',
            'fp32',
            '--impls',
            'math',
            '--warmup',
            '0',
            '--repeats',
            '1',
            '--out-dir',
            str(tmp_path),
        ]
    )
    columns, rows = _read_csv(tmp_path / 'benchmark.csv')
    assert columns == benchmark.columns_for('vil-t')
    # The baseline joins the run by itself, first; each model runs forward and forward+backward.
    assert [(r['model'], r['impl'], r['mode']) for r in rows] == [
        ('vil-t', 'math', 'fwd'),
        ('vil-t', 'math', 'fwd+bwd'),
        ('vvt-t', 'math', 'fwd'),
        ('vvt-t', 'math', 'fwd+bwd'),
    ]
    assert all(r['status'] == 'ok' and float(r['time_ms']) > 0 and float(r['peak_mem_mib']) > 0 for r in rows)
    base = {r['mode']: r for r in rows if r['model'] == 'vil-t'}
    for r in rows:
        for key in ('time_ms', 'peak_mem_mib'):
            # The CSV holds 3 significant digits.
            assert float(r[f'{key}_vs_vil-t']) == pytest.approx(float(r[key]) / float(base[r['mode']][key]), rel=0.01)
    _assert_png(tmp_path / 'benchmark.png')


def test_interrupted_benchmark_writes_the_models_measured(tmp_path, monkeypatch, capsys):
    """A time limit (SIGINT) during the second model keeps the first model's rows and exits with
    an error; without matplotlib the PNG is left out with a line saying so."""
    measure = benchmark.run_model

    def interrupted_at_vvt_t(name, *args):
        if name == 'vvt-t':
            raise KeyboardInterrupt
        return measure(name, *args)

    monkeypatch.setattr(benchmark, 'run_model', interrupted_at_vvt_t)
    monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import raises ImportError
    with pytest.raises(SystemExit, match='interrupted before all cases were measured'):
        benchmark.main(
            [
                '--models',
                'vvt-t',
                '--baseline',
                'vil-t',
                '--sizes',
                '64x64',
                '--batches',
                '1',
                '--dtypes',
                'fp32',
                '--impls',
                'math',
                '--modes',
                'fwd',
                '--warmup',
                '0',
                '--repeats',
                '1',
                '--out-dir',
                str(tmp_path),
            ]
        )
    _, rows = _read_csv(tmp_path / 'benchmark.csv')
    assert [(r['model'], r['status'], r['time_ms_vs_vil-t']) for r in rows] == [('vil-t', 'ok', '1')]
    assert not (tmp_path / 'benchmark.png').exists()
    out = capsys.readouterr().out
    assert 'interrupted: reporting the 1 rows' in out and 'matplotlib cannot be imported' in out


def test_attention_benchmark_end_to_end(tmp_path, capsys):
    # The dense limit lets 49 tokens through (7.2e-5 GiB of scores) and skips 196 (1.1e-3 GiB);
    # sdpa needs no N x N memory and is capped by the token count instead.
    attentions = 'sliding_chunk,vicinity,dense,sdpa'
    attention_benchmark.main(
        [
            '--attentions',
            attentions,
            '--sides',
            '7,14',
            '--impls',
            'math',
            '--modes',
            'fwd',
            '--warmup',
            '0',
            '--repeats',
            '1',
            '--dense-limit-gib',
            '1e-4',
            '--dense-max-tokens',
            '100',
            '--out-dir',
            str(tmp_path),
        ]
    )
    columns, rows = _read_csv(tmp_path / 'attention_benchmark.csv')
    assert columns == list(attention_benchmark.COLUMNS)
    status = {(r['attention'], int(r['tokens'])): r['status'] for r in rows}
    assert status.pop(('dense', 196)) == 'skipped: would need 0.00114 GiB'
    assert status.pop(('sdpa', 196)) == 'skipped: over --dense-max-tokens 100'
    assert set(status.values()) == {'ok'} and len(status) == 6
    columns, growth = _read_csv(tmp_path / 'attention_growth.csv')
    assert columns == list(attention_benchmark.GROWTH_COLUMNS)
    assert [g['attention'] for g in growth] == [a for a in attentions.split(',') if a in attention_benchmark.OURS]
    assert all(float(g['token_ratio']) == 4 and float(g['mem_ratio']) > 0 for g in growth)
    assert 'skipped: would need' in capsys.readouterr().out
    _assert_png(tmp_path / 'attention_benchmark.png')


def test_baselines_come_from_timm_and_torchvision_without_mmdet(monkeypatch, capsys):
    """Same architectures (parameter counts within 0.1%), any input size, four maps at
    strides 4-32, and a line saying where they came from."""
    with_mmdet = {
        name: sum(p.numel() for p in benchmark_backbones.MODEL_ZOO[name][0]().parameters())
        for name in ('swin-t', 'r50')
    }
    monkeypatch.setitem(sys.modules, 'mmdet.models.backbones', None)  # import raises ImportError
    for name, source in (('swin-t', 'timm'), ('r50', 'torchvision')):
        model = benchmark_backbones.MODEL_ZOO[name][0]()
        assert f'built from {source}' in capsys.readouterr().out
        params = sum(p.numel() for p in model.parameters())
        assert params == pytest.approx(with_mmdet[name], rel=1e-3)
        outputs = model(torch.randn(1, 3, 70, 90))
        if name == 'r50':  # torchvision's extractor: a dict of NCHW maps
            sizes = [tuple(o.shape[2:]) for o in outputs.values()]
        else:  # timm's Swin: NHWC maps
            sizes = [tuple(o.shape[1:3]) for o in outputs]
        assert sizes == [(18, 23), (9, 12), (5, 6), (3, 3)]
        benchmark_backbones.backbone_loss(model(torch.randn(1, 3, 70, 90))).backward()


# --- training throughput ----------------------------------------------------------------


def test_swin_t_baseline_is_prepared_for_toy_data(tmp_path):
    """mmdet's own Swin-T config, as the tool changes it: toy data, no ImageNet weights, AMP."""
    cfg = train_throughput.load_config(train_throughput.SWIN_T_CONFIG)
    args = train_throughput.parse_args(['x.py', '--batch', '3', '--iters', '4', '--warmup', '1'])
    train_throughput.prepare_config(cfg, tmp_path / 'toy', 'fp16', args, str(tmp_path / 'work'))
    assert cfg.model.backbone.type == 'SwinTransformer' and cfg.model.backbone.init_cfg is None
    assert cfg.model.roi_head.bbox_head.num_classes == cfg.model.roi_head.mask_head.num_classes == 3
    dataset = cfg.train_dataloader.dataset
    assert dataset.data_root == f'{tmp_path}/toy/' and dataset.metainfo.classes == toy.COCO_CLASSES
    assert cfg.train_dataloader.batch_size == 3 and cfg.train_cfg.max_iters == 5
    assert cfg.val_cfg is None and cfg.default_hooks.checkpoint is None
    assert (cfg.optim_wrapper.type, cfg.optim_wrapper.dtype) == ('AmpOptimWrapper', 'float16')


def test_upernet_swin_t_baseline_is_prepared_for_toy_ade20k(tmp_path):
    """mmseg configs are measured against mmseg's own UperNet Swin-T, on the ADE20K layout."""
    assert train_throughput.library_of(['configs/upernet_vil_t_160k_ade20k.py']) == 'mmseg'
    cfg = train_throughput.load_config(train_throughput.BASELINES['mmseg'])
    args = train_throughput.parse_args(['x.py', '--batch', '2', '--dtypes', 'fp32'])
    train_throughput.prepare_config(cfg, tmp_path / 'toy', 'fp32', args, str(tmp_path / 'work'))
    assert cfg.model.backbone.type == 'SwinTransformer' and cfg.model.backbone.init_cfg is None
    assert cfg.model.decode_head.num_classes == cfg.model.auxiliary_head.num_classes == len(toy.ADE_CLASSES)
    assert cfg.train_dataloader.dataset.data_root == f'{tmp_path}/toy/'


def test_train_throughput_refuses_configs_of_two_libraries():
    with pytest.raises(SystemExit, match='one library per run') as error:
        train_throughput.library_of(['configs/maskrcnn_vil_t_1x.py', 'configs/upernet_vil_t_160k_ade20k.py'])
    assert 'maskrcnn_vil_t_1x.py: mmdet' in str(error.value) and 'upernet_vil_t_160k_ade20k.py: mmseg' in str(
        error.value
    )


def test_train_throughput_end_to_end(tmp_path):
    """Two tiny detectors (a cheap stand-in for the Swin-T baseline), 1 + 1 iterations each."""
    data = toy.make_coco_instances(tmp_path / 'toy', num_train=4, num_val=1, image_size=(64, 96))
    configs = []
    for name, channels in (('tiny_a', 16), ('tiny_b', 8)):
        text = DET_CONFIG.format(data_root=data, classes=toy.COCO_CLASSES)
        configs.append(tmp_path / f'{name}.py')
        configs[-1].write_text(
            text.replace('base_channels=16', f'base_channels={channels}').replace(
                'in_channels=[16, 32, 64, 128]', f'in_channels={[channels * 2**i for i in range(4)]}'
            )
        )
    # A subprocess: the Runners it builds leave no default scope behind for later tests.
    _run(
        [
            sys.executable,
            str(ANALYSIS / 'train_throughput.py'),
            str(configs[0]),
            '--baseline',
            str(configs[1]),
            '--data-root',
            str(data),
            '--image-size',
            '64x96',
            '--batch',
            '2',
            '--warmup',
            '1',
            '--iters',
            '1',
            '--workers',
            '0',
            '--out-dir',
            str(tmp_path / 'out'),
        ],
        cwd=tmp_path,
    )
    columns, rows = _read_csv(tmp_path / 'out' / 'train_throughput.csv')
    assert columns == list(train_throughput.COLUMNS)
    assert [r['config'] for r in rows] == ['tiny_b', 'tiny_a']  # the baseline first
    for row in rows:
        assert row['status'] == 'ok' and row['iters'] == '1', row  # warm-up not timed
        assert float(row['images_per_s']) == pytest.approx(2e3 / float(row['step_ms']), rel=0.01)
        assert float(row['peak_mem_mib']) > 0
    baseline, measured = rows
    assert float(baseline['images_per_s_vs_baseline']) == 1.0
    assert float(measured['images_per_s_vs_baseline']) == pytest.approx(
        float(measured['images_per_s']) / float(baseline['images_per_s']), rel=0.01
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason='the refusal concerns machines without a GPU')
def test_train_throughput_refuses_amp_without_gpu():
    with pytest.raises(SystemExit, match='needs a GPU'):
        train_throughput.parse_args(['x.py', '--dtypes', 'fp32,fp16'])


def test_vvt_bf16_variants_build_vvt_with_bf16_products():
    """``vvt-<arch>-bf16`` is VVT of that arch with ``bf16_products=True``: the bf16 rows measure
    what the opt-in costs, the plain name fp32 products."""
    from visattn_mm.models.vvt import VicinityAttention

    plain, bf16 = (benchmark_backbones.MODEL_ZOO[name][0]() for name in ('vvt-t', 'vvt-t-bf16'))
    flags = [{m.bf16_products for m in model.modules() if isinstance(m, VicinityAttention)} for model in (plain, bf16)]
    assert flags == [{False}, {True}]
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in bf16.parameters())


def test_vvt_fused_variants_build_vvt_with_fused_conv_gelu_and_stay_out_of_all():
    """``vvt-<arch>-fused`` is VVT of that arch with ``fused_conv_gelu=True`` (the same parameters); its kernels run
    on CUDA only, so ``--models all`` (on the CPU by default) leaves it out."""
    from visattn_mm.models.vvt import ConvMlp

    plain, fused = (benchmark_backbones.MODEL_ZOO[name][0]() for name in ('vvt-t', 'vvt-t-fused'))
    flags = [{m.fused_conv_gelu for m in model.modules() if isinstance(m, ConvMlp)} for model in (plain, fused)]
    assert flags == [{False}, {True}]
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in fused.parameters())
    models = benchmark.parse_args(['--sizes', '64x64']).grids[0].models
    assert 'vvt-t' in models and 'vvt-t-bf16' in models and not any(name.endswith('-fused') for name in models)


def test_compile_option_names_the_compiled_rows_and_compiles_swin_blocks():
    """``--compile``: models and baseline named ``+compile``; ours built with ``compile_blocks``, each of
    Swin-T's 12 blocks behind its own compiled runner; r50 refused with the fix."""
    args = benchmark.parse_args(['--compile', '--models', 'vil-t', '--sizes', '64x64'])
    assert args.baseline == 'swin-t+compile'
    assert args.grids[0].models == ['swin-t+compile', 'vil-t+compile']
    assert benchmark.build_model('vil-t+compile').block_compiler is not None
    assert benchmark.build_model('vil-t').block_compiler is None
    swin = benchmark.compile_baseline_blocks(benchmark_backbones._timm_swin_t(), 'swin-t')
    wrapped = [m for m in swin.modules() if isinstance(m, benchmark.CompiledBlock)]
    assert len(wrapped) == 12 and len(wrapped[0].compiler.runners) == 12
    with pytest.raises(SystemExit, match='r50 has no compiled variant'):
        benchmark.parse_args(['--compile', '--models', 'r50'])


def test_cuda_graphs_option_names_the_graphed_rows():
    args = benchmark.parse_args(['--cuda-graphs', '--device', 'cuda', '--models', 'vil-t', '--sizes', '64x64'])
    assert args.baseline == 'swin-t+graphs'
    assert args.grids[0].models == ['swin-t+graphs', 'vil-t+graphs']
    assert type(benchmark.build_model('vil-t+graphs')) is type(benchmark.build_model('vil-t'))


GRAPHED_CASES = [(name, impl) for name in ('vil-t', 'vil-ls-t', 'pale-t', 'vvt-t') for impl in ('fast', 'triton')]


@pytest.mark.cuda
@pytest.mark.parametrize('name,impl', [*GRAPHED_CASES, ('swin-t', 'fast')])
def test_captured_training_step_replays_what_the_eager_step_computes(name, impl):
    """A bf16 forward + backward captured as a CUDA graph (benchmark.py --cuda-graphs): each replay gives
    the eager step's parameter gradients (to the atomics' last bits) and allocates nothing; the capture's
    peak is the eager step's to within the graph's bookkeeping."""
    from visattn_mm.ops import attention_impl

    torch.manual_seed(0)
    model = benchmark_backbones.build_backbone(name).cuda()
    for module in model.modules():  # stochastic depth draws differ between the two runs
        if hasattr(module, 'drop_prob'):
            module.drop_prob = 0.0
    images = torch.randn(2, 3, 96, 128, device='cuda')
    device, meter = torch.device('cuda'), benchmarking.CudaPeakMemory(torch.device('cuda'))

    def gradients(step):
        step()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def keeping_grads(cache_casts):
        # The case's step without its zero_grad, so the gradients stay readable.
        def step():
            model.zero_grad(set_to_none=False)
            with benchmarking.autocast(device, 'bf16', cache_casts):
                loss = benchmark_backbones.backbone_loss(model(images))
            loss.backward()

        return step

    with attention_impl(impl):
        model.train()
        meter.start()
        eager = gradients(keeping_grads(True))
        eager_peak = meter.peak()
        captured = benchmarking.CapturedStep(keeping_grads(False), meter)
        replayed = gradients(captured)
        meter.start()
        captured()
        assert meter.peak() < benchmarking.MIB  # a replay allocates nothing
        again = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(eager) == len(replayed) == len(again) > 0
    for expected, got, second in zip(eager, replayed, again):
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=1e-3)
        torch.testing.assert_close(second, got, rtol=2e-2, atol=1e-3)
    assert 0.5 * eager_peak < captured.capture_peak < 2 * eager_peak
