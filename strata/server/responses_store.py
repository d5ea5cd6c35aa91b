"""Stored responses (`store: true`, the default): kept in the frontend process's memory, so that
`previous_response_id` continues a conversation and `GET` / `DELETE /v1/responses/{id}` find them.

`ResponseStore` is an LRU by id of at most `--responses-store-size` responses; the least recently
created or read goes first. A stored response holds only its own input items and output, and the
stored response it continued:

    resp_1 (input: [user], output: [message])  <-  resp_2 (input: [user], output: [function_call])
                                                   <-  resp_3 (input: [function_call_output], ...)

so a conversation's items are each kept once, and a continuation still reaches an ancestor that
was dropped from the store (or deleted): it keeps it alive, though no id finds it any more.
Everything runs on the server's event loop; nothing here locks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from strata.server.responses_protocol import Item, Response


@dataclass(eq=False)
class StoredResponse:
    response: Response
    input: list[Item]  # this request's own input items (its instructions are not items)
    previous: StoredResponse | None = None

    def input_context(self) -> list[Item]:
        """The items the model was given: the conversation before it, then its own input."""
        before = self.previous.conversation() if self.previous is not None else []
        return before + self.input

    def conversation(self) -> list[Item]:
        """Every item up to this response's output: what a continuation of it starts from."""
        chain: list[StoredResponse] = []
        node: StoredResponse | None = self
        while node is not None:
            chain.append(node)
            node = node.previous
        items: list[Item] = []
        for stored in reversed(chain):
            items += stored.input
            items += stored.response.output
        return items


class ResponseStore:
    """An LRU of stored responses by id; `capacity` 0 keeps none."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_id: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._by_id.get(response_id)
        if stored is not None:
            self._by_id.move_to_end(response_id)
        return stored

    def put(self, stored: StoredResponse) -> None:
        if self.capacity <= 0:
            return
        self._by_id[stored.response.id] = stored
        self._by_id.move_to_end(stored.response.id)
        while len(self._by_id) > self.capacity:
            self._by_id.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._by_id.pop(response_id, None) is not None
