//! The ViT patch embedding's two passes around its GEMM, for the GPU
//! (`kernels/patch_embed.cu`): unfold pixels into patch rows, and add the class row and
//! the positions. The CPU twins are the kernels' reference ([`self_test`]); the model
//! crate's `PatchEmbed` checks them against candle's conv.

use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape, Tensor};

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

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("patch_embed");

/// Pixels [B, C, S, S] → rows [B · (S/p)², width] in `dtype` (each patch's C · p²
/// values, then zeros to `width`).
pub fn unfold(pixels: &Tensor, patch: usize, width: usize, dtype: DType) -> candle_core::Result<Tensor> {
    pixels.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(&Unfold { patch, width, dtype })
}

/// Patch rows [B · n, D], `class` [D], `positions` [1 + n, D] → [B · (1 + n), D]: each
/// image's class row then its patch rows, plus the positions.
pub fn add_positions(
    patches: &Tensor,
    class: &Tensor,
    positions: &Tensor,
    batch: usize,
) -> candle_core::Result<Tensor> {
    patches.apply_op3_no_bwd(class, positions, &AddPositions { batch })
}

/// Pixels [B, C, S, S] in f32 → rows [B · (S/p)², width] in `dtype`.
struct Unfold {
    patch: usize,
    width: usize,
    dtype: DType,
}

impl Unfold {
    fn dims(&self, l: &Layout) -> candle_core::Result<(usize, usize, usize)> {
        let (b, c, s, s2) = l.shape().dims4()?;
        if s != s2 || self.patch == 0 || !s.is_multiple_of(self.patch) || c * self.patch * self.patch > self.width {
            candle_core::bail!("unfold_patches: pixels {:?} for patches of {}", l.shape(), self.patch);
        }
        if !l.is_contiguous() {
            candle_core::bail!("unfold_patches: pixels must be contiguous");
        }
        Ok((b, c, s))
    }

    fn reference<T: FromF32>(&self, px: &[f32], b: usize, c: usize, s: usize) -> Vec<T> {
        let (p, side) = (self.patch, s / self.patch);
        let mut out = Vec::with_capacity(b * side * side * self.width);
        for bi in 0..b {
            for py in 0..side {
                for pxi in 0..side {
                    for col in 0..self.width {
                        let v = if col < c * p * p {
                            let (ch, ky, kx) = (col / (p * p), col % (p * p) / p, col % p);
                            px[((bi * c + ch) * s + py * p + ky) * s + pxi * p + kx]
                        } else {
                            0.0
                        };
                        out.push(T::from_f32(v));
                    }
                }
            }
        }
        out
    }
}

impl CustomOp1 for Unfold {
    fn name(&self) -> &'static str {
        "unfold_patches"
    }

    fn cpu_fwd(&self, px: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (b, c, s) = self.dims(l)?;
        let CpuStorage::F32(px) = px else { candle_core::bail!("unfold_patches: pixels must be f32") };
        let px = &px[l.start_offset()..];
        let out = match self.dtype {
            DType::F32 => CpuStorage::F32(self.reference(px, b, c, s)),
            DType::BF16 => CpuStorage::BF16(self.reference(px, b, c, s)),
            DType::F16 => CpuStorage::F16(self.reference(px, b, c, s)),
            other => candle_core::bail!("unfold_patches: unsupported dtype {other:?}"),
        };
        Ok((out, Shape::from((b * (s / self.patch).pow(2), self.width))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        px: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (b, c, s) = self.dims(l)?;
        let rows = b * (s / self.patch).pow(2);
        let dev = px.device().clone();
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (c, s, p, w) = (c as i32, s as i32, self.patch as i32, self.width as i32);
        let out = by_float!(self.dtype, "unfold_patches", |T, SUFFIX| {
            let px = crate::launch::view::<f32>(px, l)?;
            // SAFETY: the kernel writes every column of every row.
            let mut out = unsafe { dev.alloc::<T>(rows * self.width)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("unfold_patches_{SUFFIX}"))?;
            let mut builder = func.builder();
            builder.arg(&px).arg(&mut out).arg(&c).arg(&s).arg(&p).arg(&w);
            // SAFETY: reads [B, C, S, S] from the slice's start, writes [rows, width].
            unsafe { builder.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((rows, self.width))))
    }
}

/// (patch rows [B · P², D], class [D], positions [1 + P², D]) → [B · (1 + P²), D].
struct AddPositions {
    batch: usize,
}

impl AddPositions {
    fn dims(&self, lp: &Layout, lc: &Layout, lpos: &Layout) -> candle_core::Result<(usize, usize)> {
        let (rows, d) = lp.shape().dims2()?;
        let (tokens, dp) = lpos.shape().dims2()?;
        if dp != d || lc.shape().elem_count() != d || rows != self.batch * (tokens.max(1) - 1) {
            candle_core::bail!("add_positions: patches {:?}, positions {:?} do not fit", lp.shape(), lpos.shape());
        }
        if !lp.is_contiguous() || !lc.is_contiguous() || !lpos.is_contiguous() {
            candle_core::bail!("add_positions needs contiguous tensors");
        }
        Ok((tokens, d))
    }
}

fn add_positions_reference<T: FromF32>(
    patches: &[T],
    cls: &[T],
    pos: &[T],
    batch: usize,
    tokens: usize,
    d: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(batch * tokens * d);
    for b in 0..batch {
        for t in 0..tokens {
            let src = if t == 0 { &cls[..d] } else { &patches[(b * (tokens - 1) + t - 1) * d..][..d] };
            out.extend(src.iter().zip(&pos[t * d..][..d]).map(|(&a, &p)| T::from_f32(a.into() + p.into())));
        }
    }
    out
}

impl CustomOp3 for AddPositions {
    fn name(&self) -> &'static str {
        "add_positions"
    }

    fn cpu_fwd(
        &self,
        p: &CpuStorage,
        lp: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        pos: &CpuStorage,
        lpos: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (tokens, d) = self.dims(lp, lc, lpos)?;
        let (op, oc, opos) = (lp.start_offset(), lc.start_offset(), lpos.start_offset());
        let out = cpu_float!("add_positions", (p, c, pos) =>
            add_positions_reference(&p[op..], &c[oc..], &pos[opos..], self.batch, tokens, d));
        Ok((out, Shape::from((self.batch * tokens, d))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        p: &candle_core::CudaStorage,
        lp: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        pos: &candle_core::CudaStorage,
        lpos: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (tokens, d) = self.dims(lp, lc, lpos)?;
        let rows = self.batch * tokens;
        let dev = p.device().clone();
        let cfg = LaunchConfig {
            grid_dim: (d.div_ceil(256) as u32, rows.clamp(1, 65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (rows_arg, tokens_arg, d_arg) = (rows as i64, tokens as i32, d as i32);
        let out = by_float!(p.dtype(), "add_positions", |T, SUFFIX| {
            let p = crate::launch::view::<T>(p, lp)?;
            let c = crate::launch::view::<T>(c, lc)?;
            let pos = crate::launch::view::<T>(pos, lpos)?;
            // SAFETY: the grid-stride loops write every element.
            let mut out = unsafe { dev.alloc::<T>(rows * d)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("add_positions_{SUFFIX}"))?;
            let mut builder = func.builder();
            builder.arg(&p).arg(&c).arg(&pos).arg(&mut out).arg(&rows_arg).arg(&tokens_arg).arg(&d_arg);
            // SAFETY: reads the patch rows, the class row and the positions within the
            // shapes `dims` checked; writes [B · tokens, D].
            unsafe { builder.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((rows, d))))
    }
}

/// Runs both kernels on `device` against their CPU twins (odd image and patch sizes, every
/// dtype); both only move and round values, so they must agree exactly. A line per
/// mismatch.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    for (i, &(b, c, s, p, d)) in [(2usize, 3usize, 28usize, 14usize, 40usize), (3, 2, 15, 5, 8)].iter().enumerate() {
        let px = Tensor::randn(0f32, 1.0, (b, c, s, s), &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let width = (c * p * p).next_multiple_of(8);
            let op = Unfold { patch: p, width, dtype };
            let rows_cpu = px.apply_op1_no_bwd(&op)?;
            let rows_gpu = px.to_device(device)?.apply_op1_no_bwd(&op)?;
            let tokens = (s / p).pow(2) + 1;
            let patches = Tensor::randn(0f32, 1.0, (b * (tokens - 1), d), &Device::Cpu)?.to_dtype(dtype)?;
            let cls = Tensor::randn(0f32, 1.0, d, &Device::Cpu)?.to_dtype(dtype)?;
            let pos = Tensor::randn(0f32, 1.0, (tokens, d), &Device::Cpu)?.to_dtype(dtype)?;
            let add = AddPositions { batch: b };
            let want = patches.apply_op3_no_bwd(&cls, &pos, &add)?;
            let got =
                patches.to_device(device)?.apply_op3_no_bwd(&cls.to_device(device)?, &pos.to_device(device)?, &add)?;
            for (what, got, want) in [("unfold_patches", rows_gpu, rows_cpu), ("add_positions", got, want)] {
                let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
                if got != want {
                    bad.push(format!("{what} case {i} {dtype:?}: differs"));
                }
            }
        }
    }
    Ok(bad)
}
