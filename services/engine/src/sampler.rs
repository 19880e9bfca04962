//! Choosing the next token: penalties (repetition, presence, frequency), `min_tokens`,
//! then greedy, or temperature with top-k, top-p and min-p, from a per-request seeded
//! generator (the same seed and input give the same output whatever else runs).
//! Log-probabilities are those of the model's distribution, before any of the settings.

use std::collections::HashMap;

use mmserve_protocol::{SamplingParams, TokenLogprobs};

/// splitmix64: small, fast, and reproducible across platforms.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Temperatures below this are greedy.
const GREEDY_BELOW: f32 = 1e-5;

/// What a sequence has seen, for the penalties.
#[derive(Debug, Default, Clone)]
pub struct History {
    /// Text tokens of the prompt (for the repetition penalty).
    pub prompt: Vec<u32>,
    /// Generated tokens and how often each occurred.
    pub counts: HashMap<u32, u32>,
    pub generated: u32,
}

impl History {
    pub fn push(&mut self, token: u32) {
        *self.counts.entry(token).or_default() += 1;
        self.generated += 1;
    }
}

/// One sequence's share of a model step, as the sampler gets it.
#[derive(Debug, Clone)]
pub enum Next {
    /// The last position's logits, copied to the host: the settings need all of them.
    Logits(Vec<f32>),
    /// The greedy choice, made where the logits are: only the id crossed to the host.
    Greedy(u32),
    /// A draw made where the logits are ([`device_samples`]), with the value that the
    /// request's generator draws next: the caller advances the generator past it.
    Sampled(u32),
}

/// Whether the argmax alone decides the next token under `params` (greedy, no
/// penalties, no log-probabilities, `min_tokens` met), so that the step can pick it on
/// the device and leave the logits there.
pub fn argmax_decides(params: &SamplingParams, history: &History) -> bool {
    params.temperature < GREEDY_BELOW && logits_suffice(params, history)
}

/// Whether the device may draw the next token (`mmserve_models::sample_rows`, the
/// same rules as [`sample`]): sampled, and neither penalties nor log-probabilities nor
/// `min_tokens` need the logits on the host.
pub fn device_samples(params: &SamplingParams, history: &History) -> bool {
    params.temperature >= GREEDY_BELOW && logits_suffice(params, history)
}

/// The model's logits alone decide: nothing to adjust or report on the host.
fn logits_suffice(params: &SamplingParams, history: &History) -> bool {
    params.logprobs.is_none()
        && params.repetition_penalty == 1.0
        && params.presence_penalty == 0.0
        && params.frequency_penalty == 0.0
        && history.generated >= params.min_tokens
}

/// The settings [`sample`] applies, with the generator's next draw (left unconsumed).
pub fn device_settings(params: &SamplingParams, rng: &Rng) -> mmserve_models::SampleSettings {
    mmserve_models::SampleSettings {
        temperature: params.temperature,
        top_k: params.top_k,
        min_p: params.min_p,
        top_p: params.top_p,
        u: rng.clone().next_f64(),
    }
}

/// Applies penalties and `min_tokens` to `logits` in place.
pub fn adjust(logits: &mut [f32], params: &SamplingParams, history: &History, stop_ids: &[u32]) {
    let p = params.repetition_penalty;
    if p != 1.0 && p > 0.0 {
        let seen = history.prompt.iter().chain(history.counts.keys());
        let mut done = std::collections::HashSet::new();
        for &t in seen {
            if let Some(l) = logits.get_mut(t as usize).filter(|_| done.insert(t)) {
                *l = if *l > 0.0 { *l / p } else { *l * p };
            }
        }
    }
    if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
        for (&t, &n) in &history.counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= params.presence_penalty + params.frequency_penalty * n as f32;
            }
        }
    }
    if history.generated < params.min_tokens {
        for &t in stop_ids {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

/// The model's log-probabilities: the sampled token's and the `k` best.
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = f64::from(max) + logits.iter().map(|&l| f64::from(l - max).exp()).sum::<f64>().ln();
    let lp = |l: f32| (f64::from(l) - lse) as f32;
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k);
    if k > 0 {
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        let k = k.min(idx.len());
        idx.select_nth_unstable_by(k - 1, |&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        idx.truncate(k);
        idx.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
        top = idx.into_iter().map(|i| (i, lp(logits[i as usize]))).collect();
    }
    TokenLogprobs { logprob: lp(logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY)), top }
}

pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature < GREEDY_BELOW {
        return argmax(logits);
    }
    let inv_t = 1.0 / f64::from(params.temperature);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((f64::from(l) - f64::from(max)) * inv_t).exp()))
        .filter(|p| p.1 > 0.0)
        .collect();
    if probs.is_empty() {
        return argmax(logits);
    }
    // Best first (ties by id), so every filter below keeps a prefix.
    probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if params.top_k > 0 {
        probs.truncate(params.top_k as usize);
    }
    if params.min_p > 0.0 {
        let floor = probs[0].1 * f64::from(params.min_p);
        probs.retain(|p| p.1 >= floor);
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        let keep = probs
            .iter()
            .position(|p| {
                mass += p.1;
                mass >= f64::from(params.top_p)
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
        let kept: f64 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= kept);
    }
    let mut u = rng.next_f64();
    for &(id, p) in &probs {
        if u < p {
            return id;
        }
        u -= p;
    }
    probs.last().map_or(0, |p| p.0)
}

/// Index of the largest logit (the first on ties, as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams { temperature: 1.0, ..Default::default() };
        f(&mut p);
        p
    }

    fn draws(logits: &[f32], p: &SamplingParams, seed: u64, n: usize) -> Vec<u32> {
        let mut rng = Rng::new(seed);
        (0..n).map(|_| sample(logits, p, &mut rng)).collect()
    }

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = [0.1, 2.0, -1.0, 2.0];
        assert_eq!(sample(&logits, &params(|p| p.temperature = 0.0), &mut Rng::new(1)), 1);
        let hot = params(|_| {});
        assert_eq!(draws(&logits, &hot, 7, 32), draws(&logits, &hot, 7, 32));
        assert_ne!(draws(&logits, &hot, 7, 32), draws(&logits, &hot, 8, 32));
        // top_p small enough keeps only the two tied best tokens.
        assert!(draws(&logits, &params(|p| p.top_p = 0.5), 3, 200).iter().all(|t| matches!(t, 1 | 3)));
    }

    #[test]
    fn top_k_and_min_p_filter() {
        let logits = [3.0, 2.9, 0.0, -5.0];
        assert!(draws(&logits, &params(|p| p.top_k = 2), 1, 300).iter().all(|&t| t < 2));
        let d = draws(&logits, &params(|p| p.min_p = 0.5), 1, 300);
        assert!(d.iter().all(|&t| t < 2) && d.contains(&0) && d.contains(&1));
        assert_eq!(draws(&logits, &params(|p| p.top_k = 1), 1, 10), vec![0; 10]);
    }

    #[test]
    fn the_device_sampler_draws_what_the_host_draws() {
        // The device's rules (here its CPU twin) against `sample`, seed by seed.
        let mut draws = Rng::new(11);
        let mut same = 0;
        let cases = 400;
        for case in 0..cases {
            let logits: Vec<f32> = (0..500).map(|_| (draws.next_f64() * 12.0 - 6.0) as f32).collect();
            let p = params(|p| {
                p.temperature = [0.5, 1.0, 1.5][case % 3];
                p.top_k = [0, 40, 1, 0][case % 4];
                p.top_p = [1.0, 0.9, 0.5][case % 3];
                p.min_p = [0.0, 0.0, 0.05, 0.0, 0.0][case % 5];
            });
            let rng = Rng::new(case as u64);
            let settings = device_settings(&p, &rng);
            let t = candle_core::Tensor::from_slice(&logits, (1, 500), &candle_core::Device::Cpu).unwrap();
            let device = mmserve_models::sample_rows(&t, &[settings]).unwrap()[0];
            same += usize::from(device == sample(&logits, &p, &mut rng.clone()));
        }
        // Integer masses (2^-40) against f64 sums: a draw can differ only within
        // rounding of a boundary, which these seeds never hit.
        assert_eq!(same, cases);
    }

    #[test]
    fn argmax_decides_only_plain_greedy() {
        let mut h = History::default();
        let greedy = params(|p| p.temperature = 0.0);
        assert!(argmax_decides(&greedy, &h));
        assert!(!argmax_decides(&params(|_| {}), &h), "sampled");
        let with = |f: fn(&mut SamplingParams)| {
            let mut p = greedy.clone();
            f(&mut p);
            p
        };
        assert!(!argmax_decides(&with(|p| p.logprobs = Some(0)), &h));
        assert!(!argmax_decides(&with(|p| p.repetition_penalty = 1.1), &h));
        assert!(!argmax_decides(&with(|p| p.presence_penalty = 0.5), &h));
        assert!(!argmax_decides(&with(|p| p.frequency_penalty = 0.5), &h));
        let min = with(|p| p.min_tokens = 1);
        assert!(!argmax_decides(&min, &h), "stop tokens still banned");
        h.push(5);
        assert!(argmax_decides(&min, &h));
    }

    #[test]
    fn penalties_and_min_tokens() {
        let mut h = History { prompt: vec![0], ..Default::default() };
        h.push(1);
        h.push(1);
        let mut l = vec![2.0, 2.0, -1.0, 0.5];
        adjust(&mut l, &params(|p| p.repetition_penalty = 2.0), &h, &[]);
        assert_eq!(l, vec![1.0, 1.0, -1.0, 0.5], "prompt and output tokens, positive divided");
        let mut l = vec![0.0, 0.0, -1.0, 0.5];
        adjust(
            &mut l,
            &params(|p| {
                p.presence_penalty = 0.5;
                p.frequency_penalty = 0.25
            }),
            &h,
            &[],
        );
        assert_eq!(l, vec![0.0, -1.0, -1.0, 0.5], "only output tokens, by count");
        let mut l = vec![0.0, 0.0, 9.0, 0.5];
        adjust(&mut l, &params(|p| p.min_tokens = 3), &h, &[2]);
        assert_eq!(argmax(&l), 3, "the stop token is banned until min_tokens");
    }

    #[test]
    fn logprobs_are_the_models() {
        let logits = [1.0f32, 2.0, 3.0];
        let lp = logprobs(&logits, 0, 2);
        let z: f32 = logits.iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (1.0f32.exp() / z).ln()).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![2, 1]);
        assert!(lp.top[0].1 > lp.top[1].1);
    }
}
