//! The paged KV cache: blocks, block tables, the prefix cache (being written).
