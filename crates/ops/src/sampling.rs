//! Sampling where the logits are (`kernels/sampling.cu`): temperature, top-k, min-p and
//! top-p, then a draw with the caller's uniform number, one row per block, so that only
//! token ids cross to the host. It makes the choice of the engine's host sampler, which
//! sorts the row, without sorting: keys `(weight bits << 32) | !id` order tokens as that
//! sort does, every filter keeps the keys above a bound, and weights are counted as
//! integer masses (2⁴⁰ per unit) so that sums do not depend on the order threads add
//! in. The CPU twin ([`sample_rows`] on the CPU) is the reference the kernel is tested
//! against; it sorts.

use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor};

use crate::OpError;

/// One row's settings, as the host sampler applies them, with its uniform draw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleSettings {
    pub temperature: f32,
    /// 0: every token.
    pub top_k: u32,
    pub min_p: f32,
    pub top_p: f32,
    /// Uniform in [0, 1): the request's generator's next draw.
    pub u: f64,
}

impl SampleSettings {
    /// The kernel's parameters: 1/temperature, top-k, min-p (clamped to 0..=1), top-p, u.
    fn params(&self) -> [f64; 5] {
        [
            1.0 / f64::from(self.temperature),
            f64::from(self.top_k),
            f64::from(self.min_p.clamp(0.0, 1.0)),
            f64::from(self.top_p),
            self.u,
        ]
    }
}

/// The token each row of `logits` [rows, vocab] samples under its settings.
pub fn sample_rows(logits: &Tensor, rows: &[SampleSettings]) -> Result<Vec<u32>, OpError> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    let (n, _) = logits.dims2()?;
    if n != rows.len() {
        return Err(OpError::InvalidInput(format!("{n} rows of logits for {} settings", rows.len())));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // A zero or non-finite temperature would leave no weight at all (the engine takes
    // the argmax for those instead).
    if let Some(bad) = rows.iter().find(|s| !(s.temperature > 0.0 && (1.0 / s.temperature).is_finite())) {
        return Err(OpError::InvalidInput(format!("sampling at temperature {}", bad.temperature)));
    }
    let params: Vec<f64> = rows.iter().flat_map(SampleSettings::params).collect();
    Ok(logits.apply_op1_no_bwd(&SampleRows { params })?.to_vec1::<u32>()?)
}

/// The argmax of each row of `logits` [rows, vocab] where the logits are: the first index
/// on ties, as the host's argmax and torch.argmax (NaN loses to every number). Our kernel
/// on the GPU: candle's took 28 µs for one row of 32,000, a twentieth of a 7B decode step.
pub fn argmax_rows(logits: &Tensor) -> Result<Vec<u32>, OpError> {
    let logits = logits.to_dtype(DType::F32)?.contiguous()?;
    if logits.dims2()?.0 == 0 {
        return Ok(Vec::new());
    }
    Ok(logits.apply_op1_no_bwd(&ArgmaxRows)?.to_vec1::<u32>()?)
}

struct ArgmaxRows;

/// The argmax of one row in the kernel's order: numbers by value, NaN below them all,
/// then the lower index. The host's greedy choice and the CPU twin of `argmax_rows`.
pub fn argmax_row(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] || (row[best].is_nan() && !x.is_nan()) {
            best = i;
        }
    }
    best as u32
}

impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n) = l.shape().dims2()?;
        let CpuStorage::F32(x) = s else { candle_core::bail!("argmax_rows: logits must be f32") };
        let x = &x[l.start_offset()..];
        let out = (0..rows).map(|r| argmax_row(&x[r * n..(r + 1) * n])).collect();
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        let (rows, n) = l.shape().dims2()?;
        if n == 0 || n > i32::MAX as usize {
            candle_core::bail!("argmax_rows: rows of {n} logits");
        }
        let dev = s.device().clone();
        let x = crate::launch::view::<f32>(s, l)?;
        // SAFETY: the kernel writes one id per row.
        let mut out = unsafe { dev.alloc::<u32>(rows)? };
        let func = crate::launch::kernel!(MODULE, dev, "argmax_rows")?;
        let mut b = func.builder();
        let n_arg = n as i32;
        b.arg(&x).arg(&n_arg).arg(&mut out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: block r reads row r of x (n values) and writes out[r].
        unsafe { b.launch(cfg) }.w()?;
        Ok((crate::launch::storage(out, &dev), Shape::from(rows)))
    }
}

struct SampleRows {
    params: Vec<f64>,
}

const SCALE: f64 = (1u64 << 40) as f64;

fn weight(l: f32, m: f32, inv_t: f64) -> f32 {
    let w = (f64::from(l - m) * inv_t).exp() as f32;
    if w > 0.0 { w } else { 0.0 }
}

fn key(w: f32, i: usize) -> u64 {
    (u64::from(w.to_bits()) << 32) | u64::from(u32::MAX - i as u32)
}

fn mass(w: f32) -> u64 {
    (f64::from(w) * SCALE) as u64
}

/// The draw of one row under `s`: the host sampler's choice and the CPU twin of one
/// block of `sample_rows` (the same integer rules, over a sort). `s.temperature` must be
/// positive (greedy is [`argmax_row`]'s job).
pub fn sample_row(logits: &[f32], s: &SampleSettings) -> u32 {
    draw(logits, &s.params())
}

fn draw(l: &[f32], p: &[f64]) -> u32 {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return l.iter().position(|&x| x == m).unwrap_or(l.len() - 1) as u32;
    }
    let w: Vec<f32> = l.iter().map(|&x| weight(x, m, p[0])).collect();
    let mut keys: Vec<u64> = w.iter().enumerate().map(|(i, &w)| key(w, i)).filter(|&k| k >= 1 << 32).collect();
    keys.sort_unstable_by(|a, b| b.cmp(a));
    let weight_of = |k: u64| f32::from_bits((k >> 32) as u32);
    // The first key (from the top, at or above `bound`) where the mass reaches `target`.
    let crossing = |bound: u64, target: u64| {
        let mut acc = 0;
        for &k in keys.iter().take_while(|&&k| k >= bound) {
            acc += mass(weight_of(k));
            if acc >= target {
                return k;
            }
        }
        bound
    };
    let total = |bound: u64| keys.iter().take_while(|&&k| k >= bound).map(|&k| mass(weight_of(k))).sum::<u64>();
    let mut bound = 1u64 << 32;
    let top_k = p[1] as usize;
    if top_k > 0 && top_k < keys.len() {
        bound = keys[top_k - 1];
    }
    if p[2] > 0.0 {
        bound = bound.max(u64::from((p[2] as f32).to_bits()) << 32);
    }
    if p[3] < 1.0 {
        let q = total(bound);
        let t = (p[3] * q as f64).ceil();
        let target = if t < 1.0 {
            1
        } else if t > q as f64 {
            q
        } else {
            t as u64
        };
        bound = crossing(bound, target);
    }
    let q = total(bound);
    let draw = ((p[4] * q as f64) as u64).min(q.saturating_sub(1));
    let k = crossing(bound, draw + 1);
    u32::MAX - (k & 0xFFFF_FFFF) as u32
}

impl CustomOp1 for SampleRows {
    fn name(&self) -> &'static str {
        "sample_rows"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, n) = l.shape().dims2()?;
        let CpuStorage::F32(x) = s else { candle_core::bail!("sample_rows: logits must be f32") };
        let x = &x[l.start_offset()..];
        let out = (0..rows).map(|r| draw(&x[r * n..(r + 1) * n], &self.params[5 * r..5 * r + 5])).collect();
        Ok((CpuStorage::U32(out), Shape::from(rows)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        let (rows, n) = l.shape().dims2()?;
        let dev = s.device().clone();
        let x = crate::launch::view::<f32>(s, l)?;
        let params = dev.clone_htod(&self.params)?;
        // SAFETY: the kernel writes every row's weights before reading them.
        let mut weights = unsafe { dev.alloc::<f32>(rows * n)? };
        // SAFETY: the kernel writes one id per row.
        let mut out = unsafe { dev.alloc::<u32>(rows)? };
        let func = crate::launch::kernel!(MODULE, dev, "sample_rows")?;
        let mut b = func.builder();
        let n_arg = n as i32;
        b.arg(&x).arg(&n_arg).arg(&params).arg(&mut weights).arg(&mut out);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: block r reads row r of x (n values) and its 5 parameters, and writes row
        // r of the weights and out[r].
        unsafe { b.launch(cfg) }.w()?;
        Ok((crate::launch::storage(out, &dev), Shape::from(rows)))
    }
}

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("sampling");

/// Runs the kernels on `device` against their CPU twins: random rows (odd widths, ties,
/// masked tokens) under every filter and extreme draws, and their argmax (with NaN too).
/// A line per row that differs.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let settings = |temperature, top_k, min_p, top_p, u| SampleSettings { temperature, top_k, min_p, top_p, u };
    let cases = [
        settings(1.0, 0, 0.0, 1.0, 0.5),
        settings(0.7, 50, 0.0, 0.9, 0.3),
        settings(1.3, 0, 0.05, 0.95, 0.999_999),
        settings(1.0, 1, 0.0, 1.0, 0.7),
        settings(0.8, 7, 0.0, 1.0, 0.0),
        settings(2.0, 0, 0.0, 0.5, 0.6),
        settings(1.0, 3, 0.2, 0.8, 0.25),
    ];
    let mut bad = Vec::new();
    for n in [1031usize, 32064] {
        for (variant, what) in ["plain", "ties", "masked"].iter().enumerate() {
            let rows: Vec<SampleSettings> = (0..4)
                .flat_map(|r| cases.iter().map(move |c| SampleSettings { u: (c.u + 0.13 * r as f64) % 1.0, ..*c }))
                .collect();
            let mut x: Vec<f32> = Tensor::randn(0f32, 3.0, (rows.len(), n), &Device::Cpu)?.flatten_all()?.to_vec1()?;
            match variant {
                1 => x.iter_mut().for_each(|v| *v = (*v * 2.0).round() / 2.0),
                2 => x.iter_mut().enumerate().filter(|(i, _)| i % 3 != 0).for_each(|(_, v)| *v = f32::NEG_INFINITY),
                _ => {}
            }
            let cpu = Tensor::from_vec(x.clone(), (rows.len(), n), &Device::Cpu)?;
            let mut with_nan = x;
            with_nan.iter_mut().step_by(97).for_each(|v| *v = f32::NAN);
            for (t, what) in [(cpu.clone(), what), (Tensor::from_vec(with_nan, (rows.len(), n), &Device::Cpu)?, &"nan")]
            {
                let (got, want) = (argmax_rows(&t.to_device(device)?)?, argmax_rows(&t)?);
                if got != want {
                    bad.push(format!("argmax_rows {what} n={n}: {got:?} against {want:?}"));
                }
            }
            let want = sample_rows(&cpu, &rows)?;
            let got = sample_rows(&cpu.to_device(device)?, &rows)?;
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                if g != w {
                    bad.push(format!("sample_rows {what} n={n} row {r} {:?}: {g} against {w}", rows[r]));
                }
            }
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(logits: &[f32], s: SampleSettings) -> u32 {
        let t = Tensor::from_slice(logits, (1, logits.len()), &Device::Cpu).unwrap();
        sample_rows(&t, &[s]).unwrap()[0]
    }

    #[test]
    fn filters_keep_what_the_settings_say() {
        let s = SampleSettings { temperature: 1.0, top_k: 0, min_p: 0.0, top_p: 1.0, u: 0.0 };
        let logits = [0.0, 3.0, 3.0, 1.0, f32::NEG_INFINITY];
        // u = 0 takes the first in sorted order: the best, lowest id on a tie.
        assert_eq!(one(&logits, s), 1);
        assert_eq!(one(&logits, SampleSettings { u: 0.999_999, ..s }), 0, "the last kept is the weakest");
        assert_eq!(one(&logits, SampleSettings { u: 0.999_999, top_k: 2, ..s }), 2);
        assert_eq!(one(&logits, SampleSettings { u: 0.999_999, min_p: 0.1, ..s }), 3);
        assert_eq!(one(&logits, SampleSettings { u: 0.999_999, top_p: 0.5, ..s }), 2);
        // Masked tokens never come back, whatever the draw.
        for i in 0..100 {
            assert_ne!(one(&logits, SampleSettings { u: f64::from(i) / 100.0, ..s }), 4);
        }
        assert_eq!(one(&[f32::NEG_INFINITY; 3], s), 0, "nothing finite: the first");
        let t = Tensor::from_slice(&logits, (1, logits.len()), &Device::Cpu).unwrap();
        assert!(sample_rows(&t, &[SampleSettings { temperature: 0.0, ..s }]).is_err(), "greedy is the argmax's job");
    }

    #[test]
    fn argmax_takes_the_first_of_ties_and_skips_nan() {
        let t =
            Tensor::from_slice(&[1.0f32, 3.0, 3.0, f32::NAN, 0.0, f32::NAN, 2.0, 2.0], (2, 4), &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&t).unwrap(), [1, 2]);
        let all_nan = Tensor::from_slice(&[f32::NAN; 3], (1, 3), &Device::Cpu).unwrap();
        assert_eq!(argmax_rows(&all_nan).unwrap(), [0]);
    }

    /// An independent reference written for the test: the textbook sampler, with f64
    /// probabilities sorted best first, each filter keeping a prefix, and a linear walk.
    fn textbook(logits: &[f32], s: &SampleSettings) -> u32 {
        let inv_t = 1.0 / f64::from(s.temperature);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((f64::from(l) - f64::from(max)) * inv_t).exp()))
            .filter(|p| p.1 > 0.0)
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if s.top_k > 0 {
            probs.truncate(s.top_k as usize);
        }
        if s.min_p > 0.0 {
            let floor = probs[0].1 * f64::from(s.min_p);
            probs.retain(|p| p.1 >= floor);
        }
        let total: f64 = probs.iter().map(|p| p.1).sum();
        probs.iter_mut().for_each(|p| p.1 /= total);
        if s.top_p < 1.0 {
            let mut mass = 0.0;
            let keep = probs
                .iter()
                .position(|p| {
                    mass += p.1;
                    mass >= f64::from(s.top_p)
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            let kept: f64 = probs.iter().map(|p| p.1).sum();
            probs.iter_mut().for_each(|p| p.1 /= kept);
        }
        let mut u = s.u;
        for &(id, p) in &probs {
            if u < p {
                return id;
            }
            u -= p;
        }
        probs.last().map_or(0, |p| p.0)
    }

    #[test]
    fn the_cpu_twin_draws_what_the_textbook_sampler_draws() {
        let mut seed = 11u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 11) as f64 / (1u64 << 53) as f64
        };
        let cases = 400;
        for case in 0..cases {
            let logits: Vec<f32> = (0..500).map(|_| (next() * 12.0 - 6.0) as f32).collect();
            let s = SampleSettings {
                temperature: [0.5, 1.0, 1.5][case % 3],
                top_k: [0, 40, 1, 0][case % 4],
                top_p: [1.0, 0.9, 0.5][case % 3],
                min_p: [0.0, 0.0, 0.05, 0.0, 0.0][case % 5],
                u: next(),
            };
            // Integer masses (2^-40) against f64 sums: a draw can differ only within
            // rounding of a boundary, which these draws never hit.
            assert_eq!(sample_row(&logits, &s), textbook(&logits, &s), "case {case}: {s:?}");
        }
    }

    #[test]
    fn the_cpu_argmax_is_a_plain_loops() {
        let mut seed = 5u64;
        for case in 0..200 {
            let row: Vec<f32> = (0..97)
                .map(|i| {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    // Few distinct values, so ties are common.
                    if (i + case) % 41 == 0 { f32::NAN } else { ((seed >> 60) as f32) - 8.0 }
                })
                .collect();
            let mut best: Option<usize> = None;
            for (i, &x) in row.iter().enumerate() {
                if !x.is_nan() && best.is_none_or(|b| x > row[b]) {
                    best = Some(i);
                }
            }
            assert_eq!(argmax_row(&row) as usize, best.unwrap_or(0), "case {case}");
        }
    }
}
