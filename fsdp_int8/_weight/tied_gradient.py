"""One dense gradient for a weight shared by an output head and an embedding lookup.

With ``tie_word_embeddings`` one parameter receives two gradients in one backward: the
head's ``grad_y^T x`` (dense, the table's size) and the lookup's rows. Torch's lookup
backward spreads its rows over a second dense table, and autograd sums the two into a
third whenever it cannot add in place (always under a ``TorchDispatchMode`` such as
torch's memory trackers): three copies of the table at once.

Here the head notes that it produced a dense gradient for the weight in this backward
(:func:`note_dense_gradient`); the lookup, running after it, sums its rows per id in a
compact table (one row per token), returns no gradient for the weight, and adds the
compact rows into the weight's summed gradient from a one-shot hook that autograd runs
before accumulating it (:func:`defer_lookup_rows`). One dense copy, and the same values:
each id's rows are summed by the same kernel and added to the head's gradient once, as
autograd's own sum does.

Only for a leaf weight (what FSDP2 and plain modules hand the layers) outside
``torch.compile``: a lookup that runs first, or alone (an untied embedding), returns its
dense gradient as torch does.
"""

from __future__ import annotations

import torch

# The weights (by id) that received a dense gradient in backward pass ``_noted[0]`` (its
# graph task id). Ids, not weak references: a tensor with weak references cannot be
# swapped (``torch.utils.swap_tensors``, which ``Module.to`` uses for subclasses). Only
# the latest backward's are kept; a lookup in another (a nested backward) finds none and
# returns its dense gradient.
_noted: tuple[int, set[int]] = (-1, set())


def _current_backward() -> int:
    return torch._C._current_graph_task_id()  # -1 outside backward


def _eligible(weight: torch.Tensor) -> bool:
    return weight.is_leaf and weight.requires_grad and not torch.compiler.is_compiling()


def note_dense_gradient(weight: torch.Tensor) -> None:
    """Called from a backward that returns a dense gradient for ``weight``."""
    global _noted
    if not _eligible(weight):
        return
    task = _current_backward()
    if _noted[0] != task:
        _noted = (task, set())
    _noted[1].add(id(weight))


def _noted_in(task: int, weight: torch.Tensor) -> bool:
    return task >= 0 and _noted[0] == task and id(weight) in _noted[1]


def _rows_per_id(grad_out: torch.Tensor, ids: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool):
    """``(ids_once, rows)``: each id of ``ids`` once, with the sum of its gradient rows as
    ``embedding_dense_backward`` computes it (padding rows zero, ``scale_grad_by_freq``).

    The table has one row per token (ids that repeat leave zero rows at its end, pointing at
    id 0), so that no step depends on how many ids are distinct: no device synchronisation.
    """
    flat = ids.reshape(-1)
    grad_rows = grad_out.reshape(flat.numel(), -1)
    if padding_idx >= 0:
        grad_rows = grad_rows.masked_fill((flat == padding_idx).unsqueeze(1), 0)
    sorted_ids, order = flat.sort(stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot_of_sorted = starts.long().cumsum(0) - 1
    slot = torch.empty_like(slot_of_sorted).scatter_(0, order, slot_of_sorted)
    ids_once = torch.zeros_like(flat).scatter_(0, slot_of_sorted, sorted_ids)
    rows = torch.ops.aten.embedding_dense_backward(grad_rows, slot, flat.numel(), -1, scale_grad_by_freq)
    return ids_once, rows


def defer_lookup_rows(
    weight: torch.Tensor, ids: torch.Tensor, grad_out: torch.Tensor, padding_idx: int, scale_grad_by_freq: bool
) -> bool:
    """Called from a lookup's backward. When a dense gradient of ``weight`` was produced
    earlier in this backward, schedule the lookup's rows to be added into the weight's
    summed gradient and return True: the lookup then returns no gradient for ``weight``.
    Otherwise return False and do nothing."""
    if not _eligible(weight):
        return False
    task = _current_backward()
    if not _noted_in(task, weight):
        return False
    ids_once, rows = _rows_per_id(grad_out, ids, padding_idx, scale_grad_by_freq)

    def add_rows(grad: torch.Tensor) -> torch.Tensor | None:
        handle.remove()
        if _current_backward() != task:  # a backward that failed before reaching the weight
            return None
        values = rows.to(grad.dtype)
        if type(grad) is torch.Tensor and grad.is_contiguous():
            grad.index_add_(0, ids_once, values)  # autograd's summed gradient, held by nothing else
            return None
        return grad.index_add(0, ids_once, values)

    handle = weight.register_hook(add_rows)
    return True
