"""Every family in the layout matrix, from its shrunk published config: TP2 and PP2 (together,
PP2 x TP2), DP2 x TP2 with the `naive` and `allgather_reducescatter` backends, DP2 x PP2 with
expert parallelism over `alltoall`; on every rank the tokens equal the one-process run, with
uneven prompt loads (one DP rank with nothing) and receive buffers poisoned with NaN. One spawned
world of four ranks per family runs all four layouts. Sinks and q/k norms split over TP, sliding
windows, chunks, NoPE and dense leading layers over the pipeline stages (4 layers, 2 a stage),
expert counts that EP does not divide (7 over 2)."""

import pytest
from distributed_utils import run_distributed
from layout_cases import rank_main
from real_checkpoints import Sizes
from sweeps import sweep
from test_real_families import FAMILIES

from expertmesh import LLM, SamplingParams

LENGTHS = [4, 40, 9, 70, 2, 33]  # past the window / chunk of 32 and decoding past it
MAX_TOKENS = [3, 10, 6, 12, 3, 8]  # some requests finish many steps after others
LAYOUTS = [  # (DP, PP, TP, expert parallel, backend)
    (1, 2, 2, False, "allgather_reducescatter"),
    (2, 1, 2, False, "naive"),
    (2, 1, 2, False, "allgather_reducescatter"),
    (2, 2, 1, True, "alltoall"),
]
# The families whose blocks differ (the other published configs reuse these blocks), with an
# expert count EP 2 does not divide where the router allows it.
MATRIX = {
    "gpt-oss": Sizes(experts=7),
    "olmoe": Sizes(),
    "glm-4.5": Sizes(experts=7),
    "granite-shared": Sizes(),  # tied embeddings, a vocabulary TP 2 does not divide (515)
    "llama4": Sizes(experts=7),
    "llama4-interleaved": Sizes(),
    "qwen3-yarn": Sizes(),
    "phi-3.5-moe": Sizes(),
    "minimax-m2.7": Sizes(experts=7),  # whole-width q/k norm, its squares summed over TP
    "kimi-k2.5": Sizes(experts=7),  # MLA text tower under language_model., vision skipped
    "longcat-flash": Sizes(experts=7),  # two latent caches a layer, identity experts under EP
    "deepseek-v3.2": Sizes(),  # the indexer's keys beside the latent rows; 16 experts in 8 groups
}


def _prompts():
    import torch

    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


def _mine(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven loads: the first DP rank takes prompts 0, 2, 4, ...; the last one none at all."""
    if dp_size == 1:
        return list(range(len(LENGTHS)))
    return [] if dp_rank == dp_size - 1 else list(range(len(LENGTHS)))[::2]


ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, debug_nan_recv_buffers=True)


def _layout_tokens(llm: LLM, idx: list[int]) -> list[list[int]]:
    """This replica's share of the prompts, greedy: the tokens of each."""
    prompts = _prompts()
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in idx],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True) for i in idx],
        use_tqdm=False,
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "family",
    sweep(sorted(MATRIX), ["gpt-oss", "glm-4.5", "granite-shared", "llama4-interleaved", "minimax-m2.7"]),
)
def test_layout_matrix_equals_one_process(family, real_checkpoint):
    source, overrides = FAMILIES[family]
    path = real_checkpoint(source, sizes=MATRIX[family], **overrides)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS],
        use_tqdm=False,
    )
    expected = [o.outputs[0].token_ids for o in outs]
    per_ranks = run_distributed(rank_main, 4, path, LAYOUTS, ENGINE, _mine, _layout_tokens, timeout=230)
    for rank, per_rank in enumerate(per_ranks):
        for layout, idx, tokens in per_rank:
            assert tokens == [expected[i] for i in idx], (
                f"{family}: rank {rank}, (DP,PP,TP,EP,backend)={layout}"
            )
