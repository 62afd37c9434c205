"""``DefaultSourceProcessor``: one backend's engine KV events in, prefix events out.

Per batch: (1) apply every event to the :class:`~listener.tracker.BlockTracker` in order,
attributing what needs no I/O; (2) recover the prompts of new unattributed chains through
``/detokenize`` (:mod:`listener.recovery`); (3) emit what changed for each prefix
(``cache_created`` / ``cache_offloaded`` / ``cache_evicted``; the tier rules are in
:mod:`listener.tracker`). ``AllBlocksCleared`` and :meth:`DefaultSourceProcessor.reset`
emit ``cache_cleared`` at once.

How a new block gets its prefix, first rule that applies:

1. A *tainted* block (mismatched block size, vLLM null/masked blocks) and its descendants
   get none (the seed's mismatched-block rule).
2. Its parent is attributed: it inherits the parent's prefix (no call).
3. The event carries a router-issued salt valid for this backend (vLLM: a string of
   ``extra_keys[0]`` of the event holding block 0; SGLang/TensorRT-LLM: ``cache_salt``):
   the salt's prefix hash, with no tokens kept and no call. A salt that is present but
   invalid (forged, or issued for another backend), or a missing salt when the source
   requires one (``require_salt``, always on for TensorRT-LLM), discards the event's blocks
   (``salt_rejected``). vLLM ``extra_keys`` strings count as salts only in the router's
   ``cr1-`` format (LoRA names and multimodal ids share those entries).
4. Otherwise the block keeps its token segment (when its chain fits ``max_chain_tokens``)
   and the chain is recovered from text after the batch's events are applied. A stored
   chain whose tip lies beyond ``max_chain_tokens`` is not recovered (the seed: longer
   chains keep their sequence but stay unattributed); its blocks within the limit keep
   their tokens for shorter chains that branch off them.

Engine rules: vLLM events of KV groups that are not full attention (``kv_cache_spec_kind``,
remembered per ``group_idx``) give no prefix hits and are not tracked (``ignored_blocks``);
a vLLM event with more tokens than ``len(block_hashes) * block_size`` has null/masked blocks
(§4.4): its blocks are tracked but tainted (``masked_blocks``). A store with neither
tokens nor ``block_size`` (vLLM's offloading connector's placeholder for a block it copied
to CPU or storage) adds that medium to the block when tracked, else is skipped
(``placeholder_blocks``). Any other event whose
non-empty ``token_ids`` do not fill ``len(block_hashes) * block_size`` exactly (SGLang's
per-event rule; the seed's single-block rule), or whose ``block_size`` exceeds the source's
configured ``block_size``, is mismatched: its blocks keep only their chain length, are
tainted, ``mismatched_blocks`` counts the event and one warning per source is logged. A
``BlockRemoved`` without a medium means the GPU, except for TensorRT-LLM, whose ``removed``
drops a block from every cache level. ``AllBlocksCleared`` without a medium is a reset;
with one, that medium is dropped from every block (a reset if that leaves no block, nothing
to emit if there was none).

Data parallelism: each rank has its own cache, so for a TensorRT-LLM source (attention DP)
and for a vLLM/SGLang source with ``data_parallel_size`` > 1 (one backend, one stream per
rank) a batch's ``data_parallel_rank`` (vLLM's ``data_parallel_rank``, SGLang's
``attn_dp_rank``, TensorRT-LLM's ``attention_dp_rank``) is part of its blocks' keys, group
``(rank, group_idx)`` (TensorRT-LLM: ``(rank, window_size)``): a removal on one rank leaves
the copy another rank holds, and the prefix goes when the last rank drops it. An
``AllBlocksCleared`` in such a batch (the engine reset that rank's cache, or the source lost
that rank's events or saw it restart) drops that rank's blocks only; if that leaves no block
at all it is a reset (``cache_cleared``), but a clear that finds the tracker empty already
emits nothing (a rank cleared twice, or before anything was stored). Batches without a rank
key blocks as before, and so does every batch of a vLLM/SGLang source with one rank (its
keys stay ``(group_idx, hash)``). A TensorRT-LLM
``updated`` cache-level change arrives as a placeholder store on the new medium and a removal
from the old one (``listener.decode_trtllm``): the block moves tier, an unknown block is
skipped (``placeholder_blocks``).

Chain keys (:mod:`listener.chain`): after the prefixes, every stored event whose blocks
carry their token ids gets the router's chain keys of its blocks (one ``/detokenize`` call
per event), each attributed to the block its end lies in and reported under the prefix of
the chain's tip; evicting a block removes exactly the chain keys whose end lay in it.
Chains attributed through a salt get none (a salt names the seed key only, and costs no
call).

Nothing logs or exposes prompt text, token ids, salts or response bodies.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from continuum.cache_salt import SALT_VERSION, verify_salt
from continuum.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from listener.chain import ChainKeys, NewBlocks
from listener.config import DetokenizeConfig, LimitsConfig, SourceConfig
from listener.model import CACHE_CLEARED, Emit, PrefixEvent
from listener.recovery import EngineClient, HttpClient, PromptRecovery, RecoveryJob
from listener.tracker import (
    ALL_MEDIA,
    INHERITED_FLAGS,
    NO_TEXT,
    TAINTED,
    UNDECIDED,
    BlockKey,
    BlockTracker,
    GroupKey,
)

log = logging.getLogger(__name__)

#: ``kv_cache_spec_kind`` values whose groups serve prefix hits (vLLM §4.1).
PREFIX_KINDS = frozenset(("full_attention", "mla_attention", "sink_full_attention"))

#: ``metrics_hook(backend_name, stats)``, called after every batch and reset.
MetricsHook = Callable[[str, dict[str, int]], None]

_COUNTERS = ("mismatched_blocks", "masked_blocks", "ignored_blocks", "placeholder_blocks",
             "salt_rejected", "unattributed_chains", "events_in", "events_out")


def _strings(value: object, depth: int = 0) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, tuple) and depth < 4:
        for item in value:
            yield from _strings(item, depth + 1)


class DefaultSourceProcessor:
    """The :class:`~listener.model.SourceProcessor` of one source (see the module docstring).

    Args:
        source: The source's config.
        limits: Tracker memory limits.
        detok: ``/detokenize`` timeouts, concurrency and cache.
        emit: Receives every prefix event, in order, from the caller's greenlet.
        salt_secret: The router's cache-salt secret; None: no salt is valid.
        client: HTTP session for ``/tokenize`` and ``/detokenize``; default: a
            :class:`~listener.recovery.EngineClient` made here (only for sources with a
            ``detokenize_endpoint``) and closed by :meth:`close`.
        metrics_hook: Optional ``hook(backend_name, stats())`` after each batch and reset.
        clock: Monotonic seconds (template-learning retry delay).
    """

    def __init__(self, source: SourceConfig, limits: LimitsConfig, detok: DetokenizeConfig,
                 *, emit: Emit, salt_secret: bytes | None, client: HttpClient | None = None,
                 metrics_hook: MetricsHook | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.limits = limits
        self.emit = emit
        self.salt_secret = salt_secret
        self.metrics_hook = metrics_hook
        self._own_client: EngineClient | None = None
        if client is None and source.detokenize_endpoint:
            client = self._own_client = EngineClient(detok.max_response_bytes)
        self.tracker = BlockTracker(limits)
        self.recovery = PromptRecovery(source, detok, client or _NoClient(), clock=clock)
        self.chain = ChainKeys(self.recovery.detokenize, source.chain_chunk_bytes,
                               source.chain_max_keys, limits.max_chain_text_bytes,
                               limits.max_chain_tokens)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._group_kinds: dict[int, str] = {}
        self._warned_mismatch = False
        #: Blocks are keyed per data-parallel rank (see the module docstring): TensorRT-LLM
        #: (attention DP), and vLLM/SGLang sources that take several ranks' streams
        self._per_rank = source.engine == "trtllm" or source.data_parallel_size > 1

    # -- SourceProcessor ---------------------------------------------------------------------

    def handle_batch(self, batch: KvEventBatch) -> None:
        """Apply one decoded batch (events in order) and emit what changed."""
        tips: dict[BlockKey, str] = {}  # last block of each store → model for recovery
        stores: list[NewBlocks] = []  # new blocks with their tokens, for chain keys
        rank = batch.data_parallel_rank if self._per_rank else None
        for event in batch.events:
            self.counters["events_in"] += 1
            if isinstance(event, BlockStored):
                self._stored(event, event.group_idx if rank is None
                             else (rank, event.group_idx), tips, stores)
            elif isinstance(event, BlockRemoved):
                self._removed(event, event.group_idx if rank is None
                              else (rank, event.group_idx))
            elif isinstance(event, AllBlocksCleared):
                if rank is None:  # a rank's clear leaves the others' (checked when used)
                    tips.clear()
                    stores.clear()
                self._cleared(event, rank)
        self._recover(tips)
        self._chain_keys(stores)
        for key in tips:
            block = self.tracker.get(key)
            if block is not None and block.prefix is None:
                self.counters["unattributed_chains"] += 1
        self._send(self.tracker.drain())
        self._report()

    def reset(self, reason: str) -> None:
        """Forget every block of this backend and emit ``cache_cleared``."""
        log.info("kv-listener source %s: state reset (%s)", self.source.backend_name, reason)
        self.tracker.clear()
        self.recovery.clear()
        self.chain.clear()
        self._send([PrefixEvent(CACHE_CLEARED)])
        self._report()

    def stats(self) -> dict[str, int]:
        """Gauges ``tracked_blocks``, ``retained_tokens``, ``attributed_prefixes``,
        ``chain_keys`` (held now); every other value counts since start."""
        recovery = self.recovery
        return {
            "tracked_blocks": self.tracker.tracked_blocks,
            "retained_tokens": self.tracker.retained_tokens,
            "attributed_prefixes": self.tracker.held_prefixes,
            "chain_keys": self.tracker.held_chain_keys,
            "chain_unknown_parents": self.chain.unknown_parents,
            "pruned_blocks": self.tracker.pruned_blocks,
            "detokenize_calls": recovery.calls,
            "detokenize_errors": recovery.errors,
            "detokenize_too_large": recovery.too_large,
            "detokenize_cache_hits": recovery.cache_hits,
            **self.counters,
        }

    def close(self) -> None:
        """Close the HTTP session this processor made (a given client is left open)."""
        if self._own_client is not None:
            self._own_client.close()

    # -- events ------------------------------------------------------------------------------

    def _stored(self, event: BlockStored, group: GroupKey, tips: dict[BlockKey, str],
                stores: list[NewBlocks]) -> None:
        count = len(event.block_hashes)
        if not count:
            return
        group_idx, kind = event.group_idx, event.kv_cache_spec_kind
        if group_idx is not None:
            if kind is None:
                kind = self._group_kinds.get(group_idx)
            elif len(self._group_kinds) < 1024:
                self._group_kinds[group_idx] = kind
        if kind is not None and kind not in PREFIX_KINDS:
            self.counters["ignored_blocks"] += count
            return
        size, total = event.block_size, len(event.token_ids)
        if not size and not total:
            self._placeholder(event, group)
            return
        segments: list[tuple[int, ...] | None] = [None] * count
        lengths = [size] * count
        tainted = False
        fits = self.source.block_size is None or size <= self.source.block_size
        if total == count * size and fits:
            segments = [event.token_ids[i * size:(i + 1) * size] for i in range(count)]
        elif self.source.engine == "vllm" and count > 1 and total > count * size and fits:
            tainted = True
            self.counters["masked_blocks"] += count
        elif total:
            tainted = True
            lengths = [total * (i + 1) // count - total * i // count for i in range(count)]
            self._mismatch(event)
        model = event.lora_name or (self.source.model if event.lora_id is None else None)
        media = self.tracker.medium_bit(event.medium)
        parent_key: BlockKey | None = (None if event.parent_block_hash is None
                                       else (group, int(event.parent_block_hash)))
        salt_prefix: str | None = None
        end = 0
        first_parent = parent_key
        keys: list[BlockKey] = []
        ends: list[int] = []
        fresh = False
        for i, block_hash in enumerate(event.block_hashes):
            key: BlockKey = (group, int(block_hash))
            parent = self.tracker.get(parent_key)
            flags = TAINTED if tainted else 0
            if parent is not None:
                flags |= parent.flags & INHERITED_FLAGS
                end = parent.end
            elif parent_key is not None:
                flags |= NO_TEXT  # the chain's start is unknown
            end += lengths[i]
            block = self.tracker.get(key)
            prefix: str | None = None
            if not flags & TAINTED:
                if parent is not None and parent.prefix is not None:
                    prefix = parent.prefix
                elif block is not None and block.prefix is not None:
                    prefix = block.prefix  # a duplicate store of an attributed block
                elif i == 0:
                    salt_prefix, rejected = self._salt(event)
                    if rejected:
                        self.counters["salt_rejected"] += 1
                        return
                    prefix = salt_prefix
                else:
                    prefix = salt_prefix
            if block is not None:
                self.tracker.touch(key, media)
                if prefix is not None and not block.flags & TAINTED:
                    self.tracker.attribute(key, prefix)
            else:
                tokens = segments[i]
                if (prefix is not None or flags & (TAINTED | NO_TEXT) or model is None
                        or not self.recovery.available or end > self.limits.max_chain_tokens
                        or (parent is not None and parent.tokens is None)):
                    tokens = None
                if tokens is None and prefix is None:
                    flags |= NO_TEXT
                self.tracker.add(key, parent_key, tokens, end, media, prefix, flags)
                fresh = True
            keys.append(key)
            ends.append(end)
            parent_key = key
        assert parent_key is not None
        tips[parent_key] = model or ""
        if (fresh and not tainted and model is not None and segments[0] is not None
                and salt_prefix is None
                and self.chain.enabled and self.recovery.available
                and all(self._untainted(k) for k in keys)):
            stores.append(NewBlocks(first_parent, tuple(keys), tuple(ends),
                                    tuple(event.token_ids), model))

    def _placeholder(self, event: BlockStored, group: GroupKey) -> None:
        """A store without tokens or size: vLLM's offloading connector names a block it
        copied to another medium (CPU, storage) by its hash alone when it kept nothing more
        of it, and a TensorRT-LLM cache-level ``updated`` decodes to one. A tracked block
        gains that medium; an unknown one cannot be placed in a chain and is skipped
        (``placeholder_blocks``)."""
        media = self.tracker.medium_bit(event.medium)
        for block_hash in event.block_hashes:
            key: BlockKey = (group, int(block_hash))
            if self.tracker.get(key) is not None:
                self.tracker.touch(key, media)
            else:
                self.counters["placeholder_blocks"] += 1

    def _untainted(self, key: BlockKey) -> bool:
        """Whether ``key`` is still tracked (small limits may prune it at once) and clean."""
        block = self.tracker.get(key)
        return block is not None and not block.flags & TAINTED

    def _salt(self, event: BlockStored) -> tuple[str | None, bool]:
        """``(prefix_hash, rejected)`` from the event's salt, under the source's rules."""
        candidates = [] if event.cache_salt is None else [event.cache_salt]
        if event.parent_block_hash is None and event.extra_keys and event.extra_keys[0]:
            candidates.extend(s for s in _strings(event.extra_keys[0])
                              if s.startswith(SALT_VERSION + "-"))
        if self.salt_secret is not None:
            for salt in candidates:
                prefix = verify_salt(self.salt_secret, self.source.backend_name, salt)
                if prefix is not None:
                    return prefix, False
        return None, bool(candidates) or self.source.salt_required

    def _mismatch(self, event: BlockStored) -> None:
        self.counters["mismatched_blocks"] += 1
        if not self._warned_mismatch:
            self._warned_mismatch = True
            log.warning(
                "kv-listener source %s: a BlockStored with %d block hash(es), block_size %d "
                "and %d token ids does not match the block layout; such blocks keep only "
                "their chain length and their descendants stay unattributed (counted in "
                "mismatched_blocks; this warning is logged once)", self.source.backend_name,
                len(event.block_hashes), event.block_size, len(event.token_ids))

    def _removed(self, event: BlockRemoved, group: GroupKey) -> None:
        if event.medium is None and self.source.engine == "trtllm":
            media = ALL_MEDIA
        else:
            media = self.tracker.medium_bit(event.medium)
        for block_hash in event.block_hashes:
            self.tracker.remove((group, int(block_hash)), media)

    def _cleared(self, event: AllBlocksCleared, rank: int | None) -> None:
        if event.medium is not None or rank is not None:
            media = ALL_MEDIA if event.medium is None else self.tracker.medium_bit(event.medium)
            held = self.tracker.tracked_blocks
            self.tracker.remove_medium(media, rank)
            if self.tracker.tracked_blocks:
                return
            if not held:  # it was empty already: nothing to tell the router, and the
                return    # evictions earlier events of the batch queued still go out
        self.tracker.clear()
        self.chain.clear()
        self._send([PrefixEvent(CACHE_CLEARED)])

    # -- recovery ----------------------------------------------------------------------------

    def _recover(self, tips: dict[BlockKey, str]) -> None:
        tracker = self.tracker
        jobs: list[RecoveryJob] = []
        paths: list[list[BlockKey]] = []
        for tip, model in tips.items():
            block = tracker.get(tip)
            if (block is None or block.prefix is not None or block.tokens is None
                    or block.flags & (TAINTED | NO_TEXT | UNDECIDED)):
                continue
            path: list[BlockKey] = []
            inherited: str | None = None
            broken = False
            for key, node in tracker.lineage(tip):
                if node is None or node.flags & (TAINTED | NO_TEXT) or (
                        node.prefix is None and node.tokens is None):
                    broken = True
                    break
                if node.prefix is not None:
                    inherited = node.prefix
                    break
                path.append(key)
            if inherited is not None or broken:
                for key in path:  # inherit a prefix attributed since, or give up on text
                    if inherited is not None:
                        tracker.attribute(key, inherited)
                    else:
                        tracker.drop_tokens(key)
                        tracker.blocks[key].flags |= NO_TEXT
                continue
            path.reverse()
            lo = next((i + 1 for i in range(len(path) - 1, -1, -1)
                       if tracker.blocks[path[i]].flags & UNDECIDED), 0)
            if lo >= len(path):
                continue
            tokens: list[int] = []
            ends: list[int] = []
            for key in path:
                tokens.extend(tracker.blocks[key].tokens or ())
                ends.append(len(tokens))
            jobs.append(RecoveryJob(tuple(k[1] for k in path), tuple(ends), tokens, lo, model,
                                    group=path[lo]))
            paths.append(path)
        if not jobs:
            return
        markers = self.recovery.markers()
        if markers is None:
            return
        for path, result in zip(paths, self.recovery.run(jobs, markers), strict=True):
            for index, key in enumerate(path):
                block = tracker.get(key)
                if block is None:
                    continue
                if index <= result.pending_upto:
                    block.flags |= UNDECIDED
                if result.never_from is not None and index >= result.never_from:
                    tracker.drop_tokens(key)
                    block.flags |= NO_TEXT
                if result.decided_at is not None and index >= result.decided_at:
                    assert result.prefix_hash is not None
                    tracker.attribute(key, result.prefix_hash)
            if result.decided_at:  # the block before the one that decided it leads to it
                assert result.prefix_hash is not None
                tracker.lead(path[result.decided_at - 1], result.prefix_hash)

    def _chain_keys(self, stores: list[NewBlocks]) -> None:
        """Attribute the chain keys of the batch's new blocks (see :mod:`listener.chain`)."""
        if not stores:
            return
        markers = self.recovery.markers()
        if markers is None:
            return
        tracker = self.tracker
        for new in stores:
            if tracker.get(new.keys[-1]) is None:
                continue  # pruned or removed within the batch
            found = self.chain.keys_for(new, markers)
            tip = tracker.get(new.keys[-1])
            if not found or tip is None or tip.prefix is None:
                continue  # no text, or no prefix to report the keys under
            for block_key, chain_key, _tokens in found:
                if tracker.get(block_key) is not None:
                    tracker.add_chain_key(block_key, chain_key, tip.prefix)

    # -- output ------------------------------------------------------------------------------

    def _send(self, events: list[PrefixEvent]) -> None:
        for event in events:
            self.counters["events_out"] += 1
            self.emit(event)

    def _report(self) -> None:
        if self.metrics_hook is not None:
            self.metrics_hook(self.source.backend_name, self.stats())


class _NoClient:
    """The client of a source without ``/detokenize`` (never called)."""

    def post(self, url: str, *, json: Any, timeout: float, allow_redirects: bool) -> Any:
        raise RuntimeError("this source has no detokenize_endpoint")
