"""Weight provenance of generated tokens (issue 28): the weight version each token
was sampled under (`CompletionOutput.token_weight_versions`) and the version each
request started under (for `LLMEngine.abort_older_than`)."""

from __future__ import annotations

from typing import Iterable

from jaxserve.outputs import ListPrefix, RequestOutput


class WeightProvenance:
    """Per-request weight versions, kept by the engine beside the output processor.

    `versions[child_id]` has one int per sampled token of that child (a sample of
    a request with n > 1); `started[request_id]` is the weight version live when
    the request was added.
    """

    def __init__(self) -> None:
        self.versions: dict[str, list[int]] = {}
        self.started: dict[str, int] = {}
        self._children: dict[str, list[str]] = {}
        self._sent: dict[str, int] = {}  # DELTA children: tokens already handed out

    def add(self, request_id: str, child_ids: list[str], version: int, *,
            delta: bool = False) -> None:
        """Start tracking a request added under weight `version` (`delta`: its outputs
        are RequestOutputKind.DELTA, each completion holding only its new tokens)."""
        self.started[request_id] = version
        self._children[request_id] = list(child_ids)
        for cid in child_ids:
            self.versions[cid] = []
            if delta:
                self._sent[cid] = 0

    def record(self, child_ids: Iterable[str], version: int) -> None:
        """One token was sampled for each of `child_ids` under weight `version`."""
        for cid in child_ids:
            if cid in self.versions:
                self.versions[cid].append(version)

    def older_than(self, version: int) -> list[str]:
        """Ids of the tracked requests that started under a weight version < `version`."""
        return [rid for rid, v in self.started.items() if v < version]

    def drop(self, request_id: str) -> None:
        """Forget a request (finished or aborted)."""
        self.started.pop(request_id, None)
        for cid in self._children.pop(request_id, ()):
            self.versions.pop(cid, None)
            self._sent.pop(cid, None)

    def fill(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Set `token_weight_versions` on each completion (one int per token id);
        forget the requests that finished. Returns `outputs`.

        O(1) per completion: each gets a `ListPrefix` of its child's version list,
        which `record` only appends to (and `drop` only unlinks), so the prefix read
        later equals the versions at this step."""
        children, sent, versions = self._children, self._sent, self.versions
        for o in outputs:
            kids = children.get(o.request_id)
            if kids is None:
                continue
            for c in o.outputs:  # O(1): copied when read (`versions` lists only grow)
                cid = kids[c.index]
                start = sent.get(cid)
                if start is None:  # (the property's slot, set directly: one per row a step)
                    c._token_weight_versions = ListPrefix(versions[cid], c.num_tokens)
                else:  # DELTA: the versions of this output's new tokens
                    sent[cid] = end = start + c.num_tokens
                    c._token_weight_versions = versions[cid][start:end]
            if o.finished:
                self.drop(o.request_id)
        return outputs
