//! Fused ops of the decoder layer on the GPU (`kernels/decoder.cu`): residual add with
//! RMSNorm, SiLU·mul over a fused gate/up projection, and RoPE that splits a fused q/k/v
//! projection. Each replaces several candle passes and launches (a batch-1 decode step is
//! bound by launches, not bytes). Each has a CPU twin, the reference its kernel is tested
//! against ([`self_test`]); the model calls them on the GPU only.

#[cfg(feature = "cuda")]
use candle_core::Storage;
use candle_core::{CpuStorage, CustomOp1, CustomOp3, DType, Device, Layout, Shape, Tensor};

use crate::OpError;
#[cfg(feature = "cuda")]
use crate::dispatch::by_float;
use crate::dispatch::cpu_float;
use crate::elem::FromF32;
#[cfg(feature = "cuda")]
use crate::pdl;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

/// One op of `T`'s arithmetic: the f32 result rounded to `T` and back.
fn r<T: FromF32>(x: f32) -> f32 {
    T::from_f32(x).into()
}

fn contiguous(what: &str, layouts: &[&Layout]) -> candle_core::Result<()> {
    if layouts.iter().all(|l| l.is_contiguous()) {
        Ok(())
    } else {
        candle_core::bail!("{what}: inputs must be contiguous")
    }
}

/// `[x + y, RMSNorm(x + y) · w]` as one `[2, rows, h]` tensor.
struct AddRmsNorm {
    eps: f32,
}

fn add_rmsnorm_ref<T: FromF32>(x: &[T], y: &[T], w: &[T], rows: usize, h: usize, eps: f32) -> Vec<T> {
    let mut sums = Vec::with_capacity(2 * rows * h);
    sums.extend(x[..rows * h].iter().zip(&y[..rows * h]).map(|(&a, &b)| T::from_f32(a.into() + b.into())));
    for row in 0..rows {
        let s = &sums[row * h..(row + 1) * h];
        let ss: f32 = s.iter().map(|&v| v.into() * v.into()).sum();
        let inv = 1.0 / (ss / h as f32 + eps).sqrt();
        let normed: Vec<T> = s.iter().zip(w).map(|(&v, &g)| T::from_f32(r::<T>(v.into() * inv) * g.into())).collect();
        sums.extend(normed);
    }
    sums
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add_rmsnorm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, h) = norm_dims(lx, ly, lw)?;
        let (ox, oy, ow) = (lx.start_offset(), ly.start_offset(), lw.start_offset());
        let e = self.eps;
        let out = cpu_float!("add_rmsnorm", (x, y, w) => add_rmsnorm_ref(&x[ox..], &y[oy..], &w[ow..], rows, h, e));
        Ok((out, Shape::from((2, rows, h))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, h) = norm_dims(lx, ly, lw)?;
        // The kernel holds ADD_NORM_PER (8) elements per thread, in whole warps.
        if h > ADD_RMSNORM_MAX_WIDTH {
            candle_core::bail!("add_rmsnorm: rows of {h} exceed the kernel's {ADD_RMSNORM_MAX_WIDTH}");
        }
        let threads = h.div_ceil(8).next_multiple_of(32).clamp(32, 1024) as u32;
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let (rows_arg, h_arg) = (rows as i32, h as i32);
        let out = by_float!(x.dtype(), "add_rmsnorm", |T, SUFFIX| {
            // A thread's 8 elements in 16-byte accesses when rows and starts align to them.
            let vec = [h, lx.start_offset(), ly.start_offset(), lw.start_offset()].iter().all(|a| a.is_multiple_of(8));
            let name = format!("add_rmsnorm{}_{SUFFIX}", if vec { "_vec" } else { "" });
            let x = crate::launch::view::<T>(x, lx)?;
            let y = crate::launch::view::<T>(y, ly)?;
            let w = crate::launch::view::<T>(w, lw)?;
            // SAFETY: the kernel writes both halves of every row.
            let mut out = unsafe { dev.alloc::<T>(2 * rows * h)? };
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut b = pdl::Launch::new(&stream, &func);
            b.arg(&x).arg(&y).arg(&w).arg(&mut out).arg(rows_arg).arg(h_arg).arg(self.eps);
            // SAFETY: reads [rows, h] of x and y and [h] of w, writes [2, rows, h]; only w
            // is read before the PDL wait.
            unsafe { b.launch(cfg) }?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((2, rows, h))))
    }
}

fn norm_dims(lx: &Layout, ly: &Layout, lw: &Layout) -> candle_core::Result<(usize, usize)> {
    contiguous("add_rmsnorm", &[lx, ly, lw])?;
    let (rows, h) = lx.shape().dims2()?;
    if ly.shape().dims2()? != (rows, h) || lw.shape().dims1()? != h {
        candle_core::bail!("add_rmsnorm: shapes {:?}, {:?}, {:?} do not fit", lx.shape(), ly.shape(), lw.shape());
    }
    Ok((rows, h))
}

/// `silu(gate) · up` of a fused `[rows, 2I]` gate/up projection: `[rows, I]`.
struct SiluMul;

fn silu_mul_ref<T: FromF32>(gu: &[T], rows: usize, inter: usize) -> Vec<T> {
    let mut out = Vec::with_capacity(rows * inter);
    for row in gu.chunks(2 * inter).take(rows) {
        let (g, u) = row.split_at(inter);
        out.extend(g.iter().zip(u).map(|(&g, &u)| {
            let g: f32 = g.into();
            T::from_f32(r::<T>(g / (1.0 + (-g).exp())) * u.into())
        }));
    }
    out
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu_mul"
    }

    fn cpu_fwd(&self, gu: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        contiguous("silu_mul", &[l])?;
        let (rows, two) = l.shape().dims2()?;
        let (inter, o) = (two / 2, l.start_offset());
        let out = cpu_float!("silu_mul", (gu) => silu_mul_ref(&gu[o..], rows, inter));
        Ok((out, Shape::from((rows, inter))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        gu: &candle_core::CudaStorage,
        l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        contiguous("silu_mul", &[l])?;
        let (rows, two) = l.shape().dims2()?;
        let inter = two / 2;
        let dev = gu.device().clone();
        let n = rows * inter;
        let (rows_arg, inter_arg) = (rows as i64, inter as i32);
        let out = by_float!(gu.dtype(), "silu_mul", |T, SUFFIX| {
            // 16-byte chunks of gate and up when the halves and the start align to them.
            let v = 16 / std::mem::size_of::<T>();
            let vec = inter.is_multiple_of(v) && l.start_offset().is_multiple_of(v);
            let chunks = if vec { inter / v } else { inter };
            let cfg = LaunchConfig {
                grid_dim: (chunks.div_ceil(256) as u32, rows.clamp(1, 65_535) as u32, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            let name = format!("silu_mul{}_{SUFFIX}", if vec { "_vec" } else { "" });
            let gu = crate::launch::view::<T>(gu, l)?;
            // SAFETY: the grid-stride loops write every element.
            let mut out = unsafe { dev.alloc::<T>(n)? };
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut b = func.builder();
            b.arg(&gu).arg(&mut out).arg(&rows_arg).arg(&inter_arg);
            // SAFETY: reads [rows, 2I], writes [rows, I].
            unsafe { b.launch(cfg) }.w()?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from((rows, inter))))
    }
}

/// RoPE on the q and k parts of a fused `[T, (H + 2K)·D]` projection; q, k and v written
/// one after the other (`T·H·D`, `T·K·D`, `T·K·D` elements) into one flat tensor.
struct RopeSplit<'a> {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Where k and v go instead of the output (GPU only): see [`rope_split_into`].
    pools: Option<PoolSlots<'a>>,
}

/// One layer's K and V pools [blocks, kv_heads, block_size, head_dim] and each new
/// token's slot (u32 [T], `block · block_size + row`), every slot inside the pools.
#[derive(Clone, Copy)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct PoolSlots<'a> {
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub slots: &'a Tensor,
}

impl RopeSplit<'_> {
    fn dims(&self, lx: &Layout, lc: &Layout, ls: &Layout) -> candle_core::Result<usize> {
        contiguous("rope_split", &[lx, lc, ls])?;
        let (t, width) = lx.shape().dims2()?;
        let half = self.head_dim / 2;
        if width != (self.heads + 2 * self.kv_heads) * self.head_dim
            || !self.head_dim.is_multiple_of(2)
            || lc.shape().dims2()? != (t, half)
            || ls.shape().dims2()? != (t, half)
        {
            candle_core::bail!("rope_split: shapes {:?}, {:?} do not fit", lx.shape(), lc.shape());
        }
        Ok(t)
    }

    /// The pools' block size, once their shapes, dtype and the slots fit `t` tokens.
    #[cfg(feature = "cuda")]
    fn check_pools(&self, p: PoolSlots<'_>, t: usize, dtype: DType) -> candle_core::Result<usize> {
        let (_, kvh, bs, hd) = p.k.dims4()?;
        let fits = p.k.shape() == p.v.shape()
            && (kvh, hd) == (self.kv_heads, self.head_dim)
            && bs > 0
            && p.k.dtype() == dtype
            && p.v.dtype() == dtype
            && p.k.is_contiguous()
            && p.v.is_contiguous()
            && p.slots.dtype() == DType::U32
            && p.slots.is_contiguous()
            && p.slots.dims1()? == t;
        if !fits {
            candle_core::bail!("rope_split: pools {:?} or slots {:?} do not fit", p.k.shape(), p.slots.shape());
        }
        Ok(bs)
    }

    fn reference<T: FromF32>(&self, qkv: &[T], cos: &[T], sin: &[T], t: usize) -> Vec<T> {
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let half = d / 2;
        let mut out = vec![T::from_f32(0.0); t * (h + 2 * k) * d];
        let (q_part, rest) = out.split_at_mut(t * h * d);
        let (k_part, v_part) = rest.split_at_mut(t * k * d);
        for tok in 0..t {
            let row = &qkv[tok * (h + 2 * k) * d..][..(h + 2 * k) * d];
            let (c, s) = (&cos[tok * half..][..half], &sin[tok * half..][..half]);
            for head in 0..h + k {
                let src = &row[head * d..][..d];
                let dst = if head < h {
                    &mut q_part[(tok * h + head) * d..][..d]
                } else {
                    &mut k_part[(tok * k + head - h) * d..][..d]
                };
                for i in 0..half {
                    let (a, b): (f32, f32) = (src[i].into(), src[i + half].into());
                    let (cc, ss): (f32, f32) = (c[i].into(), s[i].into());
                    dst[i] = T::from_f32(r::<T>(a * cc) - r::<T>(b * ss));
                    dst[i + half] = T::from_f32(r::<T>(b * cc) + r::<T>(a * ss));
                }
            }
            v_part[tok * k * d..][..k * d].copy_from_slice(&row[(h + k) * d..]);
        }
        out
    }
}

impl CustomOp3 for RopeSplit<'_> {
    fn name(&self) -> &'static str {
        "rope_split"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        c: &CpuStorage,
        lc: &Layout,
        s: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let t = self.dims(lx, lc, ls)?;
        if self.pools.is_some() {
            candle_core::bail!("rope_split into the pool runs on the GPU only");
        }
        let (ox, oc, os) = (lx.start_offset(), lc.start_offset(), ls.start_offset());
        let out = cpu_float!("rope_split", (x, c, s) => self.reference(&x[ox..], &c[oc..], &s[os..], t));
        Ok((out, Shape::from(lx.shape().elem_count())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
        s: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let t = self.dims(lx, lc, ls)?;
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        let n = if self.pools.is_some() { t * self.heads * self.head_dim } else { lx.shape().elem_count() };
        let block_size = match self.pools {
            Some(p) => self.check_pools(p, t, x.dtype())? as i32,
            None => 0,
        };
        let guards =
            self.pools.map(|p| (p.k.storage_and_layout(), p.v.storage_and_layout(), p.slots.storage_and_layout()));
        let all_heads = (self.heads + 2 * self.kv_heads) as u32;
        let half = self.head_dim / 2;
        // Many tokens (prefill) with halves of 8: a thread takes 8 pairs in 16-byte accesses.
        let offsets = [lx.start_offset(), lc.start_offset(), ls.start_offset()];
        let vec = t >= 64 && half.is_multiple_of(8) && offsets.iter().all(|o| o.is_multiple_of(8));
        let threads = (if vec { half / 8 } else { half }).clamp(1, 1024) as u32;
        // Few tokens (decodes): a CTA per head, so that one token fills H + 2K CTAs. Many
        // (prefill): several heads per CTA, so that CTAs are not a few dozen threads each.
        let per_cta = if t >= 64 { (512 / threads).clamp(1, all_heads) } else { 1 };
        let cfg = LaunchConfig {
            grid_dim: (t as u32, all_heads.div_ceil(per_cta), 1),
            block_dim: (threads, per_cta, 1),
            shared_mem_bytes: 0,
        };
        let (t_arg, h, k, d) = (t as i32, self.heads as i32, self.kv_heads as i32, self.head_dim as i32);
        let out = by_float!(x.dtype(), "rope_split", |T, SUFFIX| {
            let x = crate::launch::view::<T>(x, lx)?;
            let c = crate::launch::view::<T>(c, lc)?;
            let s = crate::launch::view::<T>(s, ls)?;
            // SAFETY: every q (and, without pools, k and v) element of every token is written.
            let mut out = unsafe { dev.alloc::<T>(n)? };
            let kv = if self.pools.is_some() { "_kv" } else { "" };
            let name = format!("rope_split{kv}{}_{SUFFIX}", if vec { "_vec" } else { "" });
            let func = crate::launch::kernel!(MODULE, dev, &name)?;
            let mut b = pdl::Launch::new(&stream, &func);
            b.arg(&x).arg(&c).arg(&s).arg(&mut out).arg(t_arg).arg(h).arg(k).arg(d);
            let views = match &guards {
                Some(((kg, kl), (vg, vl), (sg, sl))) => {
                    let (Storage::Cuda(kc), Storage::Cuda(vc), Storage::Cuda(sc)) = (&**kg, &**vg, &**sg) else {
                        candle_core::bail!("rope_split: the pools are not on the GPU")
                    };
                    Some((
                        crate::launch::view::<T>(kc, kl)?,
                        crate::launch::view::<T>(vc, vl)?,
                        crate::launch::view::<u32>(sc, sl)?,
                    ))
                }
                None => None,
            };
            if let Some((kp, vp, slots)) = &views {
                b.arg(kp).arg(vp).arg(slots).arg(block_size);
            }
            // SAFETY: reads [T, (H + 2K)·D] and [T, D/2] twice, writes as many elements,
            // or q's [T, H·D] and each token's K·D keys and values at its slot of the pools,
            // inside them (`PoolSlots`' contract; shapes and dtypes checked above). The
            // pools are written through views taken under read locks: device memory that
            // only this stream touches, in order, while the caller holds the pools.
            // Nothing is touched before the PDL wait.
            unsafe { b.launch(cfg) }?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, Shape::from(n)))
    }
}

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("decoder");

/// The widest row `add_rmsnorm` takes on the GPU: the kernel keeps a row in registers,
/// 8 values a thread over at most 1,024 threads (every model family here fits).
pub const ADD_RMSNORM_MAX_WIDTH: usize = 8 * 1024;

/// `(x + y, RMSNorm(x + y) · w)` for rows `x`, `y` [rows, h].
pub fn add_rmsnorm(x: &Tensor, y: &Tensor, w: &Tensor, eps: f32) -> candle_core::Result<(Tensor, Tensor)> {
    let out = x.contiguous()?.apply_op3_no_bwd(&y.contiguous()?, w, &AddRmsNorm { eps })?;
    Ok((out.get(0)?, out.get(1)?))
}

/// `silu(gate) · up` of `gu` [rows, 2I] (gate | up).
pub fn silu_mul(gu: &Tensor) -> candle_core::Result<Tensor> {
    let width = gu.dims().last().copied().unwrap_or(0);
    if !width.is_multiple_of(2) {
        candle_core::bail!("silu_mul: rows of {width} values are not a gate and an up half");
    }
    gu.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

/// q [T, H, D] and k [T, K, D] with RoPE (`cos`, `sin` [T, D/2]), and v [T, K, D], from
/// a fused projection `qkv` [T, (H + 2K)·D].
pub fn rope_split(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (heads, kv_heads, head_dim): (usize, usize, usize),
) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
    let t = qkv.dim(0)?;
    let op = RopeSplit { heads, kv_heads, head_dim, pools: None };
    let flat = qkv.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)?;
    let (nq, nk) = (t * heads * head_dim, t * kv_heads * head_dim);
    Ok((
        flat.narrow(0, 0, nq)?.reshape((t, heads, head_dim))?,
        flat.narrow(0, nq, nk)?.reshape((t, kv_heads, head_dim))?,
        flat.narrow(0, nq + nk, nk)?.reshape((t, kv_heads, head_dim))?,
    ))
}

/// [`rope_split`] that writes k and v into their slots of `pools` (the GPU): q [T, H, D].
pub fn rope_split_into(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    pools: PoolSlots<'_>,
) -> candle_core::Result<Tensor> {
    let t = qkv.dim(0)?;
    let op = RopeSplit { heads, kv_heads, head_dim, pools: Some(pools) };
    let q = qkv.contiguous()?.apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)?;
    q.reshape((t, heads, head_dim))
}

/// Runs the kernels on `device` against their CPU twins on random inputs (odd sizes;
/// f32, bf16, f16): a line per case whose results differ by more than two units of the
/// output's last place (at its magnitude).
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let rand = |shape: &[usize]| -> Result<(Tensor, Tensor), OpError> {
            let cpu = Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?.to_dtype(dtype)?;
            Ok((cpu.to_device(device)?, cpu))
        };
        let ulp = match dtype {
            DType::BF16 => 2f32.powi(-7),
            DType::F16 => 2f32.powi(-10),
            _ => 1e-6,
        };
        let mut check = |what: &str, got: &Tensor, want: &Tensor| -> Result<(), OpError> {
            let got: Vec<f32> = got.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let want: Vec<f32> = want.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
                .fold(0f32, |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) });
            if worst > 2.0 * ulp {
                bad.push(format!("{what} {dtype:?}: max relative |Δ| {worst:.3e}"));
            }
            Ok(())
        };
        // An odd width (element by element), then one of 16-byte chunks.
        for width in [1031, 1024] {
            let ((xd, x), (yd, y), (wd, w)) = (rand(&[5, width])?, rand(&[5, width])?, rand(&[width])?);
            let (got, want) = (add_rmsnorm(&xd, &yd, &wd, 1e-5)?, add_rmsnorm(&x, &y, &w, 1e-5)?);
            check("add_rmsnorm sum", &got.0, &want.0)?;
            check("add_rmsnorm norm", &got.1, &want.1)?;
        }
        // Odd halves (element by element), then halves of 16-byte chunks.
        for inter in [333, 512] {
            let (gud, gu) = rand(&[7, 2 * inter])?;
            check("silu_mul", &silu_mul(&gud)?, &silu_mul(&gu)?)?;
        }
        // Few tokens (a CTA per head), then enough for several heads per CTA, then halves of
        // 8 (16-byte accesses).
        for (tokens, dims) in [(3, (6, 2, 10)), (70, (6, 2, 10)), (70, (4, 2, 16))] {
            let (width, half) = ((dims.0 + 2 * dims.1) * dims.2, dims.2 / 2);
            let ((qd, q), (cd, c), (sd, s)) = (rand(&[tokens, width])?, rand(&[tokens, half])?, rand(&[tokens, half])?);
            let (got, want) = (rope_split(&qd, &cd, &sd, dims)?, rope_split(&q, &c, &s, dims)?);
            check("rope_split q", &got.0, &want.0)?;
            check("rope_split k", &got.1, &want.1)?;
            check("rope_split v", &got.2, &want.2)?;
            if device.is_cuda() {
                // Into a poisoned pool of blocks of 5 at shuffled slots: the GPU's fused write
                // against the CPU's rope_split, then write_kv.
                let (kvh, hd) = (dims.1, dims.2);
                // Every other slot, backwards: distinct, across blocks, out of order.
                let blocks = (2 * tokens).div_ceil(5) + 1;
                let slots: Vec<u32> = (0..tokens as u32).rev().map(|i| 2 * i + 1).collect();
                let pool = Tensor::full(1e4f32, (blocks, kvh, 5, hd), &Device::Cpu)?.to_dtype(dtype)?;
                let (kc, vc) = (pool.copy()?, pool.copy()?);
                let (kd, vd) = (pool.to_device(device)?, pool.to_device(device)?);
                let slots_c = Tensor::new(slots.as_slice(), &Device::Cpu)?;
                let slots_d = slots_c.to_device(device)?;
                crate::kv_write::write_kv(&kc, &want.1.contiguous()?, &slots_c)?;
                crate::kv_write::write_kv(&vc, &want.2.contiguous()?, &slots_c)?;
                let q = rope_split_into(&qd, &cd, &sd, dims, PoolSlots { k: &kd, v: &vd, slots: &slots_d })?;
                check("rope_split_into q", &q, &want.0)?;
                check("rope_split_into k pool", &kd, &kc)?;
                check("rope_split_into v pool", &vd, &vc)?;
            }
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn twins_match_candle_in_f32() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (3, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, 8, &dev).unwrap();
        let (sum, normed) = add_rmsnorm(&x, &y, &w, 1e-6).unwrap();
        let want_sum = (&x + &y).unwrap();
        let want = candle_nn::ops::rms_norm(&want_sum, &w, 1e-6).unwrap();
        let diff =
            |a: &Tensor, b: &Tensor| (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(diff(&sum, &want_sum), 0.0);
        assert!(diff(&normed, &want) < 1e-5);

        let gu = Tensor::randn(0f32, 2.0, (2, 6), &dev).unwrap();
        let want = (gu.narrow(1, 0, 3).unwrap().silu().unwrap() * gu.narrow(1, 3, 3).unwrap()).unwrap();
        assert!(diff(&silu_mul(&gu).unwrap(), &want) < 1e-6);

        // q: 2 heads, k and v: 1 head, head_dim 4, 3 tokens.
        let qkv = Tensor::randn(0f32, 1.0, (3, 16), &dev).unwrap();
        let angles = Tensor::randn(0f32, 1.0, (3, 2), &dev).unwrap();
        let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
        let (q, k, v) = rope_split(&qkv, &cos, &sin, (2, 1, 4)).unwrap();
        let heads = |from: usize, n: usize| qkv.narrow(1, from * 4, n * 4).unwrap().reshape((1, 3, n, 4)).unwrap();
        let rope = |t: Tensor| {
            candle_nn::rotary_emb::rope_thd(&t.contiguous().unwrap(), &cos, &sin).unwrap().squeeze(0).unwrap()
        };
        assert!(diff(&q, &rope(heads(0, 2))) < 1e-6);
        assert!(diff(&k, &rope(heads(2, 1))) < 1e-6);
        assert_eq!(diff(&v, &heads(3, 1).squeeze(0).unwrap()), 0.0);
    }
}
