"""Attention micro-benchmark: our attention ops against dense softmax attention.

Each attention runs on ``(B, heads, N, d)`` queries, keys and values of an
``S x S`` token map (``N = S^2``) for a ladder of sides where each step has 4x
the tokens (default 28, 56, 112, 224). Ours, as the backbones call them:

* ``sliding_chunk`` (ViL): window 7, all 8 neighbour chunks, 1 global token, RPB;
* ``long_short`` (ViL-LS): segment 7, dynamic projection of rank 8, 1 global token, RPB;
* ``pale`` (Pale): pale size 7, half the heads on interlaced rows, half on columns;
* ``vicinity`` (VVT): linear attention with the 2-D Manhattan re-weighting;

against ``dense`` (``q k^T -> softmax -> @ v``, ``visattn_mm.ops.common.dense_attention``, the
explicit kernel behind the references) and ``sdpa`` (``torch.nn.functional.scaled_dot_product_attention``).
``dense`` cases whose ``N x N`` fp32 scores would need more than
``--dense-limit-gib`` are skipped with the memory they would need; ``dense`` and
``sdpa`` cases above ``--dense-max-tokens`` are skipped to bound the run time.
Ours run once per attention implementation (``--impls``); the dense ones have ``impl`` ``-``.

Prints and writes ``attention_benchmark.csv`` (every case),
``attention_growth.csv`` (memory and time ratios between consecutive sides:
about 4x for linear growth, 16x for quadratic) and ``attention_benchmark.png``.

Example::

    .venv/bin/python tools/analysis/attention_benchmark.py --sides 28,56,112 --repeats 3
"""

from __future__ import annotations

import argparse
import os.path as osp

import torch
import torch.nn.functional as F

from visattn_mm.analysis import benchmarking as bench
from visattn_mm.ops.common import dense_attention
from visattn_mm.ops.indexing import segment_pad
from visattn_mm.ops.long_short import long_short_attention
from visattn_mm.ops.pale import pale_attention
from visattn_mm.ops.sliding_chunk import sliding_chunk_attention
from visattn_mm.ops.specs import OP_NAMES
from visattn_mm.ops.vicinity import vicinity_attention

WINDOW = 7
DP_RANK = 8
NUM_GLOBAL = 1
OURS = OP_NAMES
DENSE = ('dense', 'sdpa')
# fp32 N x N buffers alive at the peak of the dense path: logits and probabilities
# in forward; plus their gradients in backward.
DENSE_SCORE_COPIES = {'fwd': 2, 'fwd+bwd': 4}
COLUMNS = (
    'attention',
    'impl',
    'mode',
    'dtype',
    'batch',
    'heads',
    'head_dim',
    'side',
    'tokens',
    'time_ms',
    'peak_mem_mib',
    'status',
)
GROWTH_COLUMNS = (
    'attention',
    'impl',
    'mode',
    'dtype',
    'tokens_from',
    'tokens_to',
    'token_ratio',
    'mem_ratio',
    'time_ratio',
)


def _sliding_chunk_extras(batch, heads, head_dim, device):
    w2 = WINDOW * WINDOW
    return dict(
        global_k=torch.randn(batch, heads, NUM_GLOBAL, head_dim, device=device),
        global_v=torch.randn(batch, heads, NUM_GLOBAL, head_dim, device=device),
        local_bias=0.02 * torch.randn(heads, w2, 9 * w2, device=device),
    )


def _long_short_extras(batch, heads, head_dim, device):
    patch = (WINDOW + 2 * segment_pad(WINDOW)) ** 2
    return dict(
        k_bar=torch.randn(batch, heads, DP_RANK, head_dim, device=device),
        v_bar=torch.randn(batch, heads, DP_RANK, head_dim, device=device),
        global_k=torch.randn(batch, heads, NUM_GLOBAL, head_dim, device=device),
        global_v=torch.randn(batch, heads, NUM_GLOBAL, head_dim, device=device),
        local_bias=0.02 * torch.randn(heads, WINDOW * WINDOW, patch, device=device),
    )


def attention_call(name, q, k, v, side, extras):
    """One call of attention ``name`` on an ``side x side`` map."""
    if name == 'sliding_chunk':
        return sliding_chunk_attention(q, k, v, side, side, WINDOW, **extras)
    if name == 'long_short':
        return long_short_attention(q, k, v, side, side, WINDOW, **extras)
    if name == 'pale':
        return pale_attention(q, k, v, side, side, WINDOW)
    if name == 'vicinity':
        return vicinity_attention(q, k, v, side, side)
    if name == 'dense':
        return dense_attention(q, k, v)
    if name == 'sdpa':
        return F.scaled_dot_product_attention(q, k, v, scale=1.0)  # q is pre-scaled
    raise ValueError(f'unknown attention {name!r}')


def make_extras(name, batch, heads, head_dim, device):
    """The op's other inputs (global tokens, projections, biases), random like a trained model's."""
    if name == 'sliding_chunk':
        return _sliding_chunk_extras(batch, heads, head_dim, device)
    if name == 'long_short':
        return _long_short_extras(batch, heads, head_dim, device)
    return {}


def dense_score_gib(batch, heads, tokens, mode):
    """GiB of fp32 ``N x N`` buffers the dense path holds at its peak."""
    return DENSE_SCORE_COPIES[mode] * batch * heads * tokens**2 * 4 / bench.GIB


def case_function(name, q, k, v, side, extras, mode, device, dtype):
    """A no-argument callable running one forward (or forward + backward)."""
    if mode == 'fwd':

        def forward():
            with torch.no_grad(), bench.autocast(device, dtype):
                attention_call(name, q, k, v, side, extras)

        return forward

    def forward_backward():
        with bench.autocast(device, dtype):
            out = attention_call(name, q, k, v, side, extras)
        out.float().mean().backward()
        for t in (q, k, v):
            t.grad = None

    return forward_backward


def run_side(side, args, device, meter, log):
    """All attentions, impls, dtypes and modes at one side; returns their rows."""
    batch, heads, head_dim = args.batch, args.heads, args.head_dim
    tokens = side * side
    scale = head_dim**-0.5
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device) for _ in range(3))
    q = (q * scale).requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    rows = []
    for name in args.attentions:
        extras = make_extras(name, batch, heads, head_dim, device)
        impls = args.impls if name in OURS else [bench.NO_IMPL]
        for dtype in args.dtypes:
            for impl in impls:
                for mode in args.modes:
                    row = dict(
                        attention=name,
                        impl=impl,
                        mode=mode,
                        dtype=dtype,
                        batch=batch,
                        heads=heads,
                        head_dim=head_dim,
                        side=side,
                        tokens=tokens,
                    )
                    need = dense_score_gib(batch, heads, tokens, mode)
                    if name == 'dense' and need > args.dense_limit_gib:
                        row['status'] = f'skipped: would need {need:.3g} GiB'
                    elif name in DENSE and tokens > args.dense_max_tokens:
                        row['status'] = f'skipped: over --dense-max-tokens {args.dense_max_tokens}'
                    else:
                        fn = case_function(name, q, k, v, side, extras, mode, device, dtype)
                        bench.measure_case(row, fn, impl, device, meter, args)
                    log(row)
                    rows.append(row)
    return rows


def growth_rows(rows):
    """Ratios between consecutive measured sides of each (attention, impl, mode, dtype)."""
    series = {}
    for row in rows:
        if row['status'] == 'ok':
            key = (row['attention'], row['impl'], row['mode'], row['dtype'])
            series.setdefault(key, []).append(row)
    growth = []
    for (name, impl, mode, dtype), points in series.items():
        points.sort(key=lambda r: r['tokens'])
        for small, large in zip(points, points[1:]):
            growth.append(
                dict(
                    attention=name,
                    impl=impl,
                    mode=mode,
                    dtype=dtype,
                    tokens_from=small['tokens'],
                    tokens_to=large['tokens'],
                    token_ratio=large['tokens'] / small['tokens'],
                    mem_ratio=(large['peak_mem_mib'] / small['peak_mem_mib'] if small['peak_mem_mib'] else None),
                    time_ratio=large['time_ms'] / small['time_ms'],
                )
            )
    return growth


def plot_rows(rows, path, title):
    """One colour per (attention, impl), one line style per (mode, dtype), over tokens; returns
    whether the PNG was written (``visattn_mm.analysis.benchmarking.plot_growth``)."""
    series = {}
    for row in rows:
        if row['status'] == 'ok':
            label = (f"{row['attention']} {row['impl']}", f"{row['mode']} {row['dtype']}")
            series.setdefault(label, []).append((row['tokens'], row['time_ms'], row['peak_mem_mib']))
    return bench.plot_growth(series, 'tokens N', path, title)


def default_dense_limit_gib(device):
    """Half the memory available now: CUDA free memory, or MemAvailable on CPU."""
    if device.type == 'cuda':
        return torch.cuda.mem_get_info(device)[0] / bench.GIB / 2
    with open('/proc/meminfo') as info:
        for line in info:
            if line.startswith('MemAvailable:'):
                return int(line.split()[1]) * 1024 / bench.GIB / 2
    return 4.0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--attentions', default=','.join(OURS + DENSE))
    parser.add_argument(
        '--sides', default='28,56,112,224', help='map sides S (N = S^2 tokens); use 2x steps for 4x tokens'
    )
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--heads', type=int, default=4, help='even (pale splits the heads)')
    parser.add_argument('--head-dim', type=int, default=32)
    parser.add_argument('--dtypes', default='fp32', help='fp32, bf16, fp16 (autocast)')
    parser.add_argument('--impls', default='math,fast', help='for ours: math, fast, auto, triton (CUDA)')
    parser.add_argument('--modes', default=','.join(bench.MODES))
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    parser.add_argument('--threads', type=int, default=None, help='torch CPU threads')
    parser.add_argument(
        '--dense-limit-gib',
        type=float,
        default=None,
        help='skip dense cases whose N x N scores need more (default: half the memory available)',
    )
    parser.add_argument(
        '--dense-max-tokens',
        type=int,
        default=112 * 112,
        help='skip dense and sdpa cases above this many tokens (their time '
        'grows as N^2; sdpa\'s fused kernels need no N x N memory)',
    )
    parser.add_argument('--out-dir', default='work_dirs/attention_benchmark')
    args = parser.parse_args(argv)
    args.attentions = bench.check_choices(bench.parse_list(args.attentions), OURS + DENSE, '--attentions')
    args.sides = bench.parse_list(args.sides, int, '--sides')
    if min(args.sides) < WINDOW:
        raise SystemExit(f'--sides: every side must be >= the window {WINDOW}')
    if 'pale' in args.attentions and args.heads % 2:
        raise SystemExit(f'--heads {args.heads}: pale attention needs an even number of heads')
    bench.check_run_options(args)
    return args


def main(argv=None):
    args = parse_args(argv)
    device, meter, machine = bench.start_run(args)
    if args.dense_limit_gib is None:
        args.dense_limit_gib = default_dense_limit_gib(device)

    def log(row):
        print(
            f"{row['attention']:>13} {row['impl']:>4} {row['mode']:>7} {row['dtype']:>4} "
            f"N={row['tokens']}: {bench.format_value(row.get('time_ms'))} ms, "
            f"{bench.format_value(row.get('peak_mem_mib'))} MiB {row['status']}",
            flush=True,
        )

    rows = []
    for side in sorted(args.sides):
        rows += run_side(side, args, device, meter, log)
    growth = growth_rows(rows)
    print(f'\n{machine}; {device.type}; median of {args.repeats} after {args.warmup} warm-up\n')
    print(bench.format_table(rows, COLUMNS))
    print('\ngrowth between consecutive sizes (linear: mem_ratio ~ token_ratio)\n')
    print(bench.format_table(growth, GROWTH_COLUMNS))
    paths = [
        osp.join(args.out_dir, name)
        for name in ('attention_benchmark.csv', 'attention_growth.csv', 'attention_benchmark.png')
    ]
    bench.write_csv(rows, COLUMNS, paths[0])
    bench.write_csv(growth, GROWTH_COLUMNS, paths[1])
    if not plot_rows(rows, paths[2], f'attention benchmark ({device.type}): {machine}'):
        paths.pop()
    print(f'\nwrote {", ".join(paths)}')
    return rows, growth


if __name__ == '__main__':
    main()
