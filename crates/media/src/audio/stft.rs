//! Power spectra `|rfft(frame · window)|²` of [`LANES`] frames at once.
//!
//! Each frame of a group lives in its own SIMD lane ("vertical" layout: value `i` of every
//! frame side by side), so every butterfly is lane-wise arithmetic on runs of whole lanes,
//! which the compiler vectorises with no shuffles, and the spectra come out bin-major
//! (`[bin][lane]`), the layout the mel filter bank sums over. One frame at a time, the FFT
//! was 40% of Whisper's features and the transposition into the mel tile most of the rest.
//!
//! The real FFT of `n` samples is a complex FFT of `n/2` points over `x[2j] + i·x[2j+1]`
//! and one pass that splits the even and odd halves. The complex FFT is a mixed-radix
//! Stockham decimation in frequency (radices 4, 2, 3, 5, and a direct DFT for larger
//! primes), which leaves its output in natural order. Sizes whose half has a prime factor
//! above [`MAX_PRIME`] are left to [`realfft`] (see [`Stft::new`]).

use std::f64::consts::TAU;

use crate::simd::dispatch_wide;

/// Frames per group (two AVX2 registers, one AVX-512 register).
pub const LANES: usize = 16;

/// The largest prime factor of `n_fft / 2` taken here; a direct DFT of a prime `p` costs `p²`.
pub const MAX_PRIME: usize = 13;

/// One stage of the complex FFT: radix `p` over sub-transforms of `len` points, with the
/// twiddles `w_len^(j·k)` for `j < len / p`, `1 ≤ k < p`, as `(cos, sin)` of `-2πjk/len`.
#[derive(Debug, Clone)]
struct Stage {
    p: usize,
    len: usize,
    twiddles: Vec<(f32, f32)>,
    /// `(cos, sin)` of `-2πrk/p` for a direct DFT (radices above 5).
    roots: Vec<(f32, f32)>,
}

/// Plans for [`power_spectra`](Stft::power_spectra) at one `n_fft`.
#[derive(Debug, Clone)]
pub struct Stft {
    n_fft: usize,
    stages: Vec<Stage>,
    /// `(cos, sin)` of `-2πk/n_fft`, `k ≤ n_fft/2`: the split's twiddles.
    split: Vec<(f32, f32)>,
}

/// Buffers for one group: two complex planes of `n_fft/2` vectors each.
#[derive(Debug, Clone)]
pub struct Scratch {
    re: [Vec<f32>; 2],
    im: [Vec<f32>; 2],
}

fn factor(mut m: usize) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    while m.is_multiple_of(4) {
        out.push(4);
        m /= 4;
    }
    for p in 2..=MAX_PRIME {
        while m.is_multiple_of(p) {
            out.push(p);
            m /= p;
        }
    }
    (m == 1).then_some(out)
}

fn cis(angle: f64) -> (f32, f32) {
    (angle.cos() as f32, angle.sin() as f32)
}

impl Stft {
    /// A plan for frames of `n_fft` samples, or `None` where `n_fft` is odd or half of it
    /// has a prime factor above [`MAX_PRIME`].
    pub fn new(n_fft: usize) -> Option<Self> {
        if n_fft < 2 || n_fft % 2 == 1 {
            return None;
        }
        let m = n_fft / 2;
        let mut len = m;
        let mut stages = Vec::new();
        for p in factor(m)? {
            let twiddles =
                (0..len / p).flat_map(|j| (1..p).map(move |k| cis(-TAU * (j * k) as f64 / len as f64))).collect();
            let roots = if p > 5 {
                (0..p * p).map(|rk| cis(-TAU * ((rk / p) * (rk % p)) as f64 / p as f64)).collect()
            } else {
                Vec::new() // radices 2 to 5 have their constants in their kernels
            };
            stages.push(Stage { p, len, twiddles, roots });
            len /= p;
        }
        let split = (0..=m).map(|k| cis(-TAU * k as f64 / n_fft as f64)).collect();
        Some(Self { n_fft, stages, split })
    }

    pub fn scratch(&self) -> Scratch {
        let n = self.n_fft / 2 * LANES;
        Scratch { re: [vec![0.0; n], vec![0.0; n]], im: [vec![0.0; n], vec![0.0; n]] }
    }

    /// `out[bin · LANES + f] = |rfft(frames[f] · window)[bin]|²` for `bin ≤ n_fft/2`, each
    /// frame `n_fft` samples; lanes past `frames.len()` (at most [`LANES`]) come out zero.
    pub fn power_spectra(&self, frames: &[&[f32]], window: &[f32], s: &mut Scratch, out: &mut [f32]) {
        let m = self.n_fft / 2;
        assert!(frames.len() <= LANES && window.len() == self.n_fft && out.len() >= (m + 1) * LANES);
        transform(self, frames, window, s, out);
    }
}

/// Load, every stage, and the split.
fn transform(plan: &Stft, frames: &[&[f32]], window: &[f32], s: &mut Scratch, out: &mut [f32]) {
    let [re0, re1] = &mut s.re;
    let [im0, im1] = &mut s.im;
    load(frames, window, re0, im0);
    // Ping-pong between the two planes; `cur` holds the latest stage's output.
    let mut cur = 0;
    let mut stride = 1;
    for st in &plan.stages {
        let (src_re, src_im, dst_re, dst_im) =
            if cur == 0 { (&*re0, &*im0, &mut *re1, &mut *im1) } else { (&*re1, &*im1, &mut *re0, &mut *im0) };
        stage(st, stride, src_re, src_im, dst_re, dst_im);
        stride *= st.p;
        cur ^= 1;
    }
    let (zr, zi) = if cur == 0 { (&*re0, &*im0) } else { (&*re1, &*im1) };
    split_power(zr, zi, &plan.split, out);
}

/// The complex input `z[j] = x[2j]·w[2j] + i·x[2j+1]·w[2j+1]`, frame `f` in lane `f`.
fn load(frames: &[&[f32]], window: &[f32], re: &mut [f32], im: &mut [f32]) {
    let n = window.len();
    assert!(frames.iter().all(|f| f.len() == n) && re.len() >= n / 2 * LANES && im.len() >= n / 2 * LANES);
    #[cfg(target_arch = "x86_64")]
    if frames.len() == LANES && n.is_multiple_of(8) && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked); the lengths `load_avx2` relies on are asserted above.
        unsafe { load_avx2(frames, window, re, im) };
        return;
    }
    if frames.len() < LANES {
        re.fill(0.0);
        im.fill(0.0);
    }
    for (f, frame) in frames.iter().enumerate() {
        for (j, (pair, w)) in frame.chunks_exact(2).zip(window.chunks_exact(2)).enumerate() {
            re[j * LANES + f] = pair[0] * w[0];
            im[j * LANES + f] = pair[1] * w[1];
        }
    }
}

/// [`load`] for a full group by 8×8 transposes in registers: eight frames' next eight
/// samples in, one vector per sample index out (the scalar loop's scattered stores were a
/// fifth of the features' time). The same products as the scalar loop, so the same bits.
///
/// # Safety
/// AVX2 must be present; `frames` holds [`LANES`] frames of `window.len()` samples, a
/// multiple of 8, and `re`, `im` hold at least `window.len() / 2 · LANES` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn load_avx2(frames: &[&[f32]], window: &[f32], re: &mut [f32], im: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = window.len();
    for h in 0..LANES / 8 {
        for k0 in (0..n).step_by(8) {
            // SAFETY: k0 + 8 ≤ n = each frame's length (the caller's contract).
            let r: [__m256; 8] =
                std::array::from_fn(|f| unsafe { _mm256_loadu_ps(frames[8 * h + f].as_ptr().add(k0)) });
            let t: [__m256; 8] = std::array::from_fn(|i| {
                let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
                if i % 2 == 0 { _mm256_unpacklo_ps(a, b) } else { _mm256_unpackhi_ps(a, b) }
            });
            // u[4q + k]: rows 4q..4q+4; columns k and k + 4 (k even: from t[4q], t[4q + 2] low
            // pairs; k odd: their high pairs; k ≥ 2 from the unpackhi halves).
            let u: [__m256; 8] = std::array::from_fn(|i| {
                let (q, k) = (i / 4, i % 4);
                let (a, b) = (t[4 * q + k / 2], t[4 * q + 2 + k / 2]);
                if k % 2 == 0 { _mm256_shuffle_ps::<0x44>(a, b) } else { _mm256_shuffle_ps::<0xEE>(a, b) }
            });
            let c: [__m256; 8] = std::array::from_fn(|i| {
                if i < 4 {
                    _mm256_permute2f128_ps::<0x20>(u[i], u[4 + i])
                } else {
                    _mm256_permute2f128_ps::<0x31>(u[i - 4], u[i])
                }
            });
            for (i, ci) in c.iter().enumerate() {
                let k = k0 + i;
                let v = _mm256_mul_ps(*ci, _mm256_set1_ps(window[k]));
                let dst = if k % 2 == 0 { &mut *re } else { &mut *im };
                // SAFETY: (k / 2) · LANES + 8h + 8 ≤ n / 2 · LANES ≤ the plane's length.
                unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(k / 2 * LANES + 8 * h), v) };
            }
        }
    }
}

/// One radix-`p` stage for `s` interleaved sequences of `st.len` points: input element
/// `q + s·(j + r·m)` (vectors of LANES), output `q + s·(p·j + k)`, `m = len / p`; the `s`
/// sequences and their lanes are one contiguous run of `s · LANES` values.
fn stage(st: &Stage, s: usize, xr: &[f32], xi: &[f32], yr: &mut [f32], yi: &mut [f32]) {
    match st.p {
        2 => stage2(st, s, xr, xi, yr, yi),
        3 => stage3(st, s, xr, xi, yr, yi),
        4 => stage4(st, s, xr, xi, yr, yi),
        5 => stage5(st, s, xr, xi, yr, yi),
        p => {
            let (m, run) = (st.len / p, s * LANES);
            for j in 0..m {
                let at: Vec<usize> = (0..p).map(|r| s * (j + r * m) * LANES).collect();
                let output = s * p * j * LANES;
                let (yr, yi) = (&mut yr[output..output + p * run], &mut yi[output..output + p * run]);
                radix_any(xr, xi, &at, run, &st.twiddles[j * (p - 1)..][..p - 1], &st.roots, yr, yi);
            }
        }
    }
}

/// A radix-`P` stage's loop over `j` around `$kernel`, dispatched once per stage (a
/// dispatch per butterfly group cost more than the butterflies at the first stages, where
/// a group is one vector of lanes).
macro_rules! stage_of_radix {
    ($name:ident, $kernel_loop:ident, $kernel:ident, $p:literal) => {
        dispatch_wide!(
            $name(st: &Stage, s: usize, xr: &[f32], xi: &[f32], yr: &mut [f32], yi: &mut [f32]) -> () => $kernel_loop
        );

        #[inline(always)]
        fn $kernel_loop(st: &Stage, s: usize, xr: &[f32], xi: &[f32], yr: &mut [f32], yi: &mut [f32]) {
            let (m, run) = (st.len / $p, s * LANES);
            for j in 0..m {
                let tw: [(f32, f32); $p - 1] = std::array::from_fn(|k| st.twiddles[j * ($p - 1) + k]);
                let at: [usize; $p] = std::array::from_fn(|r| s * (j + r * m) * LANES);
                let output = s * $p * j * LANES;
                let (yr, yi) = (&mut yr[output..output + $p * run], &mut yi[output..output + $p * run]);
                $kernel(xr, xi, at, run, tw, yr, yi);
            }
        }
    };
}

stage_of_radix!(stage2, stage2_kernel, radix2_kernel, 2);
stage_of_radix!(stage3, stage3_kernel, radix3_kernel, 3);
stage_of_radix!(stage4, stage4_kernel, radix4_kernel, 4);
stage_of_radix!(stage5, stage5_kernel, radix5_kernel, 5);

/// The complex product `(a + ib)(c + is)`: every twiddle of every kernel.
#[inline(always)]
fn cmul((a, b): (f32, f32), (c, s): (f32, f32)) -> (f32, f32) {
    (a * c - b * s, a * s + b * c)
}

/// `y ← y · w` on a run (complex, `w` the same for every element).
#[inline(always)]
fn twiddle(yr: &mut [f32], yi: &mut [f32], w: (f32, f32)) {
    for (r, i) in yr.iter_mut().zip(yi.iter_mut()) {
        (*r, *i) = cmul((*r, *i), w);
    }
}

#[inline(always)]
fn radix2_kernel(xr: &[f32], xi: &[f32], at: [usize; 2], n: usize, w: [(f32, f32); 1], yr: &mut [f32], yi: &mut [f32]) {
    let (ar, br) = (&xr[at[0]..][..n], &xr[at[1]..][..n]);
    let (ai, bi) = (&xi[at[0]..][..n], &xi[at[1]..][..n]);
    let (y0r, y1r) = yr.split_at_mut(n);
    let (y0i, y1i) = yi.split_at_mut(n);
    let w = w[0];
    for t in 0..n {
        let (a_r, a_i, b_r, b_i) = (ar[t], ai[t], br[t], bi[t]);
        y0r[t] = a_r + b_r;
        y0i[t] = a_i + b_i;
        (y1r[t], y1i[t]) = cmul((a_r - b_r, a_i - b_i), w);
    }
}

#[inline(always)]
fn radix4_kernel(xr: &[f32], xi: &[f32], at: [usize; 4], n: usize, w: [(f32, f32); 3], yr: &mut [f32], yi: &mut [f32]) {
    let (a0r, a1r, a2r, a3r) = (&xr[at[0]..][..n], &xr[at[1]..][..n], &xr[at[2]..][..n], &xr[at[3]..][..n]);
    let (a0i, a1i, a2i, a3i) = (&xi[at[0]..][..n], &xi[at[1]..][..n], &xi[at[2]..][..n], &xi[at[3]..][..n]);
    let (y0r, rest) = yr.split_at_mut(n);
    let (y1r, rest) = rest.split_at_mut(n);
    let (y2r, y3r) = rest.split_at_mut(n);
    let (y0i, rest) = yi.split_at_mut(n);
    let (y1i, rest) = rest.split_at_mut(n);
    let (y2i, y3i) = rest.split_at_mut(n);
    for t in 0..n {
        let (t0r, t0i) = (a0r[t] + a2r[t], a0i[t] + a2i[t]);
        let (t1r, t1i) = (a0r[t] - a2r[t], a0i[t] - a2i[t]);
        let (t2r, t2i) = (a1r[t] + a3r[t], a1i[t] + a3i[t]);
        // (a1 − a3) · (−i)
        let (t3r, t3i) = (a1i[t] - a3i[t], a3r[t] - a1r[t]);
        y0r[t] = t0r + t2r;
        y0i[t] = t0i + t2i;
        (y1r[t], y1i[t]) = cmul((t1r + t3r, t1i + t3i), w[0]);
        (y2r[t], y2i[t]) = cmul((t0r - t2r, t0i - t2i), w[1]);
        (y3r[t], y3i[t]) = cmul((t1r - t3r, t1i - t3i), w[2]);
    }
}

#[inline(always)]
fn radix3_kernel(xr: &[f32], xi: &[f32], at: [usize; 3], n: usize, w: [(f32, f32); 2], yr: &mut [f32], yi: &mut [f32]) {
    const C: f32 = -0.5;
    let s = (TAU / 3.0).sin() as f32;
    let (a0r, a1r, a2r) = (&xr[at[0]..][..n], &xr[at[1]..][..n], &xr[at[2]..][..n]);
    let (a0i, a1i, a2i) = (&xi[at[0]..][..n], &xi[at[1]..][..n], &xi[at[2]..][..n]);
    let (y0r, rest) = yr.split_at_mut(n);
    let (y1r, y2r) = rest.split_at_mut(n);
    let (y0i, rest) = yi.split_at_mut(n);
    let (y1i, y2i) = rest.split_at_mut(n);
    for t in 0..n {
        let (br, bi) = (a1r[t] + a2r[t], a1i[t] + a2i[t]);
        let (dr, di) = (a1r[t] - a2r[t], a1i[t] - a2i[t]);
        y0r[t] = a0r[t] + br;
        y0i[t] = a0i[t] + bi;
        let (tr, ti) = (a0r[t] + C * br, a0i[t] + C * bi);
        // u = −i·s·d
        let (ur, ui) = (s * di, -s * dr);
        (y1r[t], y1i[t]) = cmul((tr + ur, ti + ui), w[0]);
        (y2r[t], y2i[t]) = cmul((tr - ur, ti - ui), w[1]);
    }
}

#[inline(always)]
fn radix5_kernel(xr: &[f32], xi: &[f32], at: [usize; 5], n: usize, w: [(f32, f32); 4], yr: &mut [f32], yi: &mut [f32]) {
    let (c1, s1) = ((TAU / 5.0).cos() as f32, (TAU / 5.0).sin() as f32);
    let (c2, s2) = ((2.0 * TAU / 5.0).cos() as f32, (2.0 * TAU / 5.0).sin() as f32);
    let a: [(&[f32], &[f32]); 5] = std::array::from_fn(|r| (&xr[at[r]..][..n], &xi[at[r]..][..n]));
    let (y0r, rest) = yr.split_at_mut(n);
    let (y1r, rest) = rest.split_at_mut(n);
    let (y2r, rest) = rest.split_at_mut(n);
    let (y3r, y4r) = rest.split_at_mut(n);
    let (y0i, rest) = yi.split_at_mut(n);
    let (y1i, rest) = rest.split_at_mut(n);
    let (y2i, rest) = rest.split_at_mut(n);
    let (y3i, y4i) = rest.split_at_mut(n);
    for t in 0..n {
        let (x0r, x0i) = (a[0].0[t], a[0].1[t]);
        let (b1r, b1i) = (a[1].0[t] + a[4].0[t], a[1].1[t] + a[4].1[t]);
        let (b2r, b2i) = (a[2].0[t] + a[3].0[t], a[2].1[t] + a[3].1[t]);
        let (d1r, d1i) = (a[1].0[t] - a[4].0[t], a[1].1[t] - a[4].1[t]);
        let (d2r, d2i) = (a[2].0[t] - a[3].0[t], a[2].1[t] - a[3].1[t]);
        y0r[t] = x0r + b1r + b2r;
        y0i[t] = x0i + b1i + b2i;
        let (t1r, t1i) = (x0r + c1 * b1r + c2 * b2r, x0i + c1 * b1i + c2 * b2i);
        let (t2r, t2i) = (x0r + c2 * b1r + c1 * b2r, x0i + c2 * b1i + c1 * b2i);
        let (u1r, u1i) = (s1 * d1r + s2 * d2r, s1 * d1i + s2 * d2i);
        let (u2r, u2i) = (s2 * d1r - s1 * d2r, s2 * d1i - s1 * d2i);
        // y1 = t1 − i·u1, y4 = t1 + i·u1, y2 = t2 − i·u2, y3 = t2 + i·u2; then the twiddles.
        let v = [(t1r + u1i, t1i - u1r), (t2r + u2i, t2i - u2r), (t2r - u2i, t2i + u2r), (t1r - u1i, t1i + u1r)];
        let ys: [(&mut [f32], &mut [f32]); 4] =
            [(&mut *y1r, &mut *y1i), (&mut *y2r, &mut *y2i), (&mut *y3r, &mut *y3i), (&mut *y4r, &mut *y4i)];
        for ((yr, yi), (v, w)) in ys.into_iter().zip(v.into_iter().zip(w)) {
            (yr[t], yi[t]) = cmul(v, w);
        }
    }
}

/// A direct DFT of a prime radix above 5 (rare: only for unusual `n_fft`).
#[allow(clippy::too_many_arguments)]
fn radix_any(
    xr: &[f32],
    xi: &[f32],
    at: &[usize],
    n: usize,
    tw: &[(f32, f32)],
    roots: &[(f32, f32)],
    yr: &mut [f32],
    yi: &mut [f32],
) {
    let p = at.len();
    for k in 0..p {
        let (or, oi) = (&mut yr[k * n..][..n], &mut yi[k * n..][..n]);
        or.fill(0.0);
        oi.fill(0.0);
        for (r, &a) in at.iter().enumerate() {
            for t in 0..n {
                let (pr, pi) = cmul((xr[a + t], xi[a + t]), roots[r * p + k]);
                or[t] += pr;
                oi[t] += pi;
            }
        }
        if k > 0 {
            twiddle(or, oi, tw[k - 1]);
        }
    }
}

dispatch_wide!(
    /// `|X[k]|²` from the half-size transform `Z`: `X[k] = E[k] + w^k·O[k]` with
    /// `E = (Z[k] + conj Z[m−k]) / 2`, `O = (Z[k] − conj Z[m−k]) / 2i`.
    split_power(zr: &[f32], zi: &[f32], split: &[(f32, f32)], out: &mut [f32]) -> () => split_power_kernel
);

#[inline(always)]
fn split_power_kernel(zr: &[f32], zi: &[f32], split: &[(f32, f32)], out: &mut [f32]) {
    let m = split.len() - 1;
    for (k, &(c, s)) in split.iter().enumerate() {
        let a = (k % m) * LANES;
        let b = ((m - k % m) % m) * LANES;
        let (ar, ai, br, bi) = (&zr[a..][..LANES], &zi[a..][..LANES], &zr[b..][..LANES], &zi[b..][..LANES]);
        let o = &mut out[k * LANES..][..LANES];
        for l in 0..LANES {
            // E = ((ar + br) + i(ai − bi)) / 2; O = ((ai + bi) − i(ar − br)) / 2.
            let (er, ei) = (0.5 * (ar[l] + br[l]), 0.5 * (ai[l] - bi[l]));
            let (or, oi) = (0.5 * (ai[l] + bi[l]), -0.5 * (ar[l] - br[l]));
            let (wr, wi) = cmul((or, oi), (c, s));
            let (xr, xi) = (er + wr, ei + wi);
            o[l] = xr * xr + xi * xi;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `|DFT(x · w)|²` in f64, straight from the definition.
    fn reference(frame: &[f32], window: &[f32]) -> Vec<f64> {
        let n = frame.len();
        (0..=n / 2)
            .map(|k| {
                let (mut re, mut im) = (0f64, 0f64);
                for (t, (&x, &w)) in frame.iter().zip(window).enumerate() {
                    let a = -TAU * ((k * t) % n) as f64 / n as f64;
                    let v = f64::from(x) * f64::from(w);
                    re += v * a.cos();
                    im += v * a.sin();
                }
                re * re + im * im
            })
            .collect()
    }

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn every_radix_matches_the_definition() {
        // 400 = 2·(4·2·5·5) (Whisper); the others exercise radices 3, 7, 11, 13 and tiny sizes.
        for n_fft in [2, 4, 6, 8, 10, 14, 22, 26, 30, 64, 96, 210, 400, 512, 858] {
            let stft = Stft::new(n_fft).unwrap_or_else(|| panic!("{n_fft} planned"));
            let hop = n_fft / 3 + 1;
            let x = noise(n_fft + hop * LANES, n_fft as u64);
            let window: Vec<f32> = noise(n_fft, 7).iter().map(|v| v.abs()).collect();
            // A full group (the transposing load where n_fft is a multiple of 8), and a partial
            // one, whose last lanes must come out zero.
            for used in [LANES, LANES - 3] {
                let starts: Vec<usize> = (0..used).map(|f| f * hop).collect();
                let frames: Vec<&[f32]> = starts.iter().map(|&s| &x[s..s + n_fft]).collect();
                let mut out = vec![f32::NAN; (n_fft / 2 + 1) * LANES];
                stft.power_spectra(&frames, &window, &mut stft.scratch(), &mut out);
                for (f, &start) in starts.iter().enumerate() {
                    let want = reference(&x[start..start + n_fft], &window);
                    let scale = want.iter().cloned().fold(0.0, f64::max);
                    for (k, w) in want.iter().enumerate() {
                        let got = f64::from(out[k * LANES + f]);
                        assert!((got - w).abs() <= 2e-5 * scale, "n_fft {n_fft} frame {f} bin {k}: {got} vs {w}");
                    }
                }
                for f in used..LANES {
                    assert!((0..=n_fft / 2).all(|k| out[k * LANES + f] == 0.0), "n_fft {n_fft}: lane {f} not zero");
                }
            }
        }
    }

    #[test]
    fn sizes_left_to_realfft() {
        assert!(Stft::new(401).is_none(), "odd");
        assert!(Stft::new(2 * 17).is_none(), "prime 17");
        assert!(Stft::new(0).is_none());
    }
}
