"""Engine arguments are declared once (EngineArgs): LLM's signature, the CLI flags of `generate` and
`serve` and their --help derive from it and agree with it, and each cross-field rule fails at
construction with a message naming the values."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import MISSING, fields

import pytest

from expertmesh import LLM
from expertmesh.config import EPLBConfig, ParallelConfig
from expertmesh.config.engine_args import EngineArgs, cli_fields, flag, from_cli
from expertmesh.entrypoints.cli import COMMAND_DEFAULTS, build_parser


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_llm_signature_equals_engine_args():
    params = list(inspect.signature(LLM.__init__).parameters.values())[1:]  # without self
    want = [(f.name, f.default) for f in fields(EngineArgs)]
    got = [(p.name, p.default) for p in params]
    assert got == want
    assert all(f.default is not MISSING for f in fields(EngineArgs))
    annotations = {p.name: p.annotation for p in params}
    assert annotations == {f.name: f.type for f in fields(EngineArgs)}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_flags_and_help_agree_with_engine_args(command):
    sub = _subparser(command)
    by_dest = {a.dest: a for a in sub._actions}
    help_text = " ".join(sub.format_help().split())
    changed = COMMAND_DEFAULTS[command]  # the few defaults a command changes, declared in one place
    default = {f.name: changed.get(f.name, f.default) for f in cli_fields()}
    for f in cli_fields():
        action = by_dest[f.name]
        assert flag(f) in action.option_strings, f.name
        assert action.default == default[f.name], f.name
        first_help_words = " ".join(f.metadata["help"].replace("%%", "%").split()[:4])
        assert first_help_words in help_text, (f.name, first_help_words)
    # Defaults parse back to EngineArgs' own defaults: the flags of an empty command are EngineArgs().
    argv = ["--prompt", "x"] if command == "generate" else []
    parsed = from_cli(sub.parse_args(argv))
    assert {k: v for k, v in parsed.items()} == default
    # Python-only keywords are said to be so (no flag in --help).
    for f in fields(EngineArgs):
        if not f.metadata["cli"]:
            assert flag(f) not in help_text


def test_cli_values_reach_engine_args():
    sub = _subparser("serve")
    args = sub.parse_args(
        ["-tp", "2", "--enable-expert-parallel", "--all2all-backend", "alltoall", "--no-warmup",
         "--pipeline-split", "3", "5", "--eplb-config", '{"step_interval": 7}',
         "--distributed-timeout-seconds", "9"]
    )  # fmt: skip
    ea = EngineArgs.from_kwargs(from_cli(args, model="m"))
    assert (ea.tensor_parallel_size, ea.enable_expert_parallel, ea.all2all_backend) == (2, True, "alltoall")
    assert (ea.warmup, ea.pipeline_split, ea.distributed_timeout_seconds) == (False, [3, 5], 9.0)
    assert ea.eplb_config == {"step_interval": 7} and ea.model == "m"


def test_unknown_keyword_names_itself():
    with pytest.raises(TypeError, match=r"unknown engine argument\(s\) \['tensor_parallel'\]"):
        EngineArgs.from_kwargs({"tensor_parallel": 2})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(all2all_backend="alltoall"), "all2all_backend='alltoall' requires enable_expert_parallel=True"),
        (dict(all2all_backend="fastest"), "all2all_backend='fastest' is unknown; valid: .*naive"),
        (dict(enable_eplb=True), "enable_eplb=True needs enable_expert_parallel=True"),
        (dict(eplb_config={"step_interval": 5}), "is set but enable_eplb=False"),
        (dict(expert_placement="random"), "expert_placement='random' is unknown"),
        (dict(distributed_executor_backend="ray"), "distributed_executor_backend='ray' is unknown"),
    ],
)
def test_cross_field_rules_fail_at_construction_naming_the_values(kwargs, message):
    args = EngineArgs(**kwargs)  # the keywords themselves are accepted ...
    with pytest.raises(ValueError, match=message):
        args.parallel_config()  # ... the config they build checks the rule, once
    if "alltoall" in str(kwargs) or "eplb" in str(kwargs):
        fixed = {**kwargs, "enable_expert_parallel": True, "enable_eplb": True}
        assert isinstance(EngineArgs(**fixed).parallel_config(), ParallelConfig)  # the fixed request builds


@pytest.mark.parametrize("bad", [0, -1.0, "60", True])
def test_timeout_fails_at_construction(bad):
    with pytest.raises(ValueError, match=f"distributed_timeout_seconds={bad!r} must be a number > 0"):
        EngineArgs(distributed_timeout_seconds=bad)


def test_eplb_config_dict_and_object_agree():
    a = EngineArgs(enable_expert_parallel=True, enable_eplb=True, eplb_config={"step_interval": 5})
    b = EngineArgs(enable_expert_parallel=True, enable_eplb=True, eplb_config=EPLBConfig(step_interval=5))
    assert a.parallel_config() == b.parallel_config()
