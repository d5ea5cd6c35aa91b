"""L2 of the KV cache hierarchy: device KV pages copied into host memory (strata.cache.hicache)."""

from __future__ import annotations

import numpy as np
import torch

from strata.cache.kv_pool import KVPool, tensor_bytes


class HostKVPool:
    """Host-memory pages, one contiguous block per page: [num_pages, *l1.page_shape] (MHA: layers,
    2 (k/v), page_size, Hkv, D; MLA: layers, 1, page_size, 1, latent dim), and per page which window
    groups still held their part (sliding-window models; a page evicted after its window KV was
    given back comes without it)."""

    def __init__(self, l1: KVPool, num_pages: int):
        self.page_shape = l1.page_shape
        self.dtype = l1.dtype
        pin = l1.device.type == "cuda"
        self.data = torch.empty(
            (num_pages, *self.page_shape), dtype=self.dtype, pin_memory=pin
        )
        self.present = np.ones((num_pages, len(l1.windows)), dtype=bool)
        self.kv_bytes = self.data[0].numel() * self.data.element_size()
        self.page_bytes = (
            self.kv_bytes + self.present.shape[1]
        )  # a payload: the KV, then a byte per group

    def l1_payloads(self, l1: KVPool, l1_pages: list[int]) -> list[bytes]:
        """Storage payloads of L1 pages (what `page_payload` gives for them once in L2)."""
        data, present = l1.read_pages(l1_pages)
        return [
            tensor_bytes(data[i]) + present[i].tobytes() for i in range(len(l1_pages))
        ]

    def copy_from_l1(
        self, l1: KVPool, l1_pages: list[int], host_pages: list[int]
    ) -> None:
        data, present = l1.read_pages(l1_pages)
        self.data[torch.tensor(host_pages)] = data
        self.present[host_pages] = present

    def presence(self, host_pages: list[int]) -> np.ndarray:
        """Which window groups' parts host pages carry: [n, groups]."""
        return self.present[host_pages]

    def copy_to_l1(
        self, l1: KVPool, host_pages: list[int], l1_pages: list[int]
    ) -> None:
        """Write host pages into L1 pages allocated with their `presence` (each group's part where
        the L1 page has one)."""
        l1.write_pages(l1_pages, self.data[torch.tensor(host_pages)])

    def page_payload(self, host_page: int) -> bytes:
        return tensor_bytes(self.data[host_page]) + self.present[host_page].tobytes()

    def load_payload(self, host_page: int, payload: bytes) -> None:
        raw = torch.frombuffer(bytearray(payload[: self.kv_bytes]), dtype=torch.uint8)
        self.data[host_page] = raw.view(self.dtype).view(self.page_shape)
        self.present[host_page] = np.frombuffer(payload[self.kv_bytes :], dtype=bool)
