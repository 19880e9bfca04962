//! `x·Wᵀ (+ b)` for at most 8 rows of x on the GPU (`kernels/skinny.cu`): a decode step's
//! linear layers, where the weights are read once and every byte of HBM bandwidth counts.
//! cuBLAS picks split-K kernels plus a reduce for several of these shapes and reaches
//! 55-90% of bandwidth; this streams each weight row once in 16-byte loads. bf16 and f16
//! only, K a multiple of 8, 16-byte aligned operands; anything else takes the GEMM.
//! The CPU twin ([`self_test`]'s reference) sums in f32 in index order.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

use crate::ModelError;
#[cfg(feature = "cuda")]
use crate::dispatch::by_float;
use crate::dispatch::cpu_float;
use crate::elem::FromF32;

/// Most rows of x the kernel takes: 1 unless `MMSERVE_SKINNY_MAX_ROWS` (0 to 8) says
/// otherwise, for benchmarking it against cuBLAS. Measured on the H200 (llava-1.5-7b
/// shapes, bf16): 12% faster decode steps at one row, 2.5% slower at two, 34% slower at
/// eight, where cuBLAS's tiles reuse each weight load across rows better.
fn max_rows() -> usize {
    static ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| std::env::var("MMSERVE_SKINNY_MAX_ROWS").ok().and_then(|v| v.parse().ok()).unwrap_or(1).min(8))
}

/// `x [M, K] · w [N, K]ᵀ (+ bias [N])` where the kernel applies (see the module doc),
/// else `None`.
pub(crate) fn linear(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Option<Tensor>> {
    linear_upto(x, w, bias, max_rows())
}

/// [`linear`] for up to `rows` rows of x (the self-test runs every compiled count).
fn linear_upto(x: &Tensor, w: &Tensor, bias: Option<&Tensor>, rows: usize) -> candle_core::Result<Option<Tensor>> {
    let (m, k) = x.dims2()?;
    let aligned =
        |t: &Tensor| t.is_contiguous() && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16);
    let fits = x.device().is_cuda()
        && (1..=rows.min(8)).contains(&m)
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && w.dtype() == x.dtype()
        && bias.is_none_or(|b| b.dtype() == x.dtype() && b.is_contiguous())
        && k.is_multiple_of(8)
        && w.dims2()?.1 == k
        && aligned(x)
        && aligned(w);
    if !fits {
        return Ok(None);
    }
    Ok(Some(apply(x, w, bias)?))
}

fn apply(x: &Tensor, w: &Tensor, bias: Option<&Tensor>) -> candle_core::Result<Tensor> {
    // Without a bias the third operand is unused (the kernel gets a null pointer).
    x.apply_op3_no_bwd(w, bias.unwrap_or(w), &Skinny { bias: bias.is_some() })
}

struct Skinny {
    bias: bool,
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
        let out = cpu_float!("skinny_linear", (x, w, b) =>
            reference(&x[ox..], &w[ow..], has.then(|| &b[ob..]), m, n, k));
        Ok((out, Shape::from((m, n))))
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
        use candle_core::backend::BackendStorage;
        use candle_core::cuda_backend::WrapErr;
        use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

        let (m, k) = lx.shape().dims2()?;
        let n = lw.shape().dims2()?.0;
        let dev = x.device().clone();
        // 8 warps a CTA, `per_warp` weight rows a warp (see the kernel).
        let per_warp = if n <= 8192 { 1 } else { 2 };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(8 * per_warp) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_arg, k_arg) = (n as i32, k as i32);
        let out = by_float!(x.dtype(), "skinny_linear", |T, SUFFIX| {
            let x = x.as_cuda_slice::<T>()?.slice(lx.start_offset()..);
            let w = w.as_cuda_slice::<T>()?.slice(lw.start_offset()..);
            let b = b.as_cuda_slice::<T>()?.slice(lb.start_offset()..);
            // SAFETY: the kernel writes every element of [m, n].
            let mut y = unsafe { dev.alloc::<T>(m * n)? };
            let func =
                dev.get_or_load_custom_func(&format!("skinny_{SUFFIX}_{m}_{per_warp}"), "mmserve_skinny", PTX)?;
            let mut builder = func.builder();
            let null = 0u64;
            builder.arg(&x).arg(&w);
            match self.bias {
                true => builder.arg(&b),
                false => builder.arg(&null),
            };
            builder.arg(&mut y).arg(&n_arg).arg(&k_arg);
            // SAFETY: reads [m, k] of x, [n, k] of w (both 16-byte aligned, k a multiple
            // of 8, checked by `linear`) and [n] of the bias; writes [m, n].
            unsafe { builder.launch(cfg) }.w()?;
            candle_core::CudaStorage::wrap_cuda_slice(y, dev.clone())
        });
        Ok((out, Shape::from((m, n))))
    }
}

#[cfg(feature = "cuda")]
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/skinny.ptx"));

/// The kernel on `device` against the CPU twin (bf16 and f16, 1 to 8 rows, odd N, with
/// and without a bias): a line per case beyond two units in the last place.
pub fn self_test(device: &Device) -> Result<Vec<String>, ModelError> {
    let mut bad = Vec::new();
    if !device.is_cuda() {
        // The twin is the reference; only the kernel has anything to show.
        return Ok(bad);
    }
    for (n, k) in [(333, 1032), (8195, 24)] {
        for dtype in [DType::BF16, DType::F16] {
            check(device, n, k, dtype, &mut bad)?;
        }
    }
    Ok(bad)
}

fn check(device: &Device, n: usize, k: usize, dtype: DType, bad: &mut Vec<String>) -> Result<(), ModelError> {
    let ulp = if dtype == DType::BF16 { 2f32.powi(-7) } else { 2f32.powi(-10) };
    let rand = |shape: (usize, usize)| -> Result<Tensor, ModelError> {
        Ok(Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?)
    };
    let (w, b) = (rand((n, k))?, rand((1, n))?.flatten_all()?);
    for m in [1, 3, 8] {
        let x = rand((m, k))?;
        for bias in [None, Some(&b)] {
            let want = apply(&x, &w, bias)?;
            let (xd, wd, bd) = (x.to_device(device)?, w.to_device(device)?, b.to_device(device)?);
            let Some(got) = linear_upto(&xd, &wd, bias.map(|_| &bd), 8)? else {
                bad.push(format!("skinny_linear {dtype:?} m={m}: not taken"));
                continue;
            };
            let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, c)| (a - c).abs() / c.abs().max(1.0))
                .fold(0f32, |acc, d| if d.is_nan() { f32::INFINITY } else { acc.max(d) });
            if worst > 2.0 * ulp {
                let has = bias.is_some();
                bad.push(format!("skinny_linear {dtype:?} m={m} n={n} bias={has}: max relative |Δ| {worst:.3e}"));
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
        let got = apply(&x, &w, Some(&b)).unwrap();
        let diff = (got - want).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(diff < 1e-5, "{diff}");
        // The CPU never takes the kernel's path.
        assert!(linear(&x, &w, None).unwrap().is_none());
    }
}
