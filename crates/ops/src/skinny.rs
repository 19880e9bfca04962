//! `x·Wᵀ (+ b)` for one or two rows of x on the GPU (`kernels/skinny.cu`): a decode step's
//! linear layers, where the weights are read once and every byte of HBM bandwidth counts.
//! cuBLAS picks split-K kernels plus a reduce for several of these shapes and reaches
//! 55-90% of bandwidth; this streams each weight row once in 16-byte loads. bf16 and f16
//! only, K a multiple of 8, 16-byte aligned operands; anything else takes the GEMM.
//! The CPU twin ([`self_test`]'s reference) sums in f32 in index order.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

use crate::OpError;
#[cfg(feature = "cuda")]
use crate::dispatch::by_float;
use crate::dispatch::cpu_float;
use crate::elem::FromF32;

/// Most rows of x the kernel takes. Measured on the H200 (llava-1.5-7b shapes, bf16, with
/// PDL and the fused SiLU): decode steps 5% faster at two rows than cuBLAS's (4.52 against
/// 4.76 ms), 1% slower at four, 54% slower at eight, where cuBLAS's tiles reuse each weight
/// load across rows better (twice the weight rows a warp from 3 rows of x did not change
/// that); only one and two rows are compiled.
const MAX_ROWS: usize = 2;

/// Gate/up row pairs a warp of the SiLU kernel takes: on the H200 at 7B shapes a decode
/// step of batch 1 took 4.544 ms with 2, 4.705 ms with 1 and 4.586 ms unfused.
const SILU_PAIRS: usize = 2;

/// `x [M, K] · w [N, K]ᵀ (+ bias [N])` where the kernel applies (see the module doc),
/// else `None`.
pub fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
    linear_upto(x, w, bias, MAX_ROWS)
}

/// `silu(g) · u` of `x·Wᵀ (+ bias)` = `[g | u]` for W the gate and up projections
/// stacked ([2I, K]): [M, I], in one launch, where the kernel applies, else `None`.
pub fn linear_silu(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
    if !w.dim(0)?.is_multiple_of(2) || !fits(x, w, bias, MAX_ROWS)? {
        return Ok(None);
    }
    Ok(Some(apply(x, w, bias, SILU_PAIRS)?))
}

/// Whether the kernel takes `x·Wᵀ (+ bias)` for up to `rows` rows of x.
fn fits(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, rows: usize) -> candle_core::Result<bool> {
    let (m, k) = x.dims2()?;
    let aligned =
        |t: &Tensor| t.is_contiguous() && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    Ok(x.device().is_cuda()
        && (1..=rows.min(MAX_ROWS)).contains(&m)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && bias.is_none_or(|b| b.dtype() == x.dtype() && b.is_contiguous())
        && k.is_multiple_of(8)
        && w.dims2()?.1 == k
        && aligned(x)
        && aligned(w))
}

/// [`linear`] for up to `rows` rows of x.
fn linear_upto(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, rows: usize) -> candle_core::Result<Option<Tensor>> {
    if !fits(x, w, bias, rows)? {
        return Ok(None);
    }
    Ok(Some(apply(x, w, bias, 0)?))
}

/// `silu_pairs` > 0: the SiLU product of W's halves, that many pairs a warp.
fn apply(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, silu_pairs: usize) -> candle_core::Result<Tensor> {
    // Without a bias the third operand is unused (the kernel gets a null pointer).
    x.apply_op3_no_bwd(w, bias.unwrap_or(w), &Skinny { bias: bias.is_some(), silu_pairs })
}

struct Skinny {
    bias: bool,
    /// Above 0, W stacks a gate and an up projection: the output is silu_mul of the two
    /// halves, each warp taking this many gate/up row pairs.
    silu_pairs: usize,
}

/// silu_mul's rounding (`decoder_fused.rs`) of the halves of each row of `y` [m, 2i].
fn silu_rows<T: FromF32>(y: &[T], m: usize, i: usize) -> Vec<T> {
    let r = |x: f32| T::from_f32(x).into();
    let mut out = Vec::with_capacity(m * i);
    for row in y.chunks(2 * i).take(m) {
        let (g, u) = row.split_at(i);
        out.extend(g.iter().zip(u).map(|(&g, &u)| {
            let g: f32 = g.into();
            T::from_f32(r(g / (1.0 + (-g).exp())) * u.into())
        }));
    }
    out
}

fn reference<T: FromF32>(x: &[T], w: &[T], b: Option<&[T]>, m: usize, n: usize, k: usize) -> Vec<T> {
    let mut y = Vec::with_capacity(m * n);
    for row in x.chunks(k).take(m) {
        for (j, wr) in w.chunks(k).take(n).enumerate() {
            let dot: f32 = row.iter().zip(wr).map(|(&a, &c)| a.into() * c.into()).sum();
            let mut out = T::from_f32(dot);
            if let Some(b) = b {
                out = T::from_f32(out.into() + b[j].into());
            }
            y.push(out);
        }
    }
    y
}

impl CustomOp3 for Skinny {
    fn name(&self) -> &'static str {
        "skinny_linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = lx.shape().dims2()?;
        let n = lw.shape().dims2()?.0;
        let (ox, ow, ob, has) = (lx.start_offset(), lw.start_offset(), lb.start_offset(), self.bias);
        let silu = self.silu_pairs > 0;
        let out = cpu_float!("skinny_linear", (x, w, b) => {
            let y = reference(&x[ox..], &w[ow..], has.then(|| &b[ob..]), m, n, k);
            if silu { silu_rows(&y, m, n / 2) } else { y }
        });
        Ok((out, Shape::from((m, if silu { n / 2 } else { n }))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        use crate::pdl;
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;

        let (m, k) = lx.shape().dims2()?;
        let n = lw.shape().dims2()?.0;
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        // 8 warps a CTA, `per_warp` output rows a warp (see the kernel).
        let silu = self.silu_pairs > 0;
        let per_warp = if silu {
            self.silu_pairs
        } else if n <= 8192 {
            1
        } else {
            2
        };
        let n_out = if silu { n / 2 } else { n };
        let cfg = LaunchConfig {
            grid_dim: (n_out.div_ceil(8 * per_warp) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_arg, k_arg) = (n as i32, k as i32);
        let out = by_float!(x.dtype(), "skinny_linear", |T, SUFFIX| {
            let x = crate::launch::view::<T>(x, lx)?;
            let w = crate::launch::view::<T>(w, lw)?;
            let b = crate::launch::view::<T>(b, lb)?;
            // SAFETY: the kernel writes every element of [m, n_out].
            let mut y = unsafe { dev.alloc::<T>(m * n_out)? };
            let name = format!("skinny_{}{SUFFIX}_{m}_{per_warp}", if silu { "silu_" } else { "" });
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut l = pdl::Launch::new(&stream, &func);
            l.arg(&x).arg(&w);
            match self.bias {
                true => l.arg(&b),
                false => l.arg(0u64),
            };
            l.arg(&mut y).arg(n_arg).arg(k_arg);
            // SAFETY: reads [m, k] of x, [n, k] of w (both 16-byte aligned, k a multiple
            // of 8, checked by `fits`) and [n] of the bias; writes [m, n_out]; touches
            // nothing before its PDL wait.
            unsafe { l.launch(cfg) }?;
            crate::launch::storage(y, &dev)
        });
        Ok((out, Shape::from((m, n_out))))
    }
}

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("skinny");

/// The kernel on `device` against the CPU twin (bf16 and f16, every compiled row count,
/// odd N, with and without a bias, plain and with silu_mul): a line per case beyond two units in the
/// last place.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    if !device.is_cuda() {
        // The twin is the reference; only the kernel has anything to show.
        return Ok(bad);
    }
    for (n, k) in [(333, 1032), (8195, 24), (2 * 4099, 40), (2 * 11, 1024)] {
        for dtype in [DType::BF16, DType::F16] {
            check(device, n, k, dtype, &mut bad)?;
        }
    }
    Ok(bad)
}

fn check(device: &Device, n: usize, k: usize, dtype: DType, bad: &mut Vec<String>) -> Result<(), OpError> {
    let ulp = if dtype == DType::BF16 { 2f32.powi(-7) } else { 2f32.powi(-10) };
    let rand = |shape: (usize, usize)| -> Result<Tensor, OpError> {
        Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?)
    };
    let (w, b) = (rand((n, k))?, rand((1, n))?.flatten_all()?);
    for m in 1..=MAX_ROWS {
        let x = rand((m, k))?;
        for (bias, pairs) in [(None, 0), (Some(&b), 0), (None, SILU_PAIRS), (Some(&b), SILU_PAIRS)] {
            if pairs > 0 && !n.is_multiple_of(2) {
                continue;
            }
            let (xd, wd, bd) = (x.to_device(device)?, w.to_device(device)?, b.to_device(device)?);
            let bias_d = bias.map(|_| &bd);
            let (got, want) = if pairs == 0 {
                (linear_upto(&xd, &wd, bias_d, MAX_ROWS)?, apply(&x, &w, bias, 0)?)
            } else if fits(&xd, &wd, bias_d, MAX_ROWS)? {
                // The product against silu_mul's twin over the same kernel's plain output:
                // the epilogue must round as that path does (the sums are checked above).
                let plain = apply(&xd, &wd, bias_d, 0)?.to_device(&Device::Cpu)?;
                (Some(apply(&xd, &wd, bias_d, pairs)?), crate::decoder_fused::silu_mul(&plain)?)
            } else {
                (None, x.clone())
            };
            let silu = pairs;
            let Some(got) = got else {
                bad.push(format!("skinny_linear {dtype:?} m={m}: not taken"));
                continue;
            };
            let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            // The sum is rounded before the bias is added: a sum that lands on the other
            // side of a rounding boundary is one ulp of the sum off, which the bias's
            // cancellation can make more than an ulp of the result. Measure against the
            // sum's magnitude, bounded by |result| + |bias|.
            let bias_mag: Vec<f32> = match (bias, pairs) {
                (Some(b), 0) => b.to_dtype(DType::F32)?.abs()?.to_vec1()?,
                _ => Vec::new(),
            };
            let worst = got
                .iter()
                .zip(&want)
                .enumerate()
                .map(|(i, (a, c))| {
                    let b = bias_mag.get(i % n).copied().unwrap_or(0.0);
                    (a - c).abs() / (c.abs() + b).max(1.0)
                })
                .fold(0f32, |acc, d| if d.is_nan() { f32::INFINITY } else { acc.max(d) });
            if worst > 2.0 * ulp {
                let has = bias.is_some();
                bad.push(format!(
                    "skinny_linear {dtype:?} m={m} n={n} bias={has} silu_pairs={silu}: max relative |Δ| {worst:.3e}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twin_matches_candle() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 16), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (5, 16), &dev).unwrap();
        let b = Tensor::randn(0f32, 1.0, 5, &dev).unwrap();
        let want = x.matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap();
        let got = apply(&x, &w, Some(&b), 0).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
        // The CPU never takes the kernel's path.
        assert!(linear(&x, &w, None).unwrap().is_none());
    }
}
