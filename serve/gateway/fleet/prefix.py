"""What each vLLM replica's prefix cache probably holds, approximated from what the gateway sent it (as llm-d's
approximate prefix scorer does): a prompt as the hashes of its successive blocks of text, each hash chained to the
ones before it (a block matches only behind the same beginning, as vLLM's cached blocks do), plus one for its
conversation (the x-session-id header, else the request's `user`, else its first two messages), which every later
turn repeats even while the prompt is shorter than a block. Each replica keeps the hashes it was recently sent, LRU-
bounded, and dispatch.py scores replicas by how much of a request's prefix they hold against the tokens they have in
flight, never by scraping vLLM (whose queue metrics lag by seconds)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import orjson


@dataclass(frozen=True)
class Prefix:
    """One request's routing facts: its conversation's hash, its prompt's chained block hashes, and the tokens it is
    likely to hold in flight (its prompt's, estimated at 4 characters a token, and the most it may generate)."""

    conversation: bytes
    blocks: tuple[bytes, ...]
    tokens: int


def _hash(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8).digest()


def prompt_text(messages: list | None, prompt) -> str:
    """A chat's messages (or a completion's prompt) as one text, in order, the way they reach the model's template."""
    if messages is not None:
        def content(m: dict) -> str:
            c = m.get("content")
            return c if isinstance(c, str) else orjson.dumps(c, default=str).decode()

        return "".join(f"{m.get('role', '')}\x00{content(m)}\x01" for m in messages if isinstance(m, dict))
    return prompt if isinstance(prompt, str) else orjson.dumps(prompt, default=str).decode()


def prefix_of(text: str, conversation: str, block_chars: int, max_tokens: int) -> Prefix:
    blocks, chain = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):  # full blocks only: vLLM caches full blocks
        chain = _hash(chain + text[start:start + block_chars].encode())
        blocks.append(chain)
    return Prefix(_hash(conversation.encode()), tuple(blocks), len(text) // 4 + max_tokens)


class PrefixIndex:
    """The block hashes one replica was sent, the most recent last, at most `capacity` of them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, prefix: Prefix) -> int:
        """The conversation (1 if seen) and the leading blocks this replica holds."""
        n = 0
        for block in prefix.blocks:
            if block not in self._seen:
                break
            n += 1
        return n + (prefix.conversation in self._seen)

    def add(self, prefix: Prefix) -> None:
        for h in (prefix.conversation, *prefix.blocks):
            self._seen[h] = None
            self._seen.move_to_end(h)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
