"""The state API of the torch recurrent ops (what ring CP's state passing builds on), in one process, fp64:
``chunk_gated_delta_rule(initial_state=, output_final_state=)`` and ``ssd_chunk_scan(output_final_state=)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nemo_ac.models.kernels.gated_delta_rule import chunk_gated_delta_rule, document_starts, l2norm
from nemo_ac.models.layers.mamba2 import Mamba2CoreParams, segment_ids, ssd_chunk_scan

S, CUT = 37, 19  # a row cut mid-document (and mid-chunk: chunk 5)


def _docs() -> torch.Tensor:
    ids = torch.zeros(2, S, dtype=torch.int64)
    ids[0, 11:] = 1  # row 0: a document starts before the cut and runs across it
    ids[1, CUT:] = 1  # row 1: a document starts exactly at the cut (nothing is carried)
    return ids


def _ssd_params(*, nh: int, hd: int, n: int, A: torch.Tensor, D: torch.Tensor) -> Mamba2CoreParams:
    """The scan's parameters for ``ssd_chunk_scan`` called directly (its conv weights are not read: chunk 5)."""
    return Mamba2CoreParams(
        conv_x_weight=torch.empty(nh, hd, 4),
        conv_x_bias=None,
        conv_b_weight=torch.empty(1, n, 4),
        conv_b_bias=None,
        conv_c_weight=torch.empty(1, n, 4),
        conv_c_bias=None,
        A=A,
        D=D,
        dt_bias=torch.zeros(nh, dtype=torch.float64),
        chunk_size=5,
    )


def test_gated_delta_rule_carried_state_continues_the_row_exactly() -> None:
    gen = torch.Generator().manual_seed(0)
    h, dk, dv = 3, 4, 6
    q = l2norm(torch.randn(2, S, h, dk, generator=gen, dtype=torch.float64))
    k = l2norm(torch.randn(2, S, h, dk, generator=gen, dtype=torch.float64))
    v = torch.randn(2, S, h, dv, generator=gen, dtype=torch.float64)
    g = -torch.rand(2, S, h, generator=gen, dtype=torch.float64)
    beta = torch.rand(2, S, h, generator=gen, dtype=torch.float64)
    starts = document_starts(_docs())
    full, final = chunk_gated_delta_rule(q, k, v, g, beta, doc_starts=starts, chunk_size=5, output_final_state=True)
    head = slice(0, CUT)
    tail = slice(CUT, S)
    first, carried = chunk_gated_delta_rule(
        q[:, head],
        k[:, head],
        v[:, head],
        g[:, head],
        beta[:, head],
        doc_starts=starts[:, head],
        chunk_size=5,
        output_final_state=True,
    )
    second, end = chunk_gated_delta_rule(
        q[:, tail],
        k[:, tail],
        v[:, tail],
        g[:, tail],
        beta[:, tail],
        doc_starts=starts[:, tail],
        chunk_size=5,
        initial_state=carried,
        output_final_state=True,
    )
    torch.testing.assert_close(torch.cat((first, second), dim=1), full, rtol=0, atol=1e-12)
    torch.testing.assert_close(end, final, rtol=0, atol=1e-12)
    # Without the carried state the tail of row 0 differs (the state matters), row 1 does not (its document starts
    # exactly at the cut).
    alone = chunk_gated_delta_rule(
        q[:, tail], k[:, tail], v[:, tail], g[:, tail], beta[:, tail], doc_starts=starts[:, tail], chunk_size=5
    )
    assert (alone[0] - full[0, tail]).abs().max() > 1e-3
    torch.testing.assert_close(alone[1], full[1, tail], rtol=0, atol=1e-12)


def test_ssd_final_state_is_the_last_segments_recurrence() -> None:
    gen = torch.Generator().manual_seed(1)
    nh, hd, n = 2, 3, 4
    x = torch.randn(2, S, nh, hd, generator=gen, dtype=torch.float64)
    dt = torch.randn(2, S, nh, generator=gen, dtype=torch.float64)
    B = torch.randn(2, S, 1, n, generator=gen, dtype=torch.float64)
    C = torch.randn(2, S, 1, n, generator=gen, dtype=torch.float64)
    A = -torch.tensor([0.3, 1.2], dtype=torch.float64)
    params = _ssd_params(nh=nh, hd=hd, n=n, A=A, D=torch.zeros(nh, dtype=torch.float64))
    segments = segment_ids(_docs())
    _, final = ssd_chunk_scan(x, dt, B, C, params, segments, output_final_state=True)
    step = F.softplus(dt)
    for row in range(2):
        state = torch.zeros(nh, hd, n, dtype=torch.float64)
        for t in range(S):
            if t and segments[row, t] != segments[row, t - 1]:
                state = torch.zeros_like(state)  # a document start: the state restarts
            decay = torch.exp(A * step[row, t])[:, None, None]
            write = (x[row, t] * step[row, t, :, None])[:, :, None] * B[row, t, 0][None, None, :]
            state = decay * state + write
        torch.testing.assert_close(final[row], state, rtol=0, atol=1e-12)


def test_ssd_compiled_padding_path_matches_the_eager_one(monkeypatch) -> None:
    """Compiled, the chunk padding is a gather and a mask applied to every row length (no ``if pad`` guard on the
    row length, ``mamba2._pad_always``); run eagerly here, it gives the same output and final state as the
    padding by ``F.pad``, for a row that needs padding (37 = 7 chunks of 5 + 2) and one that does not (35)."""
    from nemo_ac.models.layers import mamba2

    gen = torch.Generator().manual_seed(2)
    nh, hd, n = 2, 3, 4
    params = _ssd_params(
        nh=nh,
        hd=hd,
        n=n,
        A=-torch.tensor([0.3, 1.2], dtype=torch.float64),
        D=torch.tensor([0.5, -1.0], dtype=torch.float64),
    )
    for s in (S, 35):
        args = (
            torch.randn(2, s, nh, hd, generator=gen, dtype=torch.float64),
            torch.randn(2, s, nh, generator=gen, dtype=torch.float64),
            torch.randn(2, s, 1, n, generator=gen, dtype=torch.float64),
            torch.randn(2, s, 1, n, generator=gen, dtype=torch.float64),
        )
        segments = segment_ids(_docs()[:, :s])
        monkeypatch.setattr(mamba2, "_pad_always", lambda: False)
        y_ref, final_ref = ssd_chunk_scan(*args, params, segments, output_final_state=True)
        monkeypatch.setattr(mamba2, "_pad_always", lambda: True)
        y, final = ssd_chunk_scan(*args, params, segments, output_final_state=True)
        torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-12)
