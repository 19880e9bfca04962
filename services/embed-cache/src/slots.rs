//! Contiguous blocks of arena slots: best fit on allocation, merged with free
//! neighbours on release.
//!
//! Invariant: the free blocks never overlap or touch (touching blocks are merged),
//! and `free + used = total`.

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone)]
pub struct SlotAllocator {
    total: u64,
    free_slots: u64,
    /// Free blocks by start: start → len.
    by_start: BTreeMap<u64, u64>,
    /// Free blocks by size, for best fit: (len, start).
    by_len: BTreeSet<(u64, u64)>,
}

impl SlotAllocator {
    pub fn new(total: u64) -> Self {
        let mut a = SlotAllocator { total, free_slots: 0, by_start: BTreeMap::new(), by_len: BTreeSet::new() };
        if total > 0 {
            a.insert_free(0, total);
        }
        a
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn free(&self) -> u64 {
        self.free_slots
    }

    pub fn used(&self) -> u64 {
        self.total - self.free_slots
    }

    pub fn largest_free_block(&self) -> u64 {
        self.by_len.iter().next_back().map_or(0, |&(len, _)| len)
    }

    /// The start of a block of `len` slots taken from the smallest free block that
    /// holds it, or `None`.
    pub fn alloc(&mut self, len: u64) -> Option<u64> {
        if len == 0 {
            return Some(0);
        }
        let &(block_len, start) = self.by_len.range((len, 0)..).next()?;
        self.remove_free(start, block_len);
        if block_len > len {
            self.insert_free(start + len, block_len - len);
        }
        Some(start)
    }

    /// Takes the exact range `start..start + len` if it is free (used to undo releases).
    pub fn take(&mut self, start: u64, len: u64) -> bool {
        if len == 0 {
            return true;
        }
        let Some((&block, &block_len)) = self.by_start.range(..=start).next_back() else { return false };
        if block + block_len < start + len {
            return false;
        }
        self.remove_free(block, block_len);
        if start > block {
            self.insert_free(block, start - block);
        }
        if block + block_len > start + len {
            self.insert_free(start + len, block + block_len - start - len);
        }
        true
    }

    /// Returns a block to the free list, merging it with free neighbours.
    pub fn release(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        debug_assert!(start + len <= self.total);
        let (mut start, mut len) = (start, len);
        if let Some((&prev_start, &prev_len)) = self.by_start.range(..start).next_back() {
            debug_assert!(prev_start + prev_len <= start, "double free of slots at {start}");
            if prev_start + prev_len == start {
                self.remove_free(prev_start, prev_len);
                start = prev_start;
                len += prev_len;
            }
        }
        if let Some(&next_len) = self.by_start.get(&(start + len)) {
            self.remove_free(start + len, next_len);
            len += next_len;
        }
        self.insert_free(start, len);
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
        self.free_slots += len;
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.by_start.remove(&start);
        self.by_len.remove(&(len, start));
        self.free_slots -= len;
    }

    /// Checks the invariants (used by tests).
    pub fn check(&self) -> Result<(), String> {
        let mut end = None::<u64>;
        let mut sum = 0;
        for (&s, &l) in &self.by_start {
            if l == 0 || s + l > self.total {
                return Err(format!("bad block {s}+{l}"));
            }
            if let Some(e) = end
                && s <= e
            {
                return Err(format!("block {s} overlaps or touches the previous one ending at {e}"));
            }
            if !self.by_len.contains(&(l, s)) {
                return Err(format!("block {s}+{l} missing from the size index"));
            }
            end = Some(s + l);
            sum += l;
        }
        if self.by_len.len() != self.by_start.len() || sum != self.free_slots {
            return Err("indexes disagree".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn best_fit_and_merge() {
        let mut a = SlotAllocator::new(100);
        let x = a.alloc(10).unwrap();
        let y = a.alloc(20).unwrap();
        let z = a.alloc(30).unwrap();
        a.release(x, 10);
        a.release(z, 30); // merges with the tail
        // Best fit picks the 10-slot hole, not the 70-slot tail.
        assert_eq!(a.alloc(8), Some(x));
        a.release(x, 8);
        a.release(y, 20);
        assert_eq!(a.largest_free_block(), 100);
        a.check().unwrap();
    }

    proptest! {
        #[test]
        fn accounting_is_exact(ops in proptest::collection::vec((any::<bool>(), 1u64..40, any::<prop::sample::Index>()), 1..200)) {
            let mut a = SlotAllocator::new(500);
            let mut held: Vec<(u64, u64)> = Vec::new();
            for (alloc, len, pick) in ops {
                if alloc || held.is_empty() {
                    if let Some(start) = a.alloc(len) {
                        for &(s, l) in &held {
                            prop_assert!(start + len <= s || s + l <= start, "overlap");
                        }
                        held.push((start, len));
                    } else {
                        prop_assert!(a.largest_free_block() < len);
                    }
                } else {
                    let (s, l) = held.swap_remove(pick.index(held.len()));
                    a.release(s, l);
                    // Taking the exact range back and releasing it again changes nothing.
                    prop_assert!(a.take(s, l));
                    prop_assert!(!a.take(s, l), "a taken range is not free");
                    a.release(s, l);
                }
                prop_assert_eq!(a.used(), held.iter().map(|h| h.1).sum::<u64>());
                prop_assert!(a.check().is_ok(), "{:?}", a.check());
            }
        }
    }
}
