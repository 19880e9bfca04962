//! The prefix cache's block key: a deterministic chain hash of (parent block's hash, the
//! block's token ids). Token ids are `u64`, so the virtual ids of images and audio
//! (≥ 2³²) are part of the key: a repeated item shares KV, two different items never do.
//!
//! No per-process random state: the same tokens give the same hash in every process and
//! every run. Not cryptographic; the manager also compares the block's own tokens and
//! its parent's hash on every hit, so a collision would have to be one of the 64-bit
//! chain hash of two different prefixes.

/// The "parent hash" of a sequence's first block.
pub const ROOT_HASH: u64 = 0x6d6d_7365_7276_652d;

const K0: u64 = 0x9e37_79b9_7f4a_7c15;
const K1: u64 = 0xbf58_476d_1ce4_e5b9;
const K2: u64 = 0x94d0_49bb_1331_11eb;

/// MurmurHash3's 64-bit finaliser: a bijection with full avalanche.
fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// The key of a block holding `tokens` whose parent block has key `parent` (use
/// [`ROOT_HASH`] for a sequence's first block).
pub fn block_hash(parent: u64, tokens: &[u64]) -> u64 {
    let mut h = fmix64(parent ^ (tokens.len() as u64).wrapping_mul(K1));
    for &t in tokens {
        // Each step is a bijection of `h` for a fixed token and of the token for a fixed `h`.
        h = fmix64(h ^ t.wrapping_mul(K0)).wrapping_add(K2);
    }
    fmix64(h)
}
