"""``Int8Weight``: every supported op with its real semantics, and the error paths."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_int8 import Int8TrainingConfig, Int8Weight, quantize_
from fsdp_int8.weight import Int8WeightMeta
from _quant import quantize_rowwise

ROWS, K = 6, 8


def make(rows: int = ROWS, k: int = K, *, sr: bool = False, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, k, generator=gen).to(dtype)
    return Int8Weight.from_float(values, stochastic_rounding=sr), values


def same_bytes(a: Int8Weight, b_int: torch.Tensor, b_scale: torch.Tensor) -> bool:
    return torch.equal(a.int_rows(), b_int.view(a.int_rows().shape)) and torch.equal(a.scale, b_scale)


# ------------------------------------------------------------------ construction / metadata
def test_the_metadata_is_one_frozen_object_that_views_derive_and_the_protocol_carries_whole():
    w, _ = make()
    meta = w.meta
    assert isinstance(meta, Int8WeightMeta) and meta.unsharded_rows == ROWS and meta.row_len == K
    with pytest.raises(AttributeError):
        w.unsharded_rows = 3  # read-only: every field is the metadata's
    with pytest.raises(Exception, match="cannot assign"):
        meta.unsharded_rows = 3  # frozen
    piece = w[2:5]
    assert piece.meta == meta  # a dim-0 slice keeps the whole weight's rows
    assert w.with_tensors(w.int_data, w.scale, unsharded_rows=0).meta == meta.replace(unsharded_rows=0)
    _, (dtype, carried) = w.__tensor_flatten__()
    assert dtype == w.dtype and carried is meta
    rebuilt = Int8Weight.__tensor_unflatten__({"int_data": w.int_data, "scale": w.scale}, (dtype, carried), None, None)
    assert rebuilt.meta is meta
    with pytest.raises(TypeError, match="takes its metadata as an Int8WeightMeta"):
        Int8Weight(w.int_data, w.scale, {"row_len": K}, dtype=torch.float32)


def test_a_pickle_whose_matmul_config_has_no_int8_gemm_loads_as_int8_gathered_weights():
    """Layout 4 pickles wrote "keep the gathered weight int8" as an all-off matmul config."""
    from fsdp_int8.weight import _rebuild_int8_weight

    w, _ = make()
    no_gemm = {"output": False, "grad_input": False, "grad_weight": False, "save_int8_input": False}
    fields = {"row_len": K, "full_rows": ROWS, "stochastic_rounding": True, "int8_matmul": no_gemm, "compiled": False}
    back = _rebuild_int8_weight(w.int_data, w.scale, torch.float32, fields, False, False)
    assert back.int8_matmul is None and back.int8_gathered_weights and back.unsharded_rows == ROWS
    again = pickle.loads(pickle.dumps(back))
    assert again.meta == back.meta


def test_from_float_dequantize_roundtrip_and_metadata():
    w, x = make()
    assert isinstance(w, Int8Weight)
    assert w.shape == (ROWS, K) and w.dtype == torch.float32 and w.device.type == "cpu"
    assert w.int_data.dtype == torch.int8 and w.scale.dtype == torch.float32
    assert w.rows == ROWS and w.row_len == K and w.unsharded_rows == ROWS
    q, s = quantize_rowwise(x)
    assert same_bytes(w, q, s)
    deq = w.dequantize()
    assert type(deq) is torch.Tensor and deq.dtype == torch.float32
    assert torch.equal(deq, q.float() * s[:, None])
    # Round to nearest: within half a step of the input (fp32 slack of a few ulps).
    assert ((deq - x).abs() <= s[:, None] * (0.5 + 1e-5)).all()
    # Outer dtype may differ from the source dtype.
    wb = Int8Weight.from_float(x, dtype=torch.bfloat16)
    assert wb.dtype == torch.bfloat16 and wb.dequantize().dtype == torch.bfloat16
    assert same_bytes(wb, q, s)


def test_from_float_and_constructor_errors():
    w, _ = make()
    with pytest.raises(TypeError, match="already quantized"):
        Int8Weight.from_float(w)
    with pytest.raises(ValueError, match=r"2-D \[out_features, in_features\].*3-D expert.*\(2, 3, 4, 5\)"):
        Int8Weight.from_float(torch.randn(2, 3, 4, 5))
    with pytest.raises(TypeError, match="int8 data and fp32 scales"):
        Int8Weight(torch.zeros(2, 4), torch.zeros(2), Int8WeightMeta(row_len=4), dtype=torch.float32)
    with pytest.raises(TypeError, match="outer dtype must be floating"):
        Int8Weight(torch.zeros(2, 4, dtype=torch.int8), torch.zeros(2), Int8WeightMeta(row_len=4), dtype=torch.int32)
    with pytest.raises(ValueError, match="does not hold whole rows"):
        Int8Weight(torch.zeros(10, dtype=torch.int8), torch.zeros(2), Int8WeightMeta(row_len=4), dtype=torch.float32)


def test_repr_names_shape_and_dtype():
    w, _ = make(dtype=torch.bfloat16)
    text = repr(w)
    assert "Int8Weight" in text and "shape=(6, 8)" in text and "torch.bfloat16" in text
    assert "rounding=nearest" in text
    p = nn.Parameter(Int8Weight.from_float(torch.randn(3, 4)))
    assert "requires_grad=True" in repr(p) and "rounding=stochastic" in repr(p)


def test_tensor_flatten_unflatten_roundtrip():
    w, _ = make()
    names, ctx = w.__tensor_flatten__()
    assert names == ["int_data", "scale"]
    inner = {name: getattr(w, name) for name in names}
    back = Int8Weight.__tensor_unflatten__(inner, ctx, w.shape, w.stride())
    assert isinstance(back, Int8Weight) and back.shape == w.shape and back.dtype == w.dtype
    assert back.int_data is w.int_data and back.scale is w.scale
    assert (back.row_len, back.unsharded_rows, back.stochastic_rounding) == (K, ROWS, False)
    assert torch.equal(back, w)
    flat = w.view(-1)
    names, ctx = flat.__tensor_flatten__()
    back = Int8Weight.__tensor_unflatten__(
        {n: getattr(flat, n) for n in names}, ctx, flat.shape, flat.stride()
    )
    assert back.shape == (ROWS * K,) and torch.equal(back.dequantize(), w.dequantize().view(-1))


# ------------------------------------------------------------------ aliasing / copies
def test_detach_aliases_inner_tensors():
    w, _ = make()
    d = w.detach()
    assert isinstance(d, Int8Weight) and d.shape == w.shape
    assert d.int_data.data_ptr() == w.int_data.data_ptr()
    assert d.scale.data_ptr() == w.scale.data_ptr()
    d.copy_(torch.ones(ROWS, K))
    assert torch.equal(w.dequantize(), d.dequantize())


def test_clone_has_independent_storage():
    w, _ = make()
    c = w.clone()
    assert isinstance(c, Int8Weight) and torch.equal(c, w)
    assert c.int_data.data_ptr() != w.int_data.data_ptr()
    assert c.scale.data_ptr() != w.scale.data_ptr()
    before = w.dequantize()
    c.copy_(torch.zeros(ROWS, K))
    assert torch.equal(w.dequantize(), before)
    assert (c.dequantize() == 0).all()


def test_to_bfloat16_keeps_subclass_and_values_and_int_dtype_raises():
    w, _ = make()
    b = w.to(torch.bfloat16)
    assert isinstance(b, Int8Weight) and b.dtype == torch.bfloat16 and b.shape == w.shape
    assert same_bytes(b, w.int_data, w.scale)
    assert b.int_data.data_ptr() != w.int_data.data_ptr()  # _to_copy copies
    assert torch.equal(b.dequantize(torch.float32), w.dequantize())
    assert torch.equal(b.dequantize(), w.dequantize().bfloat16())
    assert w.to(torch.float32) is w  # no-op conversion
    with pytest.raises(NotImplementedError, match="cannot convert an Int8Weight to torch.int32"):
        w.to(torch.int32)


def test_module_to_bfloat16_keeps_parameter_identity_and_bytes():
    lin = quantize_(nn.Linear(32, 32))
    param = lin.weight
    q, s = param.int_data.clone(), param.scale.clone()
    lin.to(torch.bfloat16)
    assert lin.weight is param and isinstance(lin.weight, nn.Parameter)
    assert isinstance(lin.weight, Int8Weight) and lin.weight.dtype == torch.bfloat16
    assert same_bytes(lin.weight, q, s)


# ------------------------------------------------------------------ views
def test_view_and_reshape_to_own_shape():
    w, _ = make()
    for v in (w.view(ROWS, K), w.view(-1, K), w.reshape(ROWS, K), w.view_as(w)):
        assert isinstance(v, Int8Weight) and v.shape == (ROWS, K)
        assert v.int_data.data_ptr() == w.int_data.data_ptr()
        assert torch.equal(v, w)


def test_flat_view_and_back():
    w, _ = make()
    for flat in (w.view(-1), w.reshape(-1), w.view(ROWS * K), w.flatten()):
        assert isinstance(flat, Int8Weight) and flat.shape == (ROWS * K,) and flat.dim() == 1
        assert flat.int_data.data_ptr() == w.int_data.data_ptr()
        assert torch.equal(flat.dequantize(), w.dequantize().view(-1))
        back = flat.view(ROWS, K)
        assert isinstance(back, Int8Weight) and back.shape == (ROWS, K)
        assert torch.equal(back, w)
    # Writes through the flat view reach the weight.
    flat = w.view(-1)
    flat.copy_(torch.arange(ROWS * K, dtype=torch.float32))
    assert torch.equal(w, Int8Weight.from_float(torch.arange(ROWS * K, dtype=torch.float32).view(ROWS, K)))


# (2, 3, K) regroups whole rows and is a valid view now (test_regrouped_views...); a 3-D
# shape that splits the rows themselves still raises.
@pytest.mark.parametrize("shape", [(K, ROWS), (ROWS * 2, K // 2), (ROWS // 2, K * 2), (ROWS, 2, K // 2)])
def test_row_breaking_view_raises(shape):
    w, _ = make()
    with pytest.raises(NotImplementedError, match=r"whole rows of 8 elements"):
        w.view(*shape)
    with pytest.raises(NotImplementedError, match=r"whole rows of 8 elements"):
        w.reshape(*shape)


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda w: w.t(), "aten.t"),
        (lambda w: w.transpose(0, 1), "aten.transpose"),
        (lambda w: w.permute(1, 0), "aten.permute"),
        (lambda w: w.unsqueeze(0), "aten.unsqueeze"),
        (lambda w: w[:, 0], "aten.select"),
        (lambda w: w.view(-1)[3], "aten.select"),
        (lambda w: w.T, "aten"),
    ],
)
def test_transposing_views_raise_naming_the_op(op, name):
    w, _ = make()
    with pytest.raises(NotImplementedError, match=rf"Int8Weight does not support {name}"):
        op(w)


def test_select_of_a_row_is_a_one_row_view_that_writes_through():
    w, x = make()
    row = w[-2]  # an embedding's padding row: weight[padding_idx].fill_(0)
    assert isinstance(row, Int8Weight) and row.shape == (K,)
    assert row.int_data.data_ptr() == w.int_rows()[ROWS - 2].data_ptr()
    assert torch.equal(row.dequantize(), w.dequantize()[ROWS - 2])
    row.fill_(0)
    assert torch.equal(w.dequantize()[ROWS - 2], torch.zeros(K))
    assert torch.equal(w.dequantize()[: ROWS - 2], Int8Weight.from_float(x).dequantize()[: ROWS - 2])
    with pytest.raises(IndexError, match="out of bounds"):
        w[ROWS]


def test_as_strided_own_shape_aliases_and_writes_through():
    w, _ = make()
    a = torch.as_strided(w, w.shape, (K, 1), 0)
    assert isinstance(a, Int8Weight) and a.shape == w.shape
    assert a.int_data.data_ptr() == w.int_data.data_ptr()
    new = torch.randn(ROWS, K)
    a.copy_(new)
    assert torch.equal(w, Int8Weight.from_float(new))


def test_as_strided_window_of_whole_rows():
    w, x = make()
    win = torch.as_strided(w, (2, K), (K, 1), 3 * K)
    assert isinstance(win, Int8Weight) and win.shape == (2, K)
    assert torch.equal(win.dequantize(), w.dequantize()[3:5])
    flat_win = torch.as_strided(w, (2 * K,), (1,), K)
    assert flat_win.shape == (2 * K,) and torch.equal(flat_win.dequantize(), w.dequantize()[1:3].reshape(-1))
    win.copy_(torch.zeros(2, K))  # aliases rows 3..4 of w
    assert (w.dequantize()[3:5] == 0).all() and (w.scale[3:5] == 0).all()
    assert torch.equal(w.dequantize()[:3], Int8Weight.from_float(x[:3]).dequantize())


@pytest.mark.parametrize(
    "size, stride, offset, match",
    [
        ((2, K), (K, 1), 1, "whole rows"),  # starts mid-row
        ((3,), (1,), 0, "whole rows"),  # covers part of a row
        ((ROWS + 1, K), (K, 1), 0, "whole rows"),  # runs past the end
        ((K, 2), (1, K), 0, "contiguous strides"),  # a transpose
    ],
)
def test_as_strided_not_row_aligned_raises(size, stride, offset, match):
    w, _ = make()
    with pytest.raises(NotImplementedError, match=match):
        torch.as_strided(w, size, stride, offset)


# ------------------------------------------------------------------ shard ops
@pytest.mark.parametrize(
    "take, rows",
    [
        (lambda w: w.split(4)[1], slice(4, 7)),
        (lambda w: torch.split(w, [2, 5])[1], slice(2, 7)),
        (lambda w: w.chunk(2)[1], slice(4, 7)),
        (lambda w: w[2:5], slice(2, 5)),
        (lambda w: w[-3:], slice(4, 7)),
        (lambda w: w.narrow(0, 1, 3), slice(1, 4)),
        (lambda w: w.tensor_split(3)[2], slice(5, 7)),
    ],
)
def test_dim0_pieces_share_storage_with_parent(take, rows):
    w, x = make(rows=7)
    piece = take(w)
    assert isinstance(piece, Int8Weight)
    n = rows.stop - rows.start
    assert piece.shape == (n, K)
    assert torch.equal(piece.dequantize(), w.dequantize()[rows])
    new = torch.randn(n, K) * 10
    piece.copy_(new)  # in-place into the piece ...
    expected = x.clone()
    expected[rows] = new
    assert torch.equal(w, Int8Weight.from_float(expected))  # ... visible in the parent


def test_uneven_chunks():
    w, _ = make(rows=7)
    assert [c.shape[0] for c in w.chunk(2)] == [4, 3]
    assert [c.shape[0] for c in w.chunk(3)] == [3, 3, 1]
    assert [c.shape[0] for c in w.split(3)] == [3, 3, 1]
    assert all(c.unsharded_rows == 7 for c in w.chunk(3))


@pytest.mark.parametrize(
    "op",
    [
        lambda w: w.split(2, dim=1),
        lambda w: w.chunk(2, dim=1),
        lambda w: torch.split(w, [4, 4], dim=-1),
    ],
)
def test_dim1_pieces_raise(op):
    w, _ = make()
    with pytest.raises(NotImplementedError, match="along dim 0 only"):
        op(w)


def test_out_of_range_dim_raises_like_a_plain_tensor():
    """An out-of-range ``dim`` (2 on a 2-D weight, 1 on a flat one) raises ``IndexError``
    like a plain tensor, instead of being read as dim 0."""
    w, _ = make()
    ops = {
        "split(2, dim=2)": lambda t: t.split(2, dim=2),
        "cat([t, t], dim=2)": lambda t: torch.cat([t, t], dim=2),
        "aten.slice(t, 2, 0, 2)": lambda t: torch.ops.aten.slice.Tensor(t, 2, 0, 2),
        "flat.split(16, dim=1)": lambda t: t.view(-1).split(16, dim=1),
    }
    silently_accepted = []
    for name, op in ops.items():
        with pytest.raises(IndexError, match="out of range"):
            op(w.dequantize())  # the plain-tensor behaviour
        try:
            op(w)
        except (IndexError, NotImplementedError):
            continue
        silently_accepted.append(name)
    assert not silently_accepted, f"out-of-range dims taken as dim 0: {silently_accepted}"


def test_flat_view_slicing_on_row_boundaries():
    w, _ = make()
    flat = w.view(-1)
    piece = flat[K : 3 * K]
    assert isinstance(piece, Int8Weight) and piece.shape == (2 * K,)
    assert torch.equal(piece.dequantize(), w.dequantize()[1:3].reshape(-1))
    assert torch.equal(piece.scale, w.scale[1:3])
    parts = flat.split(2 * K)
    assert [p.shape for p in parts] == [(2 * K,)] * 3
    parts[2].copy_(torch.ones(2 * K))
    assert (w.dequantize()[4:] == 1).all()
    with pytest.raises(NotImplementedError, match=r"cut between rows of 8 elements.*got an offset or length of 1"):
        flat[1 : 3 * K]
    with pytest.raises(NotImplementedError, match="cut between rows"):
        flat[: K + 3]
    with pytest.raises(NotImplementedError, match="cut between rows"):
        flat.split(K + 1)


def test_cat_of_chunks_reproduces_weight():
    w, _ = make(rows=7)
    joined = torch.cat(w.chunk(3))
    assert isinstance(joined, Int8Weight) and joined.shape == w.shape
    assert torch.equal(joined, w)
    assert joined.int_data.data_ptr() != w.int_data.data_ptr()
    flat = w.view(-1)
    joined_flat = torch.cat(flat.split(2 * K))
    assert joined_flat.shape == (7 * K,) and torch.equal(joined_flat.dequantize(), flat.dequantize())
    with pytest.raises(NotImplementedError, match="with plain tensors"):
        torch.cat([w, torch.zeros(1, K)])
    with pytest.raises(NotImplementedError, match="along dim 0 only"):
        torch.cat(w.chunk(2), dim=1)


# ------------------------------------------------------------------ factories
def test_new_zeros_new_empty_empty_like_keep_subclass_with_zeros():
    w, _ = make()
    for t, shape in (
        (w.new_zeros(3, K), (3, K)),
        (w.new_empty((5, K)), (5, K)),
        (w.new_zeros(4 * K), (4 * K,)),
        (torch.empty_like(w), (ROWS, K)),
    ):
        assert isinstance(t, Int8Weight) and t.shape == shape and t.dtype == w.dtype
        assert (t.int_data == 0).all() and (t.scale == 0).all()
        assert (t.dequantize() == 0).all()
    b = w.new_zeros(2, K, dtype=torch.bfloat16)
    assert isinstance(b, Int8Weight) and b.dtype == torch.bfloat16
    i = w.new_zeros(2, 3, dtype=torch.int64)  # integer request: plain tensor
    assert type(i) is torch.Tensor and i.dtype == torch.int64 and (i == 0).all()
    with pytest.raises(NotImplementedError, match="whole rows of 8 elements"):
        w.new_zeros(3, 5)


def test_zeros_like_returns_plain_tensor():
    w, _ = make(dtype=torch.bfloat16)
    z = torch.zeros_like(w)
    assert type(z) is torch.Tensor
    assert z.shape == w.shape and z.dtype == torch.bfloat16 and (z == 0).all()
    z32 = torch.zeros_like(w, dtype=torch.float32, memory_format=torch.preserve_format)
    assert type(z32) is torch.Tensor and z32.dtype == torch.float32


def test_is_pinned_and_equal():
    w, x = make()
    assert w.is_pinned() is False
    assert torch.equal(w, w.clone())
    assert torch.equal(w, w.dequantize())  # against a plain tensor: compares values
    other = w.clone()
    other.int_data[0, 0] += 1
    assert not torch.equal(w, other)
    other = w.clone()
    other.scale[1] *= 2
    assert not torch.equal(w, other)
    assert not torch.equal(w, x)  # x is the unquantized original


# ------------------------------------------------------------------ copy_
def test_copy_int8_from_int8_copies_bytes():
    w, _ = make(seed=0)
    src, _ = make(seed=1)
    w.copy_(src)
    assert torch.equal(w.int_data, src.int_data) and torch.equal(w.scale, src.scale)
    assert w.int_data.data_ptr() != src.int_data.data_ptr()
    # A flat source with the same rows is fine too.
    w2, _ = make(seed=2)
    w2.copy_(src.view(-1))
    assert torch.equal(w2, src)
    wrong = Int8Weight.from_float(torch.randn(K, ROWS))  # same numel, other row length
    with pytest.raises(RuntimeError, match="different layouts"):
        w.copy_(wrong)


@pytest.mark.parametrize("sr", [False, True])
def test_copy_float_into_int8_rounds_to_nearest(sr):
    w, _ = make(sr=sr)
    # Values off the grid: stochastic rounding would disagree with RTN on many elements.
    src = torch.randn(ROWS, K, generator=torch.Generator().manual_seed(5))
    for _ in range(3):  # deterministic every time, whatever the weight's rounding
        w.copy_(src)
        assert torch.equal(w, Int8Weight.from_float(src))
    w.copy_(src.bfloat16())
    assert torch.equal(w, Int8Weight.from_float(src.bfloat16()))
    w.copy_(torch.arange(K, dtype=torch.float32))  # broadcasts over rows
    assert torch.equal(w, Int8Weight.from_float(torch.arange(K, dtype=torch.float32).expand(ROWS, K)))
    with pytest.raises(TypeError, match="needs floating values"):
        w.copy_(torch.ones(ROWS, K, dtype=torch.int32))


def test_copy_plain_from_int8_writes_dequantized_values():
    w, _ = make()
    dst = torch.empty(ROWS, K)
    dst.copy_(w)
    assert type(dst) is torch.Tensor and torch.equal(dst, w.dequantize())
    dst16 = torch.empty(ROWS, K, dtype=torch.bfloat16)
    dst16.copy_(w)
    assert torch.equal(dst16, w.dequantize(torch.bfloat16))


def test_fill_and_init_quantize_with_round_to_nearest():
    w, _ = make(sr=True)
    w.fill_(0.5)
    assert (w.int_data == 127).all() and torch.allclose(w.dequantize(), torch.full((ROWS, K), 0.5))
    torch.manual_seed(3)
    w.uniform_(-1, 1)
    torch.manual_seed(3)
    ref = torch.empty(ROWS, K).uniform_(-1, 1)
    assert torch.equal(w, Int8Weight.from_float(ref))
    w.zero_()
    assert (w.int_data == 0).all() and (w.scale == 0).all()


# ------------------------------------------------------------------ in-place updates
def _operands(dtype):
    gen = torch.Generator().manual_seed(7)
    t = (torch.randn(ROWS, K, generator=gen) * 0.3).to(dtype)
    pos = (torch.rand(ROWS, K, generator=gen) + 0.5).to(dtype)
    return t, pos


UPDATES = {
    "add_": lambda v, t, pos: v.add_(t),
    "add_alpha": lambda v, t, pos: v.add_(t, alpha=-0.7),
    "add_scalar": lambda v, t, pos: v.add_(0.05),
    "sub_": lambda v, t, pos: v.sub_(t, alpha=2.0),
    "sub_scalar": lambda v, t, pos: v.sub_(0.1),
    "mul_": lambda v, t, pos: v.mul_(pos),
    "div_": lambda v, t, pos: v.div_(pos),
    "addcdiv_": lambda v, t, pos: v.addcdiv_(t, pos, value=-0.2),
    "addcmul_": lambda v, t, pos: v.addcmul_(t, pos, value=0.3),
    "lerp_scalar": lambda v, t, pos: v.lerp_(t, 0.25),
    "lerp_tensor": lambda v, t, pos: v.lerp_(t, pos - 0.5),
    "clamp_": lambda v, t, pos: v.clamp_(-0.5, 0.5),
    "neg_": lambda v, t, pos: v.neg_(),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(UPDATES))
def test_inplace_update_is_dequantize_fp32_math_requantize(name, dtype):
    update = UPDATES[name]
    w, _ = make(dtype=dtype, sr=False)
    t, pos = _operands(dtype)
    # Reference: dequantize in fp32, apply the op in fp32 (bf16 operands upcast exactly),
    # requantize. The weight itself is updated with the operands in the outer dtype, as an
    # optimizer of a bf16 model would pass them.
    expected = update(w.dequantize(torch.float32), t.float(), pos.float())
    q, s = quantize_rowwise(expected)
    out = update(w, t, pos)
    assert out is w  # in-place ops return their target
    assert isinstance(w, Int8Weight) and w.dtype == dtype
    assert same_bytes(w, q, s), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaling_by_a_scalar_rescales_exactly(dtype):
    """mul_ / div_ by a scalar scale every row's absmax by the same factor: the scales
    change exactly and the int8 values do not (negated for a negative factor), with no
    requantization and no rounding noise (AdamW's weight decay is such a mul_)."""
    for stochastic in (False, True):
        w, _ = make(dtype=dtype, sr=stochastic)
        q0, s0 = w.int_data.clone(), w.scale.clone()
        w.mul_(0.9)
        assert torch.equal(w.int_data, q0) and torch.equal(w.scale, s0 * 0.9)
        w.div_(3.0)
        assert torch.equal(w.int_data, q0) and torch.equal(w.scale, s0 * 0.9 / 3.0)
        w.mul_(-2.0)
        assert torch.equal(w.int_data, -q0) and torch.equal(w.scale, s0 * 0.9 / 3.0 * 2.0)
        torch._foreach_mul_([w], 0.5)
        assert torch.equal(w.int_data, -q0) and torch.equal(w.scale, s0 * 0.9 / 3.0 * 2.0 * 0.5)
    with pytest.raises(ValueError, match="non-finite"):
        w.div_(0.0)  # falls to the general path, whose check refuses the Inf


def test_zero_gradient_adamw_step_only_decays_the_scales():
    w, _ = make(sr=True)
    param = torch.nn.Parameter(w)
    q0, s0 = param.int_data.clone(), param.scale.clone()
    opt = torch.optim.AdamW([param], lr=0.1, weight_decay=0.5)
    param.grad = torch.zeros(param.shape)
    opt.step()
    assert torch.equal(param.int_data, q0)
    assert torch.equal(param.scale, s0 * (1 - 0.1 * 0.5))


def test_update_recomputes_each_rows_scale():
    w, _ = make(sr=False)
    q0, s0 = w.int_data.clone(), w.scale.clone()
    factor = torch.ones(ROWS, 1)
    factor[2] = 2.0
    factor[4] = 0.5
    w.mul_(factor)
    # Doubling a row doubles its scale (up to one fp32 rounding of amax / 127) and keeps
    # its int8 values; untouched rows keep their exact bytes.
    torch.testing.assert_close(w.scale[2], 2 * s0[2], rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    torch.testing.assert_close(w.scale[4], 0.5 * s0[4], rtol=2 * torch.finfo(torch.float32).eps, atol=0)
    assert torch.equal(w.int_data, q0)
    untouched = [0, 1, 3, 5]
    assert torch.equal(w.scale[untouched], s0[untouched])


def test_update_uses_the_weights_rounding_mode():
    # An update of a quarter step: round to nearest loses it everywhere, stochastic
    # rounding moves about a quarter of the elements up by one step.
    for sr in (False, True):
        w, _ = make(rows=4, k=256, sr=sr)
        q0 = w.int_data.clone()
        w.add_(0.25 * w.scale[:, None] * (w.int_data.abs() < 127))
        moved = (w.int_data.int() - q0.int())
        if not sr:
            assert (moved == 0).all()
        else:
            frac = (moved == 1).float().mean().item()
            # ~1000 elements at p=0.25: sigma ~0.014; 0.1 is a >7 sigma margin.
            assert ((moved == 0) | (moved == 1)).all() and abs(frac - 0.25) < 0.1, frac


def test_plain_target_updated_with_int8_operand():
    w, _ = make()
    p = torch.ones(ROWS, K)
    p.add_(w, alpha=2.0)
    assert type(p) is torch.Tensor and torch.equal(p, 1 + 2 * w.dequantize())
    p.mul_(w)
    assert torch.equal(p, (1 + 2 * w.dequantize()) * w.dequantize())


def test_foreach_updates_on_mixed_lists():
    w, _ = make(sr=False)
    p = torch.randn(3, 5)
    g = [torch.randn(ROWS, K), torch.randn(3, 5)]
    pos = [torch.rand(ROWS, K) + 0.5, torch.rand(3, 5) + 0.5]

    def check(w_expected, p_expected):
        q, s = quantize_rowwise(w_expected)
        assert isinstance(w, Int8Weight) and same_bytes(w, q, s)
        assert type(p) is torch.Tensor and torch.allclose(p, p_expected, rtol=1e-6, atol=1e-7)

    cases = [
        (lambda ts: torch._foreach_add_(ts, g, alpha=-0.1), lambda v, i: v.add(g[i], alpha=-0.1)),
        (lambda ts: torch._foreach_add_(ts, 0.3), lambda v, i: v + 0.3),
        (lambda ts: torch._foreach_mul_(ts, 0.5), lambda v, i: v * 0.5),
        (lambda ts: torch._foreach_mul_(ts, pos), lambda v, i: v * pos[i]),
        (lambda ts: torch._foreach_addcdiv_(ts, g, pos, value=0.2), lambda v, i: v.addcdiv(g[i], pos[i], value=0.2)),
        (lambda ts: torch._foreach_addcdiv_(ts, g, pos, [0.1, -0.3]), lambda v, i: v.addcdiv(g[i], pos[i], value=[0.1, -0.3][i])),
        (lambda ts: torch._foreach_addcdiv_(ts, g, pos, torch.tensor([0.4, 0.2])), lambda v, i: v.addcdiv(g[i], pos[i], value=[0.4, 0.2][i])),
        (lambda ts: torch._foreach_addcmul_(ts, g, pos, value=-0.1), lambda v, i: v.addcmul(g[i], pos[i], value=-0.1)),
        (lambda ts: torch._foreach_lerp_(ts, g, 0.1), lambda v, i: v.lerp(g[i], 0.1)),
    ]
    for foreach, reference in cases:
        w_expected = reference(w.dequantize(), 0)
        p_expected = reference(p.clone(), 1)
        foreach([w, p])
        check(w_expected, p_expected)


def test_foreach_lerp_on_bf16_weights_computes_in_fp32():
    # An EMA of a bf16 model: lerp_ with bf16 operands. Regression test: the fp32
    # dequantized values once met a bf16 `end` and lerp_ raised a dtype mismatch.
    w, _ = make(dtype=torch.bfloat16)
    target = torch.randn(ROWS, K).bfloat16()
    expected = quantize_rowwise(w.dequantize(torch.float32).lerp(target.float(), 0.1))
    torch._foreach_lerp_([w], [target], 0.1)
    assert w.dtype == torch.bfloat16 and same_bytes(w, *expected)


def test_foreach_out_of_place_returns_plain_tensors():
    w, _ = make()
    p = torch.randn(3, 5)
    out = torch._foreach_mul([w, p], 2.0)
    assert [type(o) for o in out] == [torch.Tensor, torch.Tensor]
    assert torch.equal(out[0], w.dequantize() * 2) and torch.equal(out[1], p * 2)


# ------------------------------------------------------------------ out-of-place math
@pytest.mark.parametrize(
    "op",
    [
        lambda w: w + 1,
        lambda w: 1 + w,
        lambda w: w * 2,
        lambda w: w - torch.ones(K),
        lambda w: w / 3,
        lambda w: -w,
        lambda w: torch.sqrt(w.abs()),
        lambda w: w.pow(2),
        lambda w: w.sign(),
        lambda w: w.clamp(-0.1, 0.1),
        lambda w: torch.maximum(w, torch.zeros(ROWS, K)),
        lambda w: w.sum(),
        lambda w: w.sum(dim=1),
        lambda w: w.mean(dim=0),
        lambda w: torch.linalg.vector_norm(w),
        lambda w: torch.isfinite(w),
        lambda w: w == w.dequantize(),
        lambda w: w.lerp(torch.ones(ROWS, K), 0.5),
    ],
)
def test_out_of_place_math_returns_plain_tensor(op):
    w, _ = make()
    out = op(w)
    assert type(out) is torch.Tensor
    assert torch.equal(out, op(w.dequantize()))


def test_allclose_compares_dequantized_values():
    w, x = make()
    assert torch.allclose(w, w.dequantize())
    assert not torch.allclose(w, x, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda w: torch.sin(w), "aten.sin"),
        (lambda w: w.cumsum(0), "aten.cumsum"),
        (lambda w: w.exp(), "aten.exp"),
        (lambda w: w.sin_(), "aten.sin_"),
        (lambda w: w @ torch.randn(K, 2), "aten.mm"),
    ],
)
def test_unsupported_op_raises_naming_op_and_class(op, name):
    w, _ = make()
    with pytest.raises(NotImplementedError, match=rf"Int8Weight does not support {name}") as info:
        op(w)
    assert ".dequantize()" in str(info.value)


# ------------------------------------------------------------------ F.linear
def _linear_case(dtype=torch.float32, x_shape=(5, 32), bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = nn.Parameter(Int8Weight.from_float(torch.randn(16, 32, generator=gen), dtype=dtype))
    b = nn.Parameter(torch.randn(16, generator=gen).to(dtype)) if bias else None
    x = torch.randn(*x_shape, generator=gen).to(dtype).requires_grad_()
    return w, b, x


@pytest.mark.parametrize("x_shape", [(5, 32), (2, 3, 32), (32,)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_backward_match_reference(x_shape, bias):
    w, b, x = _linear_case(x_shape=x_shape, bias=bias)
    y = F.linear(x, w, b)
    deq = w.dequantize().detach()
    x_ref = x.detach().clone().requires_grad_()
    b_ref = b.detach().clone().requires_grad_() if bias else None
    y_ref = x_ref @ deq.T + (b_ref if bias else 0)
    # fp32: (x @ q^T) * s vs x @ (q * s)^T differ only by rounding order; K = 32 products
    # of O(1) values give errors ~1e-6, so 1e-5 is tight yet safe.
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert type(w.grad) is torch.Tensor and w.grad.shape == w.shape and w.grad.dtype == torch.float32
    g2, x2 = g.reshape(-1, 16), x.detach().reshape(-1, 32)
    torch.testing.assert_close(w.grad, g2.T @ x2, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(b.grad, g2.sum(0), rtol=1e-6, atol=1e-6)
    # Gradients accumulate as plain tensors.
    F.linear(x, w, b).backward(g)
    assert type(w.grad) is torch.Tensor
    torch.testing.assert_close(w.grad, 2 * (g2.T @ x2), rtol=1e-6, atol=1e-6)


def test_linear_bf16():
    w, b, x = _linear_case(dtype=torch.bfloat16, x_shape=(4, 3, 32))
    y = F.linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 3, 16)
    ref = x.detach().float() @ w.dequantize(torch.float32).T + b.detach().float()
    # bf16 has an 8-bit mantissa (rel. 2^-8 = 0.4%); the output is rounded a couple of
    # times (matmul result, scale multiply, bias add). Outputs are O(5), so 0.1 abs /
    # 2% rel catches a wrong scale or transpose while allowing bf16 rounding.
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=1e-1)
    y.sum().backward()
    assert w.grad.dtype == torch.bfloat16 and type(w.grad) is torch.Tensor
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape


def test_linear_errors():
    w, _, _ = _linear_case()
    with pytest.raises(RuntimeError, match=r"input of shape \(3, 31\) cannot multiply"):
        F.linear(torch.randn(3, 31), w)
    with pytest.raises(TypeError, match="floating input"):
        F.linear(torch.ones(3, 32, dtype=torch.int64), w)


def test_linear_module_uses_int8_path():
    lin = quantize_(nn.Linear(32, 16))
    x = torch.randn(4, 32)
    torch.testing.assert_close(lin(x), x @ lin.weight.dequantize().T + lin.bias, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ serialization
def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def test_state_dict_save_load_roundtrip_is_bit_exact():
    torch.manual_seed(0)
    model = quantize_(_mlp(), Int8TrainingConfig(stochastic_rounding=False))
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    for name, ref in model.state_dict().items():
        got = sd[name]
        assert type(got) is type(ref), name
        if isinstance(ref, Int8Weight):
            assert torch.equal(got.int_data, ref.int_data) and torch.equal(got.scale, ref.scale)
            assert (got.dtype, got.row_len, got.unsharded_rows, got.stochastic_rounding) == (
                ref.dtype, ref.row_len, ref.unsharded_rows, False
            )
        else:
            assert torch.equal(got, ref)
    assert isinstance(sd["0.weight"], Int8Weight) and isinstance(sd["2.weight"], Int8Weight)
    assert not isinstance(sd["4.weight"], Int8Weight)  # 4 output features: kept fp32

    torch.manual_seed(1)  # a different init
    fresh = quantize_(_mlp(), Int8TrainingConfig(stochastic_rounding=False))
    assert not torch.equal(fresh[0].weight, model[0].weight)
    params_before = [id(p) for p in fresh.parameters()]
    fresh.load_state_dict(sd)
    assert [id(p) for p in fresh.parameters()] == params_before
    for (name, a), b in zip(fresh.state_dict().items(), model.state_dict().values()):
        if isinstance(b, Int8Weight):
            assert isinstance(a, Int8Weight)
            assert torch.equal(a.int_data, b.int_data) and torch.equal(a.scale, b.scale), name
        else:
            assert torch.equal(a, b), name
    x = torch.randn(3, 32)
    assert torch.equal(fresh(x), model(x))


def test_pickled_model_keeps_int8_weights_as_parameters():
    """A pickled module (``torch.save(model)``, ``pickle.dumps``) gets its int8 weights
    back as parameters, as ``copy.deepcopy`` does."""
    model = quantize_(_mlp())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded[0].weight, Int8Weight)
    assert torch.equal(loaded[0].weight, model[0].weight)
    assert loaded[0].weight.requires_grad
    assert isinstance(loaded[4].weight, nn.Parameter)  # plain parameter: fine
    assert isinstance(loaded[0].weight, nn.Parameter), "int8 weight lost its Parameter flag"


def test_int8_state_dict_loads_into_fp32_model_as_dequantized_values():
    model = quantize_(_mlp())
    plain = _mlp()
    plain.load_state_dict(model.state_dict())
    assert type(plain[0].weight.data) is torch.Tensor
    assert torch.equal(plain[0].weight.detach(), model[0].weight.dequantize())



def test_aot_autograd_cache_key_names_the_metadata_not_the_values():
    """``_stable_hash_for_caching``, which torch.compile's AOTAutograd cache asks a tensor
    subclass for: the same for other int8 values and scales (each step's weights must hit
    the same compiled graph), another for any field a graph may depend on."""
    from fsdp_int8 import Int8MatmulConfig
    from fsdp_int8._weight.tensor_parallel import ColumnWindow

    w, _ = make()
    key = w._stable_hash_for_caching()
    assert isinstance(key, str) and len(key) == 32
    other_values, _ = make(seed=1)
    assert not torch.equal(other_values.int_data, w.int_data)
    assert other_values._stable_hash_for_caching() == key
    variants = {
        "rows": make(rows=ROWS + 1)[0], "outer dtype": make(dtype=torch.bfloat16)[0],
        "rounding": make(sr=True)[0], "requires_grad": w.detach().clone().requires_grad_(),
        "int8 matmuls": w.with_tensors(w.int_data, w.scale, int8_matmul=Int8MatmulConfig()),
        "which matmuls": w.with_tensors(w.int_data, w.scale, int8_matmul=Int8MatmulConfig(grad_weight=False)),
        "compiled kernels": w.with_tensors(w.int_data, w.scale, compiled=True),
        "full rows": w.with_tensors(w.int_data, w.scale, unsharded_rows=2 * ROWS),
        "flat data": w.with_tensors(w.int_data.view(-1), w.scale),
        "column window": w.with_tensors(w.int_data, w.scale, tensor_parallel=ColumnWindow(0, K, 2 * K)),
    }
    keys = {name: variant._stable_hash_for_caching() for name, variant in variants.items()}
    assert key not in keys.values(), keys
    assert len(set(keys.values())) == len(keys), keys

# ---------------------------------------------------------------- edges (clear errors, no noise)
def test_numpy_and_tolist_say_what_to_call_instead():
    w = Int8Weight.from_float(torch.randn(4, 8))
    with pytest.raises(TypeError, match=r"dequantize\(\)\.numpy\(\)"):
        w.numpy()
    with pytest.raises(TypeError, match=r"dequantize\(\)\.tolist\(\)"):
        w.tolist()


def test_div_by_zero_is_refused_and_leaves_the_weight_unchanged():
    w = Int8Weight.from_float(torch.randn(4, 8))
    before = (w.int_data.clone(), w.scale.clone())
    for zero in (0, 0.0, torch.tensor(0.0)):
        with pytest.raises(ValueError, match="by zero"):
            w.div_(zero)
    assert torch.equal(w.int_data, before[0]) and torch.equal(w.scale, before[1])


def test_zero_input_features_are_refused_before_the_model_changes():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(0, 8))
    with pytest.raises(ValueError, match="0 input features"):
        quantize_(model, Int8TrainingConfig(module_filter=lambda m, n: True))
    assert not isinstance(model[0].weight, Int8Weight)  # nothing was swapped


def test_clamp_adds_no_rounding_noise():
    torch.manual_seed(0)
    w = Int8Weight.from_float(torch.randn(16, 64), stochastic_rounding=True)
    untouched = w.clone()
    untouched.clamp_(-100.0, 100.0)  # bounds outside the range: nothing moves
    assert torch.equal(untouched.int_data, w.int_data) and torch.equal(untouched.scale, w.scale)
    # Bounds inside the range: deterministic (two clamps agree), values clamped to the
    # bound to within half an int8 step of the new scale.
    first, second = w.clone(), w.clone()
    first.clamp_(-0.5, 0.5)
    second.clamp_(-0.5, 0.5)
    assert torch.equal(first.int_data, second.int_data)
    expected = w.dequantize(torch.float32).clamp(-0.5, 0.5)
    assert ((first.dequantize(torch.float32) - expected).abs() <= first.scale.unsqueeze(1) / 2 + 1e-7).all()


# ---------------------------------------------------------------- identity, copies, raw bytes
def test_data_ptr_is_the_int8_datas_so_frameworks_can_key_parameters_by_it():
    a, b = Int8Weight.from_float(torch.randn(4, 8)), Int8Weight.from_float(torch.randn(4, 8))
    assert a.data_ptr() == a.int_data.data_ptr() != 0
    assert a.data_ptr() != b.data_ptr()
    assert torch.nn.Parameter(a).data_ptr() == a.data_ptr()
    assert a.view(-1).data_ptr() == a.data_ptr()  # a view shares the address


def test_deepcopy_copies_data_and_keeps_parameter_grad_and_ties():
    model = quantize_(_mlp())
    model[2].weight.grad = torch.randn(16, 32)
    model[2].weight.tag = "kept"  # frameworks tag parameters (HF: _is_hf_initialized)
    model.extra = model[0]  # the same module twice: deepcopy's memo keeps it one
    copied = copy.deepcopy(model)
    for name, (a, b) in zip(
        [n for n, _ in model.named_parameters()], zip(model.parameters(), copied.parameters())
    ):
        assert type(b) is type(a) and isinstance(b, nn.Parameter), name
        assert b.requires_grad == a.requires_grad and torch.equal(b, a), name
    w, c = model[0].weight, copied[0].weight
    assert c.int_data.data_ptr() != w.int_data.data_ptr() and c.scale.data_ptr() != w.scale.data_ptr()
    assert (c.row_len, c.unsharded_rows, c.stochastic_rounding) == (w.row_len, w.unsharded_rows, w.stochastic_rounding)
    assert copied.extra is copied[0]
    assert torch.equal(copied[2].weight.grad, model[2].weight.grad)
    assert copied[2].weight.grad is not model[2].weight.grad and copied[2].weight.tag == "kept"
    with torch.no_grad():
        c.add_(1.0)  # independent storage: the original does not move
    assert torch.equal(model[0].weight, w) and not torch.equal(c, w)
    torch.optim.SGD(copied.parameters(), lr=0.1)  # still leaves an optimizer accepts


def test_raw_bytes_writers_are_refused_naming_what_to_call():
    w = Int8Weight.from_float(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=r"no storage of its floating dtype.*export_full_state_dict"):
        w.storage()


# ---------------------------------------------------------------- regrouped views ([*lead, K])
def test_regrouped_views_keep_rows_and_share_storage():
    """torchtitan views a fused QKV weight as [kv_heads, 3, head_dim, K] (rows regrouped)."""
    w, x = make(rows=12)
    v = w.view(2, 3, 2, K)
    assert isinstance(v, Int8Weight) and v.shape == (2, 3, 2, K) and v.scale.shape == (2, 3, 2)
    assert v.data_ptr() == w.data_ptr() and v.is_contiguous()
    assert torch.equal(v.dequantize(), w.dequantize().view(2, 3, 2, K))
    assert torch.equal(v.reshape(-1, K), w) and torch.equal(w.reshape(4, 3, K).view(-1), w.view(-1))
    v[1].copy_(torch.ones(3, 2, K))  # writes through a leading-dim piece reach the weight
    assert (w.dequantize()[6:] == 1).all()
    with pytest.raises(NotImplementedError, match="whole rows of 8 elements"):
        w.view(12, 2, K // 2)  # splits each row: no


def test_regrouped_views_slice_select_split_and_cat_along_leading_dims():
    w, x = make(rows=12)
    v = w.view(2, 3, 2, K)
    plain = w.dequantize().view(2, 3, 2, K)
    cases = {
        "v[:, :2]": (lambda t: t[:, :2], True),
        "v[:, 2]": (lambda t: t[:, 2], True),
        "narrow(2, 1, 1)": (lambda t: t.narrow(2, 1, 1), True),
        "split(1, 1)[1]": (lambda t: t.split(1, dim=1)[1], True),
        "split([2, 1], 1)[0]": (lambda t: torch.split(t, [2, 1], dim=1)[0], True),
    }
    for name, (take, strided) in cases.items():
        piece = take(v)
        assert isinstance(piece, Int8Weight), name
        assert torch.equal(piece.dequantize(), take(plain)), name
        assert piece.data_ptr() >= v.data_ptr(), name  # a view, not a copy
        flat_rows = piece.reshape(-1, K)  # strided: reshape copies, as for a plain tensor
        assert isinstance(flat_rows, Int8Weight) and torch.equal(flat_rows.dequantize(), take(plain).reshape(-1, K))
        assert piece.contiguous().is_contiguous()
    joined = torch.cat([v[:, :2], v[:, 2:]], dim=1)
    assert isinstance(joined, Int8Weight) and torch.equal(joined.reshape(-1, K), w)
    for bad in (lambda t: t[..., :4], lambda t: t.select(3, 0), lambda t: torch.cat([t, t], dim=3)):
        with pytest.raises(NotImplementedError, match="leading dims only"):
            bad(v)


def test_chunk_reaching_dispatch_cuts_whole_rows():
    """DTensor's Replicate -> Shard redistribution sends aten.chunk itself."""
    w, _ = make(rows=7)
    pieces = torch.ops.aten.chunk.default(w, 3)
    assert [tuple(p.shape) for p in pieces] == [(3, K), (3, K), (1, K)]
    assert torch.equal(torch.cat(pieces), w)
    assert torch.equal(torch.ops.aten.chunk.default(w.view(7, 1, K), 2, 1)[0], w.view(7, 1, K))
    with torch.inference_mode():  # no decomposition into split here: the op itself arrives
        w_inference = make(rows=7)[0]
        pieces = torch.ops.aten.chunk.default(w_inference, 3)
        assert [tuple(p.shape) for p in pieces] == [(3, K), (3, K), (1, K)]


def test_views_of_a_trained_weight_work_under_inference_mode_as_plain_views_do():
    """An evaluation block under ``torch.inference_mode()`` takes views of weights made
    outside it (``model.state_dict()`` detaches every parameter): like a plain tensor's,
    such a view is a normal tensor over the same bytes. Before, every one raised
    "Cannot set version_counter for inference tensor"."""
    w, _ = make(rows=7)
    param = torch.nn.Parameter(w)
    layer = torch.nn.Linear(K, 7, bias=False)
    layer.weight = param
    plain = torch.randn(7, K)
    with torch.inference_mode():
        views = {
            "detach": param.detach(), "view": w.view(7, K), "slice": w[2:5],
            "chunk": torch.ops.aten.chunk.default(w, 3)[0], "split": w.split(3)[1],
        }
        assert plain.view(7, K).is_inference() is False  # the rule for plain tensors
        for name, view in views.items():
            assert isinstance(view, Int8Weight) and not view.is_inference(), name
        assert torch.equal(views["slice"].int_data, w.int_data[2:5])
        state = layer.state_dict()
        assert torch.equal(state["weight"].int_data, w.int_data)
        made_inside = make(rows=7)[0]  # a view of an inference tensor stays one
        assert made_inside.view(7, K).is_inference()
    views["detach"].int_data[0, 0] = 5  # a view: the bytes are shared
    assert w.int_data[0, 0] == 5


# ---------------------------------------------------------------- DDP's flat buckets, comparisons
def test_flat_bucket_of_int8_and_plain_tensors_is_their_values():
    """DDP flattens parameters into one bucket to broadcast them, then copies them back."""
    w, bias = make(rows=4)[0], torch.randn(4)
    other = Int8Weight.from_float(torch.randn(3, 16))  # another row length
    flat = torch._utils._flatten_dense_tensors([w, bias, other])
    assert type(flat) is torch.Tensor
    assert torch.equal(flat, torch.cat([w.dequantize().view(-1), bias, other.dequantize().view(-1)]))
    before = (w.int_data.clone(), w.scale.clone(), other.int_data.clone(), other.scale.clone())
    for tensor, values in zip([w, bias, other], torch._utils._unflatten_dense_tensors(flat, [w, bias, other])):
        tensor.copy_(values)  # rounds to nearest: the values came from these very scales
    assert all(torch.equal(a, b) for a, b in zip(before, (w.int_data, w.scale, other.int_data, other.scale)))
    with pytest.raises(NotImplementedError, match="with plain tensors"):
        torch.cat([w, torch.zeros(1, K)])  # a 2-D cat would hand back plain weight rows


def test_comparisons_and_where_give_plain_results_of_the_values():
    w, _ = make()
    values = w.dequantize()
    for op in (lambda t: t < 0.1, lambda t: t >= -0.1, lambda t: t > values, lambda t: t != 0):
        got = op(w)
        assert type(got) is torch.Tensor and got.dtype == torch.bool
        assert torch.equal(got, op(values))
    picked = torch.where(w > 0, w, torch.zeros_like(values))
    assert type(picked) is torch.Tensor and torch.equal(picked, values.clamp(min=0))


def test_trunc_normal_initialises_int8_weights_in_place():
    """nn.init.trunc_normal_ (torchtitan's init) compares and redraws: without truncation it
    gives exactly the int8 of the plain draw; with it, values within the bounds and within
    two int8 steps of the plain result (normal_ rounds to nearest with the untruncated
    draw's coarser scale, the final copy_ with the truncated one's), but for the few values
    near a bound that one side redrew and the other kept."""
    for std, bound in ((0.02, 2.0), (1.0, 1.5)):
        w = Int8Weight.from_float(torch.zeros(64, 32))
        plain = torch.empty(64, 32)
        torch.nn.init.trunc_normal_(plain, std=std, a=-bound, b=bound, generator=torch.Generator().manual_seed(3))
        torch.nn.init.trunc_normal_(w, std=std, a=-bound, b=bound, generator=torch.Generator().manual_seed(3))
        assert isinstance(w, Int8Weight)
        got = w.dequantize()
        assert got.abs().max() <= bound * (1 + 1e-6)
        if std == 0.02:
            assert torch.equal(w, Int8Weight.from_float(plain))
        else:
            close = (got - plain).abs() <= 2 * w.scale.unsqueeze(1)
            assert close.float().mean() > 0.99
