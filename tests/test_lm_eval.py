"""lm-evaluation-harness against a real `expertmesh serve`: `local-completions` log-likelihoods (echo +
logprobs) equal transformers' log-softmax sums and give the accuracy those imply; `local-chat-completions`
generations equal offline greedy `LLM.generate`. Tiny custom tasks from JSONL files (no hub datasets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serve_utils import ServeProcess
from test_server import _chat_ids

from expertmesh import LLM, SamplingParams
from expertmesh.config.model_source import DEFAULT_MODEL_DIR
from expertmesh.entrypoints.api_server import DEFAULT_SERVED_NAME

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is in the `lmeval` extra: pip install -e '.[lmeval]'"
)

MC_DOCS = [
    ("The capital of France is", ["Paris", "London", "a city"]),
    ("Two plus two equals", ["four", "five"]),
    ("The sky is", ["blue", "green", "made of cheese"]),
    ("My favourite animal is the", ["cat", "dog"]),
]
CHAT_DOCS = ["What is your name?", "Hi", "Count to three."]
MAX_GEN = 12
UNTIL = ["\n\n"]


def _reference_logliks(tok) -> list[list[float]]:
    """Each choice's log-likelihood as lm-eval defines it (the whole text tokenized, then split after
    the context; target delimiter " "; BOS first), from transformers' float32 log-softmax."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32).eval()
    out = []
    for ctx, choices in MC_DOCS:
        n_ctx = len(tok(ctx)["input_ids"])
        lls = []
        for choice in choices:
            ids = tok(f"{ctx} {choice}")["input_ids"]
            with torch.no_grad():
                logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            lls.append(sum(float(logp[i - 1, ids[i]]) for i in range(n_ctx, len(ids))))
        out.append(lls)
    return out


def _write_tasks(root: Path, labels: list[int]) -> None:
    mc = root / "mc.jsonl"
    mc.write_text("".join(json.dumps({"q": q, "choices": c, "label": y}) + "\n"
                          for (q, c), y in zip(MC_DOCS, labels, strict=True)))  # fmt: skip
    gen = root / "gen.jsonl"
    gen.write_text("".join(json.dumps({"q": q, "a": ""}) + "\n" for q in CHAT_DOCS))
    # JSON is valid YAML: the task configs lm-eval's TaskManager reads from include_path.
    common = {"dataset_path": "json", "test_split": "train", "doc_to_text": "{{q}}"}
    (root / "em_mc.yaml").write_text(json.dumps({
        **common, "task": "em_mc", "dataset_kwargs": {"data_files": {"train": str(mc)}},
        "output_type": "multiple_choice", "doc_to_choice": "{{choices}}", "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc"}],
    }))  # fmt: skip
    (root / "em_gen.yaml").write_text(json.dumps({
        **common, "task": "em_gen", "dataset_kwargs": {"data_files": {"train": str(gen)}},
        "output_type": "generate_until", "doc_to_target": "{{a}}",
        "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN, "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match"}],
    }))  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lm_eval_local_completions_and_chat(tmp_path: Path) -> None:
    from lm_eval.tasks import TaskManager

    llm = LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 24)
    tok = llm.get_tokenizer()
    ref = _reference_logliks(tok)
    best = [max(range(len(lls)), key=lls.__getitem__) for lls in ref]
    # Labels: the reference's best choice for the first half, another for the rest, so the accuracy
    # the reference implies is 0.5 and each document's argmax matters.
    half = len(MC_DOCS) // 2
    labels = [b if i < half else (b + 1) % len(ref[i]) for i, b in enumerate(best)]
    _write_tasks(tmp_path, labels)
    chat_refs = llm.generate(
        [{"prompt_token_ids": _chat_ids(tok, q)} for q in CHAT_DOCS],
        SamplingParams(temperature=0, max_tokens=MAX_GEN, stop=UNTIL),
        use_tqdm=False,
    )
    tm = TaskManager(include_path=str(tmp_path))
    server = ServeProcess([], tmp_path / "serve.log")
    try:
        server.wait_healthy()
        common = {"model": DEFAULT_SERVED_NAME, "num_concurrent": 1, "max_retries": 1, "timeout": 120}
        mc = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                **common,
                "base_url": f"{server.url}/v1/completions",
                "tokenizer": DEFAULT_MODEL_DIR,
                "tokenizer_backend": "huggingface",
                "add_bos_token": True,
            },
            tasks=["em_mc"],
            task_manager=tm,
            log_samples=True,
        )
        chat = lm_eval.simple_evaluate(
            model="local-chat-completions",
            model_args={**common, "base_url": f"{server.url}/v1/chat/completions"},
            tasks=["em_gen"],
            task_manager=tm,
            apply_chat_template=True,
            log_samples=True,
        )
    finally:
        server.stop()
    samples = sorted(mc["samples"]["em_mc"], key=lambda s: s["doc_id"])
    got = [[ll for ll, _greedy in s["filtered_resps"]] for s in samples]
    assert len(got) == len(ref)
    for g, r in zip(got, ref, strict=True):
        assert g == pytest.approx(r, abs=5e-4)  # float32: a few tokens' log-softmax, summed
    assert mc["results"]["em_mc"]["acc,none"] == pytest.approx(half / len(MC_DOCS))
    gens = [s["filtered_resps"][0] for s in sorted(chat["samples"]["em_gen"], key=lambda s: s["doc_id"])]
    assert all(gens) and gens == [r.outputs[0].text for r in chat_refs]
