"""The attention entry points of expertmesh's CPU kernels (csrc/decode_attention.c, prefill*.c,
head_matmul.c): decode and prefill attention over the paged KV cache, and per-head products (MLA). A part
of `CpuKernels` (cpu_kernels.py), which holds the loaded library; these only check shapes and call it."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch


class AttentionKernels:
    lib: ctypes.CDLL  # set by CpuKernels
    supports: Callable[[torch.dtype], bool]  # CpuKernels.supports: the dtypes the kernels take

    def head_matmul(self, x: torch.Tensor, w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
        """Per head: x [B, H, K] (rows may be strided, e.g. a split of the query) times w[h], w
        [H, K, N] -> [B, H, N]; with `transposed`, w is [H, N, K] and x[b, h] @ w[h]^T is taken."""
        b, h, k = x.shape
        if w.dim() != 3 or w.shape[0] != h or w.shape[2 if transposed else 1] != k:
            raise ValueError(
                f"head_matmul: x {tuple(x.shape)} does not fit w {tuple(w.shape)} (transposed={transposed})"
            )
        if x.stride(2) != 1 or not w.is_contiguous() or w.dtype != x.dtype or not self.supports(x.dtype):
            raise ValueError(
                f"head_matmul: x ({x.dtype}, strides {x.stride()}) and w ({w.dtype}) must share a "
                "supported dtype, with unit-stride rows"
            )
        n = w.shape[1 if transposed else 2]
        out = torch.empty(b, h, n, dtype=x.dtype)
        if b:
            fn = self.lib.head_matmul_f32 if x.dtype == torch.float32 else self.lib.head_matmul_bf16
            fn(
                x.data_ptr(),
                x.stride(0),
                x.stride(1),
                w.data_ptr(),
                out.data_ptr(),
                b,
                h,
                k,
                n,
                int(transposed),
                torch.get_num_threads(),
            )
        return out

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        chunk: int | None = None,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        """q [B, H, D], caches [blocks, block_size, Hk, D], int32 tables [B, W], lengths [B] -> [B, H, Dv].
        Keys seen: the last `sliding_window` tokens, within the newest token's `chunk`; `sinks` [H]
        a per-head logit in each softmax's denominator. Values are the first `value_dim` (Dv,
        default D) entries of the v_cache rows: a latent cache passes itself as both caches, with
        one shared head of kv_lora_rank + rope values whose first kv_lora_rank are the values."""
        b, h, d = q.shape
        _, bs, hk, _ = k_cache.shape
        dv = d if value_dim is None else value_dim
        for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
            if not t.is_contiguous() or t.dtype != q.dtype:
                raise ValueError(f"paged_decode: {name} must be contiguous {q.dtype}, got {t.dtype}")
        if k_cache.shape[-1] != d or v_cache.shape != k_cache.shape or h % hk or not 1 <= dv <= d:
            raise ValueError(
                f"paged_decode: q {tuple(q.shape)}, caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                f"and value_dim {dv} do not fit (same-shape caches of width D, H a multiple of Hk, Dv <= D)"
            )
        if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
            raise ValueError("paged_decode: block_tables and context_lens must be int32")
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
            if sinks.shape != (h,):
                raise ValueError(f"paged_decode: sinks must be [{h}], got {tuple(sinks.shape)}")
        out = torch.empty(b, h, dv, dtype=q.dtype)
        fn = self.lib.paged_decode_f32 if q.dtype == torch.float32 else self.lib.paged_decode_bf16
        fn(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.contiguous().data_ptr(),
            context_lens.contiguous().data_ptr(),
            out.data_ptr(),
            b,
            h,
            hk,
            d,
            dv,
            block_tables.shape[1],
            bs,
            scale,
            sliding_window or 0,
            chunk or 0,
            None if sinks is None else sinks.data_ptr(),
            torch.get_num_threads(),
        )
        return out

    def paged_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        chunk: int | None = None,
        sinks: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        context: int = 0,
    ) -> torch.Tensor:
        """Causal attention of q [L, H, D] (rows may be token-strided), row r at position
        context + r, over every key it sees -> [L, H, D]. With `block_table` (int32, the
        sequence's blocks) k and v are the paged caches [blocks, block_size, Hk, D] holding every
        position up to context + L - 1; without, k and v [context + L, Hk, D] are the sequence's
        own rows (token-strided views allowed, the same stride for both). Window, chunk and sinks
        as in `paged_decode`, for each row's own position."""
        length, h, d = q.shape
        paged = block_table is not None
        hk = k.shape[-2]
        if q.stride(2) != 1 or q.stride(1) != d:
            q = q.contiguous()
        strided = k.stride() != v.stride() or k.stride(-1) != 1 or k.stride(-2) != d
        if strided or (paged and not k.is_contiguous()):
            k, v = k.contiguous(), v.contiguous()
        if k.dtype != q.dtype or v.dtype != q.dtype or not self.supports(q.dtype):
            raise ValueError(f"paged_prefill: q {q.dtype}, k {k.dtype}, v {v.dtype}: one float32/bf16 dtype")
        if k.shape[-1] != d or v.shape != k.shape or h % hk or (not paged and k.shape[0] != context + length):
            raise ValueError(
                f"paged_prefill: q {tuple(q.shape)} and k / v {tuple(k.shape)} / {tuple(v.shape)} do not fit "
                f"(context {context}; without a block table k / v hold context + L rows)"
            )
        bs = k.shape[1] if paged else 1
        if paged and (block_table.dtype != torch.int32 or block_table.numel() * bs < context + length):
            raise ValueError(
                f"paged_prefill: block_table must be int32 covering {context + length} positions, got "
                f"{block_table.dtype} of {block_table.numel()} blocks of {bs}"
            )
        if sinks is not None:
            sinks = sinks.to(torch.float32).contiguous()
            if sinks.shape != (h,):
                raise ValueError(f"paged_prefill: sinks must be [{h}], got {tuple(sinks.shape)}")
        out = torch.empty(length, h, d, dtype=q.dtype)
        if not length:
            return out
        table = block_table.contiguous() if paged else None
        fn = self.lib.paged_prefill_f32 if q.dtype == torch.float32 else self.lib.paged_prefill_bf16
        fn(
            q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), hk * d if paged else k.stride(0),
            None if table is None else table.data_ptr(), bs, context, length, out.data_ptr(), h, hk, d,
            scale, sliding_window or 0, chunk or 0, None if sinks is None else sinks.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return out
