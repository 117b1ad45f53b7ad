"""Token ids -> text, and the stop conditions that need text (stop strings) or ids (EOS)."""

from __future__ import annotations

from expertmesh.engine.incremental_text import IncrementalText
from expertmesh.engine.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer, model_eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        eos = set(model_eos_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_stop(self, seq: Sequence) -> tuple[str, int | str | None] | None:
        """(finish_reason, stop_reason) once the newest token ends the sequence, else None."""
        p, token = seq.params, seq.output_token_ids[-1]
        if len(seq.output_token_ids) < p.min_tokens:
            return None
        if not p.ignore_eos and token in self.eos_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        if p.stop_strings:
            # Incremental: a token costs the same at position 10 and 10,000. A stop string not in
            # the text before this token can only start in its last (longest stop - 1) characters.
            if seq.stop_scan is None:
                seq.stop_scan = IncrementalText(0)
            before = len(seq.stop_scan.text)
            skip = p.skip_special_tokens
            text = seq.stop_scan.decoded(seq.output_token_ids, lambda ids: self.decode(ids, skip))
            start = max(0, before - max(len(s) for s in p.stop_strings) + 1)
            for stop in p.stop_strings:
                at = text.find(stop, start)
                if at >= 0:
                    seq.text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
                    return "stop", stop
        return None

    def final_text(self, seq: Sequence) -> str:
        if isinstance(seq.stop_reason, str):
            return seq.text  # already cut at the stop string
        ids = seq.output_token_ids
        # vLLM leaves the EOS token out of the text (and it is a special token anyway).
        return self.decode(ids, seq.params.skip_special_tokens)
