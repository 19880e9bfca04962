//! The paged KV cache's bookkeeping: fixed-size blocks, a block table per sequence,
//! reference counts, copy-on-write for forks, and the prefix cache. This module manages
//! block *ids* only; the tensors live with the model.
//!
//! # Physical layout (what the attention kernels read)
//!
//! The pool is `num_blocks` blocks of `block_size` token slots. For every layer there are
//! two tensors, K and V, each **block-major**:
//!
//! ```text
//! k_cache[layer], v_cache[layer]: [num_blocks, kv_heads, block_size, head_dim]
//! element (block b, head h, offset o, dim d) = ((b · kv_heads + h) · block_size + o) · head_dim + d
//! ```
//!
//! Token `p` of a sequence lives in block `table[p / block_size]` at offset
//! `p % block_size` (its *slot* is `block · block_size + offset`, see
//! [`BlockManager::slot`]). Heads outside the token offset (FlashInfer's "HND") make one
//! page of one KV head a single contiguous `block_size · head_dim` tile, which is what a
//! decode kernel that gives each (sequence, KV head) its own thread block loads; writing a
//! new token costs `kv_heads` strided `head_dim` stores, which is cheap by comparison.
//! Block ids are dense (`0..num_blocks`), so they index the first dimension directly.
//!
//! # Sizing
//!
//! [`blocks_for_budget`] turns a byte budget into a block count: one block costs
//! `2 (K and V) · layers · kv_heads · head_dim · dtype_bytes · block_size` bytes.

mod hash;
mod manager;
#[cfg(test)]
mod tests;

pub use hash::{ROOT_HASH, block_hash};
pub use manager::{BlockCopy, BlockId, BlockManager, KvError, KvStats, SeqId};

/// Default tokens per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// How many blocks of `block_size` tokens fit in `bytes` of KV memory for a model with
/// `layers` layers, `kv_heads` KV heads of `head_dim`, stored as `dtype_bytes`-byte
/// elements (K and V both). Zero when any factor is zero or the budget is too small.
pub fn blocks_for_budget(
    bytes: u64,
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    dtype_bytes: usize,
    block_size: usize,
) -> usize {
    let per_block = [layers, kv_heads, head_dim, dtype_bytes, block_size]
        .iter()
        .try_fold(2u128, |acc, &f| acc.checked_mul(f as u128))
        .unwrap_or(0);
    (bytes as u128).checked_div(per_block).map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
}
