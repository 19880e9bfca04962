//! Token masks of constrained sequences (structured outputs, required tools), computed on
//! a small thread pool while the model runs the step, so that the grammar's share of a
//! step hides behind the forward; then applied where the logits are for rows the device
//! picks (a bitmask upload, `mmserve_ops::token_mask`), or by the host sampler for rows
//! it holds. A step without constrained rows touches none of this.

use candle_core::{DType, Tensor};
use mmserve_grammar::Matcher;

use crate::sampler::Pick;

/// The pool the masks are computed on: its own threads, so that a CPU forward's threads
/// and the masks do not queue behind each other.
pub struct MaskPool {
    pool: rayon::ThreadPool,
}

/// One constrained row of a step: its matcher, lent to the pool while the mask is made.
pub struct MaskJob {
    /// The row in the step's plan.
    pub row: usize,
    pub matcher: Matcher,
    mask: Option<Vec<u32>>,
}

impl MaskJob {
    pub fn new(row: usize, matcher: Matcher) -> Self {
        MaskJob { row, matcher, mask: None }
    }

    /// The mask made, if making it succeeded (a failure is logged, and the sampler ends
    /// the sequence: its grammar is broken).
    pub fn take_mask(&mut self) -> Option<Vec<u32>> {
        self.mask.take()
    }
}

/// One constrained row's matcher following the token just chosen for it, on the pool.
pub struct AdvanceJob {
    /// The sequence's index among the running ones.
    pub index: usize,
    pub token: u32,
    pub matcher: Matcher,
    pub outcome: Result<bool, mmserve_grammar::GrammarError>,
}

impl AdvanceJob {
    pub fn new(index: usize, token: u32, matcher: Matcher) -> Self {
        AdvanceJob { index, token, matcher, outcome: Ok(false) }
    }
}

/// Below this many constrained rows a step advances them on its own thread: handing work
/// to the pool costs more than a few advances.
const PARALLEL_ADVANCES: usize = 8;

impl MaskPool {
    /// Half the cores, from one to four threads: a mask takes tens of microseconds, a
    /// batch of 64 a few threads' worth of a step.
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, usize::from);
        let threads = (cores / 2).clamp(1, 4);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("mmserve-grammar-{i}"))
            .build()
            .expect("starting the grammar mask threads");
        MaskPool { pool }
    }

    /// Runs `forward` on this thread while each job's mask is made on the pool; returns
    /// when both are done.
    pub fn overlap<T>(&self, jobs: &mut [MaskJob], forward: impl FnOnce() -> T) -> T {
        if jobs.is_empty() {
            return forward();
        }
        self.pool.in_place_scope(|s| {
            for job in jobs.iter_mut() {
                s.spawn(move |_| {
                    job.mask =
                        job.matcher.mask().map_err(|e| tracing::warn!("masking a constrained sequence: {e}")).ok();
                });
            }
            forward()
        })
    }

    /// Advances each job's matcher by its token (side by side on the pool when there are
    /// many): with 64 constrained rows, one after another they were a step's longest serial
    /// stretch after the forward.
    pub fn advance(&self, jobs: &mut [AdvanceJob]) {
        let run = |job: &mut AdvanceJob| job.outcome = job.matcher.advance(job.token);
        if jobs.len() < PARALLEL_ADVANCES {
            jobs.iter_mut().for_each(run);
            return;
        }
        self.pool.in_place_scope(|s| {
            for job in jobs.iter_mut() {
                s.spawn(move |_| run(job));
            }
        });
    }
}

impl Default for MaskPool {
    fn default() -> Self {
        Self::new()
    }
}

/// `logits` with the masks of the rows the device picks applied where they are (as f32;
/// unchanged when no such row has a mask). Host-picked rows keep their raw logits: their
/// log-probabilities are the model's, and the host masks after its adjustments.
pub fn apply_on_device(logits: Tensor, picks: &[Pick], masks: &[Option<Vec<u32>>]) -> Result<Tensor, String> {
    let rows: Vec<(u32, &[u32])> = masks
        .iter()
        .zip(picks)
        .enumerate()
        .filter_map(|(r, (m, p))| match (m, p) {
            (Some(m), Pick::Argmax | Pick::Draw(_)) => Some((r as u32, m.as_slice())),
            _ => None,
        })
        .collect();
    if rows.is_empty() {
        return Ok(logits);
    }
    let err = |e: &dyn std::fmt::Display| format!("masking constrained rows: {e}");
    let logits = logits.to_dtype(DType::F32).and_then(|l| l.contiguous()).map_err(|e| err(&e))?;
    mmserve_ops::token_mask::mask_rows(&logits, &rows).map_err(|e| err(&e))?;
    Ok(logits)
}
