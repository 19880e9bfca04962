//! Rows `start..start + len` of every batch entry of x [B, n, d], packed: [B, len, d]
//! (`kernels/row_copy.cu` on the GPU). LLaVA's default feature selection drops each image's
//! class row this way before the projector; candle's strided copy of the narrowed view was
//! as slow as an output-projection GEMM at a batch of 32 images.

use candle_core::{CpuStorage, CustomOp1, Device, Layout, Shape, Tensor};

use crate::OpError;
#[cfg(feature = "cuda")]
use crate::dispatch::by_float;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("row_copy");

/// `x [B, n, d]`'s rows `start..start + len` of each batch entry, contiguous. On the GPU one
/// pass of 16-byte chunks where the byte offsets allow; elsewhere candle's narrow and copy.
pub fn rows_of_each(x: &Tensor, start: usize, len: usize) -> candle_core::Result<Tensor> {
    let (_, n, d) = x.dims3()?;
    if start + len > n {
        candle_core::bail!("rows_of_each: rows {start}..{} of {n}", start + len);
    }
    let bytes = d * x.dtype().size_in_bytes();
    let fits = x.device().is_cuda()
        && x.is_contiguous()
        && (x.layout().start_offset() * x.dtype().size_in_bytes() + start * bytes).is_multiple_of(16)
        && bytes.is_multiple_of(16);
    if fits { x.apply_op1_no_bwd(&RowsOfEach { start, len }) } else { x.narrow(1, start, len)?.contiguous() }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct RowsOfEach {
    start: usize,
    len: usize,
}

impl CustomOp1 for RowsOfEach {
    fn name(&self) -> &'static str {
        "rows_of_each"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("rows_of_each: the CPU takes candle's narrow")
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (b, n, d) = l.shape().dims3()?;
        let size = x.dtype().size_in_bytes();
        // Counted in 16-byte chunks (the caller checked that everything is aligned to them).
        let (len, stride) = ((self.len * d * size / 16) as i64, (n * d * size / 16) as i64);
        let dev = x.device().clone();
        let cfg = LaunchConfig {
            grid_dim: ((len as u32).div_ceil(256).clamp(1, 1024), b.clamp(1, 65535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let blocks = b as i64;
        let out = by_float!(x.dtype(), "rows_of_each", |T, _SUFFIX| {
            let src = x.as_cuda_slice::<T>()?.slice(l.start_offset() + self.start * d..);
            // SAFETY: the kernel writes every chunk of every block.
            let mut out = unsafe { dev.alloc::<T>(b * self.len * d)? };
            let func = crate::launch::kernel!(MODULE, dev, "copy_blocks16")?;
            let mut builder = func.builder();
            builder.arg(&src).arg(&mut out).arg(&blocks).arg(&len).arg(&stride);
            // SAFETY: reads B runs of `len` chunks `stride` apart from the view's start (all
            // inside x), writes B · len chunks.
            unsafe { builder.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((b, self.len, d))))
    }
}

/// Runs the copy on `device` against candle's narrow on the CPU (every float dtype, a
/// view that starts past its storage's start, and a shape the fallback takes): a line per
/// case that differs.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    if !device.is_cuda() {
        return Ok(bad);
    }
    for dtype in [candle_core::DType::F32, candle_core::DType::BF16, candle_core::DType::F16] {
        for &(b, n, d, start, len) in
            &[(3usize, 577usize, 64usize, 1usize, 576usize), (2, 9, 24, 2, 5), (4, 5, 3, 1, 3)]
        {
            let x = Tensor::randn(0f32, 1.0, (b + 1, n, d), &Device::Cpu)?.to_dtype(dtype)?;
            // Batch entries 1.. of a larger tensor: a contiguous view with an offset.
            let (xc, xd) = (x.narrow(0, 1, b)?, x.to_device(device)?.narrow(0, 1, b)?);
            let want = xc.narrow(1, start, len)?.contiguous()?;
            let got = rows_of_each(&xd, start, len)?.to_device(&Device::Cpu)?;
            let same = got.dims() == want.dims()
                && (got.to_dtype(candle_core::DType::F32)? - want.to_dtype(candle_core::DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?
                    == 0.0;
            if !same {
                bad.push(format!("rows_of_each {dtype:?} [{b}, {n}, {d}] rows {start}..{}", start + len));
            }
        }
    }
    Ok(bad)
}
