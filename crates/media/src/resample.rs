//! PIL's `Image.resize(size, Image.BICUBIC)` on RGB8, reproduced bit for bit.
//!
//! Pillow (`libImaging/Resample.c`) resizes with two separable passes through a uint8
//! intermediate (horizontal first unless the height shrinks much more than the width,
//! since Pillow 13). For each output pixel it takes the input
//! window `center ± support` (support = 2 × the downscale factor, at least 2),
//! evaluates the bicubic kernel (a = −0.5) at the scaled distances, normalises the
//! weights to sum 1 in f64, quantises them to 22-bit fixed point (round half away
//! from zero), accumulates in i32 from a rounding bias of 2^21, and shifts and clips
//! to 0..=255. A pass is skipped when its dimension does not change.
//!
//! The weights of one output pixel depend only on its index, so any window of the
//! output can be computed on its own, exactly: [`resize_bicubic_window`] does that,
//! which keeps a centre crop of a very elongated image cheap.

use crate::simd::dispatch;
use std::ops::Range;

use image::RgbImage;

const PRECISION_BITS: u32 = 22;
const SUPPORT: f64 = 2.0;

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Fixed-point taps of one output pixel: weights for inputs `first..first + weights.len()`.
struct Taps {
    first: usize,
    weights: Vec<i32>,
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for the outputs in `out`
/// of an `in_size` → `out_size` resize along one axis.
fn taps(in_size: u32, out_size: u32, out: Range<u32>) -> Vec<Taps> {
    // Pillow passes the box as C floats: (float)in_size, then divides in double.
    let scale = f64::from(in_size as f32) / f64::from(out_size);
    let filterscale = scale.max(1.0);
    let support = SUPPORT * filterscale;
    let ss = 1.0 / filterscale;
    let one = f64::from(1u32 << PRECISION_BITS);
    out.map(|xx| {
        let center = (f64::from(xx) + 0.5) * scale;
        // C's (int) truncates toward zero.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size));
        let raw: Vec<f64> = (xmin..xmax.max(xmin)).map(|x| bicubic((x as f64 - center + 0.5) * ss)).collect();
        let ww: f64 = raw.iter().sum();
        let weights = raw
            .iter()
            .map(|&w| {
                let w = if ww != 0.0 { w / ww } else { w };
                if w < 0.0 { (-0.5 + w * one) as i32 } else { (0.5 + w * one) as i32 }
            })
            .collect();
        Taps { first: xmin as usize, weights }
    })
    .collect()
}

fn clip8(acc: i32) -> u8 {
    (acc >> PRECISION_BITS).clamp(0, 255) as u8
}

const BIAS: i32 = 1 << (PRECISION_BITS - 1);

/// Horizontal pass (see [`horizontal_kernel`]), with AVX2 intrinsics where the CPU has them.
fn horizontal(src: &[u8], width: usize, rows: Range<usize>, taps: &[Taps]) -> Vec<u8> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { horizontal_avx2(src, width, rows, taps) };
    }
    horizontal_kernel(src, width, rows, taps)
}

/// [`horizontal_kernel`] with the four-row multiply-adds written as AVX2 instructions
/// (the compiler otherwise vectorises across taps, with slow gathers). The same integers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn horizontal_avx2(src: &[u8], width: usize, rows: Range<usize>, taps: &[Taps]) -> Vec<u8> {
    use std::arch::x86_64::{
        __m256i, _mm256_add_epi32, _mm256_loadu_si256, _mm256_mullo_epi32, _mm256_set1_epi32, _mm256_storeu_si256,
    };
    const R: usize = 4;
    let line = taps.len() * 3;
    let mut out = vec![0u8; rows.len() * line];
    let mut wide = vec![[[0i32; 4]; R]; width];
    let mut chunks = out.chunks_exact_mut(R * line);
    let mut y = rows.start;
    for block in &mut chunks {
        for r in 0..R {
            let src_line = &src[(y + r) * width * 3..(y + r + 1) * width * 3];
            for (d, s) in wide.iter_mut().zip(src_line.chunks_exact(3)) {
                d[r] = [i32::from(s[0]), i32::from(s[1]), i32::from(s[2]), 0];
            }
        }
        for (x, t) in taps.iter().enumerate() {
            let (mut a0, mut a1) = (_mm256_set1_epi32(BIAS), _mm256_set1_epi32(BIAS));
            for (p, &k) in wide[t.first..t.first + t.weights.len()].iter().zip(&t.weights) {
                let k = _mm256_set1_epi32(k);
                let p: *const __m256i = p.as_ptr().cast();
                // SAFETY: `p` points at 16 i32 (two 256-bit halves); unaligned loads.
                let (v0, v1) = unsafe { (_mm256_loadu_si256(p), _mm256_loadu_si256(p.add(1))) };
                a0 = _mm256_add_epi32(a0, _mm256_mullo_epi32(v0, k));
                a1 = _mm256_add_epi32(a1, _mm256_mullo_epi32(v1, k));
            }
            let mut acc = [[0i32; 4]; R];
            let dst: *mut __m256i = acc.as_mut_ptr().cast();
            // SAFETY: `acc` holds 16 i32 (two 256-bit halves); unaligned stores.
            unsafe {
                _mm256_storeu_si256(dst, a0);
                _mm256_storeu_si256(dst.add(1), a1);
            }
            for (r, a) in acc.iter().enumerate() {
                block[r * line + x * 3..][..3].copy_from_slice(&[clip8(a[0]), clip8(a[1]), clip8(a[2])]);
            }
        }
        y += R;
    }
    let mut wide = vec![[[0i32; 4]; 1]; width];
    for row in chunks.into_remainder().chunks_exact_mut(line) {
        horizontal_rows::<1>(src, width, y, taps, row, &mut wide);
        y += 1;
    }
    out
}
dispatch!(vertical(src: &[u8], width: usize, cols: Range<usize>, taps: &[Taps]) -> Vec<u8> => vertical_kernel);

/// Horizontal pass: for each of `rows` rows of `src` (`width` RGB pixels each) and each
/// tap set, the clipped weighted sum. Returns `[row][tap set]` RGB.
#[inline(always)]
fn horizontal_kernel(src: &[u8], width: usize, rows: Range<usize>, taps: &[Taps]) -> Vec<u8> {
    const R: usize = 4;
    let line = taps.len() * 3;
    let mut out = vec![0u8; rows.len() * line];
    let mut wide = vec![[[0i32; 4]; R]; width];
    let mut chunks = out.chunks_exact_mut(R * line);
    let mut y = rows.start;
    for block in &mut chunks {
        horizontal_rows::<R>(src, width, y, taps, block, &mut wide);
        y += R;
    }
    let mut wide = vec![[[0i32; 4]; 1]; width];
    for row in chunks.into_remainder().chunks_exact_mut(line) {
        horizontal_rows::<1>(src, width, y, taps, row, &mut wide);
        y += 1;
    }
    out
}

/// `R` rows from row `y` of the horizontal pass, into `out` (`R` output rows). Each input
/// pixel is widened to four i32 lanes per row (the fourth unused), the `R` rows side by
/// side, so that a tap is a few vector multiply-adds sharing one weight.
#[inline(always)]
fn horizontal_rows<const R: usize>(
    src: &[u8],
    width: usize,
    y: usize,
    taps: &[Taps],
    out: &mut [u8],
    wide: &mut [[[i32; 4]; R]],
) {
    for r in 0..R {
        let line = &src[(y + r) * width * 3..(y + r + 1) * width * 3];
        for (d, s) in wide.iter_mut().zip(line.chunks_exact(3)) {
            d[r] = [i32::from(s[0]), i32::from(s[1]), i32::from(s[2]), 0];
        }
    }
    let line = taps.len() * 3;
    for (x, t) in taps.iter().enumerate() {
        let mut acc = [[BIAS; 4]; R];
        for (p, &k) in wide[t.first..t.first + t.weights.len()].iter().zip(&t.weights) {
            for (a, p) in acc.iter_mut().zip(p) {
                for (a, &v) in a.iter_mut().zip(p) {
                    *a += v * k;
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            out[r * line + x * 3..][..3].copy_from_slice(&[clip8(a[0]), clip8(a[1]), clip8(a[2])]);
        }
    }
}

/// Vertical pass over the pixel columns `cols` of `src` (`width` RGB pixels per row): for
/// each tap set, a row of clipped weighted sums (accumulated row by row, the same integers
/// as Pillow's column by column). Returns `[tap set][column]` RGB.
#[inline(always)]
fn vertical_kernel(src: &[u8], width: usize, cols: Range<usize>, taps: &[Taps]) -> Vec<u8> {
    let (start, end) = (cols.start * 3, cols.end * 3);
    let n = end - start;
    let mut out = vec![0u8; taps.len() * n];
    let mut acc = vec![0i32; n];
    let row = |i: usize| &src[i * width * 3 + start..i * width * 3 + end];
    for (t, o) in taps.iter().zip(out.chunks_exact_mut(n)) {
        acc.fill(BIAS);
        let mut pairs = t.weights.chunks_exact(2);
        let mut i = t.first;
        // Two input rows per sweep over the accumulators.
        for k in &mut pairs {
            let (k0, k1) = (k[0], k[1]);
            for ((a, &v0), &v1) in acc.iter_mut().zip(row(i)).zip(row(i + 1)) {
                *a += i32::from(v0) * k0 + i32::from(v1) * k1;
            }
            i += 2;
        }
        if let [k] = *pairs.remainder() {
            for (a, &v) in acc.iter_mut().zip(row(i)) {
                *a += i32::from(v) * k;
            }
        }
        for (o, &a) in o.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    out
}

/// One axis' taps for the outputs in `out`; a unit tap when the size does not change
/// (Pillow skips that pass; a unit weight gives the same values).
fn axis_taps(in_size: u32, out_size: u32, out: Range<u32>) -> Vec<Taps> {
    if in_size == out_size {
        out.map(|i| Taps { first: i as usize, weights: vec![1 << PRECISION_BITS] }).collect()
    } else {
        taps(in_size, out_size, out)
    }
}

/// The input band `[start, end)` the taps read, and the taps shifted to start at 0.
fn band(taps: Vec<Taps>) -> (usize, usize, Vec<Taps>) {
    let start = taps.iter().map(|t| t.first).min().unwrap_or(0);
    let end = taps.iter().map(|t| t.first + t.weights.len()).max().unwrap_or(0);
    (start, end.max(start), taps.into_iter().map(|t| Taps { first: t.first - start, ..t }).collect())
}

/// `img.resize((width, height), Image.BICUBIC)` as PIL computes it.
pub fn resize_bicubic(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize_bicubic_window(img, width, height, 0..width, 0..height)
}

/// The window `cols × rows` of `img.resize((width, height), Image.BICUBIC)`, computed
/// without the rest of the resized image. The result is `cols.len() × rows.len()`
/// pixels, identical to cropping the full resize.
///
/// Like Pillow 13, the vertical pass runs first when the height shrinks by more than
/// twice as many pixels as the width (`in_h - h > 0 && in_h - h > 2 · (in_w - w)`), the
/// horizontal pass first otherwise; the order changes the result through the uint8
/// intermediate.
///
/// # Panics
/// If the window is not inside `0..width × 0..height`.
pub fn resize_bicubic_window(img: &RgbImage, width: u32, height: u32, cols: Range<u32>, rows: Range<u32>) -> RgbImage {
    assert!(
        cols.start <= cols.end && cols.end <= width && rows.start <= rows.end && rows.end <= height,
        "window {cols:?}x{rows:?} outside {width}x{height}"
    );
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    let (out_w, out_h) = (cols.len(), rows.len());
    if out_w == 0 || out_h == 0 {
        return RgbImage::new(out_w as u32, out_h as u32);
    }
    let h_taps = axis_taps(in_w as u32, width, cols);
    let v_taps = axis_taps(in_h as u32, height, rows);
    let (dh, dw) = (in_h as i64 - i64::from(height), in_w as i64 - i64::from(width));
    let raw = img.as_raw();
    let out = if dh > 0 && dh > 2 * dw {
        // Vertical pass over the band of input columns the horizontal taps read, then horizontal.
        let (start, end, h_taps) = band(h_taps);
        let mid = vertical(raw, in_w, start..end, &v_taps);
        horizontal(&mid, end - start, 0..out_h, &h_taps)
    } else {
        // Horizontal pass over the band of input rows the vertical taps read, then vertical.
        let (start, end, v_taps) = band(v_taps);
        let mid = horizontal(raw, in_w, start..end, &h_taps);
        vertical(&mid, out_w, 0..out_w, &v_taps)
    };
    RgbImage::from_raw(out_w as u32, out_h as u32, out).expect("window size")
}

#[cfg(test)]
mod tests {
    use image::Rgb;

    use super::*;

    fn pattern(w: u32, h: u32) -> RgbImage {
        RgbImage::from_fn(w, h, |x, y| Rgb([(x * 37 + y * 11) as u8, (x * x + 3 * y) as u8, ((x ^ y) * 29) as u8]))
    }

    #[test]
    fn identity_size_is_a_copy() {
        let img = pattern(13, 7);
        assert_eq!(resize_bicubic(&img, 13, 7), img);
    }

    #[test]
    fn constant_stays_constant() {
        let img = RgbImage::from_pixel(17, 9, Rgb([0, 128, 255]));
        for (w, h) in [(5, 3), (40, 31), (17, 30), (3, 9), (1, 1), (100, 2)] {
            let out = resize_bicubic(&img, w, h);
            assert_eq!(out.dimensions(), (w, h));
            assert!(out.pixels().all(|p| p.0 == [0, 128, 255]), "{w}x{h}");
        }
    }

    #[test]
    fn halving_two_pixels_rounds_half_up() {
        // Both taps weigh 1/2: (0 + 255) / 2 = 127.5 → 128 with Pillow's rounding bias.
        let img = RgbImage::from_fn(2, 1, |x, _| Rgb([255 * x as u8, 0, 10]));
        assert_eq!(resize_bicubic(&img, 1, 1).get_pixel(0, 0).0, [128, 0, 10]);
    }

    #[test]
    fn upscale_overshoots_and_clips() {
        // The negative lobes of a = -0.5 overshoot at a step edge; the result is clipped.
        let img = RgbImage::from_fn(4, 1, |x, _| Rgb([if x < 2 { 0 } else { 255 }; 3]));
        let out = resize_bicubic(&img, 16, 1);
        let row: Vec<u8> = out.pixels().map(|p| p[0]).collect();
        assert_eq!(row[..4], [0; 4]);
        assert_eq!(row[12..], [255; 4]);
        assert!(row.windows(2).all(|w| w[0] <= w[1]), "{row:?}");
    }

    #[test]
    fn pass_order_follows_pillow_13() {
        // Height shrinks by more than twice the width's change: vertical pass first, which
        // equals resizing the height alone, then the width.
        let img = pattern(29, 40);
        let two_step = |first: (u32, u32)| resize_bicubic(&resize_bicubic(&img, first.0, first.1), 33, 17);
        assert_eq!(resize_bicubic(&img, 33, 17), two_step((29, 17)));
        assert_ne!(resize_bicubic(&img, 33, 17), two_step((33, 40)));
        // Otherwise horizontal first.
        assert_eq!(resize_bicubic(&img, 20, 35), resize_bicubic(&resize_bicubic(&img, 20, 40), 20, 35));
    }

    #[test]
    fn portable_kernels_equal_dispatched_ones() {
        // The AVX2 versions run where the CPU has AVX2; the portable ones must agree.
        let img = pattern(37, 11);
        for (w, h) in [(13, 5), (90, 11), (37, 2), (5, 29)] {
            let (ht, vt) = (axis_taps(37, w, 0..w), axis_taps(11, h, 0..h));
            let raw = img.as_raw();
            assert_eq!(horizontal(raw, 37, 0..11, &ht), horizontal_kernel(raw, 37, 0..11, &ht), "{w}x{h}");
            assert_eq!(horizontal(raw, 37, 3..10, &ht), horizontal_kernel(raw, 37, 3..10, &ht), "{w}x{h}");
            assert_eq!(vertical(raw, 37, 2..30, &vt), vertical_kernel(raw, 37, 2..30, &vt), "{w}x{h}");
        }
    }

    #[test]
    fn dispatched_horizontal_pass_is_exact_on_wide_kernels() {
        // Big downscales (a tap set of ~25 weights), an upscale's negative lobes, and
        // pixels at 0 and 255 where the sums are largest.
        let noisy = RgbImage::from_fn(2048, 9, |x, y| {
            let h = x.wrapping_mul(2_654_435_761u32.wrapping_mul(y + 1)) >> 13;
            Rgb([h as u8, if x % 7 < 3 { 255 } else { 0 }, (h >> 8) as u8])
        });
        for w in [336, 335, 61, 2047, 4096, 1] {
            let t = axis_taps(2048, w, 0..w);
            let raw = noisy.as_raw();
            assert_eq!(horizontal(raw, 2048, 0..9, &t), horizontal_kernel(raw, 2048, 0..9, &t), "2048 -> {w}");
        }
    }

    #[test]
    fn window_equals_crop_of_full_resize() {
        let img = pattern(23, 11);
        for (w, h) in [(23, 11), (7, 5), (50, 11), (23, 30), (61, 3), (30, 4), (5, 3)] {
            let full = resize_bicubic(&img, w, h);
            for (cols, rows) in [(0..w, 0..h), (1..w - 1, h / 2..h), (w / 3..w / 3 + 1, 0..1), (2..2, 0..h)] {
                let win = resize_bicubic_window(&img, w, h, cols.clone(), rows.clone());
                let crop =
                    image::imageops::crop_imm(&full, cols.start, rows.start, cols.len() as u32, rows.len() as u32);
                assert_eq!(win, crop.to_image(), "{w}x{h} {cols:?} {rows:?}");
            }
        }
    }
}
