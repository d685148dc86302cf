"""Running on several processes: ``torchrun`` support for the chapters and :func:`~sphereml.train.fit`.

``torchrun --nproc_per_node=G script.py`` starts G copies of a script with ``RANK``, ``LOCAL_RANK`` and
``WORLD_SIZE`` set.  :func:`init_from_env` turns that into a process group (NCCL when CUDA is there, gloo
otherwise) and gives each process its own GPU; :class:`~sphereml.book.chapter.Chapter` calls it, so a chapter
exported as a script runs unchanged under ``torchrun``: ``fit`` then splits every batch over the processes
(Note [data parallel fit]) and only rank 0 writes metrics and figures.

Note [data parallel fit]
    Every rank draws the same data order and takes its share (``rank::world``) of each global batch of
    ``batch_size`` samples.  It back-propagates its share of the batch's mean loss (its mean loss times
    its fraction of the batch) plus 1 / world of the regulariser, and the gradients are summed over the
    ranks: each step uses exactly the gradient that one process computes on the whole batch (up to the
    order of the sums), so the regularisers, the OPT parametrisations and the optimiser states need
    nothing special.  It is the all-reduce ``DistributedDataParallel`` performs, done once per step after
    the backward pass, so any ``loss_fn`` (margin heads included) works unchanged; a model the caller has
    already wrapped in ``DistributedDataParallel`` is left to it.  Buffers (BatchNorm's running
    statistics, the decoupled layers' E{||x||}) are broadcast from rank 0 after every step; batch
    statistics are per rank, so a network with BatchNorm matches one process only with
    ``nn.SyncBatchNorm``, and the running statistics kept (BatchNorm's, E{||x||}) are those of rank 0's
    share of each batch.  The history holds the whole batch's losses and accuracy, while ``callbacks``
    see this rank's own loss.  Rank 0 writes the checkpoint and every rank resumes from it (across
    machines it must be on a shared file system).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["init_from_env", "is_distributed", "rank", "world_size", "is_main_process", "local_device", "barrier",
           "sum_gradients", "broadcast_from_rank0", "merge_batch_records"]


def is_distributed() -> bool:
    """True inside an initialised process group of more than one process."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0, or the only process: the one that writes files."""
    return rank() == 0


def _gpu_per_rank() -> bool:
    """Whether each of this machine's ranks can have a GPU of its own (else they share the CPU, with gloo)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    return torch.cuda.is_available() and ranks <= torch.cuda.device_count()


def local_device() -> torch.device:
    """This process's GPU under ``torchrun`` (``cuda:LOCAL_RANK``; the CPU when there are more ranks than GPUs),
    else the default CUDA device or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if "LOCAL_RANK" in os.environ:
        return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if _gpu_per_rank() else torch.device("cpu")
    return torch.device("cuda")


def init_from_env(backend: str | None = None) -> bool:
    """Initialise the default process group from ``torchrun``'s environment, once; True if distributed.

    Does nothing (and returns False) when ``WORLD_SIZE`` is absent or 1, so the same code runs alone.

    Args:
        backend (str, optional): ``"nccl"`` or ``"gloo"``; default NCCL when every rank has a GPU of its own.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_initialized():
        if _gpu_per_rank():
            torch.cuda.set_device(local_device())
        dist.init_process_group(backend or ("nccl" if _gpu_per_rank() else "gloo"))
    return is_distributed()


def barrier() -> None:
    """Wait for every rank (nothing to wait for when alone)."""
    if is_distributed():
        dist.barrier()


def sum_gradients(params: list[Tensor]) -> None:
    """Sum every gradient over the ranks in one flat all-reduce.  A gradient missing on a rank counts as zero;
    one missing on every rank stays missing (None), as it would in one process, so that weight decay and
    momentum leave that parameter alone."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    present = torch.tensor([float(p.grad is not None) for p in params], dtype=grads[0].dtype, device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [present])  # one collective for both
    dist.all_reduce(flat)
    anywhere = (flat[-len(params):] > 0).tolist()
    for p, chunk, has in zip(params, flat[:-len(params)].split([g.numel() for g in grads]), anywhere):
        p.grad = chunk.view_as(p).clone() if has else None


def broadcast_from_rank0(model: nn.Module, parameters: bool = False) -> None:
    """Rank 0's buffers (and, with ``parameters``, its weights) on every rank."""
    with torch.no_grad():
        for tensor in list(model.buffers()) + (list(model.parameters()) if parameters else []):
            dist.broadcast(tensor, 0)


def merge_batch_records(losses: list[Tensor], sizes: list[int],
                        correct: Tensor) -> tuple[list[Tensor], list[int], Tensor]:
    """The ranks' per-step mean losses, batch sizes and correct counts merged into the whole batches':
    one all-reduce per epoch."""
    n = torch.tensor(sizes, dtype=torch.float64, device=correct.device)
    weighted = torch.stack(losses).to(n.device) * n if losses else n
    packed = torch.cat([weighted, n, correct.double().view(1)])
    dist.all_reduce(packed)
    k = len(sizes)
    totals = packed[k:2 * k]
    return list((packed[:k] / totals.clamp_min(1)).unbind()), [int(t) for t in totals.tolist()], packed[-1].long()
