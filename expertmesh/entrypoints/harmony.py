"""gpt-oss's harmony format, read from the generated text (its markers are special tokens, kept in
the text of requests a parser reads). After the template's `<|start|>assistant`, a reply is one or
more messages:

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the recipient `to=functions.NAME` may also stand before `<|channel|>`). The `openai_gptoss`
reasoning parser takes the analysis messages as reasoning; the `openai` tool parser takes
commentary messages addressed to `functions.NAME` as calls and the final (and commentary
preamble) messages as content. A message whose header is not complete yet is held back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([A-Za-z0-9_.:-]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class Message:
    raw: str  # the message's whole text, markers included
    channel: str | None
    recipient: str | None
    body: str
    complete: bool  # its header is complete (the body may still grow)


def messages(text: str) -> list[Message]:
    out = []
    for i, raw in enumerate(text.split(START)):
        if i > 0:
            raw = START + raw
        elif not raw:
            continue
        if MESSAGE not in raw:
            out.append(Message(raw, None, None, "", False))
            continue
        header, body = raw.split(MESSAGE, 1)
        for end in ENDS:
            body = body.split(end, 1)[0]
        channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
        out.append(Message(raw, channel and channel.group(1), recipient and recipient.group(1), body, True))
    return out


def is_harmony(text: str) -> bool:
    return CHANNEL in text or MESSAGE in text


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(analysis text or None, the other messages' raw text): what the tool parser reads next."""
    if not is_harmony(text):
        return None, text
    msgs = messages(text)
    analysis = [m.body for m in msgs if m.complete and m.channel == "analysis"]
    rest = "".join(m.raw for m in msgs if m.complete and m.channel != "analysis")
    return ("".join(analysis) if analysis else None), rest
