"""`EngineArgs`: vLLM's engine keywords declared once, with their defaults and help text.

`LLM(...)`'s keywords, the `generate` / `serve` command-line flags and the engine builder all
derive from this dataclass (tests/test_engine_args.py checks that they agree). Each field's
`metadata` holds its help text and, where argparse needs it, its flag aliases, parser and
choices; a field with `cli=False` is a Python-only keyword. Rules on one value or on several
values together are checked once, by the frozen configs built from these (config/__init__.py).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from expertmesh.config import ALL2ALL_BACKEND_NAMES, EXECUTOR_BACKENDS, EPLBConfig, ParallelConfig
from expertmesh.distributed.all2all_choice import choose_all2all_backend
from expertmesh.distributed.watchdog import DEFAULT_TIMEOUT_S

if TYPE_CHECKING:
    import torch


def _quantization(name: str) -> str:
    """A scheme LLM(quantization=...) takes, suffixes included ("int4-g32", "int8+head"), or
    "dequantize"."""
    # layers.quantization loads the kernels' Python side: imported only when the flag is given.
    from expertmesh.layers.quantization.online import OnlineScheme
    from expertmesh.layers.quantization.registry import DEQUANTIZE

    if name == DEQUANTIZE:
        return name
    try:
        OnlineScheme.parse(name)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name


def _arg(default: Any, help: str, *, cli: bool = True, **argparse_kw: Any) -> Any:
    """A field with its help text; `argparse_kw`: aliases=(...), type=..., choices=..., metavar=..."""
    return field(default=default, metadata={"help": help, "cli": cli, **argparse_kw})


@dataclass(frozen=True)
class EngineArgs:
    """vLLM's engine keywords (`LLM(...)` takes the same ones, with the same defaults)."""

    model: str | None = _arg(None, "local HF directory or hub id (default: the embedded tiny PhiMoE)")
    tokenizer: str | None = _arg(None, "tokenizer directory or hub id (default: the model's)")
    trust_remote_code: bool = _arg(False, "let transformers run the checkpoint's own Python code")
    tensor_parallel_size: int = _arg(1, "TP ranks per replica", aliases=("-tp",))
    data_parallel_size: int = _arg(1, "data-parallel replicas", aliases=("-dp",))
    pipeline_parallel_size: int = _arg(1, "pipeline stages", aliases=("-pp",))
    enable_expert_parallel: bool = _arg(False, "place whole experts over the EP group")
    all2all_backend: str | None = _arg(
        None,
        "MoE token exchange (default allgather_reducescatter; VLLM_ALL2ALL_BACKEND is honoured; "
        "alltoall needs --enable-expert-parallel)",
        choices=ALL2ALL_BACKEND_NAMES,
    )
    expert_placement: str = _arg(
        "contiguous", "which EP rank holds which expert", choices=("contiguous", "round_robin")
    )
    enable_eplb: bool = _arg(False, "expert-parallel load balancing (needs EP)")
    num_redundant_experts: int | None = _arg(None, "EPLB: replica slots beyond the experts")
    eplb_config: dict | EPLBConfig | None = _arg(
        None,
        'EPLB as JSON: {"num_redundant_experts": R, "step_interval": N (default 3000; 0 = never), '
        '"window_size": W (place by the last W forwards; default: since the last rebalance), '
        '"load_path": "an --expert-stats file to place experts at start-up", "log_balancedness": true}',
        type=json.loads,
    )
    distributed_executor_backend: str | None = _arg(
        None,
        "external_launcher: one engine per torchrun process (set automatically under torchrun); "
        "mp: this process spawns one worker per rank (what `serve` uses for several ranks); "
        "uni: this process alone",
        choices=tuple(b for b in EXECUTOR_BACKENDS if b is not None),
    )
    dtype: str | torch.dtype = _arg("auto", "auto (the checkpoint's), float32, bfloat16 or float16")
    seed: int = _arg(0, "engine seed (and, for `generate`, the sampling seed)")
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    gpu_memory_utilization: float = _arg(0.9, "share of the device memory for the KV cache (vLLM's)")
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV cache size per rank (default: 10%% of free RAM on CPU, capped at what is useful)"
    )
    block_size: int = _arg(16, "tokens per KV-cache block")
    max_num_seqs: int = _arg(256, "most sequences in one batch")
    max_num_batched_tokens: int | None = _arg(None, "tokens one step computes (default 8192)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts over steps")
    enable_prefix_caching: bool = _arg(True, "reuse shared prefixes' KV")
    enforce_eager: bool = _arg(True, "vLLM's switch; every step here runs eagerly")
    revision: str | None = _arg(None, "the hub revision (branch, tag or commit) of --model")
    device: str | None = _arg(None, "cpu or cuda (default: cuda when this rank sees one, else cpu)")
    pipeline_split: list[int] | None = _arg(
        None, "decoder layers per pipeline stage (default: as even as possible)", type=int, nargs="+"
    )
    debug_nan_recv_buffers: bool = _arg(
        False, "fill receive buffers with NaN, so a wrong source shows at once", cli=False
    )
    distributed_timeout_seconds: float = _arg(
        DEFAULT_TIMEOUT_S,
        "how long a rank may stop answering before the watchdog ends every rank, naming it",
    )
    allow_nonfinite_weights: bool = _arg(False, "load weights holding inf or NaN instead of failing")
    quantization: str | None = _arg(
        None,
        "online quantization of an unquantized checkpoint: weight-only int8 / int4 / fp8, or w8a8 / "
        "w4a8 (int8 / int4 weights, int8 activations); suffixes -g32 (inputs a scale), -ch (one a "
        "channel), +head (the LM head too); a quantized checkpoint's own format is read from its "
        "config.json and its codes held as stored, or dequantized to the model dtype at load with "
        "'dequantize'",
        aliases=("-q",),
        type=_quantization,
    )
    native_decode: bool = _arg(
        True,
        "decode-only steps through whole decoder layers in one native call where every block has a "
        "native form (cpu/native_decode.py); off: the per-op path only (A/B, debugging)",
    )
    warmup: bool = _arg(
        False,
        "dummy requests through every step shape before the first real one; on for `serve` (its first "
        "requests), off offline (the first generate measured as fast without it)",
    )
    speculative_config: dict | None = _arg(
        None,
        'speculative decoding as JSON (vLLM\'s keys): {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": A, "prompt_lookup_max": B} (docs/speculative_decoding.md)',
        type=json.loads,
    )
    deterministic: bool = _arg(
        False,
        "layout- and batch-invariant sums: every layout gives one process's logprobs bit for bit, "
        "bf16 included, at a cost in speed (docs/layouts.md)",
    )

    def __post_init__(self) -> None:
        t = self.distributed_timeout_seconds
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"distributed_timeout_seconds={t!r} must be a number > 0")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        """From a keyword dict; an unknown keyword is a TypeError naming it and the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(**kwargs)

    def parallel_config(self) -> ParallelConfig:
        """The parallel request (checked: sizes, backend names, EP rules), before any process is placed."""
        return ParallelConfig(
            self.tensor_parallel_size,
            self.data_parallel_size,
            self.pipeline_parallel_size,
            self.enable_expert_parallel,
            choose_all2all_backend(self.all2all_backend),
            self.distributed_executor_backend,
            self.expert_placement,
            self.enable_eplb,
            EPLBConfig.of(self.eplb_config, self.num_redundant_experts),
        )


def cli_fields() -> list[Field]:
    """The engine arguments that are command-line flags."""
    return [f for f in fields(EngineArgs) if f.metadata["cli"]]


def flag(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def _parser_type(f: Field) -> Any:
    """int / float / str from the annotation (`int | None` -> int); bools are switches."""
    first = str(f.type).split("|")[0].strip()
    return {"int": int, "float": float}.get(first, str)


def add_cli_args(
    p: argparse.ArgumentParser, skip: tuple[str, ...] = (), defaults: dict[str, Any] | None = None
) -> None:
    """One flag per engine argument, its default and help text taken from EngineArgs; `defaults`
    overrides a default for one command (serve warms up, offline use does not)."""
    defaults = defaults or {}
    unknown = sorted(set(defaults) - {f.name for f in cli_fields()})
    assert not unknown, unknown
    for f in cli_fields():
        if f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        meta = {k: v for k, v in f.metadata.items() if k not in ("help", "cli", "aliases")}
        names = [flag(f), *f.metadata.get("aliases", ())]
        assert f.default is not MISSING, f.name
        help_text = f.metadata["help"] + (" (default %(default)s)" if default is not None else "")
        if str(f.type) == "bool":
            on_off = "on" if default else "off"
            help_text = f"{f.metadata['help']} (default {on_off})"
            p.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            p.add_argument(
                *names, default=default, type=meta.pop("type", _parser_type(f)), help=help_text, **meta
            )


def from_cli(args: argparse.Namespace, **override: Any) -> dict[str, Any]:
    """LLM(...) keywords from parsed flags: every engine argument that is a flag, then `override`."""
    return {**{f.name: getattr(args, f.name) for f in cli_fields() if hasattr(args, f.name)}, **override}
