"""A paged KV cache whose pool can be resized while requests are in flight (SLINFER Fig. 16).

Per layer there is one K pool and one V pool, each [num_blocks, block_size, n_kv_heads, head_dim].
A request owns a list of blocks (its block table); token t of the request lives in block
table[t // block_size] at offset t % block_size. Blocks are allocated lazily as requests grow, so
memory is held only for live tokens (rounded up to a block).

Resizing allocates the new pool one layer at a time, copies the used blocks into it compacted to
the front, and drops the old layer before moving on: the peak is about max(old, new) plus one
layer, not old + new. Block tables are remapped to the compacted ids.
"""

from __future__ import annotations

import torch

from .base import KVCacheFull


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if num_blocks < 0 or block_size <= 0:
            raise ValueError("num_blocks must be >= 0 and block_size > 0")
        self.num_layers = num_layers
        self.block_size = block_size
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.k: list[torch.Tensor] = [self._new_layer(num_blocks) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._new_layer(num_blocks) for _ in range(num_layers)]
        # Pop from the end; reversed so low ids are handed out first (keeps the pool dense).
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.block_tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}  # tokens whose K/V are stored, per request

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.n_kv_heads * self.head_dim * itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def blocks_needed(self, request_id: str, new_length: int) -> int:
        """Blocks to add so `request_id` can hold `new_length` tokens (0 if it already can)."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, -(-new_length // self.block_size) - have)

    # -- allocation ----------------------------------------------------------------------------

    def reserve(self, wanted: dict[str, int]) -> None:
        """Grow each request to hold wanted[id] tokens: all of them, or none (KVCacheFull)."""
        needed = {rid: self.blocks_needed(rid, n) for rid, n in wanted.items()}
        total = sum(needed.values())
        if total > len(self.free_blocks):
            raise KVCacheFull(
                f"need {total} more KV blocks, {len(self.free_blocks)} free of {self.num_blocks}")
        for rid, n in needed.items():
            table = self.block_tables.setdefault(rid, [])
            self.lengths.setdefault(rid, 0)
            for _ in range(n):
                table.append(self.free_blocks.pop())

    def trim(self, request_id: str, length: int) -> None:
        """Give back blocks beyond what `length` tokens need (undoes a reserve after a failure)."""
        table = self.block_tables.get(request_id)
        if table is None:
            return
        keep = -(-length // self.block_size)
        while len(table) > keep:
            self.free_blocks.append(table.pop())
        if not table and not self.lengths.get(request_id):
            self.free(request_id)

    def free(self, request_id: str) -> None:
        """Return a request's blocks to the free list (a no-op for an unknown id)."""
        self.free_blocks.extend(reversed(self.block_tables.pop(request_id, [])))
        self.lengths.pop(request_id, None)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Flat slot indices (block * block_size + offset) of token positions [start, end)."""
        table = torch.tensor(self.block_tables[request_id], dtype=torch.long)
        pos = torch.arange(start, end)
        return (table[pos // self.block_size] * self.block_size + pos % self.block_size).to(
            self.device)

    def table_tensor(self, request_ids: list[str]) -> torch.Tensor:
        """Block tables of a batch, right-padded with block 0 (masked out by the caller)."""
        tables = [self.block_tables[rid] for rid in request_ids]
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return torch.tensor(padded, dtype=torch.long, device=self.device)

    # -- data ----------------------------------------------------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([n, n_kv_heads, head_dim]) at flat slot indices ([n])."""
        self._flat(self.k[layer]).index_copy_(0, slots, k.to(self.dtype))
        self._flat(self.v[layer]).index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, tables: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of a batch as [batch, width * block_size, n_kv_heads, head_dim] (one gather).
        With `out` (two buffers of at least batch * width blocks, see `new_buffers`) the blocks
        are gathered into them, so a decode step allocates nothing per layer."""
        batch, width = tables.shape
        shape = (batch, width * self.block_size, self.n_kv_heads, self.head_dim)
        flat = tables.reshape(-1)  # index_select is much faster than fancy indexing here
        if out is None:
            return (self.k[layer].index_select(0, flat).view(shape),
                    self.v[layer].index_select(0, flat).view(shape))
        n = flat.numel()
        keys = torch.index_select(self.k[layer], 0, flat, out=out[0][:n])
        values = torch.index_select(self.v[layer], 0, flat, out=out[1][:n])
        return keys.view(shape), values.view(shape)

    def new_buffers(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V buffers of `num_blocks` blocks of one layer, for `gather(..., out=)`."""
        shape = (num_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        return (torch.empty(shape, dtype=self.dtype, device=self.device),
                torch.empty(shape, dtype=self.dtype, device=self.device))

    @property
    def layer_block_bytes(self) -> int:
        """K of one block in one layer."""
        return self.block_bytes // (2 * self.num_layers)

    def set_length(self, request_id: str, length: int) -> None:
        self.lengths[request_id] = length

    # -- layers (a split instance's layers move between processes, split.py) --------------

    def add_layers(self, count: int) -> list[int]:
        """`count` more layers' pools, empty, sized like the others; returns their indices.
        Block tables are per request across all layers, so the new layers' slots of every live
        request already exist (their contents are written by the caller)."""
        first = self.num_layers
        for _ in range(count):
            self.k.append(self._new_layer(self.num_blocks))
            self.v.append(self._new_layer(self.num_blocks))
        self.num_layers += count
        return list(range(first, first + count))

    def remove_layers(self, layers: list[int]) -> dict[int, int]:
        """Drop these layers' pools (their memory goes back); returns old -> new index of the
        layers kept."""
        gone = set(layers)
        kept = [i for i in range(self.num_layers) if i not in gone]
        self.k = [self.k[i] for i in kept]
        self.v = [self.v[i] for i in kept]
        self.num_layers = len(kept)
        self.release_memory()
        return {old: new for new, old in enumerate(kept)}

    # -- resize --------------------------------------------------------------------------------

    def resize(self, new_num_blocks: int) -> None:
        """Reallocate the pool with `new_num_blocks`, keeping every live block's contents."""
        used = self.used_blocks
        if new_num_blocks < used:
            raise ValueError(f"cannot shrink the KV pool to {new_num_blocks} blocks: "
                             f"{used} are in use")
        # Live blocks in block-table order become 0..used-1 in the new pool.
        old_ids = [b for table in self.block_tables.values() for b in table]
        remap = {old: new for new, old in enumerate(old_ids)}
        index = torch.tensor(old_ids, dtype=torch.long, device=self.device)
        for pools in (self.k, self.v):
            for layer in range(self.num_layers):
                pools[layer] = self._copy_layer(pools[layer], index, new_num_blocks)
        self.block_tables = {rid: [remap[b] for b in t] for rid, t in self.block_tables.items()}
        self.free_blocks = list(range(new_num_blocks - 1, used - 1, -1))
        self.num_blocks = new_num_blocks
        self.release_memory()

    def _copy_layer(self, old: torch.Tensor, index: torch.Tensor, new_num_blocks: int
                    ) -> torch.Tensor:
        new = self._new_layer(new_num_blocks)
        if index.numel():
            # Gather straight into the new pool: no temporary copy of the used blocks.
            torch.index_select(old, 0, index, out=new[: index.numel()])
        del old  # the caller's reference is replaced on return, freeing the old layer
        return new

    def release_memory(self) -> None:
        """Hand cached allocator blocks back to the device (after a shrink or unload)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- helpers -------------------------------------------------------------------------------

    def _new_layer(self, num_blocks: int) -> torch.Tensor:
        shape = (num_blocks, self.block_size, self.n_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _flat(self, pool: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, self.n_kv_heads, self.head_dim)
