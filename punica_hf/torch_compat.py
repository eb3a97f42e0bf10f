"""Every use of torch's non-public API in punica_hf, in one place.

Code elsewhere in the package calls only torch's public API and the names here. Each entry says why no public API
does the job; when torch offers one, the entry is the one place to change.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def mark_static_address(tensor: torch.Tensor) -> None:
    """Tell torch.compile that ``tensor`` keeps its storage for good, so CUDA graphs read it in place instead of
    copying it into the graph's own inputs at every replay (the adapter pool alone can be gigabytes).

    No public name: torch exports this from ``torch._dynamo`` only.
    """
    torch._dynamo.mark_static_address(tensor)


class FollowsModuleMoves(nn.Module):
    """A module whose own tensors that are not parameters or buffers follow ``.to()`` / ``.cuda()`` / ``.half()``.

    Subclasses implement ``after_module_moved(fn)``: it gets the function torch applied to every parameter and
    buffer of the module tree, after the tree moved, and applies it to the tensors they keep elsewhere; and may
    implement ``before_module_moves(fn)``, which can refuse the move (raise) before anything changed.

    No public hook: every such move goes through ``nn.Module._apply`` (torch's register-hooks run per parameter,
    without the function), so it is overridden here.
    """

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        self.before_module_moves(fn)
        super()._apply(fn, recurse)
        self.after_module_moved(fn)
        return self

    def before_module_moves(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        pass

    def after_module_moved(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        raise NotImplementedError


def process_group_store():
    """The key-value store of torch.distributed's default process group (torchrun's rendezvous store), which every
    rank reaches without a collective: a rank reports its failure there while the others may wait in one.

    No public name: ``init_process_group`` keeps the store it made, exported by ``torch.distributed.distributed_c10d``
    only as ``_get_default_store``.
    """
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()
