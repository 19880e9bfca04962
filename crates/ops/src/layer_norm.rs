//! LayerNorm over the last dim on the GPU (`kernels/layer_norm.cu`): a warp per row held
//! in registers, 16-byte accesses, and optionally the residual add before the norm in the
//! same pass. Its CPU twin computes the same in f32 and is the reference of
//! [`self_test`]; the twin is tested against candle's `LayerNorm`.

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};

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

/// Widest row the kernel holds: 8 chunks of 16 bytes per lane.
const MAX_CHUNKS: usize = 32 * 8;

/// Whether the kernel takes rows of `x` (on the GPU, in 16-byte chunks, not too wide).
pub fn fits(x: &Tensor) -> bool {
    let cols = x.dims().last().copied().unwrap_or(0);
    let chunk = 16 / x.dtype().size_in_bytes().max(1);
    x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && cols > 0
        && cols.is_multiple_of(chunk)
        && cols / chunk <= MAX_CHUNKS
}

/// The op over (x, weight, bias), with `y` added to x first when given: [rows, cols], or
/// [2 · rows, cols] with the sum's rows first when `y` is given.
struct Norm<'a> {
    y: Option<&'a Tensor>,
    eps: f32,
}

impl Norm<'_> {
    fn dims(&self, lx: &Layout, lw: &Layout, lb: &Layout) -> candle_core::Result<(usize, usize)> {
        let cols = lx.dims().last().copied().unwrap_or(1);
        let rows = lx.shape().elem_count() / cols.max(1);
        let y_fits = self.y.is_none_or(|y| y.dims() == lx.dims() && y.is_contiguous());
        if !lx.is_contiguous() || lw.shape().elem_count() != cols || lb.shape().elem_count() != cols || !y_fits {
            candle_core::bail!(
                "layer_norm: x {:?}, weight {:?}, bias {:?} do not fit",
                lx.shape(),
                lw.shape(),
                lb.shape()
            );
        }
        Ok((rows, cols))
    }

    fn out_rows(&self, rows: usize) -> usize {
        if self.y.is_some() { 2 * rows } else { rows }
    }
}

fn reference<T: FromF32>(x: &[T], y: Option<&[T]>, w: &[T], b: &[T], rows: usize, cols: usize, eps: f32) -> Vec<T> {
    let mut sums = Vec::with_capacity(if y.is_some() { rows * cols } else { 0 });
    let mut normed = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row: Vec<T> = match y {
            Some(y) => (0..cols).map(|c| T::from_f32(x[r * cols + c].into() + y[r * cols + c].into())).collect(),
            None => x[r * cols..][..cols].to_vec(),
        };
        let v: Vec<f32> = row.iter().map(|&e| e.into()).collect();
        let mean = v.iter().sum::<f32>() / cols as f32;
        let var = v.iter().map(|e| (e - mean) * (e - mean)).sum::<f32>() / cols as f32;
        let rstd = 1.0 / (var + eps).sqrt();
        normed.extend((0..cols).map(|c| T::from_f32((v[c] - mean) * rstd * w[c].into() + b[c].into())));
        if y.is_some() {
            sums.extend(row);
        }
    }
    sums.extend(normed);
    sums
}

impl CustomOp3 for Norm<'_> {
    fn name(&self) -> &'static str {
        "layer_norm"
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
        let (rows, cols) = self.dims(lx, lw, lb)?;
        let (ox, ow, ob) = (lx.start_offset(), lw.start_offset(), lb.start_offset());
        let y_storage = self.y.map(|y| y.storage_and_layout());
        let out = match (x, w, b, y_storage.as_ref().map(|(s, l)| (&**s, l.start_offset()))) {
            (x, w, b, None) => {
                cpu_float!("layer_norm", (x, w, b) => reference(&x[ox..], None, &w[ow..], &b[ob..], rows, cols, self.eps))
            }
            (x, w, b, Some((candle_core::Storage::Cpu(y), oy))) => {
                cpu_float!("layer_norm", (x, w, b, y) => reference(&x[ox..], Some(&y[oy..]), &w[ow..], &b[ob..], rows, cols, self.eps))
            }
            _ => candle_core::bail!("layer_norm: the residual is not on the CPU"),
        };
        Ok((out, Shape::from((self.out_rows(rows), cols))))
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
        const MODULE: crate::launch::Module = crate::launch::module!("layer_norm");
        const WARPS: usize = 4; // LN_WARPS

        let (rows, cols) = self.dims(lx, lw, lb)?;
        let dev = x.device().clone();
        let y_storage = self.y.map(|y| y.storage_and_layout());
        let y = match &y_storage {
            None => None,
            Some((s, l)) => match &**s {
                candle_core::Storage::Cuda(s) => Some((s, l.start_offset())),
                _ => candle_core::bail!("layer_norm: the residual is not on the GPU"),
            },
        };
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(WARPS) as u32, 1, 1),
            block_dim: (WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows_arg, cols_arg, eps) = (rows as i64, cols as i32, self.eps);
        let out = by_float!(x.dtype(), "layer_norm", |T, SUFFIX| {
            let v = 16 / std::mem::size_of::<T>();
            let offsets = [lx.start_offset(), lw.start_offset(), lb.start_offset(), y.map_or(0, |y| y.1)];
            let chunks = cols / v;
            if !cols.is_multiple_of(v) || chunks > MAX_CHUNKS || offsets.iter().any(|o| !o.is_multiple_of(v)) {
                candle_core::bail!("layer_norm: rows of {cols} at offsets {offsets:?} are not 16-byte chunks");
            }
            let ch = chunks.div_ceil(32).next_power_of_two();
            let func = crate::launch::kernel!(MODULE, dev, &format!("layer_norm_{SUFFIX}_{ch}"))?;
            let x = crate::launch::view::<T>(x, lx)?;
            let w = crate::launch::view::<T>(w, lw)?;
            let b = crate::launch::view::<T>(b, lb)?;
            // SAFETY: the kernel writes every row of out (and of the sum, with y).
            let out = unsafe { dev.alloc::<T>(self.out_rows(rows) * cols)? };
            let (sum, normed) = if y.is_some() {
                (out.slice(..rows * cols), out.slice(rows * cols..))
            } else {
                (out.slice(..0), out.slice(..))
            };
            let mut builder = func.builder();
            builder.arg(&x);
            let y = match y {
                Some((s, o)) => Some(s.as_cuda_slice::<T>()?.slice(o..)),
                None => None,
            };
            // A null pointer tells the kernel there is no residual.
            let null = 0u64;
            match &y {
                Some(y) => builder.arg(y),
                None => builder.arg(&null),
            };
            builder.arg(&w).arg(&b);
            if self.y.is_some() {
                builder.arg(&sum);
            } else {
                builder.arg(&null);
            }
            builder.arg(&normed).arg(&rows_arg).arg(&cols_arg).arg(&eps);
            // SAFETY: reads rows × cols of x (and y), cols of w and b; writes rows × cols of
            // the output's halves; `dims` checked the shapes and contiguity.
            unsafe { builder.launch(cfg) }.w()?;
            drop(builder);
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((self.out_rows(rows), cols))))
    }
}

/// `layer_norm(x)` over rows [rows, cols] of `x` (any leading shape), or with `y`:
/// [2 · rows, cols], the sums `x + y` first, then their norms.
pub fn norm(x: &Tensor, y: Option<&Tensor>, ln: &candle_nn::LayerNorm) -> candle_core::Result<Tensor> {
    let Some(bias) = ln.bias() else { candle_core::bail!("layer_norm: no bias") };
    let cols = x.dims().last().copied().unwrap_or(1);
    let y = y.map(|y| y.reshape(((), cols))).transpose()?;
    x.reshape(((), cols))?.apply_op3_no_bwd(ln.weight(), bias, &Norm { y: y.as_ref(), eps: ln.eps() as f32 })
}

/// Runs the kernel, with and without the residual, on `device` against its CPU twin on
/// random rows (one chunk to the widest, a row count that leaves a CTA part empty) for
/// every dtype: a line per case whose results differ by more than the output's rounding.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    let shapes: [(usize, usize); 5] = [(7, 1024), (3, 64), (5, 1280), (2, 2048), (9, 8)];
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let chunk = 16 / dtype.size_in_bytes();
            if !cols.is_multiple_of(chunk) || cols / chunk > MAX_CHUNKS {
                continue;
            }
            let cpu = Device::Cpu;
            let x = (Tensor::randn(0f32, 2.0, (rows, cols), &cpu)? + 0.5)?.to_dtype(dtype)?;
            let y = Tensor::randn(0f32, 1.0, (rows, cols), &cpu)?.to_dtype(dtype)?;
            let w = Tensor::randn(1f32, 0.2, cols, &cpu)?.to_dtype(dtype)?;
            let b = Tensor::randn(0f32, 0.2, cols, &cpu)?.to_dtype(dtype)?;
            let ln = candle_nn::LayerNorm::new(w.clone(), b.clone(), 1e-5);
            let lnd = candle_nn::LayerNorm::new(w.to_device(device)?, b.to_device(device)?, 1e-5);
            let (xd, yd) = (x.to_device(device)?, y.to_device(device)?);
            let runs = [
                ("layer_norm", norm(&xd, None, &lnd)?, norm(&x, None, &ln)?),
                ("add_layer_norm", norm(&xd, Some(&yd), &lnd)?, norm(&x, Some(&y), &ln)?),
            ];
            let ulp = match dtype {
                DType::BF16 => 2f32.powi(-7),
                DType::F16 => 2f32.powi(-10),
                _ => 1e-6,
            };
            for (what, got, want) in runs {
                let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
                let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| {
                    let d = (a - b).abs();
                    if d.is_nan() { f32::INFINITY } else { m.max(d) }
                });
                if got.len() != want.len() || worst > 2.0 * ulp * largest.max(1.0) {
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
    use candle_core::Module;

    /// The twin against candle's LayerNorm, with and without the residual.
    #[test]
    fn twin_matches_candle() {
        let dev = Device::Cpu;
        // [1, 3, 16], as the encoders pass it.
        let x = Tensor::randn(0f32, 1.0, (1, 3, 16), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (1, 3, 16), &dev).unwrap();
        let ln = candle_nn::LayerNorm::new(
            Tensor::randn(1f32, 0.1, 16, &dev).unwrap(),
            Tensor::randn(0f32, 0.1, 16, &dev).unwrap(),
            1e-5,
        );
        let close = |a: &Tensor, b: &Tensor| {
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-5, "{d}");
        };
        close(&norm(&x, None, &ln).unwrap(), &ln.forward(&x).unwrap().reshape((3, 16)).unwrap());
        let both = norm(&x, Some(&y), &ln).unwrap();
        let sum = (&x + &y).unwrap().reshape((3, 16)).unwrap();
        close(&both.narrow(0, 0, 3).unwrap(), &sum);
        close(&both.narrow(0, 3, 3).unwrap(), &ln.forward(&sum).unwrap());
    }
}
