//! Choosing the next token: greedy, or temperature with top-p, from a per-request
//! seeded generator (the same seed and input give the same output whatever else runs).

use mmserve_protocol::SamplingParams;

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

pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature < GREEDY_BELOW {
        return argmax(logits);
    }
    let inv_t = 1.0 / f64::from(params.temperature);
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f64)> =
        logits.iter().enumerate().map(|(i, &l)| (i as u32, ((f64::from(l) - f64::from(max)) * inv_t).exp())).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.iter_mut().for_each(|p| p.1 /= total);
    if params.top_p < 1.0 {
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
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

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits = [0.1, 2.0, -1.0, 2.0];
        let greedy = SamplingParams { temperature: 0.0, ..Default::default() };
        assert_eq!(sample(&logits, &greedy, &mut Rng::new(1)), 1);
        let hot = SamplingParams { temperature: 1.0, ..Default::default() };
        let draw = |seed| {
            (0..32).map(|_| 0).scan(Rng::new(seed), |r, _: i32| Some(sample(&logits, &hot, r))).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // top_p small enough keeps only the two tied best tokens.
        let nucleus = SamplingParams { temperature: 1.0, top_p: 0.5, ..Default::default() };
        let mut rng = Rng::new(3);
        assert!((0..200).all(|_| matches!(sample(&logits, &nucleus, &mut rng), 1 | 3)));
    }
}
