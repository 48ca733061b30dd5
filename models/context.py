"""Context parallelism: each sequence of a micro-batch (every padded row, or the packed row)
split over the `cp` ranks of Megatron's context-parallel group (models/comm.py makes it), so a
long video sample's activations are shared out along the sequence.

- The sequence (padded to a multiple of 2 x cp with pad tokens at its end, which real tokens
  never see: causal) is cut into 2 x cp chunks in Megatron's load-balanced zig-zag order: rank r
  holds chunks r and 2cp-1-r, so every rank gets the same share of causal attention's work.
- The embeddings run on every CP rank over the full tokens (every CP rank of a DP group holds
  the same samples), then they and the M-RoPE position ids [3, b, s] are sliced to this rank's
  chunks (Qwen3-VL: its DeepStack features too, so they land on the same visual tokens). The
  vision tower's frames are split over the ranks (`vision`: `media_bounds`, then the features
  all-gathered by `gather_media`): run whole on every rank, the tower was a quarter of a CP 2
  rank's activations on an 8k-token video (bench_long_context.py).
- Core attention (models/attention.py), two ways (`comm`, policy.trainer.context_parallel_comm,
  Megatron's cp_comm_type names):
  - all_gather: K and V all-gathered over the CP group (differentiable: the backward sums the
    K/V gradients of all ranks' queries), masked by the chunks' global positions: causal, and
    within each sample for a packed row. Each chunk attends only the keys up to its own end (the
    rest are all masked), 5/8 of the scores of a full mask at CP 2. Every layer keeps the whole
    rows' K and V, and the micro-batch the chunks' masks.
  - a2a (Ulysses): Q, K and V trade positions for heads (`heads_to_sequence`, one all-to-all
    each), every rank runs plain causal attention over the whole sequence for 1/CP of the heads,
    and the output trades back. A layer keeps 1/CP of the whole rows' Q, K and V (no mask): what
    it keeps without CP, split CP ways. A TP rank's query heads must divide by CP, and its
    key/value groups too, or divide CP: fewer groups than ranks are copied first, so each rank
    gets the one its query heads use.
- Qwen3.5's gated DeltaNet layers run a recurrence along the whole sequence, which the chunks
  cannot split: they trade positions for heads instead (`heads_to_sequence`, one all-to-all,
  Ulysses-style), each rank running its share of the heads over every position, and back
  (`sequence_to_heads`) before the output projection (models/qwen35/model.py).
- The per-token logprobs (and entropy) of the local chunks are all-gathered back to the full
  sequence on every CP rank, so the loss function and metrics see the same [b, s] tensors as
  without CP, and each rank computes the same loss. The gather's backward keeps only the rank's
  own slice of the gradient; Megatron's schedule multiplies the loss by cp and its DDP averages
  over DP x CP (the dp_cp group), which together give CP 1's gradients.

The plan rides to the core attention as the model's `packed_seq_params` (a `PackedSeqParams`
subclass), so an activation recompute in the backward pass sees it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

from models.inputs import per_frame_grids


def padded_length(length: int, cp: int) -> int:
    """The sequence length a CP run computes: `length` rounded up to a multiple of 2 x cp."""
    return length if cp == 1 else -(-length // (2 * cp)) * 2 * cp


def chunk_index(length: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions rank `rank` holds of a sequence of `length` (a multiple of 2 x cp):
    chunks rank and 2cp-1-rank (Megatron's get_pos_emb_on_this_cp_rank order)."""
    c = length // (2 * cp)
    last = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(last * c, (last + 1) * c)])


@dataclass
class ContextParallel(PackedSeqParams):
    """One micro-batch's split over the CP group (built by `plan`)."""

    group: object = None  # Megatron's CP group (accelerator)
    size: int = 1
    rank: int = 0
    length: int = 0  # the sequence length before padding
    padded: int = 0  # after: a multiple of 2 x size
    samples: torch.Tensor | None = None  # packed row: [padded] each position's sample (pads: one more)
    index: torch.Tensor | None = None  # [padded / size] this rank's global positions
    comm: str = "all_gather"  # core attention's exchange: all_gather (K/V) or a2a (heads; see above)
    gathered: torch.Tensor | None = None  # [padded] the global positions in all-gather order
    _mask: tuple | None = None  # ((device, dtype), masks): see masks()
    _bounds: list[int] | None = None  # see sample_bounds()

    def to(self, device) -> "ContextParallel":
        for name in ("samples", "index", "gathered"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        return self

    # -- the model's inputs ----------------------------------------------------------------------
    def local(self, x: torch.Tensor | None, dim: int = 1, pad_value=0) -> torch.Tensor | None:
        """This rank's positions of `x` along `dim` (the unpadded sequence), padding first."""
        if x is None:
            return None
        extra = self.padded - x.shape[dim]
        if extra:
            shape = list(x.shape)
            shape[dim] = extra
            x = torch.cat([x, torch.full(shape, pad_value, dtype=x.dtype, device=x.device)], dim)
        return x.index_select(dim, self.index.to(x.device))

    def localise(self, hidden: torch.Tensor | None, position_ids: torch.Tensor):
        """Embeddings [s, b, h] (None after the first pipeline stage) and M-RoPE position ids
        [3, b, s] -> this rank's chunks."""
        return self.local(hidden, 0), self.positions(position_ids)

    def positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """M-RoPE position ids [3, b, s] -> this rank's chunks [3, b, s / size]. Pads repeat the
        last position (they never reach a real token)."""
        extra = self.padded - position_ids.shape[-1]
        if extra:
            position_ids = torch.cat([position_ids, position_ids[..., -1:].expand(*position_ids.shape[:-1], extra)], -1)
        return position_ids.index_select(-1, self.index.to(position_ids.device))

    # -- attention -------------------------------------------------------------------------------
    def masks(self, device, dtype) -> list[tuple[torch.Tensor, int]]:
        """Per local chunk: (an additive mask [c, end], 0 = attend, -inf = not; end), where `end`
        is the chunk's last global position + 1: causal attention sees no key beyond it, so the
        chunk attends only keys [0, end). Made once per micro-batch and dtype (every layer, and a
        recompute, shares them): from a boolean mask the kernel would make and keep its own
        float copy in every layer."""
        key = (device, dtype)
        if self._mask is None or self._mask[0] != key:
            c = self.padded // (2 * self.size)
            index = self.index.to(device)
            samples = None if self.samples is None else self.samples.to(device)
            made = []
            for j in range(2):
                q = index[j * c:(j + 1) * c]
                end = int(q[-1]) + 1
                allowed = torch.arange(end, device=device)[None, :] <= q[:, None]  # causal by global position
                if samples is not None:  # a packed row: within each sample
                    allowed &= samples[None, :end] == samples[q][:, None]
                made.append((torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")),
                             end))
            self._mask = (key, made)
        return self._mask[1]

    def attention(self, q, k, v, dropout: float, scale, gqa: bool) -> torch.Tensor:
        """q [b, heads, s_local, d], k and v [b, groups, s_local, d] -> [b, heads, s_local, d].
        all_gather: each of the rank's two chunks against the gathered keys up to its own end:
        rank r's chunks r and 2cp-1-r see (r + 1) c and (2cp - r) c keys, (2cp + 1) c^2 scores a
        rank instead of 4cp c^2 against every key (CP 2: 5/8), and every rank the same."""
        if self.comm == "a2a":
            return self._attention_by_heads(q, k, v, dropout, scale, gqa)
        k, v = _GatherKV.apply(k, self), _GatherKV.apply(v, self)
        c = q.shape[2] // 2
        return torch.cat([F.scaled_dot_product_attention(q[:, :, j * c:(j + 1) * c], k[:, :, :end], v[:, :, :end],
                                                         attn_mask=mask, dropout_p=dropout, scale=scale,
                                                         enable_gqa=gqa)
                          for j, (mask, end) in enumerate(self.masks(q.device, q.dtype))], 2)

    def _attention_by_heads(self, q, k, v, dropout: float, scale, gqa: bool) -> torch.Tensor:
        """a2a: this rank's positions of every head -> every position of this rank's 1/CP of the
        heads (query heads and key/value groups split alike, so a query head's group stays on its
        rank; fewer groups than ranks copied so that each rank gets its heads' group, their
        gradients summed by the copy's backward); causal attention over the whole rows, within
        each sample for a packed row; back."""
        b, heads, s, d = q.shape
        if k.shape[1] % self.size:  # e.g. 1 group over 2 ranks: a copy for each
            k, v = (x.repeat_interleave(self.size // x.shape[1], dim=1) for x in (k, v))

        def whole_rows(x):  # [b, n, s_local, d] -> [b, n / size, padded, d]
            n = x.shape[1]
            x = self.heads_to_sequence(x.permute(2, 0, 1, 3).reshape(s, b, n * d))
            return x.reshape(self.padded, b, n // self.size, d).permute(1, 2, 0, 3)

        q, k, v = whole_rows(q), whole_rows(k), whole_rows(v)
        bounds = [0, self.padded] if self.samples is None else self.sample_bounds()
        out = torch.cat([F.scaled_dot_product_attention(q[..., a:e, :], k[..., a:e, :], v[..., a:e, :], is_causal=True,
                                                        dropout_p=dropout, scale=scale, enable_gqa=gqa)
                         for a, e in zip(bounds, bounds[1:])], 2)
        out = self.sequence_to_heads(out.permute(2, 0, 1, 3).reshape(self.padded, b, -1))
        return out.reshape(s, b, heads, d).permute(1, 2, 0, 3)

    # -- the vision tower --------------------------------------------------------------------------
    def media_bounds(self, patches: list[int]) -> list[int] | None:
        """Media units (frames, in order) of `patches` patches each -> the CP ranks' contiguous
        runs [bounds[r], bounds[r + 1]), balanced by patches (the vision tower's cost, which is
        per frame). None with fewer units than ranks: every rank then runs them all."""
        n = len(patches)
        if n < self.size:
            return None
        cum = [0]
        for p in patches:
            cum.append(cum[-1] + p)
        bounds = [0]
        for k in range(1, self.size):
            first = next(i for i in range(1, n + 1) if cum[i] * self.size >= k * cum[-1])
            bounds.append(min(max(first, bounds[-1] + 1), n - (self.size - k)))  # none empty
        return bounds + [n]

    def vision(self, tower, pixels: torch.Tensor, grid: torch.Tensor, merge: int) -> torch.Tensor:
        """A vision tower `tower(pixels, grid) -> [merged tokens, h]` on media of `grid` ([n, 3]
        t, h, w patches), its frames split over the CP ranks: this rank runs its run of frames
        (`media_bounds`) as (1, h, w) grids and the features are all-gathered (`gather_media`).
        Exact for towers that attend within a frame (Qwen2-VL, Qwen2.5-VL's windows and full
        layers, Qwen3-VL), whose rotary and position tables are per frame too. With fewer frames
        than ranks every rank runs the whole media."""
        frames = per_frame_grids(grid)
        patches = frames.prod(-1).tolist()
        bounds = self.media_bounds(patches)
        if bounds is None:
            return tower(pixels, grid)
        a, b = bounds[self.rank], bounds[self.rank + 1]
        local = tower(pixels[sum(patches[:a]):sum(patches[:b])], frames[a:b])
        counts = [sum(patches[bounds[r]:bounds[r + 1]]) // merge ** 2 for r in range(self.size)]
        return self.gather_media(local, counts)

    def gather_media(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's media features [counts[rank], h] -> every rank's, in rank order [sum, h].
        Backward: every rank's chunks used every feature, so the gradients are summed over the
        CP group and each rank keeps its own rows (for its share of the vision tower)."""
        return _GatherMedia.apply(x, self, counts)

    def sample_bounds(self) -> list[int]:
        """A packed row's sample boundaries over the padded sequence (the pads one more sample),
        read to the host once per micro-batch, not once per layer."""
        if self._bounds is None:
            counts = torch.unique_consecutive(self.samples.cpu(), return_counts=True)[1]
            self._bounds = [0] + torch.cumsum(counts, 0).tolist()
        return self._bounds

    # -- heads instead of positions (Qwen3.5's DeltaNet layers) -----------------------------------
    def heads_to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[s_local, b, size x d]: this rank's positions with every head group (group g: the g-th
        d columns) -> [padded, b, d]: every position, in global order, of head group `rank`. One
        all-to-all over the CP group (Ulysses-style); the backward is `sequence_to_heads`'."""
        return _AllToAll.apply(x, self, True)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse: [padded, b, d] of head group `rank` -> [s_local, b, size x d]."""
        return _AllToAll.apply(x, self, False)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        s, b, width = x.shape
        send = x.reshape(s, b, self.size, width // self.size).permute(2, 0, 1, 3).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=self.group)  # got[r]: rank r's positions, this rank's heads
        order = torch.argsort(self.gathered).to(x.device)
        return got.reshape(self.size * s, b, -1).index_select(0, order)

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        padded, b, d = x.shape
        send = x.index_select(0, self.gathered.to(x.device)).reshape(self.size, padded // self.size, b, d)
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send.contiguous(), group=self.group)  # got[r]: this rank's positions, r's heads
        return got.permute(1, 2, 0, 3).reshape(padded // self.size, b, self.size * d)

    # -- scores ----------------------------------------------------------------------------------
    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token values [b, s_local] -> [b, length] in global order, on every CP rank."""
        return _GatherScores.apply(x, self)

    @torch.no_grad()
    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Without gradient: [b, s_local, ...] (e.g. logits) -> [b, length, ...] on every CP rank."""
        return self._all_gather(x, 1)[:, : self.length]

    def _all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        order = torch.argsort(self.gathered).to(x.device)  # global position j came from gathered[order[j]]
        return torch.cat(parts, dim).index_select(dim, order)

    def _own(self, grad: torch.Tensor, dim: int) -> torch.Tensor:
        """A gradient in global order -> this rank's slice (its positions, in its order)."""
        return grad.index_select(dim, self.index.to(grad.device))


class _GatherKV(torch.autograd.Function):
    """K or V [b, g, s_local, d] -> [b, g, padded, d] in global order. Backward: every rank's
    queries contributed to every rank's keys, so the gradients are summed over the CP group and
    each rank keeps its slice."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        return cp._all_gather(x, 2)

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        grad = grad.contiguous()
        dist.all_reduce(grad, group=cp.group)
        return cp._own(grad, 2), None


class _GatherMedia(torch.autograd.Function):
    """Features [counts[rank], h] -> [sum(counts), h] (ranks' rows padded to the longest for the
    all-gather). Backward as _GatherKV's: summed over the CP group, this rank's rows kept."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel, counts: list[int]):
        ctx.cp, ctx.counts = cp, counts
        longest = max(counts)
        parts = [x.new_empty((longest, *x.shape[1:])) for _ in counts]
        dist.all_gather(parts, F.pad(x, (0, 0, 0, longest - x.shape[0])).contiguous(), group=cp.group)
        return torch.cat([part[:n] for part, n in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        cp, counts = ctx.cp, ctx.counts
        grad = grad.contiguous()
        dist.all_reduce(grad, group=cp.group)
        start = sum(counts[:cp.rank])
        return grad[start:start + counts[cp.rank]], None, None


class _AllToAll(torch.autograd.Function):
    """The all-to-all between positions and heads over the CP group (`to_sequence`: positions to
    heads, else back): a permutation of the elements, so the backward is the other direction on
    the gradient."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel, to_sequence: bool):
        ctx.cp, ctx.to_sequence = cp, to_sequence
        return cp._to_sequence(x) if to_sequence else cp._to_heads(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        return (ctx.cp._to_heads(grad) if ctx.to_sequence else ctx.cp._to_sequence(grad)), None, None


class _GatherScores(torch.autograd.Function):
    """Scores [b, s_local] -> [b, length]. Every CP rank computes the same loss from them, so the
    backward keeps the rank's own slice without communication."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallel):
        ctx.cp = cp
        return cp._all_gather(x, 1)[:, : cp.length]

    @staticmethod
    def backward(ctx, grad):
        cp = ctx.cp
        grad = F.pad(grad, (0, cp.padded - cp.length))
        return cp._own(grad, 1), None


def check_heads(spec, tp: int, cp: int, prefix: str = "") -> None:
    """a2a splits a TP rank's query heads over the CP ranks, and its key/value groups (copied
    first where there are fewer than ranks): the heads must divide by CP, the groups divide it
    or be divided by it."""
    heads, groups = spec.num_heads // tp, spec.num_kv_heads // tp
    if heads % cp or (groups % cp and cp % groups):
        raise ValueError(f"{prefix}context_parallel_comm=a2a: a TP rank's {heads} query heads must divide by "
                         f"context_parallel={cp}, and its {groups} key/value groups divide it or be divided by it "
                         f"(num_attention_heads {spec.num_heads}, num_key_value_heads {spec.num_kv_heads}, "
                         f"tensor_parallel {tp}); use all_gather")


def plan(length: int, cu_seqlens: torch.Tensor | None = None, cp_comm: str = "all_gather") -> ContextParallel | None:
    """This rank's share of a sequence of `length` (a packed row: with its samples' boundaries
    `cu_seqlens`), with core attention exchanging by `cp_comm`, or None without context parallelism
    (today's path, untouched)."""
    from models.comm import comm

    groups = comm()
    if groups.cp_size == 1:
        return None
    cp, rank = groups.cp_size, groups.cp_rank
    padded = padded_length(length, cp)
    samples = None
    if cu_seqlens is not None:
        bounds = cu_seqlens.long().cpu()
        samples = torch.full((padded,), len(bounds) - 1, dtype=torch.long)  # pads: a sample of their own
        samples[:length] = torch.repeat_interleave(torch.arange(len(bounds) - 1), bounds[1:] - bounds[:-1])
    return ContextParallel(qkv_format="sbhd", group=groups.cp, size=cp, rank=rank, length=length, padded=padded,
                           samples=samples, index=chunk_index(padded, cp, rank), comm=cp_comm,
                           gathered=torch.cat([chunk_index(padded, cp, r) for r in range(cp)])).to(groups.device)
