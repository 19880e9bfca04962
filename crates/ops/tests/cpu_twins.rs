//! The CPU twins of our kernels against independent references: candle's own ops or plain
//! loops written here. The twins are the references the kernels' GPU self-tests compare
//! against, so a wrong twin would pass a wrong kernel; checking a twin against itself (the
//! self-tests run on the CPU) cannot catch that. All in f32 on the CPU, on odd sizes and on
//! views that start past their storage's start.
//!
//! Not here, because their unit tests already compare with an independent reference:
//! `paged_attention` (`reads_each_sequence_through_its_table`: a softmax over keys gathered
//! by hand) and `arena_rows` (`cpu_gather_reads_text_and_slot_rows`: rows written out).

use candle_core::{DType, Device, Tensor};
use mmserve_ops::decoder_fused::{self, PoolSlots};
use mmserve_ops::row_copy;

/// Values uniform in [-2, 2) of `shape` from a xorshift seeded with `seed` (reproducible).
fn uniform(shape: &[usize], seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Rows 1.. of `uniform([1 + rows, ..])`: a contiguous view whose start is past its storage's.
fn offset_view(shape: &[usize], seed: u64) -> Tensor {
    let mut bigger = shape.to_vec();
    bigger[0] += 1;
    uniform(&bigger, seed).narrow(0, 1, shape[0]).unwrap()
}

/// Asserts equal shapes and |got − want| ≤ `tol` · max(1, |want|) everywhere (NaN fails).
fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f32) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes");
    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let ok = (g - w).abs() <= tol * w.abs().max(1.0);
        assert!(ok, "{what}: element {i} is {g}, want {w}");
    }
}

#[test]
fn add_rmsnorm_matches_candle_rms_norm() {
    for (i, &(rows, h, eps)) in [(1, 1, 1e-5), (3, 8, 1e-6), (5, 1031, 1e-5), (2, 4096, 1e-6)].iter().enumerate() {
        let seed = 10 * i as u64;
        let (x, y) = (offset_view(&[rows, h], seed), uniform(&[rows, h], seed + 1));
        let w = offset_view(&[h], seed + 2);
        let (sum, normed) = decoder_fused::add_rmsnorm(&x, &y, &w, eps).unwrap();
        let want_sum = (&x + &y).unwrap();
        assert_close(&format!("add_rmsnorm sum [{rows}, {h}]"), &sum, &want_sum, 0.0);
        let want = candle_nn::ops::rms_norm(&want_sum, &w, eps).unwrap();
        assert_close(&format!("add_rmsnorm norm [{rows}, {h}]"), &normed, &want, 1e-5);
    }
    // A transposed (non-contiguous) x is copied first, not read in storage order.
    let (xt, y, w) = (uniform(&[7, 3], 50).t().unwrap(), uniform(&[3, 7], 51), uniform(&[7], 52));
    let (sum, normed) = decoder_fused::add_rmsnorm(&xt, &y, &w, 1e-5).unwrap();
    let want_sum = (&xt + &y).unwrap();
    assert_close("add_rmsnorm sum of a transposed x", &sum, &want_sum, 0.0);
    let want = candle_nn::ops::rms_norm(&want_sum, &w, 1e-5).unwrap();
    assert_close("add_rmsnorm norm of a transposed x", &normed, &want, 1e-5);
}

#[test]
fn silu_mul_matches_candle_silu() {
    for (i, &(rows, inter)) in [(1, 1), (7, 333), (2, 512), (3, 5)].iter().enumerate() {
        let gu = offset_view(&[rows, 2 * inter], 100 + i as u64);
        let gate = gu.narrow(1, 0, inter).unwrap();
        let up = gu.narrow(1, inter, inter).unwrap();
        let want = (candle_nn::ops::silu(&gate).unwrap() * up).unwrap();
        assert_close(&format!("silu_mul [{rows}, 2·{inter}]"), &decoder_fused::silu_mul(&gu).unwrap(), &want, 1e-6);
    }
    // An odd width has no gate and up halves (it used to drop a column and misread rows).
    assert!(decoder_fused::silu_mul(&uniform(&[2, 7], 9)).is_err());
}

#[test]
fn rope_split_matches_candle_rope_thd() {
    // (tokens, (heads, kv_heads, head_dim)): grouped heads, odd halves, one token, many.
    let cases = [(3, (2, 1, 4)), (1, (6, 2, 10)), (70, (6, 2, 10)), (5, (4, 4, 16)), (2, (1, 1, 2))];
    for (i, &(t, (h, k, d))) in cases.iter().enumerate() {
        let seed = 200 + 10 * i as u64;
        let qkv = offset_view(&[t, (h + 2 * k) * d], seed);
        let angles = (uniform(&[t, d / 2], seed + 1) * 3.0).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let (q, kr, v) = decoder_fused::rope_split(&qkv, &cos, &sin, (h, k, d)).unwrap();
        // Heads `from..from + n` of the projection as [1, T, n, D].
        let heads = |from: usize, n: usize| qkv.narrow(1, from * d, n * d).unwrap().reshape((1, t, n, d)).unwrap();
        let rope = |x: Tensor| candle_nn::rotary_emb::rope_thd(&x, &cos, &sin).unwrap().squeeze(0).unwrap();
        let what = format!("rope_split T {t} H {h} K {k} D {d}");
        assert_close(&format!("{what} q"), &q, &rope(heads(0, h)), 1e-6);
        assert_close(&format!("{what} k"), &kr, &rope(heads(h, k)), 1e-6);
        assert_close(&format!("{what} v"), &v, &heads(h + k, k).squeeze(0).unwrap(), 0.0);
    }
    // Shapes that do not fit: an odd head dim, a width that is not (H + 2K)·D.
    let (cos, sin) = (uniform(&[2, 2], 1), uniform(&[2, 2], 2));
    assert!(decoder_fused::rope_split(&uniform(&[2, 20], 3), &cos, &sin, (2, 1, 5)).is_err());
    assert!(decoder_fused::rope_split(&uniform(&[2, 17], 4), &cos, &sin, (2, 1, 4)).is_err());
    // Into the pool is the GPU's alone: the CPU refuses rather than skipping the pools.
    let pool = Tensor::zeros((1, 1, 4, 4), DType::F32, &Device::Cpu).unwrap();
    let slots = Tensor::new(&[0u32, 1], &Device::Cpu).unwrap();
    let pools = PoolSlots { k: &pool, v: &pool, slots: &slots };
    assert!(decoder_fused::rope_split_into(&uniform(&[2, 16], 5), &cos, &sin, (2, 1, 4), pools).is_err());
}

#[test]
fn rows_of_each_matches_a_plain_loop() {
    // (batch, n, d, start, len): LLaVA's drop of the class row, odd rows, all rows, none.
    let cases = [(3, 577, 64, 1, 576), (2, 9, 24, 2, 5), (4, 5, 3, 1, 3), (1, 4, 7, 0, 4), (2, 3, 5, 3, 0)];
    for (i, &(b, n, d, start, len)) in cases.iter().enumerate() {
        let x = offset_view(&[b, n, d], 300 + i as u64);
        let got = row_copy::rows_of_each(&x, start, len).unwrap();
        assert!(got.is_contiguous());
        let all: Vec<Vec<Vec<f32>>> = x.to_vec3().unwrap();
        let want: Vec<f32> = all.iter().flat_map(|e| e[start..start + len].iter().flatten().copied()).collect();
        let want = Tensor::from_vec(want, (b, len, d), &Device::Cpu).unwrap();
        assert_close(&format!("rows_of_each [{b}, {n}, {d}] rows {start}..+{len}"), &got, &want, 0.0);
    }
    assert!(row_copy::rows_of_each(&uniform(&[2, 4, 3], 1), 2, 3).is_err(), "rows 2..5 of 4");
}
