"""What a model declares so that checkpoints of other layouts and sizes load into it.

A model that subclasses :class:`CheckpointProtocol` is asked, by type and not by
probing for attributes, three things:

* ``checkpoint_filter(state_dict, target_keys, report)``: a plain function
  converting an official layout to ours (timm's ``checkpoint_filter_fn``);
* ``derived_tensors``: names of tensors rebuilt from the config (index buffers),
  dropped wherever a checkpoint carries them;
* ``resize_checkpoint_tensor(key, value, target_shape)``: the one place a tensor
  of another size (a position table) is fitted to the model.

:meth:`CheckpointProtocol.adapt_state_dict` applies the last two. The loader calls it
before matching shapes, and every backbone also runs it as a load-state-dict pre-hook
(mmengine's ``load_from`` and resume, plain ``load_state_dict``). A tensor already
fitted by the loader has the model's shape when the hook sees it, so each table is
resized exactly once.
"""


class CheckpointProtocol:
    """Mixin of models whose checkpoints may need converting or resizing (defaults: neither)."""

    #: Last components of tensor names rebuilt from the config, never loaded.
    derived_tensors = ()

    def checkpoint_filter(self, state_dict, target_keys, report):
        """Convert ``state_dict`` to this model's layout (default: unchanged).

        Args:
            state_dict (dict): Checkpoint tensors, unwrapped.
            target_keys (set[str]): This model's state-dict keys.
            report (LoadReport): Notes the layout and what was converted or dropped.

        Returns:
            dict: The tensors under this model's names.
        """
        return dict(state_dict)

    def resize_checkpoint_tensor(self, key, value, target_shape):
        """``value`` fitted to ``target_shape``, or None if it cannot be (default: never).

        Args:
            key (str): The tensor's name in this model.
            value (Tensor): The checkpoint's tensor, of another shape.
            target_shape (torch.Size): This model's shape.

        Raises:
            ValueError: Where a resize would silently mean something else.
        """
        return None

    def adapt_state_dict(self, state_dict, prefix='', report=None):
        """Drop derived tensors and resize tensors of another size under ``prefix``, in place.

        Args:
            state_dict (dict): Checkpoint tensors, keyed as in the model holding this one.
            prefix (str): This model's prefix in ``state_dict`` (e.g. ``'backbone.'``).
            report (LoadReport, optional): Resizes are noted in ``report.resized``.
        """
        own = None
        for key in [k for k in state_dict if k.startswith(prefix)]:
            local = key[len(prefix) :]
            if local.rsplit('.', 1)[-1] in self.derived_tensors:
                del state_dict[key]
                if report is not None:
                    report.dropped[key] = 'derived tensor (rebuilt from the config)'
                continue
            own = self.state_dict() if own is None else own
            if local not in own or state_dict[key].shape == own[local].shape:
                continue
            resized = self.resize_checkpoint_tensor(local, state_dict[key], own[local].shape)
            if resized is not None:
                if report is not None:
                    report.resized[key] = (tuple(state_dict[key].shape), tuple(resized.shape))
                state_dict[key] = resized
