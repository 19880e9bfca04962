//! Writing new tokens' keys or values into one layer of the paged KV pool, in place: on
//! the GPU our kernel (`kernels/kv_cache.cu`, one thread per element), on the CPU the
//! same loop in Rust, which is also the reference the kernel is tested against.
//!
//! candle's `scatter_set` along the pool's row dimension runs one GPU thread per column
//! and loops over the rows serially: with `kv_heads · n` rows per layer it made a
//! 2,048-token prefill of a 7B model take seconds.

use candle_core::{CpuStorage, InplaceOp3, Layout, Tensor};

use crate::OpError;
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::WrapErr;
#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};

/// `pool` [num_blocks, kv_heads, block_size, head_dim] ← `src` [n, kv_heads, head_dim]
/// at `slots` [n] (u32: `block · block_size + row`).
pub struct WriteKv;

struct Dims {
    n: usize,
    heads: usize,
    block_size: usize,
    head_dim: usize,
    blocks: usize,
}

fn dims(pool: &Layout, src: &Layout, slots: &Layout) -> candle_core::Result<Dims> {
    let (blocks, heads, block_size, head_dim) = pool.shape().dims4()?;
    let (n, sh, sd) = src.shape().dims3()?;
    if (sh, sd) != (heads, head_dim) || slots.shape().dims1()? != n {
        candle_core::bail!(
            "write_kv: src {:?} or slots {:?} do not fit pool {:?}",
            src.shape(),
            slots.shape(),
            pool.shape()
        );
    }
    if !pool.is_contiguous() || !src.is_contiguous() || !slots.is_contiguous() {
        candle_core::bail!("write_kv needs contiguous tensors");
    }
    Ok(Dims { n, heads, block_size, head_dim, blocks })
}

fn write_cpu<T: Copy>(pool: &mut [T], src: &[T], slots: &[u32], d: &Dims) -> candle_core::Result<()> {
    for (t, &slot) in slots.iter().enumerate().take(d.n) {
        let (block, off) = (slot as usize / d.block_size, slot as usize % d.block_size);
        if block >= d.blocks {
            candle_core::bail!("write_kv: slot {slot} outside the pool of {} blocks", d.blocks);
        }
        for h in 0..d.heads {
            let from = (t * d.heads + h) * d.head_dim;
            let to = ((block * d.heads + h) * d.block_size + off) * d.head_dim;
            pool[to..to + d.head_dim].copy_from_slice(&src[from..from + d.head_dim]);
        }
    }
    Ok(())
}

impl InplaceOp3 for WriteKv {
    fn name(&self) -> &'static str {
        "write_kv"
    }

    fn cpu_fwd(
        &self,
        pool: &mut CpuStorage,
        lp: &Layout,
        src: &CpuStorage,
        ls: &Layout,
        slots: &CpuStorage,
        lt: &Layout,
    ) -> candle_core::Result<()> {
        let d = dims(lp, ls, lt)?;
        let CpuStorage::U32(slots) = slots else { candle_core::bail!("write_kv: slots must be u32") };
        let slots = &slots[lt.start_offset()..];
        let (po, so) = (lp.start_offset(), ls.start_offset());
        match (pool, src) {
            (CpuStorage::F32(p), CpuStorage::F32(s)) => write_cpu(&mut p[po..], &s[so..], slots, &d),
            (CpuStorage::BF16(p), CpuStorage::BF16(s)) => write_cpu(&mut p[po..], &s[so..], slots, &d),
            (CpuStorage::F16(p), CpuStorage::F16(s)) => write_cpu(&mut p[po..], &s[so..], slots, &d),
            _ => candle_core::bail!("write_kv: pool and src must share a float dtype"),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        pool: &mut candle_core::CudaStorage,
        lp: &Layout,
        src: &candle_core::CudaStorage,
        ls: &Layout,
        slots: &candle_core::CudaStorage,
        lt: &Layout,
    ) -> candle_core::Result<()> {
        const MODULE: crate::launch::Module = crate::launch::module!("kv_cache");

        let d = dims(lp, ls, lt)?;
        let dev = pool.device().clone();
        let slots = crate::launch::view::<u32>(slots, lt)?;
        if d.n * d.heads * d.head_dim == 0 {
            return Ok(());
        }
        let elem = pool.dtype().size_in_bytes();
        let row_bytes = d.head_dim * elem;
        // 16-byte words when the rows and both starts are multiples of 16 bytes (the pool's
        // and src's allocations are aligned; their offsets decide).
        let wide =
            row_bytes.is_multiple_of(16) && [lp, ls].iter().all(|l| (l.start_offset() * elem).is_multiple_of(16));
        let words = if wide { row_bytes / 16 } else { d.head_dim };
        let rows = d.n * d.heads;
        let cfg =
            LaunchConfig { grid_dim: (rows.div_ceil(8) as u32, 1, 1), block_dim: (32, 8, 1), shared_mem_bytes: 0 };
        let (rows_arg, heads, bs, words_arg) = (rows as i32, d.heads as i32, d.block_size as i32, words as i32);
        macro_rules! launch {
            ($t:ty, $kernel:expr) => {{
                let func = crate::launch::kernel!(MODULE, dev, $kernel)?;
                let s = crate::launch::view::<$t>(src, ls)?;
                let p = pool.as_cuda_slice_mut::<$t>()?;
                let mut p = p.slice_mut(lp.start_offset()..);
                let mut b = func.builder();
                b.arg(&mut p).arg(&s).arg(&slots).arg(&rows_arg).arg(&heads).arg(&bs).arg(&words_arg);
                // SAFETY: the kernel writes only inside `pool` (every slot's block was
                // checked by the caller against the pool) and reads `src` and `slots`
                // within the sizes passed (`words` words of 16 bytes only where the row is
                // that many bytes and both starts are 16-byte aligned); all three live on
                // this device's stream.
                unsafe { b.launch(cfg) }.w()?;
            }};
        }
        use candle_core::DType;
        let narrow = |name: &'static str| if wide { "write_kv_w16" } else { name };
        match pool.dtype() {
            DType::BF16 => launch!(half::bf16, narrow("write_kv_b16")),
            DType::F16 => launch!(half::f16, narrow("write_kv_b16")),
            DType::F32 => launch!(f32, narrow("write_kv_b32")),
            other => candle_core::bail!("write_kv: unsupported dtype {other:?}"),
        }
        Ok(())
    }
}

/// Writes `src` [n, kv_heads, head_dim] into `pool` at `slots` (u32 [n]).
pub fn write_kv(pool: &Tensor, src: &Tensor, slots: &Tensor) -> Result<(), OpError> {
    Ok(pool.inplace_op3(src, slots, &WriteKv)?)
}

/// Runs the KV write on `device` against the CPU reference for every dtype, with odd
/// sizes and a poisoned pool: the names of the dtypes whose results differ in any bit
/// (empty when all agree).
pub fn self_test(device: &candle_core::Device) -> Result<Vec<String>, OpError> {
    use candle_core::{DType, Device};
    let (blocks, heads, bs, n) = (7, 3, 5, 13);
    // A fixed permutation of the 35 slots; the first 13 are written.
    let slots: Vec<u32> = (0..35u32).map(|i| (i * 11 + 3) % 35).take(n).collect();
    let mut bad = Vec::new();
    // Rows of 9 values go element by element, of 16 values in 16-byte words.
    for (dtype, hd) in [DType::F32, DType::BF16, DType::F16].into_iter().flat_map(|d| [(d, 9), (d, 16)]) {
        let run = |dev: &Device| -> Result<Vec<f32>, OpError> {
            let pool = Tensor::full(1234.5f32, (blocks, heads, bs, hd), dev)?.to_dtype(dtype)?;
            let src = Tensor::arange(0f32, (n * heads * hd) as f32, dev)?.reshape((n, heads, hd))?.to_dtype(dtype)?;
            write_kv(&pool, &src, &Tensor::new(slots.as_slice(), dev)?)?;
            Ok(pool.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
        };
        if run(device)? != run(&Device::Cpu)? {
            bad.push(format!("{dtype:?} head_dim {hd}"));
        }
    }
    Ok(bad)
}

#[cfg(test)]
mod tests {
    use candle_core::Device;

    use super::*;

    #[test]
    fn writes_each_token_to_its_slot_and_nothing_else() {
        // 3 blocks of 4 rows, 2 heads of 3 values; tokens to slots 5, 0, 11.
        let pool = Tensor::full(-7f32, (3, 2, 4, 3), &Device::Cpu).unwrap();
        let src = Tensor::arange(0f32, 18., &Device::Cpu).unwrap().reshape((3, 2, 3)).unwrap();
        let slots = Tensor::new(&[5u32, 0, 11], &Device::Cpu).unwrap();
        write_kv(&pool, &src, &slots).unwrap();
        let v = pool.to_vec3::<f32>().map(drop);
        assert!(v.is_err(), "rank 4");
        let flat = pool.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let at = |block: usize, h: usize, row: usize| &flat[((block * 2 + h) * 4 + row) * 3..][..3];
        assert_eq!(at(1, 0, 1), &[0., 1., 2.]);
        assert_eq!(at(1, 1, 1), &[3., 4., 5.]);
        assert_eq!(at(0, 0, 0), &[6., 7., 8.]);
        assert_eq!(at(2, 1, 3), &[15., 16., 17.]);
        assert_eq!(flat.iter().filter(|&&x| x == -7.).count(), 72 - 18, "only the 18 values were written");
        let bad = Tensor::new(&[12u32, 0, 1], &Device::Cpu).unwrap();
        assert!(write_kv(&pool, &src, &bad).is_err(), "a slot outside the pool");
        assert!(self_test(&Device::Cpu).unwrap().is_empty());
    }
}
