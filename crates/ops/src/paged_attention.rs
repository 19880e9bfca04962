//! Decode attention read in place from the paged KV pool: each sequence's one new query
//! attends over its cached keys and values through its block table, with no gather. On the
//! GPU our kernels (`kernels/paged_attention.cu`: online softmax, one CTA per head, split
//! over positions when the batch is small; a tiled one with many rows in flight per warp
//! for 16-bit models of head dim 64 or 128); on the CPU a plain two-pass softmax in f32,
//! which is the reference the kernels are tested against.
//!
//! The gather it replaces copied every sequence's blocks, padded to the longest, into a
//! dense tensor per layer: at batch 64 that was twice the KV cache's bytes moved per layer.

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

/// The block tables of a step of decodes, as the kernel reads them: u32
/// `[seqs, 1 + width]`, each row the sequence's length (the keys to attend over: its new
/// token included), then its block table padded with zeros to `width` entries.
#[derive(Debug, Clone)]
pub struct DecodeTables {
    meta: Tensor,
    seqs: usize,
    width: usize,
    max_len: usize,
    /// The largest block id named, checked against the pool before the kernel trusts it.
    max_block: u32,
    /// The tiled kernel's count of finished splits per (sequence, head), zeros between
    /// launches: made by the first launch that splits, reused by every layer of the step.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    counters: std::sync::OnceLock<Tensor>,
}

impl DecodeTables {
    /// `(len, table)` per sequence, `table` covering at least `len` positions.
    pub fn new(seqs: &[(usize, &[u32])], block_size: usize, device: &Device) -> candle_core::Result<Self> {
        let width = seqs.iter().map(|(len, _)| len.div_ceil(block_size)).max().unwrap_or(0).max(1);
        let mut meta = Vec::with_capacity(seqs.len() * (1 + width));
        for &(len, table) in seqs {
            let used = len.div_ceil(block_size);
            if len == 0 || table.len() < used || len > u32::MAX as usize {
                candle_core::bail!("a block table of {} blocks for {len} positions", table.len());
            }
            meta.push(len as u32);
            meta.extend(table[..used].iter().copied().chain(std::iter::repeat_n(0, width - used)));
        }
        let max_len = seqs.iter().map(|s| s.0).max().unwrap_or(0);
        let max_block = seqs.iter().flat_map(|&(len, t)| &t[..len.div_ceil(block_size)]).copied().max().unwrap_or(0);
        let meta = Tensor::from_vec(meta, (seqs.len(), 1 + width), device)?;
        Ok(DecodeTables { meta, seqs: seqs.len(), width, max_len, max_block, counters: Default::default() })
    }
}

#[cfg(feature = "cuda")]
const MODULE: crate::launch::Module = crate::launch::module!("paged_attention");

/// The op: `q` [seqs, heads, head_dim] over the pool's `k`, `v`
/// [num_blocks, kv_heads, block_size, head_dim] → [seqs, heads, head_dim] in q's dtype.
struct PagedDecode<'a> {
    tables: &'a DecodeTables,
    scale: f32,
}

struct Dims {
    seqs: usize,
    heads: usize,
    kv_heads: usize,
    block_size: usize,
    head_dim: usize,
}

impl PagedDecode<'_> {
    fn dims(&self, q: &Layout, k: &Layout, v: &Layout) -> candle_core::Result<Dims> {
        let (seqs, heads, head_dim) = q.shape().dims3()?;
        let (blocks, kv_heads, block_size, kd) = k.shape().dims4()?;
        if k.shape() != v.shape() || kd != head_dim || seqs != self.tables.seqs {
            candle_core::bail!("paged_decode: q {:?}, k {:?}, v {:?} do not fit", q.shape(), k.shape(), v.shape());
        }
        if kv_heads == 0 || !heads.is_multiple_of(kv_heads) || head_dim == 0 || head_dim > 256 {
            candle_core::bail!("paged_decode: {heads} heads over {kv_heads} kv heads of {head_dim}");
        }
        if !q.is_contiguous() || !k.is_contiguous() || !v.is_contiguous() {
            candle_core::bail!("paged_decode needs contiguous tensors");
        }
        // `DecodeTables::new` made every length fit its table; the blocks must fit the pool.
        if self.tables.max_block as usize >= blocks || self.tables.width * block_size < self.tables.max_len {
            candle_core::bail!("paged_decode: block {} outside the pool of {blocks}", self.tables.max_block);
        }
        Ok(Dims { seqs, heads, kv_heads, block_size, head_dim })
    }
}

#[cfg(feature = "cuda")]
impl PagedDecode<'_> {
    /// The tiled kernel (`paged_decode_tiled_*`): 16-bit, head dim 64 or 128, operands
    /// at multiples of 8 elements (16-byte rows).
    #[allow(clippy::too_many_arguments)]
    fn launch_tiled(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
        d: &Dims,
        meta: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, u32>,
        sms: usize,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        const WARPS: usize = 4;
        let dev = q.device().clone();
        let stream = dev.cuda_stream();
        // Rows one pass of a CTA's warps covers: 8 loads a lane, 16 bytes each.
        let pass = WARPS * 8 * (32 / (d.head_dim / 8));
        let ctas = d.heads * d.seqs;
        let max_len = self.tables.max_len.max(1);
        // Split the positions until about 8 CTAs an SM are busy: a CTA issues its loads
        // at once, so more of them in flight is what hides HBM's latency.
        let splits = if ctas >= 2 * sms { 1 } else { (8 * sms).div_ceil(ctas).min(max_len.div_ceil(pass)).max(1) };
        let split_len = max_len.div_ceil(splits).next_multiple_of(pass);
        let splits = max_len.div_ceil(split_len);
        let n_out = d.seqs * d.heads * d.head_dim;
        let (part, part_ml) = if splits > 1 { (n_out * splits, 2 * ctas * splits) } else { (1, 1) };
        // SAFETY: each split's CTA writes its partials before it counts itself done, and
        // the last to count reads them; with one split they are unused.
        let (mut part_acc, mut part_ml) = unsafe { (dev.alloc::<f32>(part)?, dev.alloc::<f32>(part_ml)?) };
        let counters = match self.tables.counters.get() {
            Some(c) => c.clone(),
            None => {
                let c = Tensor::zeros(ctas, DType::U32, &candle_core::Device::Cuda(dev.clone()))?;
                self.tables.counters.get_or_init(|| c).clone()
            }
        };
        if counters.elem_count() < ctas {
            candle_core::bail!("paged_decode: {} counters for {ctas} heads", counters.elem_count());
        }
        let (counter_storage, counter_layout) = counters.storage_and_layout();
        let candle_core::Storage::Cuda(counter_storage) = &*counter_storage else {
            candle_core::bail!("paged_decode: the counters are not on the GPU")
        };
        let counters = crate::launch::view::<u32>(counter_storage, counter_layout)?;
        let cfg = LaunchConfig {
            grid_dim: (d.heads as u32, d.seqs as u32, splits as u32),
            block_dim: (WARPS as u32 * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let (heads, kvh, bs) = (d.heads as i32, d.kv_heads as i32, d.block_size as i32);
        let (width, split_len) = (self.tables.width as i32, split_len as i32);
        // The kernel's softmax is in base 2.
        let scale = self.scale * std::f32::consts::LOG2_E;
        let hd = d.head_dim;
        let out = by_float!(q.dtype(), "paged_decode", |T, SUFFIX| {
            let q = crate::launch::view::<T>(q, lq)?;
            let k = crate::launch::view::<T>(k, lk)?;
            let v = crate::launch::view::<T>(v, lv)?;
            // SAFETY: every element is written, by the only split or by the last.
            let mut out = unsafe { dev.alloc::<T>(n_out)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("paged_decode_tiled_{SUFFIX}_{hd}"))?;
            let mut b = crate::pdl::Launch::new(&stream, &func);
            b.arg(&q).arg(&k).arg(&v).arg(meta).arg(&mut out).arg(&mut part_acc).arg(&mut part_ml);
            b.arg(&counters).arg(heads).arg(kvh).arg(bs).arg(width).arg(split_len).arg(scale);
            // SAFETY: as the other kernel's launch, and the counters hold one u32 per
            // (sequence, head) (checked above), zero between launches on this stream.
            // Nothing is touched before the PDL wait.
            unsafe { b.launch(cfg) }?;
            crate::launch::storage(out, &dev)
        });
        Ok((out, lq.shape().clone()))
    }
}

fn reference<T: Copy + Into<f32> + FromF32>(
    q: &[T],
    k: &[T],
    v: &[T],
    meta: &[u32],
    width: usize,
    d: &Dims,
    scale: f32,
) -> Vec<T> {
    let (hd, bs) = (d.head_dim, d.block_size);
    let group = d.heads / d.kv_heads;
    let mut out = Vec::with_capacity(d.seqs * d.heads * hd);
    let mut scores = Vec::new();
    let mut acc = vec![0f32; hd];
    for (s, row) in meta.chunks(1 + width).enumerate().take(d.seqs) {
        let (len, table) = (row[0] as usize, &row[1..]);
        for h in 0..d.heads {
            let kvh = h / group;
            let at = |p: usize| ((table[p / bs] as usize * d.kv_heads + kvh) * bs + p % bs) * hd;
            let qrow = &q[(s * d.heads + h) * hd..][..hd];
            scores.clear();
            scores.extend((0..len).map(|p| {
                let krow = &k[at(p)..][..hd];
                scale * qrow.iter().zip(krow).map(|(&a, &b)| a.into() * b.into()).sum::<f32>()
            }));
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0f32;
            acc.fill(0.0);
            for (p, &score) in scores.iter().enumerate() {
                let w = (score - max).exp();
                total += w;
                for (a, &x) in acc.iter_mut().zip(&v[at(p)..][..hd]) {
                    *a += w * x.into();
                }
            }
            out.extend(acc.iter().map(|&a| T::from_f32(a / total)));
        }
    }
    out
}

impl CustomOp3 for PagedDecode<'_> {
    fn name(&self) -> &'static str {
        "paged_decode"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        lq: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        v: &CpuStorage,
        lv: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let d = self.dims(lq, lk, lv)?;
        let (meta, _) = self.tables.meta.storage_and_layout();
        let candle_core::Storage::Cpu(CpuStorage::U32(meta)) = &*meta else {
            candle_core::bail!("paged_decode: the tables are not u32 on the CPU")
        };
        let (w, sc) = (self.tables.width, self.scale);
        let (oq, ok, ov) = (lq.start_offset(), lk.start_offset(), lv.start_offset());
        let out = cpu_float!("paged_decode", (q, k, v) => reference(&q[oq..], &k[ok..], &v[ov..], meta, w, &d, sc));
        Ok((out, lq.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        const WARPS: u32 = 4;

        let d = self.dims(lq, lk, lv)?;
        let dev = q.device().clone();
        let (meta_storage, meta_layout) = self.tables.meta.storage_and_layout();
        let candle_core::Storage::Cuda(meta) = &*meta_storage else {
            candle_core::bail!("paged_decode: the tables are not on the GPU")
        };
        let meta = crate::launch::view::<u32>(meta, meta_layout)?;
        // The lengths and block ids were checked on the host (`DecodeTables::new`, `dims`).

        // Enough CTAs to fill the GPU: split the positions when heads × seqs alone are few.
        let sms = crate::device_caps::sm_count(&dev);
        let ctas = d.heads * d.seqs;
        let max_len = self.tables.max_len.max(1);
        let is16 = matches!(q.dtype(), DType::BF16 | DType::F16);
        // 16-bit models of head dim 64 or 128 take the tiled kernel (the other lost every
        // A/B there and keeps the rest: f32, other head dims).
        let tiled =
            is16 && matches!(d.head_dim, 64 | 128) && [lq, lk, lv].iter().all(|l| l.start_offset().is_multiple_of(8));
        if tiled {
            return self.launch_tiled(q, lq, k, lk, v, lv, &d, &meta, sms);
        }
        let splits = if ctas >= 2 * sms { 1 } else { (4 * sms).div_ceil(ctas).min(max_len.div_ceil(64)).max(1) };
        let split_len = max_len.div_ceil(splits);
        let splits = max_len.div_ceil(split_len);

        let epl = d.head_dim.div_ceil(32).next_power_of_two();
        let aligned =
            d.head_dim.is_multiple_of(epl) && [lq, lk, lv].iter().all(|l| l.start_offset().is_multiple_of(epl));
        let variant = format!("{epl}{}", if aligned && epl > 1 { "v" } else { "" });
        let n_out = d.seqs * d.heads * d.head_dim;
        let part = if splits > 1 { n_out * splits } else { 1 };
        // SAFETY: every element of `out` is written by the kernel (one split) or by the
        // reduce (several); the partials are written before the reduce reads them.
        let (mut part_acc, mut part_ml) =
            unsafe { (dev.alloc::<f32>(part)?, dev.alloc::<f32>(part / d.head_dim.max(1) * 2 + 2)?) };
        let smem = (2 * WARPS as usize + WARPS as usize * 32 * epl) * 4;
        let cfg = LaunchConfig {
            grid_dim: (d.heads as u32, d.seqs as u32, splits as u32),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let (heads, kvh, bs, hd) = (d.heads as i32, d.kv_heads as i32, d.block_size as i32, d.head_dim as i32);
        let (width, split_len, scale) = (self.tables.width as i32, split_len as i32, self.scale);
        let out = by_float!(q.dtype(), "paged_decode", |T, SUFFIX| {
            let q = crate::launch::view::<T>(q, lq)?;
            let k = crate::launch::view::<T>(k, lk)?;
            let v = crate::launch::view::<T>(v, lv)?;
            // SAFETY: written in full before it is read (see above).
            let mut out = unsafe { dev.alloc::<T>(n_out)? };
            let func = crate::launch::kernel!(MODULE, dev, &format!("paged_decode_{SUFFIX}_{variant}"))?;
            let mut b = func.builder();
            b.arg(&q).arg(&k).arg(&v).arg(&meta).arg(&mut out).arg(&mut part_acc).arg(&mut part_ml);
            b.arg(&heads).arg(&kvh).arg(&bs).arg(&hd).arg(&width).arg(&split_len).arg(&scale);
            // SAFETY: the kernel reads q within [seqs, heads, head_dim], the pool within
            // the blocks the tables name (checked against the pool by the caller), the
            // tables within [seqs, 1 + width]; it writes `out` or the partials within
            // their sizes. All live on this device's stream.
            unsafe { b.launch(cfg) }.w()?;
            if splits > 1 {
                let reduce = crate::launch::kernel!(MODULE, dev, &format!("paged_decode_reduce_{SUFFIX}"))?;
                let mut b = reduce.builder();
                let splits = splits as i32;
                b.arg(&part_acc).arg(&part_ml).arg(&mut out).arg(&heads).arg(&hd).arg(&splits);
                let cfg = LaunchConfig {
                    grid_dim: (d.heads as u32, d.seqs as u32, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: reads the partials the first launch wrote, writes `out` within
                // [seqs, heads, head_dim]; same stream, so ordered after it.
                unsafe { b.launch(cfg) }.w()?;
            }
            crate::launch::storage(out, &dev)
        });
        Ok((out, lq.shape().clone()))
    }
}

/// Decode attention of `q` [seqs, heads, head_dim] over `k`, `v`
/// [num_blocks, kv_heads, block_size, head_dim] through `tables`: [seqs, heads, head_dim].
pub fn paged_decode(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    tables: &DecodeTables,
    scale: f32,
) -> candle_core::Result<Tensor> {
    q.contiguous()?.apply_op3_no_bwd(k, v, &PagedDecode { tables, scale })
}

/// Runs the kernel on `device` against the CPU reference on random inputs (odd sizes,
/// grouped heads, shuffled block tables, lengths from 1 to several blocks, a pool of
/// poison outside the blocks in use, enough positions that the kernel splits them) for
/// every dtype: a line per dtype whose results differ by more than the output's rounding.
pub fn self_test(device: &Device) -> Result<Vec<String>, OpError> {
    let mut bad = Vec::new();
    // (seqs, heads, kv_heads, head_dim, block_size, lengths)
    // The 16-bit cases of head dim 64 and 128 take the tiled kernel: sequences of very
    // different lengths (splits past a short one's end), grouped heads, many splits.
    // The last: Qwen2-7B's seven query heads a KV head, at head dim 128.
    let cases: [(usize, usize, usize, usize, &[usize]); 7] = [
        (4, 2, 16, 5, &[1, 5, 6, 23]),
        (3, 3, 80, 16, &[300, 17, 1]),
        (1, 1, 128, 16, &[2049]),
        (8, 4, 7, 3, &[9, 1, 2, 3, 10, 11, 4, 7]),
        (8, 2, 64, 16, &[700, 3, 129, 64]),
        (4, 4, 128, 32, &[1, 513, 77]),
        (14, 2, 128, 16, &[40, 600, 1]),
    ];
    for (i, &(heads, kv_heads, head_dim, block_size, lens)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (worst, tol) = compare(device, heads, kv_heads, head_dim, block_size, lens, dtype, i as u64)?;
            if worst > tol {
                bad.push(format!("case {i} {dtype:?}: max |Δ| {worst:.3e} > {tol:.3e}"));
            }
        }
    }
    Ok(bad)
}

/// Max |kernel − reference| on one random case, and the tolerance: 2 units of the output
/// dtype's last place at the largest output, or 1e-5 of it in f32.
#[allow(clippy::too_many_arguments)]
fn compare(
    device: &Device,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    lens: &[usize],
    dtype: DType,
    seed: u64,
) -> Result<(f32, f32), OpError> {
    let seqs = lens.len();
    let used: Vec<usize> = lens.iter().map(|l| l.div_ceil(block_size)).collect();
    // Two spare blocks hold poison, and each table is a shuffled run of blocks.
    let blocks = used.iter().sum::<usize>() + 2;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut ids: Vec<u32> = (2..blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, next() as usize % (i + 1));
    }
    let mut tables = Vec::new();
    let mut at = 0;
    for &u in &used {
        tables.push(ids[at..at + u].to_vec());
        at += u;
    }
    let mut uniform =
        |n: usize| -> Vec<f32> { (0..n).map(|_| (next() >> 11) as f32 / (1u64 << 53) as f32 * 4.0 - 2.0).collect() };
    let pool_len = blocks * kv_heads * block_size * head_dim;
    let poison = |mut v: Vec<f32>| {
        // Blocks 0 (the tables' padding) and 1 are in no table: values that would show
        // in the output if read. Rows past a sequence's length hold other random values.
        v[..2 * kv_heads * block_size * head_dim].fill(1e4);
        v
    };
    let (q, k, v) = (uniform(seqs * heads * head_dim), poison(uniform(pool_len)), poison(uniform(pool_len)));
    let run = |dev: &Device| -> Result<Vec<f32>, OpError> {
        let pool = |x: &[f32]| -> Result<Tensor, OpError> {
            Ok(Tensor::from_slice(x, (blocks, kv_heads, block_size, head_dim), dev)?.to_dtype(dtype)?)
        };
        let q = Tensor::from_slice(&q, (seqs, heads, head_dim), dev)?.to_dtype(dtype)?;
        let seq_tables: Vec<(usize, &[u32])> = lens.iter().zip(&tables).map(|(&l, t)| (l, t.as_slice())).collect();
        let tables = DecodeTables::new(&seq_tables, block_size, dev)?;
        let out = paged_decode(&q, &pool(&k)?, &pool(&v)?, &tables, (head_dim as f32).powf(-0.5))?;
        Ok(out.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
    };
    let (got, want) = (run(device)?, run(&Device::Cpu)?);
    let largest = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (a, b)| if (a - b).abs().is_nan() { f32::INFINITY } else { m.max((a - b).abs()) });
    let ulp = match dtype {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        _ => 1e-5,
    };
    Ok((worst, 2.0 * ulp * largest.max(1e-3)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference against a dense softmax(q·kᵀ)·v over keys gathered by hand.
    #[test]
    fn reads_each_sequence_through_its_table() {
        let dev = Device::Cpu;
        let (blocks, kvh, bs, hd, heads) = (5, 2, 3, 4, 4);
        let k = Tensor::randn(0f32, 1., (blocks, kvh, bs, hd), &dev).unwrap();
        let v = Tensor::randn(0f32, 1., (blocks, kvh, bs, hd), &dev).unwrap();
        let q = Tensor::randn(0f32, 1., (2, heads, hd), &dev).unwrap();
        let (t0, t1) = ([4u32, 1], [2u32, 0, 3]);
        let tables = DecodeTables::new(&[(5, &t0), (7, &t1)], bs, &dev).unwrap();
        let out = paged_decode(&q, &k, &v, &tables, 0.5).unwrap().to_vec3::<f32>().unwrap();
        for (s, (len, table)) in [(5usize, &t0[..]), (7, &t1[..])].into_iter().enumerate() {
            for h in 0..heads {
                let g = h / (heads / kvh);
                let rows = |x: &Tensor| -> Vec<Vec<f32>> {
                    (0..len)
                        .map(|p| {
                            x.get(table[p / bs] as usize)
                                .unwrap()
                                .get(g)
                                .unwrap()
                                .get(p % bs)
                                .unwrap()
                                .to_vec1()
                                .unwrap()
                        })
                        .collect()
                };
                let (kr, vr) = (rows(&k), rows(&v));
                let qv: Vec<f32> = q.get(s).unwrap().get(h).unwrap().to_vec1().unwrap();
                let scores: Vec<f32> =
                    kr.iter().map(|r| 0.5 * r.iter().zip(&qv).map(|(a, b)| a * b).sum::<f32>()).collect();
                let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let w: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f32 = w.iter().sum();
                for d in 0..hd {
                    let want: f32 = w.iter().zip(&vr).map(|(w, r)| w * r[d]).sum::<f32>() / total;
                    assert!((out[s][h][d] - want).abs() < 1e-5, "seq {s} head {h} dim {d}");
                }
            }
        }
    }

    #[test]
    fn refuses_tables_outside_the_pool() {
        let dev = Device::Cpu;
        let k = Tensor::zeros((2, 1, 4, 8), DType::F32, &dev).unwrap();
        let q = Tensor::zeros((1, 1, 8), DType::F32, &dev).unwrap();
        let tables = DecodeTables::new(&[(5, &[0, 2])], 4, &dev).unwrap();
        assert!(paged_decode(&q, &k, &k, &tables, 1.0).is_err(), "block 2 of a pool of 2");
        assert!(DecodeTables::new(&[(9, &[0, 1])], 4, &dev).is_err(), "a table too short for its length");
    }
}
