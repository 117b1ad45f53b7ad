"""Layouts in bfloat16 at a real model's width: every rank's logprobs stay next to one process's.

The checkpoint is Phi-mini-MoE's published config.json (tests/real_configs/) at its full width
(hidden 4,096, 16 experts of 960, 32 heads of 128, 8 KV heads, vocab 32,064), shrunk in depth
only (2 of its 32 layers, so PP2 has one a stage), with random bf16 weights. Every partial sum
that crosses ranks is summed in float32 and rounded once, and the logits are float32
(docs/layouts.md), so what is left between a layout and one process is float32
summation order: a few bf16 roundings that fall the other way, and through them, rarely, a
sparsemixer routing decision (a hard threshold on bf16 router logits) that flips for a token.

Measured on this machine (AMD Zen 3, our widening bf16 kernels), 16 teacher-forced positions
(first token / max over the 16): TP2 0.0103 / 0.0152, TP2 + EP 0.0103 / 0.0168, DP2 x TP2 (naive
and allgather_reducescatter) 0.0103 / 0.0137, DP2 x TP2 + EP (alltoall) 0.0103 / 0.0168; PP2 and
DP2 + EP 0 (bitwise). Before partials went float32 (bf16 logits too), TP2 on another sequence: 0.031 / 0.34.
Over 64 positions (docs/layouts.md) one position in 64 flipped a sparsemixer decision (0.73),
against 4 in 64 before: hence the bound on all positions but one, and a loose one on the last.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from distributed_utils import run_distributed

from expertmesh import LLM, SamplingParams

CONFIG = Path(__file__).parent / "real_configs" / "phi-mini-moe.json"
POSITIONS = 16  # teacher-forced positions compared
TOP = 5  # reference tokens compared at each position
ASKED = 20  # logprobs a layout returns: the reference's top-5 must be among its top-20
BOUND_FIRST = 0.02  # the first generated token's top-5 logprobs, every rank (measured <= 0.0094)
BOUND_FORCED = 0.02  # every teacher-forced position but one (measured max 0.018)
BOUND_FLIP = 1.0  # the one left: a sparsemixer flip measured 0.73; a wrong layout is off by units
WORLD2_TP_PP = [  # (DP, PP, TP, EP, backend)
    (1, 1, 2, False, "allgather_reducescatter"),  # TP2: row-parallel all-reduce, MoE tp mode
    (1, 2, 1, False, "allgather_reducescatter"),  # PP2: nothing summed across stages
]
WORLD2_EP = [
    (1, 1, 2, True, "allgather_reducescatter"),  # EP over TP: whole experts, TP all-reduce
    (2, 1, 1, True, "alltoall"),  # DP2 + EP: tokens sent to their experts' ranks
]
WORLD4 = [
    (2, 1, 2, False, "naive"),  # dp_tp: experts split over DP x TP, all-reduce combine
    (2, 1, 2, False, "allgather_reducescatter"),  # dp_tp, reduce-scatter combine
    (2, 1, 2, True, "alltoall"),  # EP + sequence parallel
]


def build_checkpoint(path: str, tokenizer_dir: str, layers: int, seed: int = 0) -> str:
    """The published config with `layers` decoder layers and random bf16 weights, saved by
    transformers' own class. The model is built on the meta device and its weights drawn once,
    directly (normal, std = initializer_range; norm weights 1 and biases 0, each shaken by 0.1 so
    a dropped one shows): transformers' own init takes 2-3x longer at this size.
    """
    import transformers

    config = json.loads(CONFIG.read_text())
    config["num_hidden_layers"] = layers
    os.makedirs(path, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))
    hf = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = transformers.PhimoeForCausalLM._from_config(hf, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.1, generator=g)
            else:
                p.normal_(0, hf.initializer_range, generator=g)
    model.save_pretrained(path)
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))  # the published spelling
    for name in os.listdir(tokenizer_dir):
        (Path(path) / name).write_bytes((Path(tokenizer_dir) / name).read_bytes())
    return path


@pytest.fixture(scope="module")
def real_width(tmp_path_factory, tokenizer_dir):
    """(checkpoint, teacher-forced prompts, one process's logprobs for each)."""
    path = build_checkpoint(str(tmp_path_factory.mktemp("phi_mini_moe_2layers")), tokenizer_dir, 2)
    return (path, *reference(path))


def engine(path: str, dp=1, pp=1, tp=1, ep=False, backend="allgather_reducescatter", **kw) -> LLM:
    """A bf16 engine in the given layout (test_bitwise_layouts builds its engines here too);
    `kw`: further LLM keywords, overriding the KV cache size."""
    return LLM(
        path,
        dtype="bfloat16",
        data_parallel_size=dp,
        pipeline_parallel_size=pp,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        all2all_backend=backend,
        distributed_executor_backend="external_launcher" if dp * pp * tp > 1 else None,
        max_model_len=64,
        **{"kv_cache_memory_bytes": 1 << 25, **kw},
    )


def first_token_logprobs(llm: LLM, prompts: list[list[int]], n: int) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]


def reference(path: str) -> tuple[list[list[int]], list[dict[int, float]]]:
    """One process on 16 prefixes of one random sequence (teacher forcing: position i is
    predicted from the sequence's first 4 + i tokens, whatever the engine would have chosen)."""
    llm = engine(path)
    vocab = llm.llm_engine.config.model_config.vocab_size
    sequence = torch.randint(3, vocab, (4 + POSITIONS,), generator=torch.Generator().manual_seed(7)).tolist()
    prompts = [sequence[: 4 + i] for i in range(POSITIONS)]
    return prompts, first_token_logprobs(llm, prompts, ASKED)


def _rank_main(rank, world, path, prompts, layouts):
    results = []
    for dp, pp, tp, ep, backend in layouts:
        llm = engine(path, dp, pp, tp, ep, backend)
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        order = list(range(len(prompts)))[:: -1 if dp_rank % 2 else 1]  # DP ranks batch differently
        lps = first_token_logprobs(llm, [prompts[i] for i in order], ASKED)
        results.append(((dp, pp, tp, ep, backend), dict(zip(order, lps, strict=True))))
        del llm
    return results


def differences(ref: list[dict[int, float]], got: dict[int, dict[int, float]]) -> list[float]:
    """Per position: max |logprob difference| over the reference's top-5 tokens (infinite when
    one of them is not even in the layout's top-20)."""
    out = []
    for i, lps in sorted(got.items()):
        top = sorted(ref[i], key=ref[i].get, reverse=True)[:TOP]
        out.append(max(abs(lps[t] - ref[i][t]) if t in lps else float("inf") for t in top))
    return out


def check(
    real_width,
    world: int,
    layouts: list[tuple],
    timeout: float = 170,
    bound: float = BOUND_FORCED,
    all_but: int = 1,
    flip: float = BOUND_FLIP,
) -> None:
    """Every rank of every layout: the first token within BOUND_FIRST (and `bound`), all
    positions but `all_but` within `bound`, every one within `flip`; PP alone bitwise equal."""
    path, prompts, ref = real_width
    results = run_distributed(_rank_main, world, path, prompts, layouts, timeout=timeout, gloo_timeout=120)
    report = [
        (f"rank {rank} (DP, PP, TP, EP, backend)={layout}", layout, differences(ref, got))
        for rank, per_rank in enumerate(results)
        for layout, got in per_rank
    ]
    for where, _, diffs in report:
        print(f"{where}: first token {diffs[0]:.4f}, sorted: {[round(d, 4) for d in sorted(diffs)]}")
    for where, layout, diffs in report:
        assert diffs[0] <= min(bound, BOUND_FIRST), f"{where}: first-token top-{TOP} logprobs: {diffs[0]}"
        assert sorted(diffs)[-1 - all_but] <= bound, f"{where}: teacher-forced differences {diffs}"
        assert max(diffs) <= flip, f"{where}: teacher-forced differences {diffs}"
        if layout[2] == 1 and layout[0] == 1:  # PP alone: the same arithmetic, stage by stage
            assert max(diffs) == 0.0, f"{where}: {diffs}"


@pytest.mark.slow  # the CI budget: PP x TP stays covered by the float32 layout matrices
@pytest.mark.timeout(200)
def test_real_width_bf16_tp2_pp2(real_width):
    check(real_width, 2, WORLD2_TP_PP)


@pytest.mark.slow  # the CI budget: EP in bf16 stays covered by the world-4 alltoall layout below
@pytest.mark.timeout(200)
def test_real_width_bf16_expert_parallel_on_two_ranks(real_width):
    check(real_width, 2, WORLD2_EP)


@pytest.mark.timeout(200)
def test_real_width_bf16_dp2_tp2_every_backend(real_width):
    """naive and alltoall (EP + SP) by default; the reduce-scatter combine with -m slow (the CI
    budget: the float32 layout matrices run that backend at world 4)."""
    check(real_width, 4, [WORLD4[0], WORLD4[2]])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_real_width_bf16_dp2_tp2_reduce_scatter(real_width):
    check(real_width, 4, [WORLD4[1]])


@pytest.mark.timeout(120)
def test_shared_expert_bf16_dp2_tp2(checkpoint):
    """Qwen2-MoE's shared expert (a TP-partial dense MLP added to the routed sum before the TP
    all-reduce; under EP + sequence parallel, all-reduced apart and added after the gather), in
    bf16 at a tiny width (hidden 64), where float32 order hardly ever tips a bf16 rounding:
    measured identical to one process at all 16 positions (0.016 with partials rounded first)."""
    path = checkpoint("qwen2_moe", num_hidden_layers=2)
    check((path, *reference(path)), 4, [WORLD4[1], WORLD4[2]], bound=0.005)


WORLD4_MORE = [
    (1, 1, 4, False, "allgather_reducescatter"),  # TP4: four-way row-parallel sums
    (1, 2, 2, False, "allgather_reducescatter"),  # PP2 x TP2
    (4, 1, 1, True, "alltoall"),  # DP4 + EP: four experts a rank
    (1, 4, 1, False, "allgather_reducescatter"),  # PP4: one layer a stage
]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_real_width_bf16_four_layers(tmp_path_factory, tokenizer_dir):
    """On demand (pytest -m slow): 4 of Phi-mini-MoE's layers, every world-4 layout above and
    TP4, PP2 x TP2, DP4 + EP, PP4. Deeper, this random model is chaotic in bf16: one process in
    bf16 is 0.27 (median over 64 positions) from itself in float32, and a layout's one-step
    differences grow through 4 layers into routing flips at several positions. Measured over
    64 positions, TP2 and DP2 x TP2: median 0.028-0.031, 15-17 above 0.1 (before: median 0.25,
    42-44 above 0.1); over this test's 16: median 0.034-0.045 for the world-4 layouts, 0.03 for
    PP2 x TP2, 0.10-0.12 for TP4 (four-way split sums), 0 for DP4 + EP and PP4 (bitwise).
    Asserted: the first token within 0.02, the median position within 0.15."""
    path = build_checkpoint(str(tmp_path_factory.mktemp("phi_mini_moe_4layers")), tokenizer_dir, 4)
    ref = (path, *reference(path))
    deep = dict(bound=0.15, all_but=POSITIONS // 2, flip=float("inf"))
    check(ref, 4, WORLD4, timeout=500, **deep)
    check(ref, 4, WORLD4_MORE, timeout=600, **deep)
