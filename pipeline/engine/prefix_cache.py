"""The embedded engine's prefix cache: a radix tree from token prefixes to their KV, within a byte budget.

What it buys: the G episodes of a group share their prompt's prefill (the first one computes it, the
others reuse it), and a multi-turn episode's next turn, whose prompt is the previous turn's prompt +
output + the environment's reply, prefills only the reply instead of the whole conversation.

Layout: one tree per namespace (the LoRA adapter a request runs with; None = the base weights, whose KV
differ from an adapter's). An edge holds a run of tokens and, per layer, the keys and values of exactly
those tokens, (kv_heads, n, head_dim) tensors the cache owns (contiguous copies, so evicting a node frees
its memory). A token's KV depend on every token before it and on its position, both fixed by the path
from the root, so a prefix found in the tree is exactly what a prefill of that prefix would compute (up
to float rounding of a differently shaped forward).

Eviction: least recently used leaves first, until the tensors held fit `budget_bytes`; a match or an
insert marks every node on its path as used. The batcher clears the cache whenever the KV it holds
would no longer be what the served weights compute (a weight update, an adapter refill, /flush_cache).

Not thread-safe: only the engine's worker thread touches it (readers of the counters take plain ints).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (keys, values), each (kv_heads, n, head_dim)
# gather(start, end): the KV of the inserted sequence's tokens [start, end), per layer, as above.
Gather = Callable[[int, int], LayerKV]


def kv_bytes(kv: LayerKV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge from the parent
    kv: LayerKV
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0

    def split(self, at: int) -> _Node:
        """Cut this edge after `at` tokens: a new parent holds the first `at`, this node keeps the rest.
        Both halves are copied so that each owns (and frees) exactly its own memory."""
        assert self.parent is not None and 0 < at < len(self.tokens)
        head = _Node(
            tokens=self.tokens[:at],
            kv=[(k[:, :at].clone(), v[:, :at].clone()) for k, v in self.kv],
            parent=self.parent,
            last_used=self.last_used,
        )
        self.parent.children[self.tokens[0]] = head
        self.tokens = self.tokens[at:]
        self.kv = [(k[:, at:].clone(), v[:, at:].clone()) for k, v in self.kv]
        self.parent = head
        head.children[self.tokens[0]] = self
        return head


@dataclass
class PrefixMatch:
    """The longest cached prefix of a sequence: `length` tokens, their KV in `pieces` (edge runs in order)."""

    length: int
    pieces: list[LayerKV]

    def write(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], row: int) -> None:
        """Copy the matched KV into the last `length` columns of `row` of batch tensors (B, kv_heads, T,
        head_dim), one pair per layer."""
        end = keys[0].shape[2]
        start = end - self.length
        for piece in self.pieces:
            n = piece[0][0].shape[1]
            for layer, (k, v) in enumerate(piece):
                keys[layer][row, :, start : start + n] = k
                values[layer][row, :, start : start + n] = v
            start += n


class PrefixCache:
    """Token prefix -> KV (module docstring). Counters: `bytes`, `tokens` held, `evicted_tokens`."""

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._roots: dict[Hashable, _Node] = {}
        self._clock = 0
        self.bytes = 0
        self.tokens = 0
        self.evicted_tokens = 0

    def clear(self) -> None:
        """Drop everything."""
        for namespace in list(self._roots):
            self.clear_namespace(namespace)

    def clear_namespace(self, namespace: Hashable) -> None:
        """Drop one namespace's tree (an adapter's KV when its weights change)."""
        root = self._roots.pop(namespace, None)
        for node in _descendants(root) if root is not None else []:
            self.bytes -= kv_bytes(node.kv)
            self.tokens -= len(node.tokens)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _walk(
        self, namespace: Hashable, tokens: Sequence[int], limit: int
    ) -> tuple[list[tuple[_Node, int]], int]:
        """Edges along `tokens[:limit]` from the root: (node, tokens of it matched); the last may match
        part of its edge. Returns them and the matched length."""
        path: list[tuple[_Node, int]] = []
        node = self._roots.get(namespace)
        matched = 0
        while node is not None and matched < limit:
            child = node.children.get(tokens[matched])
            if child is None:
                break
            edge = child.tokens
            common = 0
            bound = min(len(edge), limit - matched)
            while common < bound and edge[common] == tokens[matched + common]:
                common += 1
            path.append((child, common))
            matched += common
            if common < len(edge):
                break
            node = child
        return path, matched

    def match(self, namespace: Hashable, tokens: Sequence[int], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of `tokens[:limit]` (limit None = all); marks its nodes used."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        path, matched = self._walk(namespace, tokens, limit)
        now = self._tick()
        pieces: list[LayerKV] = []
        for node, count in path:
            node.last_used = now
            pieces.append(
                node.kv if count == len(node.tokens) else [(k[:, :count], v[:, :count]) for k, v in node.kv]
            )
        return PrefixMatch(matched, pieces)

    def insert(self, namespace: Hashable, tokens: Sequence[int], gather: Gather) -> int:
        """Cache the KV of `tokens` (gather supplies what the tree lacks); returns the tokens added. Then
        evicts least recently used leaves until the budget holds (possibly what was just added)."""
        if not tokens:
            return 0
        root = self._roots.setdefault(namespace, _Node(tokens=(), kv=[], parent=None))
        path, matched = self._walk(namespace, tokens, len(tokens))
        now = self._tick()
        added = len(tokens) - matched
        node = root
        for child, count in path:
            if count < len(child.tokens) and added:  # the new tokens branch off inside this edge
                child = child.split(count)
            child.last_used = now
            node = child
        if added:
            kv = [(k.contiguous(), v.contiguous()) for k, v in gather(matched, len(tokens))]
            leaf = _Node(tokens=tuple(tokens[matched:]), kv=kv, parent=node, last_used=now)
            node.children[leaf.tokens[0]] = leaf
            self.bytes += kv_bytes(kv)
            self.tokens += added
        self._evict()
        return added

    def _evict(self) -> None:
        if self.bytes <= self.budget_bytes:
            return
        # A parent is marked whenever a child is, so a parent that becomes a leaf is never older than
        # the leaf just evicted: one heap over (last use, creation order) stays in LRU order.
        leaves = [(n.last_used, id(n), n) for root in self._roots.values() for n in _descendants(root)]
        heap = [entry for entry in leaves if not entry[2].children]
        heapq.heapify(heap)
        while self.bytes > self.budget_bytes and heap:
            _, _, victim = heapq.heappop(heap)
            parent = victim.parent
            assert parent is not None
            del parent.children[victim.tokens[0]]
            self.bytes -= kv_bytes(victim.kv)
            self.tokens -= len(victim.tokens)
            self.evicted_tokens += len(victim.tokens)
            if not parent.children and parent.parent is not None:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))


def _descendants(root: _Node) -> list[_Node]:
    """Every node below `root` (root excluded)."""
    found: list[_Node] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        found.append(node)
        stack.extend(node.children.values())
    return found
