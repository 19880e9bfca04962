//! Fused elementwise ops on the GPU (`kernels/fused.cu`), where candle would chain
//! separate passes over the tensor: the scaled (optionally causal) softmax of attention
//! scores, and the bias add after a linear layer. Each has a CPU twin that computes the
//! same thing in f32; the kernels are tested against it ([`self_test`]). The model code
//! calls them on the GPU only: the CPU keeps candle's ops, whose results the parity tests
//! pin down.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Shape, Tensor};

use crate::OpError;
#[cfg(feature = "cuda")]
use crate::dispatch::by_float;
use crate::dispatch::cpu_float;
use crate::elem::FromF32;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

/// `softmax(scale · x)` over the last dim, in f32, in x's dtype. `causal: Some((n, past))`:
/// the rows are queries folded as `[.., n]` (row r is query `r % n`, at position
/// `past + r % n`), each seeing the columns up to its own position (the rest come out 0).
/// `valid: Some(c)` also hides the columns from `c` on (keys padded for alignment).
#[derive(Debug, Clone, Copy)]
struct ScaledSoftmax {
    scale: f32,
    causal: Option<(usize, usize)>,
    valid: Option<usize>,
}

impl ScaledSoftmax {
    fn dims(&self, l: &Layout) -> candle_core::Result<(usize, usize)> {
        if !l.is_contiguous() {
            candle_core::bail!("scaled_softmax: the scores must be contiguous");
        }
        let cols = l.dims().last().copied().unwrap_or(1);
        let rows = l.shape().elem_count() / cols.max(1);
        if let Some((n, _)) = self.causal
            && (n == 0 || !rows.is_multiple_of(n))
        {
            candle_core::bail!("scaled_softmax: {rows} rows are not groups of {n} queries");
        }
        Ok((rows, cols))
    }

    /// Columns row `r` sees.
    fn visible(&self, r: usize, cols: usize) -> usize {
        let cols = self.valid.map_or(cols, |v| v.min(cols));
        self.causal.map_or(cols, |(n, past)| cols.min(past + r % n + 1))
    }

    fn reference<T: FromF32>(&self, x: &[T], rows: usize, cols: usize) -> Vec<T> {
        let mut out = Vec::with_capacity(rows * cols);
        for (r, row) in x.chunks(cols).take(rows).enumerate() {
            let vis = self.visible(r, cols);
            let scaled: Vec<f32> = row[..vis].iter().map(|&v| v.into() * self.scale).collect();
            let max = scaled.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = scaled.iter().map(|&v| (v - max).exp()).sum();
            out.extend(scaled.iter().map(|&v| T::from_f32((v - max).exp() / sum)));
            out.extend((vis..cols).map(|_| T::from_f32(0.0)));
        }
        out
    }
}

impl CustomOp1 for ScaledSoftmax {
    fn name(&self) -> &'static str {
        "scaled_softmax"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, cols) = self.dims(l)?;
        let o = l.start_offset();
        let out = cpu_float!("scaled_softmax", (x) => self.reference(&x[o..], rows, cols));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        const WARPS: usize = 8; // SOFTMAX_WARPS in the kernel

        let (rows, cols) = self.dims(l)?;
        let dev = x.device().clone();
        let (n, past) = self.causal.map_or((0, 0), |(n, past)| (n as i32, past as i32));
        let (rows_arg, cols_arg) = (rows as i64, i32::try_from(cols).map_err(candle_core::Error::wrap)?);
        let valid = self.valid.map_or(cols_arg, |v| v.min(cols) as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS) as u32, 1, 1),
            block_dim: (WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let out = by_float!(x.dtype(), "scaled_softmax", |T, SUFFIX| {
            let x = crate::launch::view::<T>(x, l)?;
            // SAFETY: the kernel writes every element of every row.
            let mut out = unsafe { dev.alloc::<T>(rows * cols)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("scaled_softmax_{SUFFIX}"))?;
            let mut b = func.builder();
            b.arg(&x).arg(&mut out).arg(&rows_arg).arg(&cols_arg).arg(&self.scale).arg(&n).arg(&past).arg(&valid);
            // SAFETY: reads and writes [rows, cols] contiguous from the slices' starts.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, l.shape().clone()))
    }
}

/// `x [.., cols] + b [cols]`, x contiguous.
struct AddBias;

fn bias_dims(lx: &Layout, lb: &Layout) -> candle_core::Result<(usize, usize)> {
    let cols = lx.dims().last().copied().unwrap_or(1);
    if !lx.is_contiguous() || !lb.is_contiguous() || lb.shape().elem_count() != cols {
        candle_core::bail!("add_bias: x {:?} and bias {:?} do not fit", lx.shape(), lb.shape());
    }
    Ok((lx.shape().elem_count(), cols))
}

fn add_bias_reference<T: FromF32>(x: &[T], b: &[T], n: usize, cols: usize) -> Vec<T> {
    x[..n].iter().enumerate().map(|(i, &v)| T::from_f32(v.into() + b[i % cols].into())).collect()
}

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "add_bias"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, cols) = bias_dims(lx, lb)?;
        let (ox, ob) = (lx.start_offset(), lb.start_offset());
        let out = cpu_float!("add_bias", (x, b) => add_bias_reference(&x[ox..], &b[ob..], n, cols));
        Ok((out, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, cols) = bias_dims(lx, lb)?;
        let dev = x.device().clone();
        let rows = n / cols.max(1);
        let (rows_arg, cols_arg) = (rows as i64, i32::try_from(cols).map_err(candle_core::Error::wrap)?);
        let out = by_float!(x.dtype(), "add_bias", |T, SUFFIX| {
            // 16-byte chunks when rows and both starts align to them.
            let v = 16 / std::mem::size_of::<T>();
            let vec = [cols, lx.start_offset(), lb.start_offset()].iter().all(|a| a.is_multiple_of(v));
            let chunks = if vec { cols / v } else { cols };
            let cfg = LaunchConfig {
                grid_dim: (chunks.div_ceil(256) as u32, rows.clamp(1, 65_535) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let name = format!("add_bias{}_{SUFFIX}", if vec { "_vec" } else { "" });
            let x = crate::launch::view::<T>(x, lx)?;
            let b = crate::launch::view::<T>(b, lb)?;
            // SAFETY: the grid-stride loops write every element.
            let mut out = unsafe { dev.alloc::<T>(n)? };
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut builder = func.builder();
            builder.arg(&x).arg(&b).arg(&mut out).arg(&rows_arg).arg(&cols_arg);
            // SAFETY: reads n elements of x and cols of b, writes n of out.
            unsafe { builder.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, lx.shape().clone()))
    }
}

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("fused");

/// `softmax(scale · scores)` over the last dim in f32, in the scores' dtype; `causal`:
/// see [`ScaledSoftmax`] (rows as `[.., n]` queries at positions `past..past + n`).
pub fn scaled_softmax(scores: &Tensor, scale: f32, causal: Option<(usize, usize)>) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1_no_bwd(&ScaledSoftmax { scale, causal, valid: None })
}

/// `softmax(scale · scores)` over the first `valid` columns (the rest come out 0).
pub fn scaled_softmax_cols(scores: &Tensor, scale: f32, valid: usize) -> candle_core::Result<Tensor> {
    scores.contiguous()?.apply_op1_no_bwd(&ScaledSoftmax { scale, causal: None, valid: Some(valid) })
}
/// `qkv` [B·N, 3·H·D] → [3, B, H, Np, D] (q, k, v by head), rows from N to Np zero.
struct SplitHeads {
    batch: usize,
    n: usize,
    np: usize,
    heads: usize,
}

impl SplitHeads {
    fn check(&self, l: &Layout) -> candle_core::Result<usize> {
        let (rows, width) = l.shape().dims2()?;
        if !l.is_contiguous()
            || rows != self.batch * self.n
            || !width.is_multiple_of(3 * self.heads)
            || self.np < self.n
        {
            candle_core::bail!("split_heads: {:?} is not [{}·{}, 3·{}·D]", l.shape(), self.batch, self.n, self.heads);
        }
        Ok(width / (3 * self.heads))
    }

    fn shape(&self, hd: usize) -> Shape {
        Shape::from((3, self.batch, self.heads, self.np, hd))
    }

    fn reference<T: FromF32>(&self, x: &[T], hd: usize) -> Vec<T> {
        let (b, n, np, h) = (self.batch, self.n, self.np, self.heads);
        let mut out = vec![T::from_f32(0.0); 3 * b * h * np * hd];
        for bi in 0..b {
            for t in 0..n {
                let row = &x[(bi * n + t) * 3 * h * hd..][..3 * h * hd];
                for (i, &v) in row.iter().enumerate() {
                    let (part, rem) = (i / (h * hd), i % (h * hd));
                    let (hi, d) = (rem / hd, rem % hd);
                    out[(((part * b + bi) * h + hi) * np + t) * hd + d] = v;
                }
            }
        }
        out
    }
}

impl CustomOp1 for SplitHeads {
    fn name(&self) -> &'static str {
        "split_heads"
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let hd = self.check(l)?;
        let o = l.start_offset();
        let out = cpu_float!("split_heads", (x) => self.reference(&x[o..], hd));
        Ok((out, self.shape(hd)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let hd = self.check(l)?;
        let dev = x.device().clone();
        let total = 3 * self.batch * self.heads * self.np * hd;
        let cfg = LaunchConfig {
            grid_dim: ((self.batch * self.np) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [self.batch as i32, self.n as i32, self.np as i32, self.heads as i32, hd as i32];
        let out = by_float!(x.dtype(), "split_heads", |T, SUFFIX| {
            let x = crate::launch::view::<T>(x, l)?;
            // SAFETY: every element of [3, B, H, Np, D] is written (padding rows as 0).
            let mut out = unsafe { dev.alloc::<T>(total)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("split_heads_{SUFFIX}"))?;
            let mut b = func.builder();
            b.arg(&x).arg(&mut out);
            for a in &args {
                b.arg(a);
            }
            // SAFETY: reads [B·N, 3·H·D], writes `total` elements.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, self.shape(hd)))
    }
}

/// q, k and v by head ([B, H, Np, D] each, rows from N to `np` zero) from a stacked
/// projection `qkv` [B·N, 3·H·D].
pub fn split_heads(
    qkv: &Tensor,
    (batch, n, np, heads): (usize, usize, usize, usize),
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let out = qkv.contiguous()?.apply_op1_no_bwd(&SplitHeads { batch, n, np, heads })?;
    Ok((out.get(0)?, out.get(1)?, out.get(2)?))
}

/// An activation in one pass: CLIP's `quick_gelu`, `x · sigmoid(1.702 x)`, or the exact
/// `gelu`, `x · Φ(x)` (LLaVA's projector; one rounding, as torch's bf16 gelu).
#[derive(Debug, Clone, Copy)]
enum Act {
    QuickGelu,
    GeluErf,
}

/// The kernel's name stem and the CPU twin of each.
impl Act {
    fn stem(self) -> &'static str {
        match self {
            Act::QuickGelu => "quick_gelu",
            Act::GeluErf => "gelu_erf",
        }
    }

    fn reference<T: FromF32>(self, x: &[T]) -> Vec<T> {
        match self {
            Act::QuickGelu => quick_gelu_reference(x),
            Act::GeluErf => x
                .iter()
                .map(|&v| {
                    let v: f32 = v.into();
                    T::from_f32(0.5 * v * (1.0 + erf(v * std::f32::consts::FRAC_1_SQRT_2)))
                })
                .collect(),
        }
    }
}

fn quick_gelu_reference<T: FromF32>(x: &[T]) -> Vec<T> {
    let r = |v: f32| -> f32 { T::from_f32(v).into() };
    x.iter()
        .map(|&v| {
            let v: f32 = v.into();
            T::from_f32(v * r(1.0 / (1.0 + (-r(1.702 * v)).exp())))
        })
        .collect()
}

/// erf in f32, candle's (the CPU twin only).
fn erf(x: f32) -> f32 {
    candle_core::cpu::erf::erf_f32(x)
}

impl CustomOp1 for Act {
    fn name(&self) -> &'static str {
        self.stem()
    }

    fn cpu_fwd(&self, x: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        if !l.is_contiguous() {
            candle_core::bail!("{}: x must be contiguous", self.stem());
        }
        let (o, n) = (l.start_offset(), l.shape().elem_count());
        let out = cpu_float!("activation", (x) => self.reference(&x[o..o + n]));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        if !l.is_contiguous() {
            candle_core::bail!("{}: x must be contiguous", self.stem());
        }
        let n = l.shape().elem_count();
        let dev = x.device().clone();
        let out = by_float!(x.dtype(), "activation", |T, SUFFIX| {
            let v = 16 / std::mem::size_of::<T>();
            let vec = n.is_multiple_of(v) && l.start_offset().is_multiple_of(v);
            let chunks = if vec { n / v } else { n };
            let cfg = LaunchConfig {
                grid_dim: (chunks.div_ceil(256).min(65_535 * 8) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let n_arg = chunks as i64;
            let name = format!("{}{}_{SUFFIX}", self.stem(), if vec { "_vec" } else { "" });
            let x = crate::launch::view::<T>(x, l)?;
            // SAFETY: the grid-stride loop writes every element.
            let mut out = unsafe { dev.alloc::<T>(n)? };
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut b = func.builder();
            b.arg(&x).arg(&mut out).arg(&n_arg);
            // SAFETY: reads and writes n elements.
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, l.shape().clone()))
    }
}

/// The activation `stem` (`quick_gelu`, `gelu_erf`) in place over the `n` elements of
/// `dtype` at device address `at`, on `dev`'s stream (`gemm_epilogue::linear_act` runs it
/// over the output its GEMM has just written).
#[cfg(feature = "cuda")]
pub fn activation_in_place(
    dev: &candle_core::CudaDevice,
    stem: &str,
    at: u64,
    n: usize,
    dtype: DType,
) -> candle_core::Result<()> {
    let size = dtype.size_in_bytes();
    let vec = (n * size).is_multiple_of(16) && at.is_multiple_of(16);
    let chunks = if vec { n * size / 16 } else { n };
    let cfg = LaunchConfig {
        grid_dim: (chunks.div_ceil(256).min(65_535 * 8) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let suffix = by_float!(dtype, "activation", |_T, SUFFIX| SUFFIX);
    let name = format!("{stem}{}_{suffix}", if vec { "_vec" } else { "" });
    let func = crate::launch::kernel!(MODULE, dev, &name)?;
    let n_arg = chunks as i64;
    let mut b = func.builder();
    b.arg(&at).arg(&at).arg(&n_arg);
    // SAFETY: `at` holds n live elements of `dtype` (the caller's); each thread reads an
    // element (or 16-byte chunk) before writing the same one, so in place is sound.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// `x · sigmoid(1.702 x)` (CLIP's activation).
pub fn quick_gelu(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&Act::QuickGelu)
}

/// `x · Φ(x)`, the exact gelu.
pub fn gelu_erf(x: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op1_no_bwd(&Act::GeluErf)
}

/// `x + bias` with `bias` [cols] broadcast over x's rows.
pub fn add_bias(x: &Tensor, bias: &Tensor) -> candle_core::Result<Tensor> {
    x.contiguous()?.apply_op2_no_bwd(bias, &AddBias)
}

/// Runs the kernels on `device` against their CPU twins on random inputs (odd sizes,
/// causal and not, rows longer than a warp's sweep, f32/bf16/f16): a line per case whose
/// results differ by more than the output's rounding.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    // (rows, cols, causal)
    type Case = (usize, usize, Option<(usize, usize)>);
    // The last: rows of 16-byte chunks in every dtype (the vectorised bias and activation).
    let cases: [Case; 6] = [
        (7, 5, None),
        (64, 577, None),
        (6, 9, Some((3, 6))),
        (2 * 37, 37, Some((37, 0))),
        (4, 2100, Some((2, 2098))),
        (5, 1024, None),
    ];
    for (i, &(rows, cols, causal)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = (Tensor::randn(0f32, 3.0, (rows, cols), &Device::Cpu)?).to_dtype(dtype)?;
            let bias = Tensor::randn(0f32, 1.0, cols, &Device::Cpu)?.to_dtype(dtype)?;
            let (xd, bd) = (x.to_device(device)?, bias.to_device(device)?);
            let tol = match dtype {
                DType::BF16 => 2f32.powi(-7),
                DType::F16 => 2f32.powi(-10),
                _ => 1e-6,
            };
            let softmax = (scaled_softmax(&xd, 0.37, causal)?, scaled_softmax(&x, 0.37, causal)?);
            let valid = cols.div_ceil(2);
            let hidden_cols = (scaled_softmax_cols(&xd, 0.37, valid)?, scaled_softmax_cols(&x, 0.37, valid)?);
            let biased = (add_bias(&xd, &bd)?, add_bias(&x, &bias)?);
            let gelu = (quick_gelu(&xd)?, quick_gelu(&x)?);
            let gelu_erf = (gelu_erf(&xd)?, gelu_erf(&x)?);
            // [rows, cols] as [B·N, 3·H·D] with B = H = 1, when 3 divides cols.
            let split = if cols.is_multiple_of(3) {
                let dims = (1, rows, rows.next_multiple_of(8), 1);
                let (g, w) = (split_heads(&xd, dims)?, split_heads(&x, dims)?);
                Some(("split_heads", (Tensor::cat(&[g.0, g.1, g.2], 0)?, Tensor::cat(&[w.0, w.1, w.2], 0)?), 1.0))
            } else {
                None
            };
            let cases = [
                ("softmax", softmax, 1.0),
                ("softmax over the first columns", hidden_cols, 1.0),
                ("bias", biased, 8.0),
                ("quick_gelu", gelu, 8.0),
                ("gelu_erf", gelu_erf, 8.0),
            ];
            for (what, (got, want), scale) in cases.into_iter().chain(split) {
                let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, |m, d| m.max(d));
                if worst.is_nan() || worst > 2.0 * tol * scale {
                    bad.push(format!("{what} case {i} {dtype:?}: max |Δ| {worst:.3e}"));
                }
            }
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_twin_matches_candle_with_a_causal_mask() {
        let dev = Device::Cpu;
        let (groups, n, past) = (2, 3, 4);
        let x = Tensor::randn(0f32, 2.0, (groups * n, past + n), &dev).unwrap();
        let got = scaled_softmax(&x, 0.5, Some((n, past))).unwrap();
        let mask: Vec<f32> = (0..groups * n)
            .flat_map(|r| (0..past + n).map(move |j| if j <= past + r % n { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let mask = Tensor::from_vec(mask, (groups * n, past + n), &dev).unwrap();
        let want = candle_nn::ops::softmax_last_dim(&((x * 0.5).unwrap() + mask).unwrap()).unwrap();
        let d = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-6, "{d}");
    }

    #[test]
    fn bias_twin_matches_broadcast_add() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 3, 5), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 5, &dev).unwrap();
        let d = (add_bias(&x, &b).unwrap() - x.broadcast_add(&b).unwrap()).unwrap();
        assert_eq!(d.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn split_heads_and_quick_gelu_twins_match_candle() {
        let dev = Device::Cpu;
        let (b, n, h, d) = (2, 5, 3, 4);
        let x = Tensor::randn(0f32, 1.0, (b * n, 3 * h * d), &dev).unwrap();
        let (q, k, v) = split_heads(&x, (b, n, 8, h)).unwrap();
        let by_head = x.reshape((b, n, 3, h, d)).unwrap().permute((2, 0, 3, 1, 4)).unwrap();
        for (i, got) in [q, k, v].iter().enumerate() {
            assert_eq!(got.dims(), &[b, h, 8, d]);
            let want = by_head.get(i).unwrap();
            let d = (got.narrow(2, 0, n).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
            let pad = got.narrow(2, n, 8 - n).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(pad.to_scalar::<f32>().unwrap(), 0.0, "padding rows are zero");
        }
        let x = Tensor::randn(0f32, 2.0, (3, 7), &dev).unwrap();
        let want = (&x * candle_nn::ops::sigmoid(&(&x * 1.702).unwrap()).unwrap()).unwrap();
        let d = (quick_gelu(&x).unwrap() - want).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-6);
    }

    #[test]
    fn refuses_misfits() {
        let x = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(add_bias(&x, &Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap()).is_err());
        assert!(scaled_softmax(&x, 1.0, Some((3, 0))).is_err(), "4 rows are not groups of 3");
    }
}
