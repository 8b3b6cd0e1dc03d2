"""Request: what the KV-cache manager needs to know about one sequence."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.errors import KVCacheUsageError
from pagedkv.kv.block import BlockHash


@dataclass(frozen=True)
class MultiModalSpan:
    """A multimodal input occupying placeholder tokens [offset, offset + length).

    The placeholder token ids are the same for every image, so the input's content
    digest (``identifier``) must enter the hash of every block the span touches.
    """

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise KVCacheUsageError(
                f"MultiModalSpan {self.identifier!r}: need offset >= 0 and length > 0, "
                f"got offset={self.offset}, length={self.length}"
            )


# the id a placeholder holds until it is resolved; never a vocabulary id
PLACEHOLDER_TOKEN_ID = -1


class Request:
    """One sequence: its token ids (prompt, then generated) and prefix-cache keys.

    ``num_computed_tokens``: tokens whose K/V are in the cache. The KV manager
    advances it (prefix hits in ``allocate_slots``, a finished step in
    ``mark_computed``); a scheduler that preempts by recompute sets it back to 0.
    ``block_hashes`` belongs to the BlockHasher of the manager serving this request.

    Placeholders (``append_placeholder``) stand for sampled tokens whose values the
    host does not know yet (a scheduler that plans the next step while the device
    still runs this one); they count in ``num_tokens`` (their slots are allocated and
    computed like any token's) but no block that holds one is hashed until
    ``resolve_placeholder`` gives its value.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_spans: Iterable[MultiModalSpan] = (),
        num_computed_tokens: int = 0,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise KVCacheUsageError(f"request_id must be a non-empty str, got {request_id!r}")
        self.request_id = request_id
        self.num_prompt_tokens = len(prompt_token_ids)
        # prompt then generated tokens; append-only, so block hashes stay valid
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.cache_salt = cache_salt
        self.lora_name = lora_name
        self.mm_spans = tuple(sorted(mm_spans, key=lambda s: s.offset))
        self.num_computed_tokens = num_computed_tokens
        # hash of each full block, in order; extended lazily by BlockHasher.update
        self.block_hashes: list[BlockHash] = []
        self.num_placeholders = 0  # the last tokens, values not known yet

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values are known: every token but the trailing placeholders."""
        return len(self._all_token_ids) - self.num_placeholders

    def append_output_token_ids(self, token_ids: int | Iterable[int]) -> None:
        if self.num_placeholders:
            raise KVCacheUsageError(
                f"request {self.request_id!r}: {self.num_placeholders} placeholder(s) to "
                "resolve before more tokens are appended"
            )
        if isinstance(token_ids, int):
            self._all_token_ids.append(token_ids)
        else:
            self._all_token_ids.extend(token_ids)

    def append_placeholder(self) -> None:
        """One more token whose value comes later (``resolve_placeholder``)."""
        self._all_token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.num_placeholders += 1

    def resolve_placeholder(self, token_id: int) -> None:
        """The value of the oldest placeholder."""
        if not self.num_placeholders:
            raise KVCacheUsageError(f"request {self.request_id!r} has no placeholder to resolve")
        self._all_token_ids[len(self._all_token_ids) - self.num_placeholders] = token_id
        self.num_placeholders -= 1

    def fork(self, child_id: str) -> Request:
        """A copy under ``child_id``: same tokens, keys and progress (parallel sampling).

        Pair it with ``KVCacheManager.fork`` so the child shares the parent's blocks.
        """
        child = Request(
            child_id,
            self._all_token_ids[: self.num_prompt_tokens],
            cache_salt=self.cache_salt,
            lora_name=self.lora_name,
            mm_spans=self.mm_spans,
            num_computed_tokens=self.num_computed_tokens,
        )
        child._all_token_ids = list(self._all_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.num_placeholders = self.num_placeholders
        return child

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )
