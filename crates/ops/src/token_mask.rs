//! Token masks of structured outputs applied where the logits are (`kernels/token_mask.cu`):
//! a constrained row's disallowed tokens become -inf before the argmax or the draw, so the
//! device picks among allowed tokens and only the bitmask (a bit a token) is uploaded.
//! The CPU twin, [`mask_row`], is what the host sampler applies to a row it holds.

use candle_core::{CpuStorage, DType, Device, InplaceOp2, Layout, Tensor};

use crate::OpError;

/// Sets every logit that `bits` disallows to -inf: token t is allowed when bit t % 32 of
/// word t / 32 is set; tokens past the mask's words are not.
pub fn mask_row(row: &mut [f32], bits: &[u32]) {
    // A word at a time: grammars allow few tokens, so most words are 0 (a fill).
    for (k, chunk) in row.chunks_mut(32).enumerate() {
        match bits.get(k).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            w => {
                chunk.iter_mut().enumerate().filter(|(j, _)| w >> j & 1 == 0).for_each(|(_, l)| *l = f32::NEG_INFINITY)
            }
        }
    }
}

/// Whether `bits` allows any of the first `n` tokens.
pub fn allows_any(bits: &[u32], n: usize) -> bool {
    bits.iter().enumerate().any(|(w, &b)| {
        let valid = n.saturating_sub(w * 32).min(32);
        let keep = if valid >= 32 { u32::MAX } else { (1u32 << valid) - 1 };
        b & keep != 0
    })
}

/// Masks rows of `logits` [rows, vocab] (f32, contiguous) in place: each entry is a row
/// index and its bits, all of one length.
pub fn mask_rows(logits: &Tensor, masks: &[(u32, &[u32])]) -> Result<(), OpError> {
    let Some(words) = masks.first().map(|(_, b)| b.len()) else { return Ok(()) };
    let (rows, _) = logits.dims2()?;
    if logits.dtype() != DType::F32 || !logits.is_contiguous() {
        return Err(OpError::InvalidInput("mask_rows: logits must be contiguous f32".into()));
    }
    let mut table = Vec::with_capacity(masks.len() * (1 + words));
    for &(row, bits) in masks {
        if bits.len() != words || row as usize >= rows {
            return Err(OpError::InvalidInput(format!("mask_rows: row {row} of {rows}, {} words", bits.len())));
        }
        table.push(row);
        table.extend_from_slice(bits);
    }
    let table = Tensor::from_vec(table, (masks.len(), 1 + words), logits.device())?;
    Ok(logits.inplace_op2(&table, &MaskLogits)?)
}

struct MaskLogits;

impl InplaceOp2 for MaskLogits {
    fn name(&self) -> &'static str {
        "mask_logits"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout, t: &CpuStorage, lt: &Layout) -> candle_core::Result<()> {
        let (_, n) = l.shape().dims2()?;
        let (m, width) = lt.shape().dims2()?;
        let (CpuStorage::F32(x), CpuStorage::U32(table)) = (s, t) else {
            candle_core::bail!("mask_logits: f32 logits and a u32 table")
        };
        let (x, table) = (&mut x[l.start_offset()..], &table[lt.start_offset()..]);
        for e in table.chunks_exact(width).take(m) {
            let r = e[0] as usize;
            mask_row(&mut x[r * n..(r + 1) * n], &e[1..]);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &mut candle_core::CudaStorage,
        l: &Layout,
        t: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> candle_core::Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
        const MODULE: crate::launch::Module = crate::launch::module!("token_mask");
        const THREADS: u32 = 1024;

        let (_, n) = l.shape().dims2()?;
        let (m, width) = lt.shape().dims2()?;
        if n == 0 || m == 0 || n > i32::MAX as usize || width > i32::MAX as usize {
            return Ok(());
        }
        let dev = s.device().clone();
        let table = crate::launch::view::<u32>(t, lt)?;
        let x = s.as_cuda_slice_mut::<f32>()?;
        let mut x = x.slice_mut(l.start_offset()..);
        let func = crate::launch::kernel!(MODULE, dev, "mask_logits")?;
        let (n_arg, words) = (n as i32, (width - 1) as i32);
        let mut b = func.builder();
        b.arg(&mut x).arg(&n_arg).arg(&table).arg(&words);
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(THREADS), m as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block (x, y) writes only within row table[y][0] of the logits (checked
        // against their rows by `mask_rows`), tokens below n, and reads entry y of the
        // table (1 + words values); both live on this device's stream.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Runs the kernel on `device` against its twin: odd widths (masks shorter than a row,
/// empty, full, random), rows masked out of order and rows left alone, into logits poisoned
/// with NaN where a mask keeps them. A line per case that differs.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    for n in [1usize, 33, 1031, 32064, 151_936] {
        let rows = 6;
        let mut x: Vec<f32> = Tensor::randn(0f32, 1.0, (rows, n), &Device::Cpu)?.flatten_all()?.to_vec1()?;
        x.iter_mut().step_by(7).for_each(|v| *v = f32::NAN);
        let words = n.div_ceil(32).saturating_sub(1).max(1);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng as u32
        };
        let random: Vec<u32> = (0..words).map(|_| next()).collect();
        let sparse: Vec<u32> = (0..words).map(|_| next() & next() & next()).collect();
        let (empty, full) = (vec![0u32; words], vec![u32::MAX; words]);
        let masks: Vec<(u32, &[u32])> = vec![(4, &random), (0, &empty), (5, &full), (2, &sparse)];
        let want = Tensor::from_vec(x.clone(), (rows, n), &Device::Cpu)?;
        mask_rows(&want, &masks)?;
        let got = Tensor::from_vec(x, (rows, n), device)?;
        mask_rows(&got, &masks)?;
        let (want, got): (Vec<f32>, Vec<f32>) = (want.flatten_all()?.to_vec1()?, got.flatten_all()?.to_vec1()?);
        if want.iter().zip(&got).any(|(a, b)| a.to_bits() != b.to_bits()) {
            bad.push(format!("mask_logits n={n}: the device's masked rows differ from the twin's"));
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_twin_keeps_exactly_the_allowed_tokens() {
        // An independent reference: a set of allowed ids.
        let bits = [0b1010u32, 1 << 31];
        let allowed = [1usize, 3, 63];
        let mut row: Vec<f32> = (0..70).map(|i| i as f32).collect();
        mask_row(&mut row, &bits);
        for (t, v) in row.iter().enumerate() {
            assert_eq!(v.is_finite(), allowed.contains(&t), "token {t}");
        }
        assert!(allows_any(&bits, 70) && allows_any(&bits, 2) && !allows_any(&bits, 1));
        assert!(!allows_any(&[0, 0], 64) && !allows_any(&[1 << 5], 5) && allows_any(&[1 << 5], 6));
    }

    #[test]
    fn the_op_masks_only_the_rows_it_names() {
        let t = Tensor::from_vec((0..12).map(|i| i as f32).collect::<Vec<_>>(), (3, 4), &Device::Cpu).unwrap();
        mask_rows(&t, &[(2, &[0b0110]), (0, &[0])]).unwrap();
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let inf = f32::NEG_INFINITY;
        assert_eq!(v, [inf, inf, inf, inf, 4.0, 5.0, 6.0, 7.0, inf, 9.0, 10.0, inf]);
        assert!(mask_rows(&t, &[(3, &[1])]).is_err(), "a row past the logits");
        assert!(mask_rows(&t, &[(0, &[1]), (1, &[1, 1])]).is_err(), "masks of two lengths");
    }

    #[test]
    fn the_self_test_passes_on_the_cpu() {
        assert!(self_test(&Device::Cpu).unwrap().is_empty());
    }
}
