"""The per-parameter scalars of follow_gradient_scale as views of one vector (optim/_scalar_vectors.py)."""

import io

import pytest
import torch

from hf_zeroone import OneBitAdam, ZeroOneAdam
from hf_zeroone._tensors import joined, mul_scalar_
from hf_zeroone.optim import _grad_scale
from hf_zeroone.optim._grad_scale import GradientScale
from hf_zeroone.optim._scalar_vectors import adopt, as_vector

SCALE_KEYS = ("grad_scale", "noise_excess", "scale_pending")


def test_entries_become_views_of_one_vector_and_follow_its_writes():
    states = [{"g": torch.tensor(float(i))} for i in range(5)]
    vector = as_vector(states, "g")
    assert torch.equal(vector, torch.arange(5.0))
    vector.mul_(2.0)
    assert [st["g"].item() for st in states] == [0.0, 2.0, 4.0, 6.0, 8.0]
    again = as_vector(states, "g")
    assert again.data_ptr() == vector.data_ptr()  # no copy the second time
    again.add_(1.0)
    assert [st["g"].item() for st in states] == [1.0, 3.0, 5.0, 7.0, 9.0]


def test_a_replaced_entry_is_noticed_and_the_vector_rebuilt():
    states = [{"g": torch.tensor(float(i))} for i in range(4)]
    vector = as_vector(states, "g")
    states[2]["g"] = torch.tensor(50.0)  # as a loaded checkpoint or a user would
    rebuilt = as_vector(states, "g")
    assert rebuilt.data_ptr() != vector.data_ptr()
    assert rebuilt.tolist() == [0.0, 1.0, 50.0, 3.0]
    rebuilt.zero_()
    assert all(st["g"].item() == 0.0 for st in states)


@pytest.mark.parametrize("order", [[1, 0, 2, 3], [0, 1, 2], [1, 2, 3]])
def test_views_in_another_order_or_a_part_join_to_the_right_values(order):
    elements = torch.tensor([10.0, 11.0, 12.0, 13.0]).unbind()
    picked = [elements[i] for i in order]
    out = joined(picked)
    assert out.tolist() == [10.0 + i for i in order]
    consecutive = order == list(range(order[0], order[0] + len(order)))
    assert (out._base is not None) == consecutive  # a view only where it is one


@pytest.mark.parametrize("order", [[3, 2, 1, 0], [2, 1], [1, 3, 0]])
def test_reading_in_another_order_leaves_the_state_vector_in_place(order):
    """A DDP bucket reads the factors in reverse: a gather, and the entries stay views of the vector updates write.

    Adopting a new vector on each read would rebuild it on every step, once in the bucket's order
    (the factors, the noise excess) and once in the parameter group's (the update of ``G``).
    """
    states = [{"grad_scale": torch.tensor(float(i + 1))} for i in range(4)]
    vector = as_vector(states, "grad_scale")
    read = _grad_scale.factors([states[i] for i in order], 0.999, 5, 0, True)
    assert read.tolist() == [float(i + 1) for i in order]
    assert all(st["grad_scale"]._base is vector for st in states)
    assert as_vector(states, "grad_scale").data_ptr() == vector.data_ptr()
    vector.add_(1.0)  # the read is a copy: the entries follow the vector, not it
    assert read.tolist() == [float(i + 1) for i in order]


def test_only_0_dim_elements_of_the_same_dtype_join_as_a_view():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rows = [base[i : i + 1] for i in range(4)]  # 1-element slices, not 0-dim: stacked as they are
    assert joined(rows).shape == (4, 1)
    as_ints = base.view(torch.int32).unbind()  # another dtype than their base's
    out = joined(list(as_ints))
    assert out.dtype == torch.int32 and torch.equal(out, base.view(torch.int32))


@pytest.mark.parametrize("steps", [1, 3])
def test_the_vector_update_of_g_has_the_bits_of_the_per_tensor_updates(steps):
    """``G <- beta2^k G + (1 - beta2^k) q`` on one vector: the bits of the per-tensor form it replaced."""
    gen = torch.Generator().manual_seed(steps)
    n = 45  # more than a vector register's lanes, and a remainder
    start = torch.rand(n, generator=gen) * 3.0
    q = torch.rand(n, generator=gen) * torch.logspace(-6, 6, n)
    group = {"betas": (0.9, 0.999), "bias_correction": True}
    schedule = {"variance_steps": 7}
    states = [{"grad_scale": start[i].clone()} for i in range(n)]
    GradientScale._update(group, states, q, schedule, steps=steps)
    per_tensor = [start[i].clone() for i in range(n)]  # as before: one 0-dim tensor each
    decay, q_scaled = 0.999**steps, q / (1.0 - 0.999**7)
    mul_scalar_(per_tensor, decay)
    torch._foreach_add_(per_tensor, list(q_scaled.unbind()), alpha=1.0 - decay)
    got = torch.stack([st["grad_scale"] for st in states])
    assert torch.equal(got.view(torch.int32), torch.stack(per_tensor).view(torch.int32))
    assert not torch.equal(got, start)


def test_adopt_makes_the_given_values_the_entries():
    states = [{}, {}, {}]
    values = torch.tensor([1.0, 2.0, 3.0])
    adopt(states, "g", values)
    values.mul_(10.0)
    assert [st["g"].item() for st in states] == [10.0, 20.0, 30.0]
    assert all(st["g"].dim() == 0 for st in states)


def _train(opt, params, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * (1.0 + 0.1 * p.numel() ** 0.5)
        opt.step()


@pytest.mark.parametrize(
    "cls, kw, stop",
    [
        (OneBitAdam, dict(freeze_step=3), 7),
        # stopped between syncs: the pending local samples are in the checkpoint
        (ZeroOneAdam, dict(var_freeze_step=4, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4), 9),
    ],
)
def test_a_checkpoint_saves_0_dim_float32_scalars_and_resumes_bit_identically(cls, kw, stop):
    torch.manual_seed(0)
    shapes = [(4, 3), (3,), (5,), (2, 2)]
    init = [torch.randn(s) for s in shapes]

    def fresh():
        params = [torch.nn.Parameter(t.clone()) for t in init]
        return params, cls(params, lr=1e-2, **kw)

    params, opt = fresh()
    _train(opt, params, stop, seed=1)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    at_stop = [p.detach().clone() for p in params]
    saved = [st[k] for st in opt.state_dict()["state"].values() for k in SCALE_KEYS if k in st]
    assert saved and all(t.dim() == 0 and t.dtype == torch.float32 for t in saved)
    assert any(st["grad_scale"].item() != 1.0 for st in opt.state.values())  # G has moved since the freeze
    if cls is ZeroOneAdam:
        assert any("scale_pending" in st for st in opt.state_dict()["state"].values())
    _train(opt, params, 6, seed=2)  # uninterrupted

    resumed_params, resumed = fresh()
    with torch.no_grad():
        for p, q in zip(resumed_params, at_stop):
            p.copy_(q)
    buffer.seek(0)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    _train(resumed, resumed_params, 6, seed=2)
    for p, q in zip(resumed_params, params):
        assert torch.equal(p, q)
        for key in SCALE_KEYS:
            if key in opt.state[q]:
                assert torch.equal(resumed.state[p][key], opt.state[q][key])
