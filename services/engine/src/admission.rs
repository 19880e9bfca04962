//! Admission by token budget, the rule of LightLLM's router (`get_tuple_tokens`), in
//! our words.
//!
//! Each running request is a [`Need`]: `held` (`a`), the tokens it holds now, and
//! `remaining` (`b`), the tokens it may still add before it finishes and frees them all.
//! Sorted by `remaining` descending, when request `i` finishes (after `b[i]` more steps)
//! the requests still running are exactly `0..=i`, holding `sum(a[0..=i]) + b[i]·(i+1)`
//! tokens; that is the peak of the batch if none is admitted meanwhile. The batch fits
//! when every such peak stays within the pool.
//!
//! `remaining` is the full rest of `max_tokens` when the system is busy (no
//! over-commitment possible), or an estimate from recent output lengths when it is not
//! (more admitted, preemption as the fallback): [`Need::new`] takes the estimate as an
//! input so the caller decides. With a paged pool every sequence may leave its last
//! block partly empty; [`Admission::slack`] (`block_size − 1`) adds that to `held`.

use std::cmp::Reverse;

/// The budget of one request, in tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// `a`: tokens held now (for a request not yet prefilled: its whole prompt).
    pub held: u64,
    /// `b`: tokens it may still add.
    pub remaining: u64,
}

impl Need {
    /// The need of a request with a prompt of `prompt_len` tokens that has generated
    /// `generated` of at most `max_new_tokens`. With `expected_output` (an estimate of a
    /// request's total output, e.g. from recently finished ones; pass `None` when busy
    /// or for `ignore_eos`), `remaining` is cut to `max(expected_output, 1.1·generated)`
    /// minus what was generated, at least 1 while unfinished.
    pub fn new(prompt_len: u64, generated: u64, max_new_tokens: u64, expected_output: Option<u64>) -> Self {
        let full = max_new_tokens.saturating_sub(generated);
        let remaining = match expected_output {
            Some(e) => {
                let expected = e.max(generated.saturating_add(generated.div_ceil(10)));
                expected.saturating_sub(generated).max(1).min(full)
            }
            None => full,
        };
        Self { held: prompt_len.saturating_add(generated), remaining }
    }
}

/// Whether `candidate` fits beside `running` in a pool of `pool_tokens` (O(n log n)).
pub fn fits(running: &[Need], candidate: Need, pool_tokens: u64) -> bool {
    let mut all: Vec<Need> = running.iter().copied().chain([candidate]).collect();
    all.sort_by_key(|x| Reverse(x.remaining));
    peak(&all) <= pool_tokens
}

/// The peak tokens of `sorted` (by `remaining` descending) if nothing else is admitted.
fn peak(sorted: &[Need]) -> u64 {
    let mut held = 0u64;
    let mut peak = 0u64;
    for (i, need) in sorted.iter().enumerate() {
        held = held.saturating_add(need.held);
        peak = peak.max(held.saturating_add(need.remaining.saturating_mul(i as u64 + 1)));
    }
    peak
}

/// Decides which waiting requests to admit in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Token slots of the whole KV pool (`num_blocks · block_size`).
    pub pool_tokens: u64,
    /// Most requests running at once (`--max-running-requests`).
    pub max_running: usize,
    /// Added to every request's `held`: `block_size − 1` for a paged pool, so that
    /// partly filled last blocks can never over-commit it.
    pub slack: u64,
}

impl Admission {
    /// How many of `waiting` (first come, first served) to admit beside `running`: the
    /// longest prefix that keeps the batch fitting and within `max_running`. Stops at
    /// the first that does not fit, so a large request is not overtaken by small ones.
    pub fn admit(&self, running: &[Need], waiting: &[Need]) -> usize {
        let mut batch: Vec<Need> = running.iter().map(|&n| self.padded(n)).collect();
        batch.sort_by_key(|x| Reverse(x.remaining));
        let mut admitted = 0;
        for &need in waiting {
            if batch.len() >= self.max_running {
                break;
            }
            let need = self.padded(need);
            // After the requests with a larger or equal `remaining` (stable: FCFS).
            let at = batch.partition_point(|x| x.remaining >= need.remaining);
            batch.insert(at, need);
            if peak(&batch) > self.pool_tokens {
                break;
            }
            admitted += 1;
        }
        admitted
    }

    fn padded(&self, n: Need) -> Need {
        Need { held: n.held.saturating_add(self.slack), ..n }
    }
}

/// Output lengths of recently finished requests, for [`Need::new`]'s estimate.
#[derive(Debug, Clone)]
pub struct OutputLengths {
    recent: std::collections::VecDeque<u64>,
}

impl OutputLengths {
    /// Requests remembered.
    const WINDOW: usize = 64;
    /// Fewer finished than this: no estimate (the full remainder is assumed).
    const MIN_SAMPLES: usize = 8;

    pub fn new() -> Self {
        Self { recent: std::collections::VecDeque::with_capacity(Self::WINDOW) }
    }

    pub fn record(&mut self, output_len: u64) {
        if self.recent.len() == Self::WINDOW {
            self.recent.pop_front();
        }
        self.recent.push_back(output_len);
    }

    /// The 90th percentile of the recent lengths: most requests stop by then, and the
    /// few that run longer are covered by `1.1·generated` and, at worst, preemption.
    pub fn estimate(&self) -> Option<u64> {
        if self.recent.len() < Self::MIN_SAMPLES {
            return None;
        }
        let mut v: Vec<u64> = self.recent.iter().copied().collect();
        v.sort_unstable();
        Some(v[(v.len() * 9).div_ceil(10) - 1])
    }
}

impl Default for OutputLengths {
    fn default() -> Self {
        Self::new()
    }
}

/// The request to preempt when the pool runs out anyway: the most recently admitted
/// (largest admission order; the last of equals). `None` when nothing runs.
pub fn choose_victim<K, O: Ord>(running: impl IntoIterator<Item = (K, O)>) -> Option<K> {
    running.into_iter().max_by(|x, y| x.1.cmp(&y.1)).map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn n(held: u64, remaining: u64) -> Need {
        Need { held, remaining }
    }

    #[test]
    fn formula_by_hand() {
        // Sorted: (10, 20), (30, 5). Peaks: 10 + 20·1 = 30; 40 + 5·2 = 50.
        assert!(fits(&[n(30, 5)], n(10, 20), 50));
        assert!(!fits(&[n(30, 5)], n(10, 20), 49));
        // Sorted: (5, 100), (50, 10), (20, 1). Peaks: 105; 55 + 20 = 75; 75 + 3 = 78.
        assert!(fits(&[n(50, 10), n(20, 1)], n(5, 100), 105));
        assert!(!fits(&[n(50, 10), n(20, 1)], n(5, 100), 104));
        // The middle peak binds: (1, 50), (100, 40): 51, 101 + 80 = 181.
        assert!(!fits(&[n(1, 50)], n(100, 40), 180));
        assert!(fits(&[n(1, 50)], n(100, 40), 181));
        assert!(fits(&[], n(0, 0), 0));
    }

    #[test]
    fn need_estimate() {
        assert_eq!(Need::new(100, 0, 512, None), n(100, 512));
        assert_eq!(Need::new(100, 10, 512, Some(64)), n(110, 54));
        // 1.1 × 200 generated beats a small estimate.
        assert_eq!(Need::new(100, 200, 512, Some(64)), n(300, 20));
        // Never above the real remainder, at least 1 while unfinished, 0 when finished.
        assert_eq!(Need::new(1, 500, 512, Some(4096)), n(501, 12));
        assert_eq!(Need::new(1, 5, 512, Some(0)), n(6, 1));
        assert_eq!(Need::new(1, 512, 512, Some(0)), n(513, 0));
    }

    #[test]
    fn fcfs_stops_at_first_misfit() {
        let adm = Admission { pool_tokens: 100, max_running: 10, slack: 0 };
        // With the first, the second peaks at 80 + 10 + 10·2 = 110 > 100; the small third
        // would fit, but must wait behind it.
        let waiting = [n(10, 10), n(80, 20), n(1, 1)];
        assert!(fits(&[n(10, 10)], n(1, 1), 100));
        assert_eq!(adm.admit(&[], &waiting), 1);
        assert_eq!(adm.admit(&[], &waiting[2..]), 1);
        let adm = Admission { max_running: 2, ..adm };
        assert_eq!(adm.admit(&[n(1, 1)], &[n(1, 1), n(1, 1)]), 1);
        // Slack counts per request: 3 × (10 + 5) = 45 > 40.
        let adm = Admission { pool_tokens: 40, max_running: 10, slack: 5 };
        assert_eq!(adm.admit(&[n(10, 0)], &[n(10, 0), n(10, 0)]), 1);
    }

    #[test]
    fn output_estimate_is_the_recent_p90() {
        let mut o = OutputLengths::new();
        for len in 1..=7 {
            o.record(len);
        }
        assert_eq!(o.estimate(), None, "too few samples");
        for len in 8..=10 {
            o.record(len);
        }
        assert_eq!(o.estimate(), Some(9));
        // Only the last 64 count: a burst of long outputs replaces the short ones.
        for _ in 0..64 {
            o.record(500);
        }
        assert_eq!(o.estimate(), Some(500));
    }

    #[test]
    fn victim_is_latest() {
        assert_eq!(choose_victim([("a", 3), ("b", 9), ("c", 1)]), Some("b"));
        assert_eq!(choose_victim(Vec::<(u8, u8)>::new()), None);
    }

    proptest! {
        /// `admit` agrees with `fits` one candidate at a time.
        #[test]
        fn admit_matches_fits(
            running in prop::collection::vec((0u64..200, 0u64..200), 0..8),
            waiting in prop::collection::vec((0u64..200, 0u64..200), 0..8),
            pool in 0u64..3000,
        ) {
            let running: Vec<Need> = running.into_iter().map(|(a, b)| n(a, b)).collect();
            let waiting: Vec<Need> = waiting.into_iter().map(|(a, b)| n(a, b)).collect();
            let k = Admission { pool_tokens: pool, max_running: usize::MAX, slack: 0 }.admit(&running, &waiting);
            let mut batch = running.clone();
            for (i, &w) in waiting.iter().enumerate() {
                let ok = fits(&batch, w, pool);
                prop_assert_eq!(ok, i < k, "candidate {} of {}", i, k);
                if !ok { break; }
                batch.push(w);
            }
        }

        /// Every admitted request runs to its `max_tokens`; the pool is never exceeded.
        #[test]
        fn simulated_never_overcommits(
            reqs in prop::collection::vec((1u64..60, 1u64..60), 1..40),
            pool in 60u64..400,
            max_running in 1usize..12,
        ) {
            let adm = Admission { pool_tokens: pool, max_running, slack: 0 };
            // (prompt, generated, max_new)
            let mut waiting: std::collections::VecDeque<(u64, u64, u64)> =
                reqs.iter().map(|&(p, m)| (p, 0, m)).filter(|&(p, _, m)| p + m <= pool).collect();
            let total = waiting.len();
            let mut running: Vec<(u64, u64, u64)> = Vec::new();
            let mut finished = 0;
            for _step in 0..10_000 {
                let needs: Vec<Need> = running.iter().map(|&(p, g, m)| Need::new(p, g, m, None)).collect();
                let wait_needs: Vec<Need> = waiting.iter().map(|&(p, g, m)| Need::new(p, g, m, None)).collect();
                let k = adm.admit(&needs, &wait_needs);
                running.extend(waiting.drain(..k));
                prop_assert!(running.len() <= max_running);
                // One decode step: every request adds its next token.
                for r in &mut running { r.1 += 1; }
                let held: u64 = running.iter().map(|&(p, g, _)| p + g).sum();
                prop_assert!(held <= pool, "held {} > pool {}", held, pool);
                let before = running.len();
                running.retain(|&(_, g, m)| g < m);
                finished += before - running.len();
                if waiting.is_empty() && running.is_empty() { break; }
            }
            prop_assert_eq!(finished, total);
        }
    }
}
