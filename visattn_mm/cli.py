"""Shared plumbing of the command-line tools (``tools/train.py``, ``tools/test.py``, the deploy
and analysis tools), in the package so that every tool imports it without editing ``sys.path``.

Both tools accept mmdet (``default_scope='mmdet'``) and mmseg
(``default_scope='mmseg'``) configs; the helpers here pick the library from
the config, register its modules and apply the library-specific conventions.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import os
import os.path as osp
import re
import sys

from mmengine.config import Config

SUPPORTED_SCOPES = ('mmdet', 'mmseg')


def import_plugin() -> None:
    """Import visattn_mm, before the config is read, so that config-dependent registrations exist.

    mmengine checkpoints load through the package's own reads (``visattn_mm.compat``), so the process's
    weights-only allowlist stays as it is.
    """
    import visattn_mm  # noqa: F401


def load_config(path: str, cfg_options: dict | None, launcher: str) -> Config:
    """Read a config file and apply ``--cfg-options`` and ``--launcher``."""
    cfg = Config.fromfile(path)
    cfg.launcher = launcher
    if cfg_options:
        cfg.merge_from_dict(cfg_options)
    return cfg


def register_scope_modules(cfg: Config) -> str:
    """Register the modules of the library named by ``cfg.default_scope``.

    Returns:
        The scope, ``'mmdet'`` or ``'mmseg'``.

    Raises:
        SystemExit: If the config names no supported scope.
    """
    scope = cfg.get('default_scope')
    if scope == 'mmdet':
        from mmdet.utils import register_all_modules
    elif scope == 'mmseg':
        from mmseg.utils import register_all_modules
    else:
        raise SystemExit(
            f"config sets default_scope={scope!r}; these tools need 'mmdet' or "
            "'mmseg' (inherit the library's _base_/default_runtime.py)."
        )
    # The Runner sets the default scope itself from cfg.default_scope.
    register_all_modules(init_default_scope=False)
    return scope


def set_work_dir(cfg: Config, cli_work_dir: str | None, config_path: str) -> None:
    """Work dir priority: ``--work-dir`` > ``cfg.work_dir`` > work_dirs/<stem>."""
    if cli_work_dir is not None:
        cfg.work_dir = cli_work_dir
    elif cfg.get('work_dir') is None:
        stem = osp.splitext(osp.basename(config_path))[0]
        cfg.work_dir = osp.join('./work_dirs', stem)


def has_accelerator() -> bool:
    """True if mmengine would place the model on a non-CPU device."""
    from mmengine.device import get_device

    return get_device() != 'cpu'


AMP_NEEDS_ACCELERATOR = (
    "mixed precision needs a GPU (or NPU/MLU/MUSA): mmengine's AmpOptimWrapper does not support CPU "
    'training. Run without --amp (and without optim_wrapper.type=AmpOptimWrapper) on this machine.'
)
DATA_DOCS = 'docs/training.md#data-layout'


def check_amp_device(cfg: Config) -> None:
    """Refuse an ``AmpOptimWrapper`` (from ``--amp`` or ``--cfg-options``) where only a CPU is there, in one
    line, before mmengine's bare ``AssertionError`` after the whole config dump."""
    if cfg.get('optim_wrapper', {}).get('type') == 'AmpOptimWrapper' and not has_accelerator():
        raise SystemExit(f'error: {AMP_NEEDS_ACCELERATOR}')


def _datasets(node):
    """The dataset configs inside a dataloader's ``dataset`` (wrappers such as RepeatDataset included)."""
    if not isinstance(node, dict):
        return
    yield node
    yield from _datasets(node.get('dataset'))
    for child in node.get('datasets') or ():
        yield from _datasets(child)


def _join(root, path):
    return path if not root or osp.isabs(path) else osp.join(root, path)


def missing_data(cfg: Config, parts) -> list:
    """``'<part>: <path> (<field>)'`` for each annotation file, image folder and evaluator annotation
    file that ``parts`` of ``cfg`` (e.g. ``('train_dataloader', 'val_dataloader', 'val_evaluator')``)
    name and that does not exist (data_root applied as mmengine's datasets apply it)."""
    missing = []
    for part in parts:
        node = cfg.get(part)
        if part.endswith('_evaluator'):
            for evaluator in node if isinstance(node, (list, tuple)) else [node]:
                path = evaluator.get('ann_file') if isinstance(evaluator, dict) else None
                if isinstance(path, str) and not osp.exists(path):
                    missing.append(f'{part}: {path} (ann_file)')
            continue
        for dataset in _datasets((node or {}).get('dataset')):
            root = dataset.get('data_root') or ''
            paths = {'ann_file': dataset.get('ann_file')}
            paths.update((f'data_prefix.{key}', value) for key, value in (dataset.get('data_prefix') or {}).items())
            for field, path in paths.items():
                if isinstance(path, str) and path and not osp.exists(_join(root, path)):
                    missing.append(f'{part}: {_join(root, path)} ({field})')
    return missing


def check_data(cfg: Config, parts) -> None:
    """Refuse, in one line before the Runner starts, a config whose ``parts`` name data files that are not
    there, naming every one of them (see :func:`missing_data`)."""
    missing = missing_data(cfg, parts)
    if missing:
        others = f', nor do {", ".join(missing[1:])}' if len(missing) > 1 else ''
        raise SystemExit(
            f'error: {missing[0]} does not exist{others}; {DATA_DOCS} says where the data goes and how to '
            'point a config elsewhere (--cfg-options ...data_root=...)'
        )


_UNEXPECTED_ARGUMENT = re.compile(r"unexpected keyword argument '(\w+)'")


def _typed_nodes(node, path):
    """``(path, dict)`` for every dict with a ``type`` in a config node, the node included, outermost first."""
    if isinstance(node, dict):
        if 'type' in node:
            yield path, node
        for key, child in node.items():
            yield from _typed_nodes(child, f'{path}.{key}')
    elif isinstance(node, (list, tuple)):
        for index, child in enumerate(node):
            yield from _typed_nodes(child, f'{path}.{index}')


def _type_name(type_):
    """The class name a config's ``type`` names (a scope prefix such as ``mmdet.`` dropped)."""
    return type_.__name__ if isinstance(type_, type) else str(type_).rsplit('.', 1)[-1]


def _init_arguments(cls) -> list:
    """The keyword arguments ``cls(...)`` accepts: its ``__init__``'s and, while an ``__init__`` passes
    ``**kwargs`` on, its bases'."""
    names = []
    for klass in cls.__mro__:
        init = klass.__dict__.get('__init__')
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names += [
            p.name
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != 'self' and p.name not in names
        ]
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return names


def _failed_build(error: Exception):
    """The config and class of the innermost registry build (mmengine's ``build_from_cfg``) that ``error``
    went through, from its traceback; ``(None, None)`` if none."""
    failed = (None, None)
    frame_tb = error.__traceback__
    while frame_tb is not None:
        code = frame_tb.tb_frame.f_code
        if code.co_name == 'build_from_cfg' and code.co_filename.endswith(osp.join('registry', 'build_functions.py')):
            local = frame_tb.tb_frame.f_locals
            failed = (local.get('cfg'), local.get('obj_cls'))
        frame_tb = frame_tb.tb_next
    return failed


def describe_build_error(model: dict, error: Exception) -> str:
    """One line naming the config key of a model build's ``error`` and the problem, e.g.
    ``model.neck.out_channel: FPN.__init__() got an unexpected keyword argument 'out_channel' (did you
    mean out_channels?)``.

    The failing node is the config of the innermost registry build in the error's traceback; the
    model's node of its type whose entries it holds (a parent module may add some, such as
    ``train_cfg``) names the key.

    Args:
        model (dict): The config's ``model``.
        error (Exception): What building it raised.

    Returns:
        str: The line, without the ``error:`` prefix.
    """
    reason = str(error.args[0]) if error.args else type(error).__name__
    if isinstance(error, KeyError) and len(reason) > 1 and reason[0] == reason[-1] == "'":
        reason = reason[1:-1]  # str() of a KeyError quotes its message
    built, cls = _failed_build(error)
    if not isinstance(built, dict) or 'type' not in built:
        return f'model: {reason}'
    name = _type_name(built['type'])
    nodes = [(path, node) for path, node in _typed_nodes(model, 'model') if _type_name(node['type']) == name]
    nodes = [(path, node) for path, node in nodes if all(built.get(k) == v for k, v in node.items())] or nodes
    if not nodes:
        return f'model ({name}): {reason}'
    argument = _UNEXPECTED_ARGUMENT.search(reason)
    if argument:
        nodes = [(path, node) for path, node in nodes if argument.group(1) in node] or nodes
        accepted = _init_arguments(cls) if isinstance(cls, type) else []
        close = difflib.get_close_matches(argument.group(1), accepted, n=1)
        hint = f'did you mean {close[0]}?' if close else f'{name} takes {", ".join(accepted)}'
        return f'{nodes[0][0]}.{argument.group(1)}: {reason} ({hint})'
    paths = ' or '.join(path for path, _ in nodes)
    return f'{paths}: {reason}' if reason.startswith(name) else f'{paths} ({name}): {reason}'


def check_model(cfg: Config, scope: str) -> None:
    """Build the config's whole model (backbone, neck, heads) on the meta device before the Runner starts,
    so that a bad argument anywhere in it (``model.neck.out_channel=128``, ``arch='smal'``) ends the run
    in one line naming the key, before the data is read and the config dumped.

    Errors that only the meta device causes (a constructor that reads a tensor's values) leave the
    verdict to the Runner's own build.

    Args:
        cfg (Config): The config, with ``--cfg-options`` applied.
        scope (str): ``'mmdet'`` or ``'mmseg'``: the default scope to build it under, whose model registry builds it.

    Raises:
        SystemExit: If building the model raises a ValueError, TypeError, KeyError or AssertionError.
    """
    import logging
    import warnings

    import torch
    from mmengine.logging import MMLogger
    from mmengine.registry import MODELS, DefaultScope

    model = cfg.get('model')
    if not isinstance(model, dict):
        return
    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)  # the build's log lines come with the Runner's build
    try:
        # The scope as the Runner sets it: the root registry builds from the scope's library (mmdet's or
        # mmseg's), as do the modules that build their parts through mmengine's registry.
        with torch.device('meta'), warnings.catch_warnings(), DefaultScope.overwrite_default_scope(scope):
            warnings.simplefilter('ignore')  # the Runner's build gives them
            MODELS.build(model)
    except (ValueError, TypeError, KeyError, AssertionError) as error:
        raise SystemExit(f'error: {describe_build_error(model, error)}') from None
    except Exception:  # a meta-device limitation, not a config error: the Runner's build decides
        return
    finally:
        logger.setLevel(level)


def prepare_cpu_distributed(cfg: Config) -> None:
    """Make a distributed launch work on a machine without an accelerator.

    mmengine 0.10.7's ``init_dist`` always calls ``torch.cuda.set_device``
    (fatal without a GPU) and the Runner passes ``device_ids=[LOCAL_RANK]``
    to DDP (rejected for CPU modules). So, on CPU only, this switches the
    backend to gloo, initialises the process group here (the Runner then
    skips its own ``init_dist``), and builds DDP with ``device_ids=None``.
    """
    if cfg.launcher == 'none' or has_accelerator():
        return
    if cfg.launcher != 'pytorch':
        raise SystemExit(
            f'--launcher {cfg.launcher} without a GPU is not supported; use '
            '--launcher pytorch (tools/dist_train.sh) for CPU runs.'
        )
    import datetime

    import torch.distributed as dist

    if cfg.get('env_cfg') is None:
        cfg.env_cfg = dict()
    env_cfg = cfg.env_cfg
    dist_cfg = dict(env_cfg.get('dist_cfg') or {})
    if dist_cfg.get('backend', 'nccl') != 'gloo' and os.environ.get('RANK', '0') == '0':
        print(
            f"[visattn_mm] no GPU: using backend 'gloo' instead of {dist_cfg.get('backend', 'nccl')!r}", file=sys.stderr
        )
    dist_cfg['backend'] = 'gloo'
    env_cfg['dist_cfg'] = dist_cfg
    if not dist.is_initialized():
        kwargs = {k: v for k, v in dist_cfg.items() if k != 'backend'}
        if 'timeout' in kwargs:  # seconds in configs, timedelta for torch
            kwargs['timeout'] = datetime.timedelta(seconds=kwargs['timeout'])
        dist.init_process_group(backend='gloo', **kwargs)

    wrapper = cfg.get('model_wrapper_cfg')
    if wrapper is None:
        # Same defaults as the Runner's built-in DDP wrapper, minus device_ids.
        cfg.model_wrapper_cfg = dict(
            type='MMDistributedDataParallel',
            broadcast_buffers=False,
            find_unused_parameters=cfg.get('find_unused_parameters', False),
            device_ids=None,
        )
    elif _is_ddp_type(wrapper.get('type', 'MMDistributedDataParallel')):
        # Explicit config values win over the Runner's default_args.
        wrapper.setdefault('device_ids', None)


def finish_distributed() -> None:
    """End a distributed run so that every rank exits with status 0.

    mmengine never destroys the process group, so every rank first waits at
    a barrier and tears the group down. On the CPU (gloo) path that is not
    enough: about one run in twenty, a rank that has finished its work still
    aborts in C++ static destruction at interpreter exit ("terminate called
    without an active exception", no Python frame), and torchrun reports the
    run as failed. Those ranks leave through ``os._exit`` once logs and
    streams are flushed; there is nothing left to finalise at that point.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    cpu_gloo = dist.get_backend() == 'gloo' and not has_accelerator()
    dist.barrier()
    dist.destroy_process_group()
    if cpu_gloo:
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _is_ddp_type(wrapper_type) -> bool:
    """Whether the Runner would pass ``device_ids`` to this model wrapper."""
    from mmengine.registry import MODEL_WRAPPERS
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(wrapper_type, str):
        wrapper_type = MODEL_WRAPPERS.get(wrapper_type)
    return isinstance(wrapper_type, type) and issubclass(wrapper_type, DistributedDataParallel)


def build_runner(cfg: Config):
    """Build ``cfg.runner_type`` from the registry, by default ``CheckpointPolicyRunner``.

    That Runner loads ``load_from``, the checkpoint of tools/test.py and ``--resume``
    under the plugin's checkpoint policy (see ``visattn_mm.checkpoint.policy``).
    """
    from mmengine.registry import RUNNERS

    if 'runner_type' not in cfg:
        cfg.runner_type = 'CheckpointPolicyRunner'
    return RUNNERS.build(cfg)


@contextlib.contextmanager
def exit_on_checkpoint_error():
    """A refused or unreadable checkpoint inside the block ends the process with its message.

    Those errors name the file, the problem and the fix, so a traceback would
    only hide them; the exit status is 1.
    """
    from visattn_mm.checkpoint import CheckpointError

    try:
        yield
    except CheckpointError as err:
        raise SystemExit(f'error: {err}') from None


def keep_config_in_log_dir(runner) -> None:
    """Copy the config the Runner dumped into this run's timestamped log dir.

    mmengine writes ``work_dir/<config name>.py`` for every run, so resuming
    in the same work dir overwrites the first run's copy; the copy next to
    each run's log keeps every run's exact settings.
    """
    from mmengine.dist import is_main_process

    name = osp.basename(runner.cfg.filename) if runner.cfg.filename else f'{runner.timestamp}.py'
    dumped = osp.join(runner.work_dir, name)
    if is_main_process() and osp.isfile(dumped):
        import shutil

        shutil.copy2(dumped, osp.join(runner.log_dir, name))


def set_local_rank_env(local_rank: int) -> None:
    """Export ``--local-rank`` for launchers that pass it as an argument."""
    os.environ.setdefault('LOCAL_RANK', str(local_rank))
