//! The sampler: every rule for choosing the next token, and where it is chosen.
//!
//! Penalties (repetition, presence, frequency) and `min_tokens` adjust the row on the
//! host; then greedy, or temperature with top-k, min-p and top-p, from a per-request
//! seeded generator (the same seed and input give the same output whatever else runs).
//! The draw's rules are `mmserve_ops::sample_row`'s, one implementation that the
//! device kernel is tested against. A step's rows go where they are cheapest ([`Pick`]):
//! the argmax or the draw where the logits are when nothing needs the whole row, the
//! host otherwise. Log-probabilities are those of the model's distribution, before any
//! of the settings.

use std::collections::HashMap;

use candle_core::Tensor;
use mmserve_ops::{OpError, SampleSettings, argmax_rows, sample_rows};
use mmserve_protocol::{GenerateRequest, SamplingParams, TokenLogprobs};

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

/// Whether the device may draw the next token (`mmserve_ops::sample_rows`, the
/// same rules as [`sample`]): sampled, and neither penalties nor log-probabilities nor
/// `min_tokens` need the logits on the host.
pub fn device_samples(params: &SamplingParams, history: &History) -> bool {
    params.temperature >= GREEDY_BELOW && logits_suffice(params, history)
}

/// The model's logits alone decide: nothing to adjust or report on the host. (A
/// constraint's mask does not need the host: it is applied where the logits are.)
fn logits_suffice(params: &SamplingParams, history: &History) -> bool {
    params.logprobs.is_none()
        && params.logit_bias.is_empty()
        && params.repetition_penalty == 1.0
        && params.presence_penalty == 0.0
        && params.frequency_penalty == 0.0
        && history.generated >= params.min_tokens
}

/// The settings [`sample`] applies, with the generator's next draw (left unconsumed).
pub fn device_settings(params: &SamplingParams, rng: &Rng) -> SampleSettings {
    settings(params, rng.clone().next_f64())
}

fn settings(params: &SamplingParams, u: f64) -> SampleSettings {
    SampleSettings { temperature: params.temperature, top_k: params.top_k, min_p: params.min_p, top_p: params.top_p, u }
}

/// Applies `logit_bias`, penalties and `min_tokens` to `logits` in place.
pub fn adjust(logits: &mut [f32], params: &SamplingParams, history: &History, stop_ids: &[u32]) {
    for &(token, bias) in &params.logit_bias {
        if let Some(l) = logits.get_mut(token as usize) {
            *l += bias;
        }
    }
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

/// The next token from a host row (penalties already applied): the argmax when greedy,
/// else a draw with the request's generator under the same rules as the device's
/// ([`mmserve_ops::sample_row`], one implementation for both).
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature < GREEDY_BELOW {
        return argmax(logits);
    }
    mmserve_ops::sample_row(logits, &settings(params, rng.next_f64()))
}

/// Index of the largest logit (the first on ties, as torch.argmax; NaN loses).
pub fn argmax(logits: &[f32]) -> u32 {
    mmserve_ops::argmax_row(logits)
}

/// What one sequence's sampling depends on besides its request.
#[derive(Debug, Clone)]
pub struct SamplingState {
    pub history: History,
    pub rng: Rng,
    /// Ids that end the sequence: the request's, plus EOS unless `ignore_eos`.
    pub stop_ids: Vec<u32>,
    /// The output constraint's place, if the request has one: it masks each row on the
    /// host and follows each chosen token.
    pub grammar: Option<mmserve_grammar::Matcher>,
    /// The constraint is complete (or failed): the sequence ends with this token.
    pub constraint_done: bool,
    /// The logits' width (the model's vocabulary).
    vocab: usize,
}

impl SamplingState {
    /// `vocab` bounds the prompt's text ids (media positions are not tokens); an
    /// unseeded request gets a fresh seed.
    pub fn new(req: &GenerateRequest, vocab: usize, eos_ids: &[u32]) -> Self {
        let p = &req.params;
        let mut stop_ids = p.stop_token_ids.clone();
        if !p.ignore_eos {
            stop_ids.extend_from_slice(eos_ids);
        }
        let prompt = req.prompt_ids.iter().filter(|&&t| t < vocab as u64).map(|&t| t as u32).collect();
        SamplingState {
            history: History { prompt, ..Default::default() },
            rng: Rng::new(p.seed.unwrap_or_else(|| fresh_seed(req.id))),
            stop_ids,
            grammar: None,
            constraint_done: false,
            vocab,
        }
    }

    /// With the matcher of the request's constraint.
    pub fn with_grammar(mut self, grammar: Option<mmserve_grammar::Matcher>) -> Self {
        self.grammar = grammar;
        self
    }

    /// The token `next` stands for, with its log-probabilities when asked; advances the
    /// generator by exactly the draws made, wherever they were made. `mask`: the
    /// constraint's mask made for this step (applied already where the device picked);
    /// without it a constrained sequence makes its own. The constraint does not follow
    /// the token here: the caller advances the matcher and reports the outcome to
    /// [`advanced`](Self::advanced), so that a step's constrained rows advance side by side.
    pub fn choose_unadvanced(
        &mut self,
        params: &SamplingParams,
        next: Next,
        mask: Option<&[u32]>,
    ) -> (u32, Option<TokenLogprobs>) {
        let (token, lps) = match next {
            Next::Greedy(token) => (self.unless_nothing_allowed(mask).unwrap_or(token), None),
            Next::Sampled(token) => {
                self.rng.next_f64(); // the draw the device used
                (self.unless_nothing_allowed(mask).unwrap_or(token), None)
            }
            Next::Logits(mut row) => {
                let raw = params.logprobs.map(|_| row.clone());
                adjust(&mut row, params, &self.history, &self.stop_ids);
                let token = match self.constrain(&mut row, mask) {
                    Some(token) => token,
                    None => sample(&row, params, &mut self.rng),
                };
                let k = usize::from(params.logprobs.unwrap_or(0).min(20));
                (token, raw.map(|raw| logprobs(&raw, token, k)))
            }
        };
        self.history.push(token);
        (token, lps)
    }

    /// The constraint's outcome for the token just chosen: complete (or failed) ends the
    /// sequence with it.
    pub fn advanced(&mut self, outcome: Result<bool, mmserve_grammar::GrammarError>) {
        match outcome {
            Ok(done) => self.constraint_done |= done,
            Err(e) => {
                tracing::warn!("ending a constrained sequence: {e}");
                self.constraint_done = true;
            }
        }
    }

    /// Masks `row` to the tokens the constraint allows (by `mask`, else by a mask made
    /// now). `Some(token)` when the choice is made already: nothing is allowed (the
    /// constraint failed, or `min_tokens` hides the end it requires), so the sequence ends.
    fn constrain(&mut self, row: &mut [f32], mask: Option<&[u32]>) -> Option<u32> {
        let g = self.grammar.as_mut()?;
        let made;
        let mask = match mask {
            Some(m) => m,
            None => match g.mask() {
                Ok(m) => {
                    made = m;
                    &made
                }
                Err(e) => {
                    tracing::warn!("ending a constrained sequence: {e}");
                    return Some(self.end_constraint());
                }
            },
        };
        mmserve_ops::token_mask::mask_row(row, mask);
        if row.iter().any(|l| l.is_finite()) {
            return None;
        }
        Some(self.end_constraint())
    }

    /// A device pick of a constrained sequence that must not stand: its mask allowed
    /// nothing (the device chose among -inf), or making the mask failed (the device chose
    /// unmasked). The sequence ends instead.
    fn unless_nothing_allowed(&mut self, mask: Option<&[u32]>) -> Option<u32> {
        self.grammar.as_ref()?;
        let allowed = mask.is_some_and(|m| mmserve_ops::token_mask::allows_any(m, self.vocab));
        (!allowed).then(|| self.end_constraint())
    }

    /// Ends a constrained sequence whose grammar allows nothing: its first stop id.
    fn end_constraint(&mut self) -> u32 {
        self.constraint_done = true;
        self.stop_ids.first().copied().unwrap_or_default()
    }
}

/// A seed for requests that give none: differs per request and per run.
fn fresh_seed(id: u64) -> u64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    Rng::new(nanos ^ id.rotate_left(32)).next_u64()
}

/// Where a planned row's next token is chosen.
pub enum Pick {
    /// The argmax, on the logits' device.
    Argmax,
    /// A draw under these settings, on the logits' device.
    Draw(SampleSettings),
    /// On the host, from the whole row (penalties, log-probabilities, siblings…).
    Host,
}

/// Where the next token of a sequence (and of its parked `siblings`, which sample from
/// the same row) is chosen. `emits`: whether it samples at all this step (a prefill
/// chunk short of the prompt's end does not: the cheapest pick); `on_device`: whether
/// the logits are where a device draw pays.
pub fn pick<'a>(
    params: &SamplingParams,
    state: &SamplingState,
    siblings: impl Iterator<Item = (&'a SamplingParams, &'a SamplingState)> + Clone,
    emits: bool,
    on_device: bool,
) -> Pick {
    let has_siblings = siblings.clone().next().is_some();
    // Siblings share one row but each has its own constraint's mask: the host applies them.
    let constrained = state.grammar.is_some() || siblings.clone().any(|(_, s)| s.grammar.is_some());
    if !emits {
        Pick::Argmax
    } else if has_siblings && constrained {
        Pick::Host
    } else if argmax_decides(params, &state.history) && siblings.clone().all(|(p, s)| argmax_decides(p, &s.history)) {
        Pick::Argmax
    } else if on_device && !has_siblings && device_samples(params, &state.history) {
        Pick::Draw(device_settings(params, &state.rng))
    } else {
        Pick::Host
    }
}

/// Each row's [`Next`] by its [`Pick`]: only ids cross to the host for device picks,
/// whole rows only for the host's.
pub fn next_tokens(logits: &Tensor, picks: &[Pick]) -> Result<Vec<Next>, OpError> {
    let rows_of = |want: fn(&Pick) -> bool| -> Vec<u32> {
        (0..picks.len() as u32).filter(|&i| want(&picks[i as usize])).collect()
    };
    let select = |rows: &[u32]| -> candle_core::Result<Tensor> {
        if rows.len() == picks.len() {
            Ok(logits.clone())
        } else {
            logits.index_select(&Tensor::new(rows, logits.device())?, 0)
        }
    };
    let greedy_rows = rows_of(|p| matches!(p, Pick::Argmax));
    let draw_rows = rows_of(|p| matches!(p, Pick::Draw(_)));
    let host_rows = rows_of(|p| matches!(p, Pick::Host));
    let mut argmax = if greedy_rows.is_empty() { Vec::new() } else { argmax_rows(&select(&greedy_rows)?)? }.into_iter();
    let mut drawn = if draw_rows.is_empty() {
        Vec::new()
    } else {
        let settings: Vec<SampleSettings> =
            picks.iter().filter_map(|p| if let Pick::Draw(s) = p { Some(*s) } else { None }).collect();
        sample_rows(&select(&draw_rows)?, &settings)?
    }
    .into_iter();
    let mut host = if host_rows.is_empty() { Vec::new() } else { select(&host_rows)?.to_vec2::<f32>()? }.into_iter();
    Ok(picks
        .iter()
        .map(|p| match p {
            Pick::Argmax => Next::Greedy(argmax.next().unwrap_or_default()),
            Pick::Draw(_) => Next::Sampled(drawn.next().unwrap_or_default()),
            Pick::Host => Next::Logits(host.next().unwrap_or_default()),
        })
        .collect())
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
    fn logit_bias_is_added_and_keeps_the_row_on_the_host() {
        let greedy = params(|p| {
            p.temperature = 0.0;
            p.logit_bias = vec![(2, 5.0), (0, -100.0), (9, 1.0)];
        });
        let h = History::default();
        assert!(!argmax_decides(&greedy, &h), "the device's argmax would miss the bias");
        assert!(!device_samples(&params(|p| p.logit_bias = vec![(1, 1.0)]), &h));
        let mut l = vec![1.0, 2.0, 0.0];
        adjust(&mut l, &greedy, &h, &[]);
        assert_eq!(l, vec![-99.0, 2.0, 5.0], "ids past the row are ignored");
        assert_eq!(argmax(&l), 2);
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

    #[test]
    fn device_picks_send_ids_host_picks_whole_rows() {
        let rows = [[0.0f32, 3.0, 1.0, 3.0], [5.0, -1.0, 0.0, 2.0], [-2.0, -1.0, -3.0, -0.5], [0.0, 0.0, 9.0, 0.0]];
        let logits = candle_core::Tensor::new(&rows, &candle_core::Device::Cpu).unwrap();
        let draw = mmserve_ops::SampleSettings { temperature: 1.0, top_k: 1, min_p: 0.0, top_p: 1.0, u: 0.5 };
        let next = next_tokens(&logits, &[Pick::Argmax, Pick::Host, Pick::Argmax, Pick::Draw(draw)]).unwrap();
        assert!(matches!(next[0], Next::Greedy(1)), "first of tied maxima, as torch.argmax: {:?}", next[0]);
        assert!(matches!(&next[1], Next::Logits(r) if r == &rows[1]), "{:?}", next[1]);
        assert!(matches!(next[2], Next::Greedy(3)), "{:?}", next[2]);
        assert!(matches!(next[3], Next::Sampled(2)), "top-1 of its own row: {:?}", next[3]);
        let all = next_tokens(&logits, &[Pick::Host, Pick::Host, Pick::Host, Pick::Host]).unwrap();
        assert!(all.iter().zip(&rows).all(|(n, r)| matches!(n, Next::Logits(l) if l == r)));
    }
}
