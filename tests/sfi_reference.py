"""Independent references for SFI: the selector of SFI_METHOD.md §4 in float64 numpy, and
transformers run with the attention sets of §2-§5 (per layer and KV head), whose selections
that selector makes from transformers' own queries and keys. Nothing here imports sfi_jax."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np


# ---------------------------------------------------------------------------------------------
# Plain per-head float64 reference of SFI_METHOD.md §4.
# ---------------------------------------------------------------------------------------------
def ref_scores(logits, key_norms, lo, hi, cfg):
    """z_adj [B, H, S] (float64, -inf outside J), written straight from the method text."""
    assert cfg.successor_radius == 0, "the paper's selector only: pass SFIConfig.paper(...)"
    B, H, R, S = logits.shape
    eps, a = cfg.eps, cfg.power_alpha
    out = np.full((B, H, S), -np.inf)
    for b in range(B):
        J = np.arange(max(lo[b], 0), min(hi[b], S))
        if len(J) == 0:
            continue
        z_nms = np.zeros((H, len(J)))
        for h in range(H):
            # 1. evidence
            mu = np.zeros(len(J))
            for r in range(R):
                row = logits[b, h, r, J].astype(np.float64)
                if np.all(np.isneginf(row)):
                    continue  # a row that sees nothing in J adds no evidence
                e = np.exp(row - row.max())
                mu += (e / e.sum()) ** a
            mu /= R
            f = mu ** (1.0 / a)
            f /= f.sum()
            # 2. prior
            u = (J - J.min()) / (J.max() - J.min() + eps)
            pi_kn = (key_norms[b, h, J].astype(np.float64) + eps) ** (-cfg.gamma)
            pi_pos = np.exp(-cfg.beta * u**cfg.p) * (1 - u + eps) ** cfg.eta
            rr = pi_kn * pi_pos
            rr /= rr.sum()
            # 3. fusion
            den = f @ f - 2 * (f @ rr) + rr @ rr
            lam = 0.0 if den == 0 else float(np.clip((f @ f - f @ rr) / den, 0.0, cfg.lam_clip))
            s = (1 - lam) * f + lam * rr
            # 4. log score
            z = np.log(s + eps)
            # 5. soft-NMS
            n = cfg.nms_radius
            m = np.array([z[max(0, i - n): i + n + 1].max() for i in range(len(J))])
            z_nms[h] = z - cfg.alpha_soft * np.maximum(m - z, 0)
        # 6. cross-head exclusivity
        y = z_nms / cfg.cross_temp
        q = np.exp(y - y.max(axis=0))
        q /= q.sum(axis=0)
        out[b][:, J] = z_nms + cfg.alpha_cross * np.log(np.maximum(q, eps))
    return out


def ref_topk_sets(scores, k):
    """7. top-k of the finite scores per row (ties to the lowest position)."""
    sets = np.empty(scores.shape[:-1], dtype=object)
    for idx in np.ndindex(*scores.shape[:-1]):
        row = scores[idx]
        finite = np.nonzero(np.isfinite(row))[0]
        order = finite[np.argsort(-row[finite], kind="stable")]
        sets[idx] = set(order[:k].tolist())
    return sets


def check_selection(got, z_ref, lo, hi, k, tol=2e-4):
    """Properties, then the selected set against the reference set; a swap is accepted only
    between positions whose reference scores tie within float32 rounding at the k-th value."""
    got = np.asarray(got)
    B, H, _ = z_ref.shape
    assert got.shape == (B, H, k) and got.dtype == np.int32
    ref_sets = ref_topk_sets(z_ref, k)
    for b in range(B):
        size_j = max(0, min(hi[b], z_ref.shape[-1]) - max(lo[b], 0))
        n = min(k, size_j)
        for h in range(H):
            row = got[b, h]
            assert np.all(row[n:] == -1), (b, h, row)
            valid = row[:n]
            assert np.all((valid >= lo[b]) & (valid < hi[b])), (b, h, valid)
            assert np.all(np.diff(valid) > 0), "ascending and unique"
            diff = set(valid.tolist()) ^ ref_sets[b, h]
            if diff:
                kth = np.sort(z_ref[b, h][np.isfinite(z_ref[b, h])])[::-1][n - 1]
                gaps = [abs(z_ref[b, h, j] - kth) for j in diff]
                assert max(gaps) < tol, (b, h, sorted(diff), gaps)


# ---------------------------------------------------------------------------------------------
# transformers with SFI's attention sets
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Selection:
    """One layer's selection: the allowed range J = [lo, hi) and the scores z_adj [Hkv, S]
    (float64) it was chosen by; `sets` the chosen positions per KV head."""

    lo: int
    hi: int
    z: np.ndarray
    sets: list


def reference_select(logits, key_norms, lo, hi, cfg, prev: Selection | None = None) -> Selection:
    """§4 for one sequence: logits [Hkv, R, S], key_norms [Hkv, S], J = [lo, hi). With
    cfg.selection_memory and the selection in force `prev`, each position prev holds inside J
    scores at least what prev chose it with, less selection_memory (§8)."""
    hi = max(lo, hi)
    z = ref_scores(logits[None], key_norms[None], [lo], [hi], cfg)[0]
    if getattr(cfg, "selection_memory", None) is not None and prev is not None:
        for h, held in enumerate(prev.sets):
            for j in held:
                if lo <= j < hi:
                    z[h, j] = max(z[h, j], prev.z[h, j] - cfg.selection_memory)
    return Selection(lo, hi, z, list(ref_topk_sets(z[None], cfg.k_select)[0]))


@dataclasses.dataclass
class Reference:
    """What `sfi_reference` computed for one sequence of length T with a prompt of P tokens."""

    logits: np.ndarray  # [T - P + 1, vocab]: the logits at positions P - 1 .. T - 1
    initial: list  # per layer: the prefill's Selection (None for "streaming")
    final: list  # per layer: the Selection in force after the last position (None: sink only)


def _allowed_fast(i, sets, sfi, S):
    """Bool [Hkv, S]: what a fast step at position i reads per KV head (SFI_METHOD.md §2): the
    sink, the selected positions, the last n_recent positions before i, and i itself."""
    out = np.zeros((len(sets), S), bool)
    out[:, :min(sfi.n_sink, i + 1)] = True
    out[:, max(sfi.n_sink, i - sfi.n_recent):i + 1] = True
    for h, chosen in enumerate(sets):
        out[h, sorted(chosen)] = True
    return out


@contextlib.contextmanager
def _attention_function(model, fn):
    """Run `model` (transformers) with fn as its attention function."""
    from transformers import AttentionInterface

    AttentionInterface.register("sfi_reference", fn)
    old = model.config._attn_implementation
    model.set_attn_implementation("sfi_reference")
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def sfi_reference(hf_model, seq, prompt_len, sfi, slow=None) -> Reference:
    """transformers' float32 forward of one sequence `seq` (the prompt, then the tokens the
    decode steps fed) with the attention of SFI_METHOD.md §2-§5 for policy `sfi.policy`:
    the prompt is dense; the selector (numpy, §4) runs at prefill on the last prefill_window
    queries, and at the slow decode steps on that step's own queries, per layer over that
    layer's keys as transformers computed them (post-norm, post-RoPE); a slow step attends
    densely and its selection holds from the next position on; "oracle" selects at every
    position from its own dense logits and attends sparsely; "streaming" keeps the sink
    only; "prefill_only" keeps the prefill's selection; "sfi" / "tmax" refreshes remember the
    selection in force when sfi.selection_memory is set. A position whose context fits the
    budget (i + 1 <= n_sink + k_select + n_recent) is dense. slow: bool [T - P] for the
    decode steps of "sfi" / "tmax" (which steps refreshed is checked elsewhere)."""
    import torch

    P, T = prompt_len, len(seq)
    policy = sfi.policy
    assert sfi.evidence_window == 1 and sfi.successor_radius == 0, \
        "the paper's method only: pass SFIConfig.paper(...)"
    if policy in ("sfi", "tmax"):
        assert slow is not None and len(slow) == T - P, "slow flags per decode step"
    initial, final = {}, {}

    def attention(module, query, key, value, attention_mask=None, scaling=None, **_):
        l = module.layer_idx
        Hq, Hkv, D = query.shape[1], key.shape[1], query.shape[-1]
        G = Hq // Hkv
        q = query[0].detach().numpy().astype(np.float64)  # [Hq, T, D]
        k = key[0].detach().numpy().astype(np.float64)  # [Hkv, T, D]
        logits = np.einsum("hgtd,hsd->hgts", q.reshape(Hkv, G, T, D), k) * scaling
        norms = np.linalg.norm(key[0].detach().numpy(), axis=-1)  # [Hkv, T]
        causal = np.tril(np.ones((T, T), bool))
        allowed = np.broadcast_to(causal, (Hkv, T, T)).copy()

        def select_at(rows, length, prev=None):
            """The selector on query rows `rows` for a cache of `length` positions."""
            lg = np.where(causal[rows][None, None], logits[:, :, rows], -np.inf)
            lg = lg.reshape(Hkv, G * len(rows), T)
            return reference_select(lg, norms, sfi.n_sink, length - sfi.n_recent, sfi, prev)

        current = None
        if policy != "streaming":
            current = select_at(np.arange(max(0, P - sfi.prefill_window), P), P)
        initial[l] = current
        for s, i in enumerate(range(P, T)):
            if policy == "oracle":
                current = select_at(np.array([i]), i)
            elif policy in ("sfi", "tmax") and slow[s]:  # used from the next position on
                current = select_at(np.array([i]), i, prev=current)
                continue  # a slow step is dense
            if i + 1 <= sfi.budget:  # the context fits the budget: dense
                continue
            sets = [set()] * Hkv if current is None else current.sets
            allowed[:, i] = _allowed_fast(i, sets, sfi, T)
        final[l] = current
        mask = torch.where(torch.as_tensor(np.repeat(allowed, G, axis=0)), 0.0,
                           -torch.inf)[None]
        kr, vr = (x.repeat_interleave(G, dim=1) for x in (key, value))
        w = torch.softmax(query @ kr.transpose(2, 3) * scaling + mask, dim=-1)
        return (w @ vr).transpose(1, 2).contiguous(), None

    ids = torch.as_tensor(np.asarray(seq), dtype=torch.long)[None]
    with _attention_function(hf_model, attention), torch.no_grad():
        out = hf_model(ids).logits[0].float().numpy()
    L = len(initial)
    return Reference(out[P - 1:], [initial[l] for l in range(L)], [final[l] for l in range(L)])


def assert_positions(got, selection: Selection | None, length, sfi, tol=2e-4, what=""):
    """The runtime's packed positions got [Hkv, C] (sink first, then the selection ascending,
    -1 padded) against the reference selection of a row whose cache holds `length` positions.
    A differing position is accepted only at a near-tie of the reference scores at the k-th
    value (float32 rounding)."""
    got = np.asarray(got)
    n_sink = min(sfi.n_sink, length)
    for h in range(got.shape[0]):
        row = got[h][got[h] >= 0].tolist()
        assert row[:n_sink] == list(range(n_sink)), f"{what} head {h}: sink {row[:n_sink]}"
        chosen = row[n_sink:]
        want = set() if selection is None else selection.sets[h]
        assert chosen == sorted(chosen), f"{what} head {h}: not ascending {chosen}"
        diff = set(chosen) ^ want
        if diff:
            assert selection is not None and len(chosen) == len(want), (
                f"{what} head {h}: kept {chosen}, reference {sorted(want)}")
            z = selection.z[h]
            kth = np.sort(z[np.isfinite(z)])[::-1][len(want) - 1]
            gaps = [abs(z[j] - kth) for j in diff]
            assert max(gaps) < tol, (f"{what} head {h}: kept {chosen}, reference "
                                     f"{sorted(want)} (score gaps to the k-th {gaps})")
